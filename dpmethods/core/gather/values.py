"""What the gather modes join values with (tensors reduced, and other leaves).

Equal values (a config, a flag) come back once. Values that differ are joined where
their meaning is clear: numpy arrays are concatenated like tensors (sentence-
transformers returns them), shapes that differ only along the join dim are summed
there, per-item lists are extended (:mod:`dpmethods.types.per_item`), numbers are reduced
under ``"mean"``/``"sum"``. Anything else comes back as a list of the replicas'
values, with a one-time warning: a silent list where one object was expected is how
outputs go wrong without a word. Which mode uses what is the table in
:mod:`dpmethods.core.gather.modes`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import Size, Tensor

__all__ = ["all_equal", "join_shapes", "numpy_arrays", "reduce"]



def all_equal(values: Sequence[Any]) -> bool:
    """Whether every value equals the first (values whose ``==`` is not a bool differ).

    Example:
        >>> all_equal([1, 1]), all_equal(["a", "b"])
        (True, False)
    """
    first = values[0]
    try:
        return all(v is first or bool(v == first) for v in values[1:])
    except Exception:  # values whose == is not a bool (arrays): treat as different
        return False


def reduce(values: Sequence[Any], weights: Sequence[float], device: torch.device, mean: bool) -> Any:
    """Sum of the replicas' values (weighted by batch share for a mean), on ``device``.

    Example:
        >>> reduce([1.0, 4.0], [2 / 3, 1 / 3], torch.device("cpu"), mean=True)
        2.0
    """
    moved = [v.to(device) if isinstance(v, Tensor) else v for v in values]
    if mean:  # weighted by batch share, so uneven shares give the full-batch mean
        moved = [w * v for w, v in zip(weights, moved)]
    total = moved[0]
    for v in moved[1:]:
        total = total + v
    return total


def numpy_arrays(values: Sequence[Any]) -> bool:
    """Whether every value is a numpy array of at least one dim.

    Example:
        >>> numpy_arrays([1, 2])
        False
    """
    np = sys.modules.get("numpy")  # never imported here: outputs can only hold arrays if it is
    return np is not None and all(isinstance(v, np.ndarray) and v.ndim for v in values)


def join_shapes(values: Sequence[Size], dim: int) -> Size | None:
    """The shapes joined along ``dim`` when they differ only there, else None.

    Example:
        >>> join_shapes([Size([2, 3]), Size([1, 3])], 0)
        torch.Size([3, 3])
    """
    ndim = len(values[0])
    if not ndim or any(len(v) != ndim for v in values):
        return None
    d = dim % ndim
    if any(v[:d] != values[0][:d] or v[d + 1 :] != values[0][d + 1 :] for v in values):
        return None
    joined = list(values[0])
    joined[d] = sum(v[d] for v in values)
    return Size(joined)
