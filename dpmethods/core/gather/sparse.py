"""Joining sparse tensor leaves: COO by ``torch.cat``, the compressed layouts here.

``torch.cat`` joins sparse COO tensors but not the compressed layouts (CSR, CSC, BSR,
BSC: "Sparse CSR tensors do not have is_contiguous"). A compressed tensor is three
parts: compressed indices (one offset per compressed row, or column, plus one), plain
indices and values. Joined along

- a batch dim: each part concatenated there;
- the compressed dim (CSR's rows, CSC's columns): the compressed indices of each
  piece after the first shifted by the elements before it, the rest concatenated;
- the plain dim (CSC's rows, CSR's columns): each compressed row of the result holds
  that row of every piece in turn, their plain indices shifted by the pieces before.

Each is the tensor one device gives, part for part, as long as the pieces are valid
(plain indices sorted within each compressed row): same layout, same index dtype.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["join_sparse", "unchecked"]

# layout -> whether its rows (not its columns) are compressed
_COMPRESSED = {torch.sparse_csr: True, torch.sparse_bsr: True, torch.sparse_csc: False, torch.sparse_bsc: False}
_BLOCKED = (torch.sparse_bsr, torch.sparse_bsc)


@contextlib.contextmanager
def unchecked() -> Iterator[None]:
    """Build sparse tensors with ``check_invariants=False`` and no warning: their parts
    are a valid tensor's. Torch 2.11 warns that checks are "implicitly disabled" even
    when the argument says so (later versions take the argument as the opt-out).

    Example:
        >>> with unchecked():
        ...     torch.sparse_coo_tensor([[0]], [1.0], (2,), check_invariants=False).shape
        torch.Size([2])
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")
        yield


def join_sparse(pieces: Sequence[Tensor], dim: int, device: torch.device, path: str) -> Tensor:
    """The replicas' sparse ``pieces`` of one leaf joined along ``dim`` on ``device``."""
    layouts = [p.layout for p in pieces]
    if len(set(layouts)) > 1:
        raise ValueError(
            f"gather: {path}: expected one layout on every replica to join along dim {dim}, "
            f"got {[str(x) for x in layouts]}"
        )
    pieces = [p.to(device) for p in pieces]
    layout = layouts[0]
    if layout not in _COMPRESSED:  # COO (and any other layout torch.cat joins)
        return torch.cat(pieces, dim)
    return _join_compressed(pieces, dim, path)


def _parts(t: Tensor) -> tuple[Tensor, Tensor]:
    if _COMPRESSED[t.layout]:
        return t.crow_indices(), t.col_indices()
    return t.ccol_indices(), t.row_indices()


def _block(t: Tensor) -> tuple[int, ...]:
    """A values element's shape: its block (BSR, BSC) and dense dims."""
    return tuple(t.values().shape[t.dim() - t.dense_dim() - 1 :])


def _check(pieces: Sequence[Tensor], d: int, path: str) -> None:
    """The pieces agree on all but the join dim: shape, dense dims, block size, dtypes."""
    first = pieces[0]

    def others(t: Tensor) -> tuple[Any, ...]:
        shape = [s for k, s in enumerate(t.shape) if k != d]
        return shape, t.dense_dim(), _block(t)[:2] if t.layout in _BLOCKED else (), t.dtype, _parts(t)[0].dtype

    for r, p in enumerate(pieces[1:], 1):
        if others(p) != others(first):
            raise ValueError(
                f"gather: {path}: {first.layout} pieces must agree on every dim but {d}, their "
                f"dense dims, block size, dtype and index dtype to be joined; replica 0 has "
                f"shape {list(first.shape)} (values {list(first.values().shape)}, {first.dtype}, "
                f"indices {_parts(first)[0].dtype}), replica {r} {list(p.shape)} (values "
                f"{list(p.values().shape)}, {p.dtype}, indices {_parts(p)[0].dtype})"
            )


def _join_compressed(pieces: Sequence[Tensor], dim: int, path: str) -> Tensor:
    first = pieces[0]
    layout, ndim = first.layout, first.dim()
    if not -ndim <= dim < ndim:
        raise ValueError(f"gather: {path}: dim {dim} is out of range for a {ndim}-dim {layout} tensor")
    d = dim % ndim
    _check(pieces, d, path)
    nb = ndim - first.dense_dim() - 2  # batch dims before the two sparse ones
    compressed_dim = nb if _COMPRESSED[layout] else nb + 1
    shape = list(first.shape)
    shape[d] = sum(p.shape[d] for p in pieces)
    if d < nb:
        parts = _along_batch(pieces, d, path)
    elif d == compressed_dim:
        parts = _along_compressed(pieces, nb)
    elif d == 2 * nb + 1 - compressed_dim:
        parts = _along_plain(pieces, nb, d)
    else:
        parts = _along_dense(pieces, d, path)
    with unchecked():  # valid by construction
        return torch.sparse_compressed_tensor(
            *parts, size=shape, layout=layout, dtype=first.dtype, device=first.device, check_invariants=False,
        )


def _along_batch(pieces: Sequence[Tensor], d: int, path: str) -> tuple[Tensor, Tensor, Tensor]:
    """Along a batch dim: every batch element of a compressed tensor has one nnz."""
    nnz = [_parts(p)[1].shape[-1] for p in pieces]
    if len(set(nnz)) > 1:
        raise ValueError(
            f"gather: {path}: a batched {pieces[0].layout} tensor holds the same number of "
            f"elements in every batch element, but the replicas' pieces hold {nnz}: they "
            f"cannot be joined along batch dim {d} in this layout; return it dense or as COO"
        )
    compressed, plain = zip(*map(_parts, pieces))
    values = [p.values() for p in pieces]
    return torch.cat(compressed, d), torch.cat(plain, d), torch.cat(values, d)


def _along_dense(pieces: Sequence[Tensor], d: int, path: str) -> tuple[Tensor, Tensor, Tensor]:
    """Along a dense dim: the values joined, where every piece has the same sparsity
    pattern (then one device's is that pattern too); else no tensor of the layout holds
    the join exactly as one device gives it."""
    compressed, plain = _parts(pieces[0])
    for r, p in enumerate(pieces[1:], 1):
        c, q = _parts(p)
        if not (torch.equal(c, compressed) and torch.equal(q, plain)):
            raise ValueError(
                f"gather: {path}: {pieces[0].layout} pieces joined along dim {d}, a dense "
                f"dim, need one sparsity pattern, but replica {r}'s differs from replica 0's; "
                f"join it along a sparse or batch dim (gather_dim=) or return it dense"
            )
    at = d - pieces[0].dim() + pieces[0].values().dim()  # the same dim, counted in values
    return compressed, plain, torch.cat([p.values() for p in pieces], at)


def _along_compressed(pieces: Sequence[Tensor], nb: int) -> tuple[Tensor, Tensor, Tensor]:
    """Along the compressed dim: the pieces' rows one after another."""
    compressed, plain = zip(*map(_parts, pieces))
    out, before = [compressed[0]], compressed[0][..., -1:]
    for c in compressed[1:]:
        out.append(c[..., 1:] + before)  # this piece's offsets after the elements before it
        before = out[-1][..., -1:]
    values = torch.cat([p.values() for p in pieces], nb)
    return torch.cat(out, -1), torch.cat(plain, -1), values


def _along_plain(pieces: Sequence[Tensor], nb: int, d: int) -> tuple[Tensor, Tensor, Tensor]:
    """Along the plain dim: each compressed row holds that row of every piece in turn."""
    batch = pieces[0].shape[:nb]
    b = math.prod(batch)
    compressed, plain = zip(*[(c.reshape(b, -1), p.reshape(b, -1)) for c, p in map(_parts, pieces)])
    values = [p.values().reshape(b, p.values().shape[nb], *p.values().shape[nb + 1 :]) for p in pieces]
    counts = [c.diff(dim=-1) for c in compressed]  # [b, rows]: each piece's elements per row
    total = torch.stack(counts).sum(0)
    out_c = torch.cat([torch.zeros_like(total[:, :1]), total.cumsum(-1)], -1).to(compressed[0].dtype)
    nnz = sum(p.shape[-1] for p in plain)
    out_p = torch.empty(b, nnz, dtype=plain[0].dtype, device=plain[0].device)
    out_v = values[0].new_empty(b, nnz, *values[0].shape[2:])
    # A block's plain index counts blocks: shift by the blocks before, not the elements.
    layout = pieces[0].layout
    step = _block(pieces[0])[1 if _COMPRESSED[layout] else 0] if layout in _BLOCKED else 1
    rows_at = torch.arange(b, device=out_p.device)[:, None]
    before, shift = torch.zeros_like(total), 0
    for c, p, v, n, piece in zip(compressed, plain, values, counts, pieces):
        j = torch.arange(p.shape[-1], dtype=c.dtype, device=c.device).expand(b, -1).contiguous()
        row = torch.searchsorted(c, j, right=True) - 1  # the compressed row of each element
        at = (out_c.gather(-1, row) + before.gather(-1, row) + j - c.gather(-1, row)).long()
        out_p.scatter_(-1, at, p + shift)
        out_v[rows_at, at] = v
        before = before + n
        shift += piece.shape[d] // step
    return out_c.reshape(*batch, -1), out_p.reshape(*batch, -1), out_v.reshape(*batch, nnz, *out_v.shape[2:])
