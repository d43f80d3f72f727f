"""Joining the non-tensor leaves of replica outputs.

Equal values (a config, a flag) come back once. Values that differ are joined where
their meaning is clear: numpy arrays are concatenated like tensors (sentence-
transformers returns them), shapes that differ only along the join dim are summed
there, per-item lists are extended (:mod:`dpmethods.types.per_item`), numbers are reduced
under ``"mean"``/``"sum"``. Anything else comes back as a list of the replicas'
values, with a one-time warning: a silent list where one object was expected is how
outputs go wrong without a word.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import Size, Tensor

from dpmethods.gather_modes import REDUCING, Mode
from dpmethods.types.per_item import Items, Whole, extend, to_device
from dpmethods.warn_once import warn_once

__all__ = ["all_equal", "join_values", "reduce"]

_NUMBERS = (int, float, complex)


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
    if mean:  # weighted by batch share, so uneven chunks give the full-batch mean
        moved = [w * v for w, v in zip(weights, moved)]
    total = moved[0]
    for v in moved[1:]:
        total = total + v
    return total


def _numpy_arrays(values: Sequence[Any]) -> bool:
    np = sys.modules.get("numpy")  # never imported here: outputs can only hold arrays if it is
    return np is not None and all(isinstance(v, np.ndarray) and v.ndim for v in values)


def _join_shapes(values: Sequence[Size], dim: int) -> Size | None:
    ndim = len(values[0])
    if not ndim or any(len(v) != ndim for v in values):
        return None
    d = dim % ndim
    if any(v[:d] != values[0][:d] or v[d + 1 :] != values[0][d + 1 :] for v in values):
        return None
    joined = list(values[0])
    joined[d] = sum(v[d] for v in values)
    return Size(joined)


def join_values(
    column: Sequence[Any],
    mode: str,
    dim: int,
    path: str,
    device: torch.device,
    weights: Sequence[float],
) -> Any:
    """Join one non-tensor leaf of every replica's output.

    Args:
        column: the replicas' values at this leaf.
        mode: its gather mode.
        dim: its join dim.
        path: its output path, for messages.
        device: the output device (for tensors inside per-item entries).
        weights: each replica's share of the batch (for ``"mean"``).

    Example:
        >>> import numpy as np
        >>> join_values([np.ones(2), np.zeros(1)], "cat", 0, "output", torch.device("cpu"), [0.5, 0.5])
        array([1., 1., 0.])
    """
    first = column[0]
    if isinstance(first, Items):
        return extend(column, device)
    if isinstance(first, Whole):
        return [to_device(w.value, device) for w in column]
    if mode == Mode.LIST:
        return list(column)
    if mode == Mode.SAME:
        if not all_equal(column):
            raise ValueError(
                f"gather: {path}: 'same' expects one value equal on every replica, got "
                f"{[v for v in column]!r}"
            )
        return first
    if mode in REDUCING and all(isinstance(v, _NUMBERS) for v in column):
        return reduce(column, weights, device, mode == Mode.MEAN)
    if _numpy_arrays(column):
        np = sys.modules["numpy"]
        if mode == Mode.STACK:
            return np.stack(column, axis=dim)
        if mode in REDUCING:
            return reduce(column, weights, device, mode == Mode.MEAN)
        return np.concatenate(column, axis=dim)
    if all_equal(column):
        return first
    if all(type(v) is Size for v in column):
        joined = _join_shapes(column, dim)
        if joined is not None:
            return joined
    kind = type(first).__name__
    if isinstance(first, (*_NUMBERS, str, bytes, bool)):
        remedy = "pass gather='list' (or 'sum'/'mean' for numbers) for that output"
    else:
        remedy = (
            f"tell dpmethods how to split and join a {kind} with "
            f"dpmethods.register_type({kind}, flatten, unflatten), or pass gather='list' for "
            "that output"
        )
    warn_once(
        f"gather: {path} ({kind}) differs across replicas and dpmethods has no rule to join "
        f"it, so it is returned as a list of the {len(column)} replicas' values; {remedy} "
        "to silence this."
    )
    return list(column)
