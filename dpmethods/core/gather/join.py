"""What the gather modes join tensors with.

The concatenated leaves (``"cat"``, and ``"stack"`` and ``"pad"`` after their per-tensor
step) go to :func:`coalesced` together, one call per join dim: that is where the
compiled kernel (:func:`dpmethods.ops.gather_coalesced`) replaces L x N copies and
autograd nodes. Which mode uses what is the table in :mod:`dpmethods.core.gather.modes`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from dpmethods import ops
from dpmethods.core.gather.sparse import join_sparse

__all__ = ["coalesced", "join_same", "joinable", "pad"]


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


def coalesced(
    tensors: Sequence[Tensor], n: int, dim: int, device: torch.device,
    path: Callable[[int], str] = "leaf {}".format,
) -> list[Tensor]:
    """ops.gather_coalesced, keeping the memory format of channels_last pieces as torch.cat;
    leaves of another layout than strided (sparse) joined by :func:`join_sparse`.
    ``path(i)`` names leaf ``i`` (the ``i``-th ``n`` tensors) in messages."""
    if not all(t.layout is torch.strided for t in tensors):
        return _with_sparse(tensors, n, dim, device, path)
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


def _with_sparse(
    tensors: Sequence[Tensor], n: int, dim: int, device: torch.device, path: Callable[[int], str],
) -> list[Tensor]:
    """The leaves of another layout (sparse) through :func:`join_sparse`, and the strided
    ones in one coalesced call, as without them (the op takes strided pieces)."""
    leaves = [tensors[i : i + n] for i in range(0, len(tensors), n)]
    dense = [i for i, pieces in enumerate(leaves) if all(t.layout is torch.strided for t in pieces)]
    out: list[Tensor | None] = [None] * len(leaves)
    joined = coalesced([t for i in dense for t in leaves[i]], n, dim, device) if dense else []
    for i, t in zip(dense, joined):
        out[i] = t
    for i, pieces in enumerate(leaves):
        if out[i] is None:
            out[i] = join_sparse(pieces, dim, device, path(i))
    return out  # type: ignore[return-value]


def join_same(col: Sequence[Tensor], device: torch.device, path: str) -> Tensor:
    """The one value every replica computed (``"same"``); an error if they differ."""
    first = col[0].to(device)
    for r, t in enumerate(col[1:], 1):
        t = t.to(device)
        if t.shape != first.shape or not torch.equal(t, first):
            raise ValueError(
                f"gather: {path}: 'same' expects one value equal on every replica, but "
                f"replica {r} has {t.detach().cpu()!r} and replica 0 {first.detach().cpu()!r}"
            )
    return first


def joinable(column: Sequence[Tensor], dim: int) -> bool:
    """Whether the tensors agree on every dim but ``dim`` (so ``cat`` can join them).

    Example:
        >>> import torch
        >>> joinable([torch.ones(3, 3), torch.ones(2, 2)], 0)
        False
    """
    d = dim % column[0].dim()
    shape = list(column[0].shape)
    del shape[d]
    for t in column[1:]:
        other = list(t.shape)
        del other[d]
        if other != shape:
            return False
    return True
