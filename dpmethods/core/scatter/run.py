"""Scatter: split the tensors of a call into balanced shares, one per device.

Unlike ``torch.nn.parallel.scatter``, shares are balanced (sizes differ by at most
one, so every device works when the batch has at least one item per device),
dataclasses are walked, 0-dim tensors and arguments named in ``broadcast`` go
whole to every replica, and tensors that disagree on the batch size are an error
that names them instead of a silent mis-split. Shares on the source device are
views (``narrow``) without autograd, and copies connected through autograd with it,
so a method may update its input in place under autograd as on the bare model. Non-tensor values go to every replica; an iterator
or generator argument is read once, lazily, and every replica gets an iterator of
its own over all of its items (as every replica gets all of any other non-tensor
argument), so no replica finds it emptied by another.
"""

from __future__ import annotations

import io
import itertools
import threading
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from dpmethods.core.devices import DeviceLike, as_device
from dpmethods.core.scatter import items as split_args
from dpmethods.core.scatter.args import (
    Arguments,
    first_split,
    list_arguments,
    mismatch_hint,
    warn_ragged_lists,
)
from dpmethods.core.signature import argument_names
from dpmethods.types import tree as _tree

__all__ = ["ScatterResult", "chunk_sizes", "scatter", "scatter_call"]

_TENSORS = itertools.repeat(Tensor)


def chunk_sizes(batch: int, parts: int) -> list[int]:
    """Balanced share sizes: ``min(batch, parts)`` shares whose sizes differ by at most 1.

    Args:
        batch: the number of items.
        parts: the number of devices.

    Example:
        >>> chunk_sizes(9, 4)
        [3, 2, 2, 2]
    """
    if batch < 1:
        raise ValueError(f"chunk_sizes: batch: expected at least 1 item, got {batch}")
    if parts < 1:
        raise ValueError(f"chunk_sizes: parts: expected at least 1, got {parts}")
    n = min(batch, parts)
    base, extra = divmod(batch, n)
    return [base + 1 if i < extra else base for i in range(n)]


def _narrowed(t: Tensor, sizes: list[int], dim: int) -> list[Tensor]:
    # Single-output views (not Tensor.split's multi-output ones), so a method may update
    # its input in place under autograd (`h += 1`), as it may on the bare model.
    out, start = [], 0
    for size in sizes:
        out.append(t.narrow(dim, start, size))
        start += size
    return out


def _split(t: Tensor, sizes: list[int], dim: int, devices: Sequence[torch.device]) -> list[Tensor]:
    src = t.device
    if all(d == src for d in devices):
        if len(sizes) == 1:
            return [t]  # one replica: the argument itself, as the bare model gets it
        if torch.is_grad_enabled():
            # Under autograd, sibling views share one version counter and a view of a
            # leaf can't be updated in place, so `h += 1` or `h *= w` in one replica
            # would break the others (or fail where the bare model works): copies,
            # connected to the input through autograd, behave as the bare input does.
            return [c.clone() for c in _narrowed(t, sizes, dim)]
        return _narrowed(t, sizes, dim)  # views: no copy
    if t.is_cuda and all(d.type == "cuda" for d in devices):
        from torch.nn.parallel._functions import Scatter

        # torch's autograd-aware scatter copies on per-device streams.
        return list(Scatter.apply([d.index for d in devices], sizes, dim, t))
    return [c.to(d, non_blocking=True) for c, d in zip(_narrowed(t, sizes, dim), devices)]


class _ReplicaIterator:
    """One replica's own pass over an iterator argument that all replicas share.

    Every replica gets all items, as every replica gets all of a non-tensor argument,
    so the results equal the bare model's. The items are read lazily and once from the
    caller's iterator (``itertools.tee``); the lock makes the tee safe across the
    replicas' threads.
    """

    __slots__ = ("_it", "_lock")

    def __init__(self, it: Any, lock: threading.Lock) -> None:
        self._it, self._lock = it, lock

    def __iter__(self) -> _ReplicaIterator:
        return self

    def __reduce__(self) -> Any:  # workers="processes" would pickle it with each share
        raise TypeError(
            "an iterator argument is read lazily, once, in the caller's process, and shared by the "
            "replicas: it cannot be sent to worker processes; pass its items as a list or tuple"
        )

    def __next__(self) -> Any:
        with self._lock:
            return next(self._it)


def _per_replica(leaf: Any, n: int) -> list[Any]:
    """A non-tensor argument for each of ``n`` replicas: the object itself, or for an
    iterator (not a file), an iterator of its own over the same items."""
    if n > 1 and isinstance(leaf, Iterator) and not isinstance(leaf, io.IOBase):
        lock = threading.Lock()
        return [_ReplicaIterator(it, lock) for it in itertools.tee(leaf, n)]
    return [leaf] * n


def _batch_size(
    leaves: list[Any], whole: Container[int], dim: int, names: Callable[[], list[str]],
    split: bool = False, lists: Callable[[], list[str]] = list,
) -> tuple[int | None, set[int]]:
    """The batch size, and the leaves of size 1 along ``dim`` beside a larger batch.

    A tensor of size 1 where the others have ``B > 1`` (``position_ids`` of shape
    ``[1, t]``, a ``[1, 1, t, t]`` mask) broadcasts on one device: every replica gets it
    whole, as if named in ``broadcast``. When every tensor has size 1, that is a batch
    of one item, unless ``split`` sequences give the batch: then they broadcast too and
    the batch is ``None``.
    """
    batch: int | None = None
    ones: set[int] = set()
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, Tensor) or leaf.dim() == 0 or i in whole:
            continue
        if not -leaf.dim() <= dim < leaf.dim():
            need = dim + 1 if dim >= 0 else -dim
            raise ValueError(
                f"scatter: dim: {names()[i]} has shape {list(leaf.shape)}, which has no dim "
                f"{dim} to split; expected at least {need} dims, or name it in broadcast= to "
                "give it whole to every replica"
            )
        size = leaf.shape[dim]
        if size == 1:
            ones.add(i)
        elif batch is None:
            batch = size
        elif size != batch:
            paths = names()
            sizes = {
                paths[j]: t.shape[dim]
                for j, t in enumerate(leaves)
                if isinstance(t, Tensor) and -t.dim() <= dim < t.dim() and j not in whole
            }
            listing = ", ".join(f"{p} has {s}" for p, s in sizes.items())
            raise ValueError(
                f"scatter: tensors split along dim {dim} must agree on its size, but "
                f"{listing}. {mismatch_hint(lists())}"
            )
    if batch is None and ones and not split:
        return 1, set()
    return batch, ones


def _whole_leaves(entries: list[tuple[bool, Any]]) -> set[int]:
    """The leaves of the arguments that go whole to every replica (``broadcast``)."""
    whole: set[int] = set()
    offset = 0
    for is_whole, value in entries:
        count = len(_tree.flatten(value)[1])
        if is_whole:
            whole.update(range(offset, offset + count))
        offset += count
    return whole


def _checked_batch(
    bound: Arguments, spec: _tree.Spec, leaves: list[Any], whole: set[int],
    entries: list[tuple[bool, Any]], taken: list[Any], n: int, dim: int,
) -> int | None:
    """The batch size, after the checks and warnings about what would split wrongly.

    Adds to ``whole`` the size-1 leaves that broadcast beside a larger batch.
    """
    names, values = bound.names(), bound.values()
    batch, ones = _batch_size(
        leaves, whole, dim, lambda: bound.leaf_names(spec), split=bool(taken),
        lists=lambda: list_arguments(names, values),
    )
    whole |= ones  # beside a larger batch, or beside split sequences: broadcast
    if n > 1 and any(isinstance(v, (list, tuple)) for v in values):
        warn_ragged_lists(names, values, {m for (w, _), m in zip(entries, names) if w}, dim)
    if taken:
        return split_args.batch_size(
            taken, batch, lambda: first_split(leaves, whole, lambda: bound.leaf_names(spec)), dim
        )
    if batch is None and n > 1:
        split_args.warn_unsplit(bound.fn, bound.args, bound.kwargs, names[: len(bound.args)], dim)
    if batch is not None and n > 1:
        split_args.warn_whole_items(bound.fn, entries, names, batch)
    return batch


def _distribute(
    spec: _tree.Spec,
    leaves: list[Any],
    whole: Container[int],
    devices: Sequence[torch.device],
    dim: int,
    batch: int | None,
) -> tuple[list[Any], list[int]]:
    # An empty batch runs once, whole, on the first device: as one device runs it.
    sizes = chunk_sizes(batch, len(devices)) if batch else [0]
    targets = devices[: len(sizes)]
    columns: list[list[Any]] = []
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, Tensor):
            columns.append(_per_replica(leaf, len(targets)))
        elif not batch or leaf.dim() == 0 or i in whole:
            columns.append([leaf.to(d, non_blocking=True) for d in targets])
        else:
            columns.append(_split(leaf, sizes, dim, targets))
    per_replica = [_tree.unflatten(spec, list(row)) for row in zip(*columns)] if columns else [
        _tree.unflatten(spec, []) for _ in targets
    ]
    return per_replica, sizes


def scatter(inputs: Any, devices: Sequence[DeviceLike], dim: int = 0) -> list[Any]:
    """Split every tensor in a nested structure into balanced shares, one per device.

    Tuples, lists, dicts, namedtuples and dataclasses are walked and rebuilt with the
    same type; 0-dim tensors and non-tensor values are given whole to every replica.
    With B items over N devices, ``min(B, N)`` structures come back; an empty batch
    (B = 0) comes back whole, as one structure for the first device.

    Args:
        inputs: the structure to split.
        devices: the target devices (ints are CUDA indices, or ``"cpu"``).
        dim: the dimension to split along.

    Example:
        >>> import torch
        >>> parts = scatter({"x": torch.arange(5)}, ["cpu", "cpu"])
        >>> [p["x"].tolist() for p in parts]
        [[0, 1, 2], [3, 4]]
    """
    if not devices:
        raise ValueError("scatter: devices: expected at least one device, got none")
    spec, leaves = _tree.flatten(inputs)
    targets = [as_device(d) for d in devices]
    batch, ones = _batch_size(leaves, (), dim, lambda: _tree.leaf_paths(spec, "inputs"))
    per_replica, _ = _distribute(spec, leaves, ones, targets, dim, batch)
    return per_replica


class ScatterResult(tuple):
    """``(inputs, kwargs)`` per replica, as torch's ``DataParallel.scatter`` returns,
    plus ``sizes``: the number of batch items each replica got (``[0]`` if nothing
    was split)."""

    sizes: list[int]

    def __new__(
        cls, inputs: tuple[tuple[Any, ...], ...], kwargs: tuple[dict[str, Any], ...], sizes: list[int]
    ) -> ScatterResult:
        self = super().__new__(cls, (inputs, kwargs))
        self.sizes = sizes
        return self


def scatter_call(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    devices: Sequence[DeviceLike],
    dim: int = 0,
    broadcast: Sequence[str] = (),
    fn: Callable[..., Any] | None = None,
    split: Sequence[str] = (),
    scatter_dim: Mapping[str, int] | None = None,
) -> ScatterResult:
    """Scatter the arguments of one call, binding them by name through ``fn``'s signature.

    Args:
        args: positional arguments.
        kwargs: keyword arguments.
        devices: the target devices.
        dim: the dimension to split along.
        broadcast: names of ``fn``'s parameters (the name of ``*args`` or ``**kwargs``
            covers all of them) or of extra keyword arguments, that every replica gets whole.
        fn: the function called on each replica; used for argument names.
        split: names of arguments that are Python sequences with one entry per batch
            item; each replica gets the run of items that lines up with its share of the tensors
            (see :mod:`dpmethods.core.scatter.items`).
        scatter_dim: argument names mapped to the dim they are split along, where it is
            not ``dim`` (their batch is moved to ``dim`` for the split, and back).

    Example:
        >>> import torch
        >>> r = scatter_call((torch.ones(3, 2),), {"scale": 2.0}, ["cpu", "cpu"])
        >>> r.sizes, r[1]  # r[0]: each replica's args, r[1]: each replica's kwargs
        ([2, 1], ({'scale': 2.0}, {'scale': 2.0}))
        >>> def encode(texts): ...
        >>> r = scatter_call((["a", "b", "c"],), {}, ["cpu", "cpu"], split=("texts",), fn=encode)
        >>> r.sizes, [a for a, in r[0]]
        ([2, 1], [['a', 'b'], ['c']])
    """
    if not devices:
        raise ValueError("scatter: devices: expected at least one device, got none")
    targets = [as_device(d) for d in devices]
    if not kwargs and not broadcast and not split and not scatter_dim and args and all(map(isinstance, args, _TENSORS)):
        # Positional batch tensors only, the most common call: no structure to walk.
        first = args[0]
        batch = first.shape[dim] if -first.dim() <= dim < first.dim() else 0
        if batch and all(-a.dim() <= dim < a.dim() and a.shape[dim] == batch for a in args):
            sizes = chunk_sizes(batch, len(targets))
            columns = [_split(a, sizes, dim, targets[: len(sizes)]) for a in args]
            return ScatterResult(tuple(zip(*columns)), ({},) * len(sizes), sizes)

    bound = Arguments(args, kwargs, fn)
    taken: list[Any] = []
    if split:
        args, kwargs, taken = split_args.take(
            args, kwargs, split, bound.selected, argument_names(bound.params, len(args))
        )
    moved = split_args.move_dims(args, kwargs, scatter_dim, bound.selected, dim) if scatter_dim else None
    if moved is not None:
        args, kwargs = moved[0], moved[1]
    if split or moved is not None:  # the arguments changed: bind them again
        bound = Arguments(args, kwargs, fn)
    # After the split sequences are taken out: they are not walked as containers.
    spec, leaves = _tree.flatten((tuple(args), dict(kwargs)))
    entries = bound.selected(broadcast)
    whole = _whole_leaves(entries) if broadcast else set()
    batch = _checked_batch(bound, spec, leaves, whole, entries, taken, len(targets), dim)
    per_replica, sizes = _distribute(spec, leaves, whole, targets, dim, batch)
    if taken:
        per_replica = split_args.put(per_replica, taken, sizes, targets)
    if moved is not None and moved[2]:
        per_replica = split_args.restore_dims(per_replica, moved[2], dim)
    return ScatterResult(
        tuple(r[0] for r in per_replica), tuple(r[1] for r in per_replica), sizes
    )


