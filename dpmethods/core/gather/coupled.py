"""Checks of gathered outputs against the replicas' shares of the batch.

Batch-coupled outputs: tensors that mix items of the batch with each other.

A replica's similarity matrix ``[n_r, n_r]`` (CLIP's ``logits_per_text`` with both
texts and images split, a contrastive loss's scores) holds only the pairs within its
own share of the batch; the full ``[n, n]`` matrix cannot be rebuilt from the pieces,
and a loss averaged over replicas is not the full-batch loss. dpmethods can't fix that
(the right pattern is to gather the features with dpmethods and compute the loss on the
gathered batch), so it says so, once per output path.

Outputs whose batch is in another dim than the one they are joined along: with equal
shares the concatenation succeeds and is wrong, so that is said too, naming the dim
that holds the shares.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Container, Sequence
from typing import Any

from torch import Tensor

from dpmethods.core.gather.modes import row
from dpmethods.vocab.warn_once import warn_once

__all__ = ["check_batch_dim", "check_coupled", "check_shares"]


def _coupled(column: Sequence[Tensor], sizes: Sequence[int], dim: int) -> bool:
    # Only shares that differ are evidence: the dims that follow each replica's own share
    # (7 rows on 2 devices: [4, 4] and [3, 3]). With equal shares a [n_r, classes] output
    # of a classifier whose class count equals the share cannot be told from [n_r, n_r].
    for t, share in zip(column, sizes):
        if t.dim() < 2:
            return False
        shape = t.shape
        if shape[dim % t.dim()] != share or shape.count(share) < 2:
            return False
    return True


def check_coupled(
    columns: Sequence[Sequence[Any]],
    sizes: Sequence[int] | None,
    dims: Sequence[int],
    modes: Sequence[str] | None,
    path: Callable[[int], str],
    exempt: Container[int] | Callable[[], Container[int]] = (),
) -> set[int]:
    """Warn (once per path) about batch-coupled tensor leaves and the losses reduced with them.

    Returns the indices of the batch-coupled leaves.

    Example:
        >>> import warnings, torch
        >>> cols = [(torch.ones(3, 3), torch.ones(2, 2)), (torch.ones(3, 5), torch.ones(2, 5))]
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     check_coupled(cols, [3, 2], [0, 0], None, lambda i: f"output[{i}]")
        {0}

    Args:
        columns: per leaf, the replicas' values.
        sizes: each replica's share of the batch; nothing is checked without it, nor
            when the shares are equal (a dim can then equal the share by chance).
        dims: per leaf, the join dim.
        modes: per leaf, the gather mode (``None``: all ``"cat"``).
        path: the output path of a leaf index, for the message.
        exempt: leaves known not to couple items (or a function returning them, called
            only when some leaf looks coupled): those whose top-level key the caller named
            in a ``gather`` or ``gather_dim`` mapping (the user has said how they join) and
            those under a ``per_item`` type rule.
    """
    if not sizes or len(sizes) < 2 or max(sizes) < 2 or len(set(sizes)) == 1:
        return set()
    share = sizes[0]
    # Replica 0 first, one cheap test per leaf, so outputs with many leaves pay little.
    counts = [c[0].shape.count(share) if isinstance(c[0], Tensor) else 0 for c in columns]
    if max(counts, default=0) < 2:
        return set()
    if callable(exempt):
        exempt = exempt()
    coupled = [
        i
        for i, count in enumerate(counts)
        if count >= 2
        and i not in exempt
        and all(map(isinstance, columns[i], itertools.repeat(Tensor)))
        and (modes is None or row(modes[i]).couples)
        and _coupled(columns[i], sizes, dims[i])
    ]
    if not coupled:
        return set()
    names = [path(i) for i in coupled]
    for name in names:
        warn_once(
            f"gather: {name} has each replica's share of the batch ({list(sizes)}) in more "
            "than one dim, like a similarity matrix: it couples items of the batch, and each "
            "replica only saw pairs within its own share, so the joined tensor is not what one "
            "device computes on the full batch. Gather the per-item features with dpmethods "
            "and compute batch-coupled results (similarities, contrastive losses) on the "
            "gathered batch instead."
        )
    for i, m in enumerate(modes or ()):
        if row(m).reduces:
            warn_once(
                f"gather: {path(i)} is reduced with {m!r} across replicas alongside the "
                f"batch-coupled {', '.join(names)}: such a loss is computed per replica on "
                "its share of the batch and is NOT the full-batch loss. Gather the features "
                "with dpmethods and compute the loss outside on the whole batch."
            )
    return set(coupled)


def check_batch_dim(
    columns: Sequence[Sequence[Any]],
    sizes: Sequence[int] | None,
    dims: Sequence[int],
    modes: Sequence[str] | None,
    path: Callable[[int], str],
    exempt: Container[int] | Callable[[], Container[int]] = (),
) -> set[int]:
    """Warn (once per path) about tensor leaves whose batch is in another dim than the join dim.

    A leaf joined along ``d`` whose size there is no replica's share, while another dim
    ``k`` has each replica's share (``[n_layers, n_r, ...]`` stacked hidden states under
    the default dim 0, or ``[n_r, 1, t]`` audio decoded with ``dim=1``), is joined wrong
    without a word when the shares are equal: concatenating along ``d`` stacks the
    replicas' batches side by side. Returns the indices of such leaves.

    Example:
        >>> import warnings, torch
        >>> cols = [(torch.ones(4, 2, 3), torch.ones(4, 2, 3))]  # batch in dim 1, joined on 0
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     check_batch_dim(cols, [2, 2], [0], None, lambda i: "output")
        {0}

    Args:
        columns: per leaf, the replicas' values.
        sizes: each replica's share of the batch; nothing is checked without it.
        dims: per leaf, the join dim.
        modes: per leaf, the gather mode (``None``: all ``"cat"``); only ``"cat"`` and
            ``"pad"`` leaves are joined along the batch dim.
        path: the output path of a leaf index, for the message.
        exempt: leaves the caller trusts (or a function returning them), as for
            :func:`check_coupled`.
    """
    if not sizes or len(sizes) < 2 or max(sizes) < 2:
        return set()
    share = sizes[0]
    # Replica 0 first, one cheap test per leaf.
    candidates = [
        i
        for i, c in enumerate(columns)
        if isinstance(c[0], Tensor)
        and c[0].dim() >= 2
        and -c[0].dim() <= dims[i] < c[0].dim()
        and c[0].shape[dims[i]] != share
        and share in c[0].shape
    ]
    if not candidates:
        return set()
    if callable(exempt):
        exempt = exempt()
    found: dict[int, int] = {}
    for i in candidates:
        if i in exempt or (modes is not None and not row(modes[i]).batch_dim):
            continue
        column = columns[i]
        if not all(map(isinstance, column, itertools.repeat(Tensor))):
            continue
        d = dims[i] % column[0].dim()
        batch_dims = [
            k for k in range(column[0].dim())
            if k != d and all(t.dim() == column[0].dim() and t.shape[k] == s for t, s in zip(column, sizes))
        ]
        if batch_dims and all(t.shape[d] != s for t, s in zip(column, sizes)):
            found[i] = batch_dims[0]
    for i, k in found.items():
        _warn_batch_dim(path(i), columns[i], dims[i] % columns[i][0].dim(), k, sizes)
    return set(found)


def _warn_batch_dim(path: str, column: Sequence[Tensor], d: int, k: int, sizes: Sequence[int]) -> None:
    maybe = (
        " With equal shares this can be a coincidence (a dim that happens to have the share's "
        f"size): if dim {d} is right, name this output in gather={{...}} or gather_dim={{...}}, "
        "which silences this warning."
        if len(set(sizes)) == 1
        else ""
    )
    warn_once(
        f"gather: {path} is joined along dim {d}, where its sizes "
        f"({[t.shape[d] for t in column]}) are not the replicas' shares of the batch "
        f"({list(sizes)}), but its dim {k} has them: if dim {k} is its batch dim, joining "
        f"along dim {d} puts the replicas' batches side by side. Pass gather_dim={k} (or "
        f"gather_dim={{key: {k}}} for this output)." + maybe
    )


def check_shares(
    columns: Sequence[Sequence[Any]],
    sizes: Sequence[int] | None,
    dims: Sequence[int],
    modes: Sequence[str] | None,
    path: Callable[[int], str],
    exempt: Container[int] | Callable[[], Container[int]] = (),
    batch_dim: bool = True,
) -> set[int]:
    """:func:`check_coupled`, then (unless ``batch_dim`` is False) :func:`check_batch_dim`.

    A callable ``exempt`` is called at most once for both. Returns the coupled leaves.

    Example:
        >>> import warnings, torch
        >>> cols = [(torch.ones(4, 2, 3), torch.ones(4, 2, 3))]
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     check_shares(cols, [2, 2], [0], None, lambda i: "stacked"), len(seen)
        (set(), 1)
    """
    if callable(exempt):
        exempt = functools.cache(exempt)
    coupled = check_coupled(columns, sizes, dims, modes, path, exempt)
    if batch_dim:
        check_batch_dim(columns, sizes, dims, modes, path, exempt)
    return coupled
