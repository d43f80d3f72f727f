"""Joining one tensor leaf of every replica's output, by its gather mode.

The concatenated leaves (``"cat"``, and ``"stack"`` and ``"pad"`` after their per-tensor
step) go to :func:`dpmethods.ops.gather_coalesced` together, one call per join dim:
that is where the compiled kernel replaces L x N copies and autograd nodes.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from dpmethods import ops
from dpmethods.core.gather.coupled import joinable
from dpmethods.core.gather.values import reduce
from dpmethods.gather_modes import REDUCING, Mode

__all__ = ["coalesced", "join_tensors", "pad", "join_same"]


def pad(parts: Sequence[Tensor], dim: int, value: float, path: str) -> list[Tensor]:
    ndim = parts[0].dim()
    if any(p.dim() != ndim for p in parts):
        raise ValueError(
            f"gather: {path}: 'pad' needs the same number of dims on every replica, got "
            f"shapes {[list(p.shape) for p in parts]}"
        )
    d = dim % ndim
    target = [max(p.shape[k] for p in parts) for k in range(ndim)]
    out = []
    for p in parts:
        widths: list[int] = []
        for k in reversed(range(ndim)):
            widths += [0, 0 if k == d else target[k] - p.shape[k]]
        out.append(F.pad(p, widths, value=value) if any(widths) else p)
    return out


def _memory_format(pieces: Sequence[Tensor]) -> torch.memory_format | None:
    """channels_last(_3d) if every piece is in it (then torch.cat keeps it), else None."""
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(pieces[0].dim())
    if fmt is None:
        return None
    for p in pieces:
        if p.is_contiguous() or not p.is_contiguous(memory_format=fmt):
            return None
    return fmt


def coalesced(tensors: Sequence[Tensor], n: int, dim: int, device: torch.device) -> list[Tensor]:
    """ops.gather_coalesced, keeping the memory format of channels_last pieces as torch.cat."""
    out = ops.gather_coalesced(tensors, n, dim, device)
    dims = list(map(Tensor.dim, out))  # (no max(default=): torch 2.11's compile can't trace it)
    if not dims or max(dims) < 4:  # the common case: one C-level pass
        return out
    out = list(out)
    for i, t in enumerate(out):
        if t.dim() >= 4:
            fmt = _memory_format(tensors[i * n : (i + 1) * n])
            if fmt is not None:
                out[i] = t.contiguous(memory_format=fmt)
    return out


def join_same(col: Sequence[Tensor], device: torch.device, path: str) -> Tensor:
    """The one value every replica computed (``"join_same"``); an error if they differ."""
    first = col[0].to(device)
    for r, t in enumerate(col[1:], 1):
        t = t.to(device)
        if t.shape != first.shape or not torch.equal(t, first):
            raise ValueError(
                f"gather: {path}: 'same' expects one value equal on every replica, but "
                f"replica {r} has {t.detach().cpu()!r} and replica 0 {first.detach().cpu()!r}"
            )
    return first


def join_tensors(
    col: Sequence[Tensor], m: str, d: int, coupled: bool, ragged: bool, paths: Any,
    i: int, plan: Any,
) -> tuple[Any, Sequence[Tensor] | None]:
    """One tensor leaf: ``(result, None)`` when joined here, or ``(None, parts)`` for the
    pieces to concatenate along ``d`` with the other leaves."""
    device, n = plan.device, plan.n
    if m == Mode.SAME:
        return join_same(col, device, paths(i)), None
    if m == Mode.LIST or (coupled and not joinable(col, d)):
        # A coupled leaf that cat can't join comes back in pieces: it was warned about.
        return [t.to(device) for t in col], None
    if m in REDUCING:
        if any(t.shape != col[0].shape for t in col):
            raise ValueError(
                f"gather: {paths(i)}: {m!r} needs the same shape on every replica, got "
                f"{[list(t.shape) for t in col]}; use 'cat' or 'pad' for batch outputs"
            )
        return reduce(col, plan.weights, device, m == Mode.MEAN), None
    if n == 1 and m != Mode.STACK:
        # One replica ran (one device, or nothing to split): its output is the result,
        # as torch returns it; a 0-dim value stays 0-dim.
        return col[0].to(device), None
    # "cat", "extend" (a tensor is a sequence of items), "stack", "pad"
    if m == Mode.STACK or col[0].dim() == 0:
        if m != Mode.STACK:
            warnings.warn(
                f"gather: {paths(i)} is 0-dim on every replica, so it was stacked into "
                f"a vector of {n} values; use gather='mean' for a loss (weighted by "
                "each replica's share of the batch), 'same' for a value every replica "
                "shares, or 'stack' to silence this",
                UserWarning,
                stacklevel=4,
            )
        return None, [t.unsqueeze(d) for t in col]
    if m == Mode.PAD:
        return None, pad(col, d, plan.pad_value, paths(i))
    if ragged and not joinable(col, d):
        return None, pad(col, d, 0, paths(i))  # the rule's lengths say what is padding
    return None, col
