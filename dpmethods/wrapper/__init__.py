"""The per-module wrapper: the base class that ``DataParallel`` and
``DistributedDataParallel`` share, and the registry of parallel methods it reads.

- :mod:`~dpmethods.wrapper.registry`: ``@parallel_method``, ``register``,
  ``get_options`` and the method finders' table;
- :mod:`~dpmethods.wrapper.base`: the wrapper class with one method per parallel
  method of its module, and the checks of its configuration.
"""
