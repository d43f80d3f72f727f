"""The item-mode map: items batched, run through the map, outputs one per item.

:func:`map_items` reads the items (each rank its own with ``shard=True``, before
sorting), sorts and cuts them into batches a window at a time, collates each batch and
runs the batches through the map as ``(index, batch)`` pairs, unordered, with
``errors="yield"``. Each finished batch's output is cut into its items' outputs (or
its exception stands for each of its items, with a note naming them); they are yielded
in input order (``ordered=True``) or as ``(index, output)`` pairs as batches finish.
The map pulls batches as it has room, so the items are read a window at a time, and
in order at most about a window of outputs waits for an earlier item.

With ``checkpoint=`` the record counts items (the checkpoint stage,
:class:`~dpmethods.streaming.resume.Checkpoint`, gives the items not taken yet, and the
iterator records the taken ones), so a rerun skips the items done, however its batches
are cut. The record also holds what shapes each item's output
(:meth:`~dpmethods.items.ItemOptions.identity`: ``trim``, ``collate``), so a rerun with
other ones, which would mix outputs of two kinds, is refused.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

from torch import Tensor, nn

from dpmethods.core.parallel_apply import add_note
from dpmethods.items.batches import read_batches
from dpmethods.items.collate import (
    as_call,
    check_takes,
    default_collate,
    masks_ids,
    padding_of,
    pads_left,
)
from dpmethods.items.options import ItemOptions
from dpmethods.items.trim import PaddedDims
from dpmethods.streaming.iterator import MapIterator
from dpmethods.streaming.map import MapTarget, map_batches, progress_bar
from dpmethods.streaming.options import MapOptions
from dpmethods.streaming.resume import Checkpoint
from dpmethods.streaming.source import Indexed, indexed
from dpmethods.types.cut import Padding, cut_output
from dpmethods.vocab.call_hooks import Call, check_prepared, is_per_item
from dpmethods.vocab.options import MethodOptions

__all__ = ["ItemIterator", "map_items"]


_PROBES = 3  # trim: probes sent in the map's stream at most (a probe that raises re-arms it)


class _Sent(NamedTuple):
    """What the cut of one batch's output needs: its items, padding and prompt; with
    trim, its shortest padded item ``(item, index, length)``, which a probe runs alone
    (a probe's own ``_Sent`` has no items and names its item's index as ``probe``)."""

    indices: list[int]
    padding: Padding | None
    prompt: Tensor | None
    shortest: tuple[Any, int, int] | None = None
    probe: int | None = None


class _Source:
    """The batches of the items, collated and checked, as ``(batch index, batch)`` pairs;
    ``sent`` keeps what each one's output is cut by, ``read`` the items' indices in input order.
    With trim, while ``probes`` is 1 the next batch that pads an item is followed by a
    probe; a probe that raised re-arms it (:meth:`rearm`), ``_PROBES`` probes in all."""

    def __init__(self, pairs: Iterable[tuple[int, Any]], items: ItemOptions, method: str, kwargs: dict[str, Any]) -> None:
        self.pairs, self.items, self.method, self.kwargs = pairs, items, method, kwargs
        self.read: collections.deque[int] = collections.deque()
        self.sent: dict[int, _Sent] = {}
        self.options = MethodOptions()
        self.module: nn.Module | None = None
        self.signature: inspect.Signature | None = None
        self.name = method
        self.repeat = 1  # a tensor's rows per item in the batch's output
        self.beams = 1  # a beam search's rows per item in its per-step outputs (num_beams)
        self.eos: tuple[int, ...] = ()  # generate's eos ids: a row ends at its first
        self.left = method == "generate"  # prompts padded on the left (a decoder-only generate)
        self.masked = False  # 1-D tensor items get an attention_mask (a transformers generate)
        self.counted: list[tuple[str, int]] = []  # its length limits that count the batch's left padding
        self.probes = 1 if items.trim else 0
        self.probes_left = _PROBES - 1 if items.trim else 0  # re-arms left after a probe raised

    def bind(self, module: nn.Module, options: MethodOptions) -> None:
        """The method's options and signature, once the map has checked its name."""
        self.options, self.module = options, module
        fn = module.forward if self.method == "forward" else getattr(module, self.method)
        self.name = f"{type(module).__name__}.{self.method}"
        self.repeat = _repeat(module, self.method, self.kwargs)
        self.beams = _repeat(module, self.method, self.kwargs, "num_beams")
        self.eos = _ids(_setting(module, self.kwargs, "eos_token_id")) if self.method == "generate" else ()
        self.left = pads_left(module, self.method)
        self.masked = masks_ids(module, self.method)
        self.counted = _counted(module, self.kwargs) if self.left else []
        try:
            self.signature = inspect.signature(fn)
        except (TypeError, ValueError):  # a builtin without one: nothing to check against
            self.signature = None

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        k = probe = 0
        for batch in read_batches(self.pairs, self.items, self.read):
            collated, padding = self._collate(batch.items, batch.indices, batch.lengths)
            shortest = None
            if self.items.trim and padding is not None and any(e - s < padding.longest for s, e in padding.spans):
                spans = padding.spans
                j = min(range(len(spans)), key=lambda i: spans[i][1] - spans[i][0])
                shortest = (batch.items[j], batch.indices[j], batch.lengths[j])
            prompt = _prompt(collated, len(batch.items)) if self.left else None  # a decoder-only generate's
            if prompt is not None and padding is not None and padding.longest != prompt.shape[1]:
                # Spans from length= in other units than the prompt's positions (characters,
                # not tokens): cutting each output's padding by them would cut at random.
                raise ValueError(
                    f"map: length: the items {batch.indices} have lengths up to {padding.longest} "
                    f"(length=), but their batch's prompt is {prompt.shape[1]} positions wide and "
                    "has no attention_mask, so each prompt's own positions are unknown: return an "
                    "attention_mask from collate=, or give length= in the prompt's positions (tokens)"
                )
            if prompt is not None and padding is not None:
                self._check_prompts(padding, batch.indices)
            if k == 0:
                self._check_per_item(collated)
            self.sent[k] = _Sent(batch.indices, padding, prompt, shortest)
            yield k, collated
            k += 1
            if self.probes and shortest is not None:
                self.probes -= 1  # its shortest item alone: measured, never yielded (dpmethods.items.trim)
                # Probes take indices of their own (-1, -2, ...): a batch's index seeds its
                # sampling, which trim must not change.
                probe -= 1
                self.sent[probe], collated = self.alone(shortest)
                yield probe, collated

    def _check_per_item(self, collated: Any) -> None:
        """Refuse a method whose results are computed over the whole batch after the
        per-item work: its hooks' ``prepare``, run on the first batch's call, returns a
        ``finish`` (sentence-transformers' ``encode(precision="int8")`` calibrates on the
        whole batch), unless the finish declares it works per item (``per_item = True``).
        Once: the keyword arguments, which choose that, are every batch's."""
        hooks = self.options.hooks
        if hooks is None or hooks.prepare is None:
            return
        args, kwargs = as_call(collated, self.kwargs)
        call = Call(self.module, self.method, args, kwargs, (), self.options)
        finish = check_prepared(hooks.prepare(args, kwargs, call), hooks.prepare)[2]
        if finish is None or is_per_item(finish):  # per item: a batch as it is gives one device's output
            return
        advice = getattr(finish, "advice", None)
        raise ValueError(
            f"map: {self.name} computes its results over the whole batch after the per-item "
            "work with these arguments (its CallHooks.prepare returns a finish), so in item "
            "mode each item's output would depend on the items batched with it. Map batches "
            "of your own (without batch_size= or max_tokens=), or leave out the argument that "
            "needs the whole batch and do that step yourself over all the outputs"
            + (f": {advice}" if isinstance(advice, str) and advice else
               # The hooks' own (a user's): a finish that only converts a format is per item.
               ". A finish that works on each item's part of the output alone (a format, as "
               "out.float()) declares it with an attribute per_item = True (CallHooks)")
        )

    def _check_prompts(self, padding: Padding, indices: list[int]) -> None:
        """Refuse a decoder-only ``generate`` batch whose padding would make an item's
        output another than its own alone: prompts padded on the right (generation would
        go on after the padding), or a length limit counted with the batch's left padding."""
        right = [i for i, (start, end) in zip(indices, padding.spans) if start < end < padding.longest]
        if right:
            raise ValueError(
                f"map: collate: the batch of items {indices} pads the prompts of items {right} on "
                "the right (their attention_mask ends in zeros), but a decoder-only generate "
                "continues each prompt from the batch's last position, so they would be "
                "generated after their padding, not as alone: pad on the left (a tokenizer "
                "with padding_side='left'), or leave out collate= (the default pads them on the left)"
            )
        if self.counted and any(start > 0 for start, _ in padding.spans):
            name, value = self.counted[0]
            raise ValueError(
                f"map: {name}: got {value}, a limit of the whole sequence, which a decoder-only "
                f"generate counts with the batch's left padding (the batch of items {indices} is "
                f"padded to {padding.longest} positions), so an item batched with longer prompts "
                f"would get another number of new tokens than alone. Pass {_NEW[name]}= (new "
                "tokens, the same for every prompt) instead, or map batches of your own (no "
                "batch_size= or max_tokens=)"
            )

    def rearm(self) -> None:
        """A probe raised: the next batch that pads an item is followed by another, while
        the stream has probes left."""
        if self.probes_left:
            self.probes_left -= 1
            self.probes = 1

    def alone(self, shortest: tuple[Any, int, int]) -> tuple[_Sent, Any]:
        """The probe of a batch's shortest padded item: its ``_Sent`` and the item collated alone."""
        item, index, length = shortest
        collated, padding = self._collate([item], [index], [length])
        return _Sent([], padding, None, probe=index), collated

    def _collate(self, items: list[Any], indices: list[int], lengths: list[int]) -> tuple[Any, Padding | None]:
        padding: Padding | None
        if self.items.collate is None:
            collated, padding = default_collate(items, indices, self.method, self.options, self.left, self.masked)
            if padding is None and self.items.trim and self.options.split:
                # Per-item lists (sentence-transformers' encode): the method pads them itself,
                # on the right, to their longest; each item's positions are its length=.
                padding = Padding.of(lengths, self.left)
        else:
            try:
                collated = self.items.collate(list(items))
            except Exception as exc:
                raise add_note(exc, f"dpmethods: DataParallel.map: raised by collate= on items {indices}") from None
            padding = padding_of(collated, lengths, self.left, len(items))
        check_takes(self.signature, self.name, collated, self.kwargs, indices)
        return collated, padding


def _repeat(module: nn.Module, method: str, kwargs: dict[str, Any], name: str = "num_return_sequences") -> int:
    """A ``generate`` output's rows per prompt: its ``num_return_sequences`` (its sequences),
    or with ``name="num_beams"`` its beams (the rows of a beam search's per-step outputs),
    from the map's keyword arguments, else the generation config it runs with."""
    if method != "generate":
        return 1
    k = kwargs.get(name)
    if k is None:
        config = kwargs.get("generation_config") or getattr(module, "generation_config", None)
        k = getattr(config, name, None)
    return k if isinstance(k, int) and not isinstance(k, bool) and k > 1 else 1


# generate's limits of a sequence's length, prompt included, and of its new tokens, which
# take precedence.
_NEW = {"max_length": "max_new_tokens", "min_length": "min_new_tokens"}


def _setting(module: nn.Module, kwargs: dict[str, Any], name: str) -> Any:
    """A ``generate`` setting as it runs with it: the map's keyword argument, else the
    ``generation_config`` passed, else the model's."""
    for source in (kwargs, kwargs.get("generation_config"), getattr(module, "generation_config", None)):
        value = source.get(name) if isinstance(source, Mapping) else getattr(source, name, None)
        if value is not None:
            return value
    return None


def _ids(value: Any) -> tuple[int, ...]:
    """Token ids (an int, a list of them or a tensor) as a tuple; () for None."""
    if isinstance(value, Tensor):
        value = value.tolist()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        return tuple(value)
    return ()


def _counted(module: nn.Module, kwargs: dict[str, Any]) -> list[tuple[str, int]]:
    """A ``generate``'s length limits (name, value) that count the prompt's positions:
    ``max_length``, and a positive ``min_length`` where an eos id is set (it holds eos
    back), each unless its new-token limit is set."""
    found = []
    for total, new in _NEW.items():
        value = _setting(module, kwargs, total)
        if value is None or _setting(module, kwargs, new) is not None:
            continue
        if total == "max_length" or (value > 0 and _setting(module, kwargs, "eos_token_id") is not None):
            found.append((total, value))
    return found


def _prompt(batch: Any, rows: int) -> Tensor | None:
    """A ``generate`` batch's prompt ids: its ``input_ids``, or its first tensor argument."""
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else batch[0] if isinstance(batch, tuple) and batch else batch
    return ids if isinstance(ids, Tensor) and ids.dim() == 2 and ids.shape[0] == rows else None


class ItemIterator(MapIterator):
    """The iterator ``DataParallel.map`` returns in item mode (see
    :class:`~dpmethods.streaming.iterator.MapIterator`).

    ``entries``, set before the first ``next()``: each per-item list's entry in an item's
    output comes wrapped in :class:`~dpmethods.types.cut.Entry` (the Ray Predictor joins
    items into columns by it); False, the default: as it is."""

    entries: bool = False

    def __init__(self, outputs: Iterator[Any], source: _Source, *, ordered: bool, errors: str, bar: Any,
                 checkpoint: Checkpoint | None, run_alone: Callable[[Any], Any] | None = None) -> None:
        self._outputs, self._source, self._errors = outputs, source, errors
        self._run_alone = run_alone  # trim: runs one batch by itself, once the map has ended
        self._probe_failed: tuple[BaseException, int] | None = None  # the last probe's error, its item
        self._done: dict[int, Any] = {}  # ordered: outputs waiting for an earlier item
        self._ready: collections.deque[tuple[int, Any]] = collections.deque()  # unordered
        self._pending: collections.deque[tuple[Any, _Sent]] = collections.deque()  # trim: dims untold
        self._dims = PaddedDims() if source.items.trim else None
        self._bar_factory, self._bar = bar, [None]  # made on the first next(), as the map's
        super().__init__(functools.partial(_stop, outputs, self._bar), checkpoint, ordered=ordered)

    def _dropped(self) -> None:
        self._done.clear()
        self._ready.clear()
        self._pending.clear()

    def _next(self) -> Any:
        if self._bar_factory is not None:
            self._bar[0], self._bar_factory = self._bar_factory(), None
        read = self._source.read
        while True:
            if self._ordered and read and read[0] in self._done:
                self._index = read.popleft()
                return self._done.pop(self._index)
            if not self._ordered and self._ready:
                pair = self._ready.popleft()
                self._index = pair[0]
                return pair
            try:
                k, out = next(self._outputs)
            except StopIteration:
                if not self._pending:
                    raise
                self._end()  # trim: dims untold when the map ended
                continue
            sent = self._source.sent.pop(k)
            if self._observe(out, sent):  # else the probe of trim, measured only
                self._pending.append((out, sent))
            # A probe's evidence may tell the batches waiting, and it may be the map's last
            # output (one batch; or one device, which runs it after its batch).
            self._place_told()

    def _observe(self, out: Any, sent: _Sent) -> bool:
        """Take ``out``'s evidence of the padded dims; False for a probe (measured only)."""
        failed = isinstance(out, BaseException)
        if self._dims is not None and not failed and sent.padding is not None:
            self._dims.observe(out, sent.padding)
        if sent.probe is not None:
            if failed:  # no evidence: another probe, while the stream has them
                self._probe_failed = (out, sent.probe)
                self._source.rearm()
            else:
                self._probe_failed = None
            return False
        return True

    def _place_told(self) -> None:
        while self._pending and self._told(*self._pending[0]):
            self._place(*self._pending.popleft())

    def _end(self) -> None:
        """The map ended with batches whose padded dims are untold. If the last probe
        raised, the shortest item of the first untold batch whose shortest was not that
        probe's runs alone; if that raises too, each untold batch's items get an error
        saying so (raised with errors="raise"). Otherwise the dim had the padded length
        in every batch: the map is refused."""
        if self._probe_failed is not None and self._run_alone is not None:
            probed = self._probe_failed[1]
            shortest = next((sent.shortest for out, sent in self._pending if sent.shortest is not None
                             and sent.shortest[1] != probed and not self._told(out, sent)), None)
            if shortest is not None:
                sent, collated = self._source.alone(shortest)
                self._observe(self._run_alone(collated), sent)
                self._place_told()
                if not self._pending:
                    return
        out, sent = self._pending[0]
        untold = self._dims.untold(out, sent.padding)  # type: ignore[union-attr]
        if self._probe_failed is None:  # the probe measured it: a dim of one size in every batch
            raise add_note(ValueError(
                f"map: trim: {untold} had the padded length in every batch, so it cannot be told "
                "from a fixed size; map with trim=False"
            ), f"dpmethods: DataParallel.map: the batch held items {sent.indices}") from None
        cause, index = self._probe_failed
        while self._pending:
            out, sent = self._pending.popleft()
            if not self._told(out, sent):
                error = RuntimeError(
                    f"map: trim: {self._dims.untold(out, sent.padding)} cannot be told from a fixed "  # type: ignore[union-attr]
                    f"size, since the probe that measures it (item {index} alone) raised (the cause "
                    "above); map with trim=False"
                )
                error.__cause__ = cause
                out = error
            self._place(out, sent)

    def _told(self, out: Any, sent: _Sent) -> bool:
        return self._dims is None or isinstance(out, BaseException) or self._dims.told(out, sent.padding)

    def _place(self, out: Any, sent: _Sent) -> None:
        for index, item_out in zip(sent.indices, self._cut(out, sent)):
            if self._ordered:
                self._done[index] = item_out
            else:
                self._ready.append((index, item_out))
        if self._bar[0] is not None:
            self._bar[0].update(len(sent.indices))

    def _cut(self, out: Any, sent: _Sent) -> list[Any]:
        if isinstance(out, BaseException):  # errors="yield" underneath: the map's error
            out = add_note(out, f"dpmethods: DataParallel.map: the batch held items {sent.indices}")
            if self._errors == "raise":
                raise out
            return [out] * len(sent.indices)
        try:
            return cut_output(out, len(sent.indices), self._source.options, sent.padding,
                              padded=None if self._dims is None else self._dims.padded, prompt=sent.prompt,
                              repeat=self._source.repeat, beams=self._source.beams, entries=self.entries,
                              eos=self._source.eos)
        except ValueError as exc:
            raise add_note(exc, f"dpmethods: DataParallel.map: the batch held items {sent.indices}") from None


def _stop(outputs: Iterator[Any], bar: list[Any]) -> None:
    close = getattr(outputs, "close", None)
    if close is not None:
        close()
    if bar[0] is not None:
        bar[0].close()
        bar[0] = None


def map_items(
    target: MapTarget, method: str, batches: Iterable[Any], items: ItemOptions, options: MapOptions,
    kwargs: dict[str, Any], /,
) -> ItemIterator:
    """The map over the items of ``batches``, batched by ``items``: its batches run by
    :func:`~dpmethods.streaming.map.map_batches` on ``target``.

    Args:
        target: what the map runs on (the method's signature checks each batch).
        options: the map's options (``ordered``, ``progress``, ``shard``, ``errors`` and
            ``checkpoint`` apply to items here; the others to the map of batches).
        kwargs: the method's keyword arguments, for every batch.

    Example:
        >>> import torch, dpmethods
        >>> dp = dpmethods.DataParallel(torch.nn.Identity(), device_ids=["cpu"] * 2)
        >>> items = [torch.ones(n) for n in (1, 3, 2)]
        >>> [o.tolist() for o in dp.map("forward", items, batch_size=2)]
        [[1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    """
    if not isinstance(batches, Iterable):
        raise TypeError(f"map: batches: expected an iterable of items, got {type(batches).__name__}")
    checkpoint = None
    pairs: Iterable[tuple[int, Any]]
    if options.checkpoint is not None:  # the record counts items; sharded per rank
        checkpoint = Checkpoint.of(options.checkpoint, method, batches, kwargs, target.module, options.shard,
                                   items.identity())
        pairs, total = checkpoint.pending, checkpoint.total
    else:
        pairs, total = indexed(batches, options.shard)
    source = _Source(pairs, items, method, kwargs)
    each_batch = dataclasses.replace(options, ordered=False, progress=False, shard=False, errors="yield",
                                     checkpoint=None)
    outputs = map_batches(target, method, Indexed(source), kwargs, each_batch)
    source.bind(target.module, target.options(method))
    alone = functools.partial(_run_alone, target, method, kwargs, dataclasses.replace(each_batch, ordered=True))
    return ItemIterator(outputs, source, ordered=options.ordered, errors=options.errors,
                        bar=progress_bar(options.progress, total, "item", checkpoint), checkpoint=checkpoint,
                        run_alone=alone if items.trim else None)


def _run_alone(target: MapTarget, method: str, kwargs: dict[str, Any], options: MapOptions, batch: Any) -> Any:
    """The output of ``batch`` run by itself, as a map of one batch (its error, if it raised)."""
    with map_batches(target, method, [batch], kwargs, options) as outputs:
        return next(outputs)
