"""The vocabulary every layer speaks: what waits on an import, a
method's options, call hooks, the gather modes' names and named-mode table, and
one-time warnings. Nothing here imports another unit of dpmethods.

- :mod:`~dpmethods.vocab.loading`: the one table of what waits on an import, run by every lookup first;
- :mod:`~dpmethods.vocab.options`: ``MethodOptions``, checked once;
- :mod:`~dpmethods.vocab.call_hooks`: ``CallHooks`` and the ``Call`` they see;
- :mod:`~dpmethods.vocab.gather_modes`: the built-in modes and the named-mode table;
- :mod:`~dpmethods.vocab.warn_once`: one warning per distinct message.
"""
