"""Arguments that are Python sequences with one entry per batch item (``split=``).

torchvision detection models take a list of images of different sizes and a list of
target dicts; sentence-transformers ``encode`` takes a list of strings; peft takes one
adapter name per row. Walked as containers, such a list would have every image cut
along its channel dim, or go whole to one replica. Named in ``split=``, the list is
cut into contiguous runs of items that line up with the tensors' shares (same balanced
sizes), and the tensors inside each item are moved to its replica's device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from dpmethods.types import tree as _tree
from dpmethods.vocab.warn_once import warn_once

__all__: list[str] = []


class _Taken(NamedTuple):
    name: str  # the argument name, for messages
    where: int | str  # positional index or keyword
    value: Any  # the sequence


def _is_items(value: Any) -> bool:
    if isinstance(value, (str, bytes, bytearray, Mapping)):
        return False
    return hasattr(value, "__len__") and hasattr(value, "__getitem__")


def take(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    split: Sequence[str],
    selected: Callable[[Sequence[str]], list[tuple[bool, Any]]],
    arg_names: list[str],
) -> tuple[tuple[Any, ...], dict[str, Any], list[_Taken]]:
    """Take the ``split`` sequences out of the call (``None`` left in their place).

    ``selected(names)`` says, per positional argument then keyword argument, whether it
    is named by ``names`` (through the signature, as for ``broadcast``). Tensors and
    ``None`` named in ``split`` stay: tensors are split along ``dim`` anyway.
    """
    flags = selected(split)
    positional = list(args)
    keyword = dict(kwargs)
    taken: list[_Taken] = []
    keys: list[int | str] = [*range(len(args)), *kwargs]
    names = [*arg_names, *kwargs]
    for (is_split, value), where, name in zip(flags, keys, names):
        if not is_split or value is None or isinstance(value, Tensor):
            continue
        if not _is_items(value):
            raise TypeError(
                f"split: argument {name!r}: expected a list, tuple or other sequence with "
                f"one entry per batch item, got {type(value).__name__} {_short(value)}"
            )
        taken.append(_Taken(name, where, value))
        if isinstance(where, int):
            positional[where] = None
        else:
            keyword[where] = None
    return tuple(positional), keyword, taken


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def batch_size(taken: list[_Taken], tensor_batch: int | None, tensor_name: Callable[[], str], dim: int) -> int:
    """The batch size: the sequences' common length, which must equal the tensors' batch."""
    first = taken[0]
    length = len(first.value)
    for other in taken[1:]:
        if len(other.value) != length:
            raise ValueError(
                f"split: arguments must have one entry per batch item, but argument "
                f"{first.name!r} has {length} items and argument {other.name!r} has "
                f"{len(other.value)}"
            )
    if tensor_batch is not None and tensor_batch != length:
        raise ValueError(
            f"split: argument {first.name!r} has {length} items, but the tensors split along "
            f"dim {dim} have a batch of {tensor_batch} ({tensor_name()} has {tensor_batch}); "
            "they must agree, or name the tensor in broadcast= if every replica needs it whole"
        )
    return length


def _share(value: Any, start: int, stop: int, device: torch.device) -> Any:
    try:
        part = value[start:stop]
    except (TypeError, KeyError):  # a sequence without slicing
        part = [value[i] for i in range(start, stop)]
    if isinstance(part, (list, tuple)):
        moved = [_tree.move(item, device) for item in part]
        if type(part) is list:
            return moved
        if type(part) is tuple:
            return tuple(moved)
        try:
            return type(part)(moved)
        except TypeError:
            return moved
    return part  # numpy arrays and other sequences: sliced as they are


def put(
    per_replica: list[tuple[tuple[Any, ...], dict[str, Any]]],
    taken: list[_Taken],
    sizes: list[int],
    devices: Sequence[torch.device],
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Put each replica's run of items back where the sequences were taken out."""
    out = []
    start = 0
    for (args, kwargs), size, device in zip(per_replica, sizes, devices):
        positional, keyword = list(args), dict(kwargs)
        for t in taken:
            share = _share(t.value, start, start + size, device)
            if isinstance(t.where, int):
                positional[t.where] = share
            else:
                keyword[t.where] = share
        out.append((tuple(positional), keyword))
        start += size
    return out


def warn_unsplit(
    fn: Callable[..., Any] | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    arg_names: list[str],
    dim: int,
) -> None:
    """Warn once per method that a call on several devices had nothing to split."""
    func = getattr(fn, "__func__", fn)
    method = getattr(func, "__qualname__", None)
    where = f"scatter: {method}:" if method else "scatter:"
    batches = [
        name
        for name, value in zip([*arg_names, *kwargs], [*args, *kwargs.values()])
        if isinstance(value, (list, tuple)) and len(value) > 0
    ]
    looks = (
        f"Arguments that look like batches (lists or tuples): {batches}; if they hold one "
        f"entry per item, pass split={tuple(batches)!r} (in @parallel_method(split=...), "
        "dpmethods.register(..., split=...) or methods={name: {'split': ...}}) so their "
        "items are shared out."
        if batches
        else "Pass split=(names of arguments with one entry per item) if the batch is a "
        "Python sequence."
    )
    warn_once(
        f"{where} nothing in this call was split along dim {dim} (no tensor with "
        f"a batch dim, no split= argument), so one replica runs the whole call on one "
        f"device. {looks}",
        stacklevel=5,
    )


def warn_whole_items(
    fn: Callable[..., Any] | None,
    entries: list[tuple[bool, Any]],
    arg_names: list[str],
    batch: int,
) -> None:
    """Warn once per argument that a list as long as the batch goes whole to every replica.

    ``entries`` holds, per positional then keyword argument, whether it is named in
    ``broadcast`` and its value. A list of strings, ints or objects with one entry per
    item (peft's ``adapter_names``, per-row lengths) is not split unless named in
    ``split``: every replica would get all of it, which is wrong without a word when the
    method doesn't check its length. Tuples of ints are shapes and sizes, not batches.
    """
    if batch < 2:
        return
    func = getattr(fn, "__func__", fn)
    method = getattr(func, "__qualname__", None)
    where = f"scatter: {method}:" if method else "scatter:"
    for name, (whole, value) in zip(arg_names, entries):
        if whole or type(value) not in (list, tuple) or len(value) != batch:
            continue
        if any(isinstance(v, Tensor) for v in value):
            continue  # a list of tensors: walked as a container, its tensors split
        if type(value) is tuple and all(type(v) is int for v in value):
            continue
        warn_once(
            f"{where} argument {name!r} is a {type(value).__name__} of {batch} items, as "
            f"many as the batch, and every replica gets all of it. If it holds one entry "
            f"per item, pass split=({name!r},) so each replica gets its items; if every "
            f"replica needs it whole, broadcast=({name!r},) says so and silences this warning.",
            stacklevel=5,
        )


class _Moved(NamedTuple):
    where: int | str  # positional index or keyword
    at: int  # the dim the argument has its batch in


def move_dims(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    scatter_dim: Mapping[str, int],
    selected: Callable[[Sequence[str]], list[tuple[bool, Any]]],
    dim: int,
) -> tuple[tuple[Any, ...], dict[str, Any], list[_Moved]]:
    """Arguments named in ``scatter_dim`` with their batch dim moved to ``dim`` (views).

    The scatter then splits every argument along ``dim``; :func:`restore_dims` moves each
    replica's chunk back, so the method gets its own layout (Encodec's ``audio_codes``
    are ``[chunks, batch, quantizers, frames]``).
    """
    positional, keyword = list(args), dict(kwargs)
    keys: list[int | str] = [*range(len(args)), *kwargs]
    moved: list[_Moved] = []
    for at in sorted(set(scatter_dim.values())):
        names = [n for n, d in scatter_dim.items() if d == at]
        for (named, value), where in zip(selected(names), keys):
            if not named or at == dim or not _tensor_leaves(value):
                continue
            changed = _map_tensors(value, _forth(at, dim, where))
            if isinstance(where, int):
                positional[where] = changed
            else:
                keyword[where] = changed
            moved.append(_Moved(where, at))
    return tuple(positional), keyword, moved


def _moved(t: Tensor, at: int, dim: int, where: int | str) -> Tensor:
    if not (-t.dim() <= at < t.dim() and -t.dim() <= dim < t.dim()):
        name = f"argument {where!r}" if isinstance(where, str) else f"positional argument {where}"
        raise ValueError(
            f"scatter_dim: {name} has shape {list(t.shape)}, which has no dim {at} to split "
            f"along; expected at least {max(at, dim) + 1} dims"
        )
    return t.movedim(at, dim)


def restore_dims(
    per_replica: list[tuple[tuple[Any, ...], dict[str, Any]]], moved: list[_Moved], dim: int
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Each replica's arguments with the dims :func:`move_dims` moved put back."""
    out = []
    for args, kwargs in per_replica:
        positional, keyword = list(args), dict(kwargs)
        for m in moved:
            if isinstance(m.where, int):
                positional[m.where] = _map_tensors(positional[m.where], _back(m.at, dim))
            else:
                keyword[m.where] = _map_tensors(keyword[m.where], _back(m.at, dim))
        out.append((tuple(positional), keyword))
    return out


def _forth(at: int, dim: int, where: int | str) -> Callable[[Tensor], Tensor]:
    return lambda t: _moved(t, at, dim, where)


def _back(at: int, dim: int) -> Callable[[Tensor], Tensor]:
    return lambda t: t.movedim(dim, at)


def _tensor_leaves(value: Any) -> bool:
    return any(isinstance(leaf, Tensor) and leaf.dim() for leaf in _tree.flatten(value)[1])


def _map_tensors(value: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    spec, leaves = _tree.flatten(value)
    return _tree.unflatten(
        spec, [fn(v) if isinstance(v, Tensor) and v.dim() else v for v in leaves]
    )
