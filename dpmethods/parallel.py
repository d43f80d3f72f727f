"""The stages of a data-parallel call, as functions: what ``torch.nn.parallel`` has for torch.

``DataParallel`` runs these through its seams of the same names; call them directly to
build a pipeline of your own. Their signatures are dpmethods' own (method-aware), not
torch's: ``parallel_apply`` takes the method's name.

Example:
    >>> import torch
    >>> from dpmethods.parallel import chunk_sizes, gather, scatter
    >>> chunk_sizes(10, 4)
    [3, 3, 2, 2]
    >>> parts = scatter(torch.arange(6.0), ["cpu", "cpu"])
    >>> gather([p * 2 for p in parts], "cpu").tolist()
    [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
"""

from __future__ import annotations

from dpmethods.core.gather import gather
from dpmethods.core.parallel_apply import parallel_apply
from dpmethods.core.replicate import replicate
from dpmethods.core.scatter import chunk_sizes, scatter, scatter_call

__all__ = ["chunk_sizes", "gather", "parallel_apply", "replicate", "scatter", "scatter_call"]
