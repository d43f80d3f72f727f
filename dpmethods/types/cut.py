"""A batch's output cut back into one output per item: the inverse of the method's gather.

An item's output is what indexing the batch's output at its row gives: a tensor's row
without the batch dim (``dim``, or ``gather_dim`` per output key), a per-item list's
entry (``"extend"``, or a list with one entry per row that is not a list of batch
tensors), and ``ModelOutput``s, dicts, dataclasses, tuples and types with a rule field
by field, rebuilt with their own type; ``None`` stays ``None``. A value shared by the
batch (a loss, a scale; anything gathered with ``"mean"``, ``"sum"``, ``"stack"``,
``"same"`` or ``"list"``; a 0-dim tensor, a tensor without one row per item, a number
or a string outside a per-item list) belongs to no item and is refused, naming it.
A named mode or a callable gather joins whole outputs: one batch's output is cut by
its batch dim as with ``"cat"``; a field the named mode's ``pairs`` names (scores of
each item against the batch's other items, a contrastive model's ``logits_per_image``)
is refused, naming it: an item's row would depend on the items batched with it.

Two cuts use the batch's padding (:class:`Padding`): a
``generate`` output that starts with the batch's left-padded prompt comes back without
the padding, so equal prompts give equal tokens whatever their batch (with
``num_return_sequences=k`` each item keeps its k rows, ``repeat``; with beam search the
per-step outputs its ``num_beams`` rows, ``beams``, and ``beam_indices`` index them; a
transformers cache keeps the batch dim (a cache of the item's rows, as alone),
and a ``generate``'s cache keeps each item's own positions); and ``trim=True``
narrows each item's tensors to its own positions in the dims told to be padding
(:mod:`dpmethods.items.trim`).
"""

from __future__ import annotations

import itertools
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from dpmethods.types import tree as _tree
from dpmethods.types.per_item import top_keys
from dpmethods.vocab.gather_modes import BUILTIN_MODES, Mode, mode_pairs
from dpmethods.vocab.options import MethodOptions
from dpmethods.vocab.warn_once import warn_once

__all__ = ["STATE_RULES", "Entry", "ItemState", "Padding", "cut_output", "register_item_state"]


class Entry:
    """One item's entry of a per-item list, as :func:`cut_output` gives it with
    ``entries=True``: a value of one item, where a tuple or dict beside it in an item's
    output is the fields of a structured output, each cut by itself. A caller that joins
    items again (the Ray Predictor's columns) tells the two apart by it.

    Example:
        >>> Entry((1, "a")).value
        (1, 'a')
    """

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Entry) and bool(self.value == other.value)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Entry({self.value!r})"

class Padding(NamedTuple):
    """Where each row's own positions lie in a padded batch: ``spans[i] = (start, end)``
    along the padded dim of length ``longest``.

    Example:
        >>> Padding.of([3, 1], left=True).spans
        [(0, 3), (2, 3)]
    """

    longest: int
    spans: list[tuple[int, int]]

    @classmethod
    def of(cls, lengths: Sequence[int], left: bool) -> Padding:
        longest = max(lengths, default=0)
        return cls(longest, [(longest - n, longest) if left else (0, n) for n in lengths])


_SHARED = (Mode.STACK, Mode.MEAN, Mode.SUM, Mode.SAME, Mode.LIST)  # modes of whole-batch values
_SEQUENCES = (_tree.TUPLE, _tree.LIST)


def _count(spec: _tree.Spec) -> int:
    if spec in _tree.LEAVES:
        return 1
    return sum(_count(c) for c in spec.children)


def _labels(spec: _tree.Spec) -> list[str]:
    kind, cls, meta, children = spec
    if kind == _tree.DICT:
        return [f"[{k!r}]" for k in meta]
    if kind == _tree.DATACLASS:
        return [f".{n}" for n in meta[0]]
    if kind == _tree.NAMEDTUPLE:
        return [f".{n}" for n in cls._fields]
    return [f"[{i}]" for i in range(len(children))]


def _got(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of shape {list(value.shape)}"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


# generate's sequences (its output, or a field of it) and per-step fields.
_SEQUENCE_PATHS = ("output", "output.sequences", "output['sequences']")
_STEP_FIELDS = frozenset(("scores", "logits", "attentions", "hidden_states", "decoder_attentions",
                          "cross_attentions", "decoder_hidden_states"))

# generate's per-step self-attentions after the first step (``attentions[t][layer]``, t > 0).
_STEP_ATTENTION = re.compile(r"(?:\.attentions|\['attentions'\])\[([1-9][0-9]*)\]\[[0-9]+\]$")


class _Cutter:
    """One walk of a batch's flattened output, giving each node's value per item."""

    def __init__(self, leaves: list[Any], rows: int, padding: Padding | None,
                 padded: Callable[[str, int], bool] | None, prompt: Tensor | None, repeat: int = 1,
                 paired: Mapping[Any, str] | None = None, entries: bool = False, beams: int = 1) -> None:
        self.leaves, self.rows, self.padding, self.padded, self.prompt = leaves, rows, padding, padded, prompt
        self.entries = entries  # wrap each per-item list's entry in Entry
        self.repeat = repeat  # a tensor's rows per item (generate's num_return_sequences)
        self.beams = beams  # a beam search's rows per item in its per-step outputs (num_beams)
        self.state: set[int] = set()  # leaves of batch state (caches): cut keeping the batch dim
        self.positional: set[int] = set()  # of them, keys and values of every position in order
        self.cross: set[int] = set()  # leaves of an encoder-decoder's cross-attention cache
        self.paired = paired or {}  # top-level keys that pair items with each other: what to do instead
        # generate with rows that ended at eos before the batch's last step (own_steps):
        self.steps: list[int] | None = None  # each item's own steps (its rows' longest)
        self.total = 0  # the batch's steps
        self.sequences = ""  # the path of its sequences
        self.step_paths: set[str] = set()  # the paths of its per-step tuples

    def own_steps(self, spec: _tree.Spec, eos: Sequence[int]) -> None:
        """A ``generate`` whose rows end at their first ``eos``: with one beam, each item's
        own steps, where one ended before the batch's last step (which filled it after its
        end), so that its sequences, per-step tuples and cache end where it ends alone. A
        beam search's steps alone are not told by its sequences: one warning where an
        item's every sequence ended before the batch's last step."""
        if not eos:
            return
        paths = _tree.leaf_paths(spec)
        found = [(p, t) for p, t in zip(paths, self.leaves) if p in _SEQUENCE_PATHS and isinstance(t, Tensor)
                 and t.dim() == 2 and not t.is_floating_point() and t.shape[0] == self.rows * self.repeat]
        if len(found) != 1:
            return
        path, seqs = found[0]
        steps = {}  # the per-step tuples, by path: their steps
        if spec not in _tree.LEAVES:
            for child, label in zip(spec.children, _labels(spec)):
                if label.strip(".[]'\"") in _STEP_FIELDS and child not in _tree.LEAVES and child.kind == _tree.TUPLE:
                    steps["output" + label] = len(child.children)
        if self.prompt is not None:  # a decoder-only prompt, left padded
            if not self.starts_with_prompt(seqs, 0):
                return
            width = self.prompt.shape[1]
        elif steps:  # an encoder-decoder's decoder prompt: what the steps did not generate
            width = seqs.shape[1] - max(steps.values())
        else:
            width = 1  # the decoder's start token
        total = seqs.shape[1] - width
        if total <= 0 or any(n != total for n in steps.values()):
            return
        hit = torch.isin(seqs[:, width:], torch.tensor(list(eos), device=seqs.device))
        own = torch.where(hit.any(1), hit.int().argmax(1) + 1, total)
        per_item = own.view(self.rows, self.repeat).amax(1).tolist()
        if all(n == total for n in per_item):
            return
        if self.beams > 1:
            warn_once(
                "map: generate: with beam search, an item whose beams ended at eos before its "
                "batch's last step keeps the batch's steps: its sequences the fill tokens after "
                "its end, its per-step outputs (scores, logits, attentions) and cache the steps "
                "its batch went on for, which alone it does not run (a beam search's own steps "
                "are not told by its sequences). Map with num_beams=1, or batch_size=1 where "
                "those must be the item's own",
                stacklevel=2,
            )
            return
        self.steps, self.total, self.sequences, self.step_paths = per_item, total, path, set(steps)

    def refuse(self, path: str, value: Any, why: str) -> ValueError:
        return ValueError(
            f"map: {path} of the output of a batch of {self.rows} items is {value}, {why}: it "
            "belongs to no item, so the output cannot be cut into one per item. Leave it out of "
            "the method's output (a loss: pass no labels), or map batches (no batch_size= or max_tokens=)"
        )

    def refuse_paired(self, path: str, value: str, advice: str, others: Mapping[str, str]) -> ValueError:
        """The refusal of the paired field at ``path``, naming ``others`` (the output's other
        paired fields: their paths, each with its advice) too, so one refusal names them all."""
        also = ""
        if others:
            also = f". So do {', '.join(others)}" + "".join(
                f"; for {p}, {a}" for p, a in others.items() if a and a != advice
            )
        return ValueError(
            f"map: {path} of the output of a batch of {self.rows} items is {value}, which pairs "
            "each item with the batch's other items: an item's row would hold its scores against "
            "whichever items were batched with it, so the output cannot be cut into one per item. "
            + (f"{advice[0].upper()}{advice[1:]}; or map" if advice else "Map")
            + " batches of your own (no batch_size= or max_tokens=), where they pair the batch's items"
            + also
        )

    def node(self, spec: _tree.Spec, pos: int, path: str, mode: Any, dim: Any, top: bool) -> tuple[list[Any], int]:
        if isinstance(mode, str) and mode in _SHARED:
            shown = _got(self.leaves[pos]) if spec in _tree.LEAVES else _tree.describe(spec)
            raise self.refuse(path, shown, f"gathered with {str(mode)!r}, one value for the whole batch")
        own = dim[None] if isinstance(dim, Mapping) else dim  # a leaf or list at the top: dim
        if spec in _tree.LEAVES:
            if pos in self.state:
                return self.state_rows(self.leaves[pos], path, own, pos), pos + 1
            return self.leaf(self.leaves[pos], path, own), pos + 1
        begin, end = pos, pos + _count(spec)
        if self.per_item(spec, pos, mode, own):
            starts = [pos]
            for child in spec.children:
                starts.append(starts[-1] + _count(child))
            parts = [self.leaves[a:b] for a, b in itertools.pairwise(starts)]
            if self.padded is not None and self.padding is not None:  # trim: each entry to its item's positions
                parts = [self.trimmed_entry(c, leaves, path + label, path + "[*]", span) for c, leaves, label, span
                         in zip(spec.children, parts, _labels(spec), self.padding.spans)]
            values = [_tree.unflatten(c, leaves) for c, leaves in zip(spec.children, parts)]
            return ([Entry(v) for v in values] if self.entries else values), end
        keys = top_keys(spec) if top and (isinstance(mode, Mapping) or isinstance(dim, Mapping) or self.paired) else None
        columns = []
        for i, (child, label) in enumerate(zip(spec.children, _labels(spec))):
            key = keys[i] if keys is not None else None
            if key is not None and key in self.paired:
                shown = _got(self.leaves[pos]) if child in _tree.LEAVES else _tree.describe(child)
                others = {path + lb: self.paired[k] for k, lb in zip(keys or [], _labels(spec))
                          if k in self.paired and k != key}
                raise self.refuse_paired(path + label, shown, self.paired[key], others)
            child_mode = mode.get(key, Mode.CAT) if isinstance(mode, Mapping) else mode
            child_dim = dim.get(key, dim[None]) if isinstance(dim, Mapping) else dim
            column, pos = self.node(child, pos, path + label, child_mode, child_dim, False)
            columns.append(column)
        holder = spec._replace(children=(_tree.OTHER,) * len(spec.children))
        if self.steps is not None and path in self.step_paths:  # each item's own steps
            values = [_tree.unflatten(spec._replace(children=(_tree.OTHER,) * n), [c[r] for c in columns[:n]])
                      for r, n in enumerate(self.steps)]
            return values, end
        values = [_tree.unflatten(holder, [c[r] for c in columns]) for r in range(self.rows)]
        info = _state_of(spec.cls, spec.meta[1]) if spec.kind == _tree.NODE and STATE_RULES else None
        if info is not None and info.narrow is not None and begin in self.cross:
            # The encoder's positions, already cut to the item's: what counts them.
            values = [info.narrow(v, 0, 0) for v in values]
        elif info is not None and info.narrow is not None:
            # A decoder-only prompt's left padding: the positions before the item's own;
            # the steps the batch went on after the item's end: those after them.
            starts = ([s for s, _ in self.padding.spans] if self.prompt is not None and self.padding is not None
                      else [0] * self.rows)
            drops = [self.total - n for n in self.steps] if self.steps is not None else [0] * self.rows
            values = [info.narrow(v, a, d) if a or d else v for v, a, d in zip(values, starts, drops)]
        return values, end

    def trimmed_entry(self, spec: _tree.Spec, leaves: list[Any], path: str, pooled: str,
                      span: tuple[int, int]) -> list[Any]:
        """The leaves of one item's entry of a per-item list (sentence-transformers'
        ``encode(output_value=None)``: each text's features, padded to the longest item of
        the call that made it) narrowed to the item's own positions in the dims told to be
        padding, by the entry's path or ``pooled``, the path of every entry (see
        :class:`dpmethods.items.trim.PaddedDims`)."""
        padded = self.padded
        assert padded is not None and self.padding is not None
        longest, (start, end) = self.padding.longest, span
        out = []
        for leaf, leaf_path, any_path in zip(leaves, _tree.leaf_paths(spec, path), _tree.leaf_paths(spec, pooled)):
            if isinstance(leaf, Tensor):
                for d in range(leaf.dim()):
                    if padded(any_path, d) or padded(leaf_path, d):
                        # Padded to its call's longest: a batch that ran in halves pads each
                        # half to its own. Right padding starts the item's positions at 0;
                        # left padding ends them at the entry's end.
                        size = leaf.shape[d]
                        at = start if size == longest or start == 0 else size - (longest - start)
                        leaf = leaf.narrow(d, at, end - start)
            out.append(leaf)
        return out

    def per_item(self, spec: _tree.Spec, pos: int, mode: Any, dim: int) -> bool:
        """Whether a list or tuple holds one entry per item (taken whole), not fields."""
        if spec.kind not in _SEQUENCES or spec.cls not in (None, list, tuple) or len(spec.children) != self.rows:
            return False
        if mode == Mode.EXTEND:  # entries of different kinds are a fixed-arity return
            return len({c if c in _tree.LEAVES else c[:2] for c in spec.children} - {_tree.NONE}) <= 1
        if spec.kind == _tree.TUPLE:  # a fixed-arity return, as the gather takes it
            return False
        # A list of batch outputs (one per layer) holds tensors with the batch on dim.
        leaves = self.leaves[pos: pos + len(spec.children)]
        return not (all(c == _tree.LEAF for c in spec.children) and all(self.batched(t, dim) for t in leaves))

    def batched(self, value: Any, dim: int) -> bool:
        return (isinstance(value, Tensor) and -value.dim() <= dim < value.dim()
                and value.shape[dim] in (self.rows, self.rows * self.repeat, self.rows * self.beams))

    def group(self, value: Tensor, dim: int) -> int:
        """A batched tensor's rows per item: ``repeat`` (generate's sequences), ``beams`` (a
        beam search's per-step outputs), or one (an encoder's outputs beside both)."""
        n = value.shape[dim]
        return self.repeat if n == self.rows * self.repeat else self.beams if n == self.rows * self.beams else 1

    def leaf(self, value: Any, path: str, dim: int) -> list[Any]:
        rows = self.rows_of(value, path, dim)
        if self.steps is not None and path == self.sequences:  # without the fill after its end
            rows = [r[..., : r.shape[-1] - (self.total - n)] for r, n in zip(rows, self.steps)]
        return rows

    def rows_of(self, value: Any, path: str, dim: int) -> list[Any]:
        if value is None:
            return [None] * self.rows
        if self.batched(value, dim):
            # generate's sequences have num_return_sequences rows per item, a beam search's
            # per-step outputs (scores, logits, attentions, encoder outputs) num_beams rows.
            k = self.group(value, dim)
            if self.beams > 1 and path.endswith(("beam_indices", "['beam_indices']")):
                return self.beam_rows(value, dim)
            if self.starts_with_prompt(value, dim):
                spans = self.padding.spans  # type: ignore[union-attr]
                if k > 1:
                    return [value[i * k:(i + 1) * k, s:] for i, (s, _) in enumerate(spans)]
                return [value[i, s:] for i, (s, _) in enumerate(spans)]
            batch_dim = dim % value.dim()
            if k > 1:  # each item's k rows, as a group that keeps the batch dim
                rows = [value.narrow(batch_dim, i * k, k) for i in range(self.rows)]
                dims = list(range(value.dim()))
            else:
                rows = list(value.unbind(dim))
                dims = [j + (j >= batch_dim) for j in range(value.dim() - 1)]
            if self.padded is None or self.padding is None:
                return rows
            # dims[j] is the batch output's dim that is the item output's dim j.
            cut = [j for j, d in enumerate(dims) if d != batch_dim and self.padded(path, d)]
            if cut:
                rows = [self.trimmed(r, span, cut) for r, span in zip(rows, self.padding.spans)]
            step = _STEP_ATTENTION.search(path) if self.prompt is not None and value.dim() == 4 else None
            if step is not None:
                rows = self.own_keys(rows, int(step.group(1)), value.shape[-1])
            return rows
        np = sys.modules.get("numpy")  # never imported here: an output can only hold arrays if it is
        if np is not None and isinstance(value, np.ndarray) and -value.ndim <= dim < value.ndim and value.shape[dim] == self.rows:
            return list(np.moveaxis(value, dim, 0))
        if isinstance(value, Tensor) or (np is not None and isinstance(value, np.ndarray)):
            groups = ["one row"] + [f"{self.repeat} rows (num_return_sequences)"] * (self.repeat > 1)
            groups += [f"{self.beams} rows (num_beams)"] * (self.beams > 1 and self.beams != self.repeat)
            each = " or ".join(groups)
            why = "one value for the whole batch" if not value.ndim else f"without {each} per item on dim {dim}"
            raise self.refuse(path, _got(value), why)
        raise self.refuse(path, _got(value), "one value for the whole batch")

    def state_rows(self, value: Any, path: str, dim: int, pos: int) -> list[Any]:
        """Each item's rows of a tensor of a type whose tensors are batch state (a
        transformers cache's keys and values), keeping the batch dim, so the item's
        object is a batch of its own as its call alone gives it (a cache of one prompt, or
        of its beams). A ``generate``'s attention cache (``[batch, heads, positions, dim]``
        of a layer that holds every position in order, :class:`ItemState`) is cut to the item's own positions: a decoder-only prompt's left padding is left
        out, and an encoder-decoder's cross-attention cache keeps the item's encoder
        positions."""
        if not self.batched(value, dim):
            return self.leaf(value, path, dim)
        k = self.group(value, dim)
        batch_dim = dim % value.dim()
        rows = [value.narrow(batch_dim, i * k, k) for i in range(self.rows)]
        padding = self.padding
        if padding is None or pos not in self.positional or value.dim() != 4 or batch_dim != 0:
            return rows
        if self.prompt is not None and value.shape[2] >= padding.longest:  # [pad | prompt | generated]
            return [r.narrow(2, s, r.shape[2] - s) for r, (s, _) in zip(rows, padding.spans)]
        if pos in self.cross and value.shape[2] == padding.longest:  # the encoder's positions
            return [r.narrow(2, s, e - s) for r, (s, e) in zip(rows, padding.spans)]
        return rows

    def own_keys(self, rows: list[Tensor], step: int, keys: int) -> list[Tensor]:
        """A decoder-only generate's attentions of a later ``step`` cut to each item's own
        keys: of the batch's ``longest + step`` positions so far, those after its left
        padding; a sliding window's last ones (it holds fewer), a static cache's from the
        item's first (it holds more: its size less the padding, as the item's cache)."""
        assert self.padding is not None
        seen = self.padding.longest + step
        out = []
        for r, (s, _) in zip(rows, self.padding.spans):
            if keys <= seen:
                n = min(keys, seen - s)
                out.append(r.narrow(-1, keys - n, n))
            else:
                out.append(r.narrow(-1, s, keys - s))
        return out

    def beam_rows(self, value: Tensor, dim: int) -> list[Tensor]:
        """Each item's rows of a beam search's ``beam_indices``, which index the batch's
        beam rows (item i's are ``i * beams`` on, -1 past a row's end): rebased to index the
        item's own beams, as its generate alone gives them."""
        k, b = self.repeat, self.beams
        batch_dim = dim % value.dim()
        rows = [value.narrow(batch_dim, i * k, k) for i in range(self.rows)]
        rows = [r.where(r < 0, r - i * b) for i, r in enumerate(rows)]
        return rows if k > 1 else [r.squeeze(batch_dim) for r in rows]

    def starts_with_prompt(self, value: Tensor, dim: int) -> bool:
        prompt = self.prompt
        if prompt is None or self.padding is None or dim != 0 or value.dim() != 2 or value.is_floating_point():
            return False
        width = prompt.shape[1]
        if self.repeat > 1:  # generate repeats each prompt for its sequences
            prompt = prompt.repeat_interleave(self.repeat, dim=0)
        return value.shape[1] >= width and bool((value[:, :width] == prompt.to(value.device)).all())

    @staticmethod
    def trimmed(row: Tensor, span: tuple[int, int], dims: list[int]) -> Tensor:
        start, end = span
        for d in dims:
            row = row.narrow(d, start, end - start)
        return row


class ItemState(NamedTuple):
    """How an item's part of a batch-state object (a cache) is cut: ``positional[i]``,
    child i holds every position in order along dim 2 (``[batch, heads, positions,
    dim]``: a decoder-only prompt's left padding is cut away); ``encoder``, the child
    (a nested state object) that holds the encoder's positions (cut to the item's);
    ``narrow(obj, start, drop)``, the item's object from the one rebuilt of its rows
    (its positional children already cut from ``start``), given the ``start`` positions
    of left padding the batch had before the item's own and the ``drop`` positions the
    batch went on after the item's end (a ``generate`` whose rows ended at eos before the
    batch's last step): what the children cannot say (a count of the positions seen, a
    sliding window's last positions, the positions after the item's end)."""

    positional: Sequence[bool] = ()
    encoder: int | None = None
    narrow: Callable[[Any, int, int], Any] | None = None


# Tells a registered type's node (its class and flatten context) as batch state, or None:
# its tensors keep the batch dim in each item's object, as its call alone gives it. Set
# by integrations (transformers' caches).
STATE_RULES: list[Callable[[type, Any], ItemState | None]] = []


def register_item_state(rule: Callable[[type, Any], ItemState | None]) -> None:
    """Tell item maps (``map`` with ``batch_size=`` or ``max_tokens=``) which registered
    types are batch state: ``rule(cls, context)`` (a node's class and its ``flatten``
    context) returns an :class:`ItemState`, or None for a type it does not know. Each
    item's object then keeps the batch dim (its rows, as its call alone gives it) where
    a registered type's tensors lose it, and its positions are cut as the state says.

    Example:
        >>> register_item_state(lambda cls, context: None)  # knows no type
        >>> STATE_RULES.pop() is not None
        True
    """
    if not callable(rule):
        raise TypeError(f"register_item_state: rule: expected a callable, got {type(rule).__name__} {rule!r}"[:300])
    STATE_RULES.append(rule)


def _state_of(cls: Any, context: Any) -> ItemState | None:
    for rule in STATE_RULES:
        state = rule(cls, context)
        if state is not None:
            return state
    return None


def _state_leaves(spec: _tree.Spec) -> tuple[set[int], set[int], set[int]]:
    """The leaves inside a batch-state object (:data:`STATE_RULES`); those of them that
    hold every position in order; and those of an encoder's positions."""
    state: set[int] = set()
    positional: set[int] = set()
    cross: set[int] = set()

    def walk(node: _tree.Spec, start: int, inside: bool, in_cross: bool) -> int:
        if node in _tree.LEAVES:
            if inside:
                state.add(start)
            if in_cross:
                cross.add(start)
            return start + 1
        info = _state_of(node.cls, node.meta[1]) if node.kind == _tree.NODE and STATE_RULES else None
        for i, child in enumerate(node.children):
            if info is not None and i < len(info.positional) and info.positional[i] and child == _tree.LEAF:
                positional.add(start)
            encoder = info is not None and info.encoder == i
            start = walk(child, start, inside or info is not None, in_cross or encoder)
        return start

    walk(spec, 0, False, False)
    return state, positional, cross


def cut_output(
    out: Any, rows: int, options: MethodOptions, padding: Padding | None = None, *,
    padded: Callable[[str, int], bool] | None = None, prompt: Tensor | None = None, repeat: int = 1,
    entries: bool = False, beams: int = 1, eos: Sequence[int] = (),
) -> list[Any]:
    """The output of a batch of ``rows`` items as one output per item.

    Args:
        out: the method's output for the batch.
        options: the method's options (``dim``, ``gather``, ``gather_dim``).
        padding: each row's own positions in the padded batch, or None.
        padded: ``padded(path, dim)`` tells the padded dims of the batch output at ``path``
            (see :mod:`dpmethods.items.trim`); each item's tensors are narrowed to its own
            positions there. None: nothing is trimmed.
        prompt: a ``generate`` batch's left-padded prompt ids (``[rows, longest]``): an
            output that starts with them comes back without each row's padding.
        repeat: a tensor's rows per item (``generate``'s ``num_return_sequences``): each
            item's output keeps its ``repeat`` rows, with the batch dim.
        entries: each per-item list's entry comes wrapped in :class:`Entry`, told apart
            from the fields of a tuple or dict that is cut field by field.
        beams: a beam search's rows per item (``generate``'s ``num_beams``) in its per-step
            outputs (scores, logits, attentions): a tensor of ``rows * beams`` rows gives
            each item its ``beams`` rows, with the batch dim; ``beam_indices`` (``repeat``
            rows per item) are rebased to index the item's own beams.
        eos: a ``generate``'s eos ids, with one beam: an item whose rows all ended at eos
            before the batch's last step ends there (its sequences, per-step tuples and
            cache), as alone.

    Example:
        >>> import torch
        >>> out = {"y": torch.arange(6).reshape(3, 2), "tags": ["a", "b", "c"], "aux": None}
        >>> cut_output(out, 3, MethodOptions())[1]
        {'y': tensor([2, 3]), 'tags': 'b', 'aux': None}
        >>> cut_output({"loss": torch.tensor(1.0)}, 3, MethodOptions())
        Traceback (most recent call last):
        ...
        ValueError: map: output['loss'] of the output of a batch of 3 items is a tensor of shape [], one value for the whole batch: it belongs to no item, so the output cannot be cut into one per item. Leave it out of the method's output (a loss: pass no labels), or map batches (no batch_size= or max_tokens=)
    """
    spec, leaves = _tree.flatten(out)
    mode: Any = options.gather
    pairs = mode_pairs(mode)
    paired = pairs(out) if pairs is not None else None
    if paired is not None and not isinstance(paired, Mapping):
        raise TypeError(
            f"register_gather_mode: pairs of {mode!r} must return a mapping of the output's keys "
            f"to what to do instead (str), got {type(paired).__name__} {paired!r}"[:300]
        )
    if not isinstance(mode, Mapping) and not (isinstance(mode, str) and mode in BUILTIN_MODES):
        mode = Mode.CAT  # a named mode or a callable joins whole outputs: rows cut by the batch dim
    dim: Any = options.dim if options.gather_dim is None else options.gather_dim
    if isinstance(dim, Mapping):
        dim = {**dim, None: options.dim}
    cutter = _Cutter(leaves, rows, padding, padded, prompt, repeat, paired, entries, beams)
    cutter.state, cutter.positional, cutter.cross = _state_leaves(spec)
    cutter.own_steps(spec, eos)
    return cutter.node(spec, 0, "output", mode, dim, True)[0]
