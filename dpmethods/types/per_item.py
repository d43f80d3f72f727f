"""Outputs that are Python lists with one entry per batch item.

Detection models return one dict per image, vision-language models one feature
tensor per image. Gathered element by element (as ``"cat"`` joins containers) such a
list comes back wrong: entries of different items are concatenated together, or the
replicas' lists differ in length and cannot be joined at all. They must be
*extended*: replica 0's entries, then replica 1's, and so on.

:func:`mark_items` walks the replicas' flattened specs (no second walk of the
outputs) and replaces each list to extend with a single :class:`Items` leaf:

- gather mode ``"extend"`` (for the whole output or a top-level key) extends the first
  list or tuple found;
- with ``"cat"``, a list whose length on every replica equals that replica's share of
  the batch, while the shares differ, is extended: it cannot be anything else;
- with equal shares the same list might be per-item or a list of batch tensors. A list
  of tensors that carry the batch on the join dim is joined element by element as
  before; any other one is joined element by element too, with a one-time warning
  naming the output path and ``"extend"``. Tuples with equal shares are taken for
  fixed-arity returns (``(loss, logits)``) and joined element by element.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from dpmethods.types import tree as _tree
from dpmethods.vocab.gather_modes import Mode
from dpmethods.vocab.warn_once import warn_once

__all__ = ["Items", "Whole", "extend", "mark_items", "needs_marking", "wants_extend"]

_SEQUENCES = (_tree.TUPLE, _tree.LIST)
_KEYED = (_tree.DICT, _tree.DATACLASS, _tree.NAMEDTUPLE)


class Items(list):  # type: ignore[type-arg]
    """One replica's per-item entries, standing in the flat leaves for the whole list.

    Example:
        >>> Items([1, 2]) + [3]
        [1, 2, 3]
    """


class Whole:
    """One replica's whole value under a ``"list"`` key, standing in the flat leaves for it.

    The replicas' values may differ in structure (lists of different lengths), which
    ``"list"`` allows: they are never compared leaf by leaf.

    Example:
        >>> Whole([1, 2]).value
        [1, 2]
    """

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _count(spec: _tree.Spec) -> int:
    if spec in _tree.LEAVES:
        return 1
    return sum(1 if c in _tree.LEAVES else _count(c) for c in spec.children)


def _keys(spec: _tree.Spec) -> Sequence[Any]:
    kind, cls, meta, _ = spec
    return meta if kind == _tree.DICT else meta[0] if kind == _tree.DATACLASS else cls._fields


def _is_sequence(spec: _tree.Spec) -> bool:
    if spec in _tree.LEAVES or spec.kind not in _SEQUENCES:
        return False
    return spec.cls is None or spec.cls in (list, tuple)


def _batched(entries: Sequence[Any], share: int, dim: int) -> bool:
    # A list of batch outputs (hidden states, one per layer) is a list of tensors that
    # carry the share on the join dim; per-item entries are containers (one dict per
    # image) or tensors without it (one feature map per image).
    return all(
        isinstance(t, Tensor) and t.dim() > dim and t.shape[dim] == share for t in entries
    )


def wants_extend(mode: Any) -> bool:
    """Whether the gather option asks for ``"extend"`` anywhere, or ``"list"`` for a key
    (whose replica values are kept whole, whatever their structure).

    Example:
        >>> wants_extend({"boxes": "extend"}), wants_extend({"x": "list"}), wants_extend("cat")
        (True, True, False)
    """
    if isinstance(mode, str):
        return mode == Mode.EXTEND
    # Compared, not hashed: torch.compile (2.11) can't put the Mode enum in a set.
    return isinstance(mode, Mapping) and any(m in (Mode.EXTEND, Mode.LIST) for m in mode.values())


def _kind(spec: _tree.Spec) -> Any:
    return spec if spec in _tree.LEAVES else spec[:2]


def _mixed(specs: list[_tree.Spec], sizes: Sequence[int] | None) -> bool:
    """Whether sequences under ``"extend"`` are a fixed-arity return, not items.

    ``(per_item_list, batch_tensor)`` holds entries of different kinds; a tuple whose
    length is not every replica's share can't hold one entry per item either. Such a
    container is walked into (each entry extended or concatenated), never extended.
    """
    kinds = {_kind(c) for c in specs[0].children} - {_tree.NONE}
    if len(kinds) > 1:
        return True
    is_tuple = specs[0].kind == _tree.TUPLE
    return is_tuple and sizes is not None and [len(s.children) for s in specs] != list(sizes)


def top_keys(spec: _tree.Spec) -> list[Any] | None:
    """The keys a gather mapping can name at the top of an output: its keys or field
    names (str), or its positions (int) for a tuple or list; None for a leaf.

    Example:
        >>> top_keys(_tree.flatten({"a": 1})[0]), top_keys(_tree.flatten((1, 2))[0])
        (['a'], [0, 1])
    """
    if spec in _tree.LEAVES:
        return None
    if spec.kind in _KEYED:
        return [str(k) for k in _keys(spec)]
    if spec.kind in _SEQUENCES:
        return list(range(len(spec.children)))
    return None


def needs_marking(spec: _tree.Spec, share: int) -> bool:
    """Whether replica 0's spec holds a list as long as its share (cheap).

    Only equal shares need this: with shares that differ, per-item lists differ in
    length across replicas, and so do the specs.

    Example:
        >>> needs_marking(_tree.flatten((1, [2, 3]))[0], 2)
        True
        >>> needs_marking(_tree.flatten((1, (2, 3)))[0], 2)
        False
    """
    if spec in _tree.LEAVES:
        return False
    children = spec.children
    if spec.kind == _tree.LIST and _is_sequence(spec) and len(children) == share:
        return True
    if all(map(isinstance, children, itertools.repeat(str))):  # leaf markers only, in C
        return False
    return any(needs_marking(c, share) for c in children if c not in _tree.LEAVES)


def mark_items(
    flat: list[tuple[_tree.Spec, list[Any]]],
    sizes: Sequence[int] | None,
    mode: Any,
    dim: int,
) -> list[tuple[_tree.Spec, list[Any]]]:
    """Replace each per-item list in every replica's ``(spec, leaves)`` by one :class:`Items` leaf.

    Args:
        flat: ``_tree.flatten`` of each replica's output.
        sizes: each replica's share of the batch (``None``: only ``"extend"`` applies).
        mode: the gather option (a mode or a mapping of top-level keys to modes).
        dim: the join dim (for telling batch tensors from per-item entries).

    Example:
        >>> flat = [_tree.flatten(["a", "b"]), _tree.flatten(["c"])]
        >>> [leaves for _, leaves in mark_items(flat, [2, 1], "cat", 0)]
        [[['a', 'b']], [['c']]]
    """
    top_mode = mode if isinstance(mode, (str, Mapping)) else "cat"
    if isinstance(top_mode, Mapping) and top_keys(flat[0][0]) is None:
        top_mode = "cat"  # reported by gather's own check of the mapping
    marker = _Marker(flat, sizes, dim)
    new_specs = marker.walk([s for s, _ in flat], [0] * len(flat), "output", top_mode, True)
    return [marker.replaced(r, spec_new) for r, spec_new in enumerate(new_specs)]


class _Marker:
    """One walk of the replicas' specs side by side, recording the lists to replace."""

    def __init__(self, flat: list[tuple[_tree.Spec, list[Any]]], sizes: Sequence[int] | None, dim: int) -> None:
        self.flat, self.sizes, self.dim, self.n = flat, sizes, dim, len(flat)
        # Per replica: (start, end, spec, kind) of each list replaced, in leaf order.
        self.cuts: list[list[tuple[int, int, _tree.Spec, type]]] = [[] for _ in flat]

    def walk(self, specs: list[_tree.Spec], starts: list[int], path: str, m: Any, top: bool) -> list[Any]:
        first = specs[0]
        if any(s in _tree.LEAVES for s in specs):
            return specs
        if all(_is_sequence(s) for s in specs):
            done = self._sequence(specs, starts, path, m)
            if done is not None:
                return done
        if any(s[:3] != first[:3] or len(s.children) != len(first.children) for s in specs[1:]):
            return specs  # differing structures: reported by gather
        if first.kind not in _SEQUENCES and first.kind not in _KEYED:
            top = False  # a rule's node: its parts are not output keys
        keys = top_keys(first) if top and isinstance(m, Mapping) else None
        offsets = list(starts)
        children: list[list[Any]] = [[] for _ in range(self.n)]
        for i, label in enumerate(_tree.children_labels(first)):
            column = [s.children[i] for s in specs]
            child_mode = m.get(keys[i], "cat") if keys is not None and isinstance(m, Mapping) else m
            if child_mode == Mode.LIST:
                new = self._whole(column, offsets)
            else:
                new = self.walk(column, offsets, path + label, child_mode, False)
            for r in range(self.n):
                children[r].append(new[r])
                offsets[r] += _count(column[r])
        return [s._replace(children=tuple(c)) for s, c in zip(specs, children)]

    def _sequence(self, specs: list[_tree.Spec], starts: list[int], path: str, m: Any) -> list[Any] | None:
        """A list or tuple on every replica: cut as per-item, or None to walk into it."""
        sizes = self.sizes
        if m == Mode.EXTEND and not _mixed(specs, sizes):
            return self._cut(specs, starts)
        if m != Mode.CAT or sizes is None or [len(s.children) for s in specs] != list(sizes):
            return None
        if len(set(sizes)) > 1:
            self._check_coupled(specs, starts, path)
            return self._cut(specs, starts)
        # Equal shares: tuples are taken for fixed-arity returns ((loss, logits)), lists of
        # batch tensors for lists of batch outputs; other lists warn.
        if specs[0].kind == _tree.LIST and not all(
            _batched(e, sizes[r], self.dim) for r, e in enumerate(self._entries(specs, starts))
        ):
            warn_once(
                f"gather: {path} is a list with one entry per batch item on every "
                f"replica ({sizes[0]} each), or a list of batch outputs: with equal "
                "shares dpmethods cannot tell, so it was joined entry by entry "
                "('cat'). If its entries are per item (one dict per image, say), pass "
                f"gather='extend' (or gather={{key: 'extend'}} for that output key) "
                "to concatenate the replicas' lists in order."
            )
        return None

    def _check_coupled(self, specs: list[_tree.Spec], starts: list[int], path: str) -> None:
        """Warn where every entry of a per-item list holds its replica's share on the join
        dim (each item scored against its replica's items): extended, it is the replicas'
        pieces, not one device's entries over the whole batch, and no mode rebuilds that.
        Shares that differ are the evidence (as for a tensor, in ``core/gather/coupled``);
        a share of 1 is none (an entry of one row is common)."""
        sizes = self.sizes
        assert sizes is not None
        if min(sizes) < 2 or not all(
            _batched(e, sizes[r], self.dim) for r, e in enumerate(self._entries(specs, starts))
        ):
            return
        warn_once(
            f"gather: {path} is a list with one entry per batch item, and every entry holds "
            f"its replica's share of the batch ({list(sizes)}) along dim {self.dim}: each "
            "item was paired only with the items of its own replica's share, so the joined "
            f"list is not what one device computes on the full batch (entries of "
            f"{sum(sizes)} along dim {self.dim}), and no gather mode can rebuild it. Return "
            "per-item features and compute what pairs the items on the gathered batch instead."
        )

    def _entries(self, specs: list[_tree.Spec], starts: list[int]) -> list[Any]:
        return [
            _tree.unflatten(s, self.flat[r][1][starts[r] : starts[r] + _count(s)])
            for r, s in enumerate(specs)
        ]

    def _cut(self, specs: list[_tree.Spec], starts: list[int], kind: type = Items) -> list[Any]:
        for r, s in enumerate(specs):
            self.cuts[r].append((starts[r], starts[r] + _count(s), s, kind))
        return [_tree.OTHER] * self.n

    def _whole(self, specs: list[_tree.Spec], starts: list[int]) -> list[Any]:
        if all(s in _tree.LEAVES for s in specs):
            return specs  # one leaf per replica: "list" joins it as it is
        return self._cut(specs, starts, Whole)

    def replaced(self, r: int, spec_new: _tree.Spec) -> tuple[_tree.Spec, list[Any]]:
        """Replica ``r``'s new spec and leaves, each cut list one leaf."""
        spec, leaves = self.flat[r]
        if not self.cuts[r]:
            return spec, leaves
        out: list[Any] = []
        pos = 0
        for start, end, sub, kind in self.cuts[r]:
            out.extend(leaves[pos:start])
            out.append(kind(_tree.unflatten(sub, leaves[start:end])))
            pos = end
        out.extend(leaves[pos:])
        return spec_new, out


def extend(column: Sequence[Any], device: torch.device) -> list[Any]:
    """The replicas' entries in order, with the tensors in them moved to ``device``.

    Example:
        >>> import torch
        >>> extend([Items([torch.ones(1)]), Items([{"a": torch.zeros(2)}])], torch.device("cpu"))
        [tensor([1.]), {'a': tensor([0., 0.])}]
    """
    return [_tree.move(entry, device) for items in column for entry in items]
