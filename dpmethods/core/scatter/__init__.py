"""The scatter stage: a call's arguments split per device.

``run`` splits tensors and structures along the batch dim (:func:`scatter`,
:func:`scatter_call`, :func:`chunk_sizes`); ``args`` binds a call's arguments to the
method's names (``broadcast``, ``scatter_dim``); ``items`` cuts per-item sequences
(``split=``) into runs that line up with the tensors' shares.
"""

from dpmethods.core.scatter.run import chunk_sizes, scatter, scatter_call

__all__ = ["chunk_sizes", "scatter", "scatter_call"]
