"""``DataParallel.map(..., workers="processes")``: each batch whole in a worker process.

The contract is the thread map's (:mod:`dpmethods.streaming.map`): input order through a
bounded reorder buffer (or ``(index, output)`` pairs as batches finish), at most
``prefetch`` batches per worker pulled ahead, a progress bar, ``shard=True``, Mapping
and tuple batches, ``**kwargs`` to every call. Here the caller's thread does the
dispatching: each worker holds at most :data:`_PER_WORKER` of its batches (the one it
runs and the next, so it never waits for the caller between two), and the moment one
replies it is sent the next pulled batch, so a worker that finished a short batch never
waits for the others (dynamic load balancing). Other maps and calls of the wrapper may
use the workers meanwhile (:mod:`dpmethods.streaming.process_pool`). Outputs are moved to
``output_device`` in the caller. Stopping early (``break``, ``close()``, an error,
Ctrl-C) returns at once; the batches still running finish in their workers and their
outputs are dropped as they arrive.
"""

from __future__ import annotations

import collections
import itertools
import time
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

from torch import nn

from dpmethods.core.devices import as_device
from dpmethods.core.parallel_apply import _ThreadState, add_note
from dpmethods.core.seeding import draw_seed, replica_seed
from dpmethods.streaming.map import (
    MapIteratorBase,
    _as_call,
    _check_options,
    _items,
    _progress_factory,
    _shard,
    _stop_iteration_error,
)
from dpmethods.streaming.process_io import dumps
from dpmethods.streaming.process_pool import ProcessPool, pool_for, received, reply_error
from dpmethods.streaming.process_slot import Client, Slot, WorkerDiedError
from dpmethods.streaming.process_worker import give

__all__: list[str] = []

_REORDER = 2  # as the thread map: outputs wait for at most this many windows of batches
_PER_WORKER = 2  # batches of one map sent to one worker and not answered yet


class _Lease:
    """What the finalizer of a map needs: its client and its bar (never the map)."""

    def __init__(self) -> None:
        self.client, self.opened, self.bar = Client(), False, None

    def end(self) -> None:
        self.client.close()
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class _ProcessMap(MapIteratorBase):
    """The iterator a process map returns; also a context manager that closes it."""

    def __init__(
        self, pool: ProcessPool, module: nn.Module, method: str, source: Iterator[tuple[int, Any]],
        kwargs: dict[str, Any], *, ordered: bool, prefetch: int, dim: int, progress: Any,
        output_device: Any,
    ) -> None:
        self._pool, self._module, self._method, self._source = pool, module, method, source
        self._kwargs, self._ordered, self._dim, self._progress = kwargs, ordered, dim, progress
        self._output_device = output_device
        self._max_inflight = prefetch * len(pool.slots)
        self._window = _REORDER * self._max_inflight
        self._seq = self._yielded = self._finished = self._items = 0
        self._exhausted = self._closed = False
        self._pending: collections.deque[tuple[int, int, Any, Any]] = collections.deque()
        self._running: dict[Slot, int] = {s: 0 for s in pool.slots}  # own batches in each
        self._buffer: dict[int, Any] = {}
        self._sizes: dict[int, int] = {}
        self._state = _ThreadState.capture()  # the caller's modes at map(), as the thread map
        self._seed = draw_seed()  # batch i is seeded from (seed, i), whichever worker runs it
        self._t0 = 0.0
        self._lease = _Lease()
        self._finalizer = weakref.finalize(self, self._lease.end)

    def close(self) -> None:
        """Stop the map; batches still running finish in their workers and are dropped."""
        super().close()
        self._pending.clear()

    def _open(self) -> None:
        lease = self._lease
        lease.opened = True
        startup = self._pool.prepare(self._module)
        if self._progress is not None:  # after the start-up: a failed one leaves no bar
            lease.bar = self._progress()
        if startup and lease.bar is not None:  # reported once, by the map that paid it
            lease.bar.set_postfix_str(f"workers started in {startup:.1f} s", refresh=True)
        self._t0 = time.perf_counter()

    def _next(self) -> Any:
        if not self._lease.opened:
            self._open()
        while True:
            if self._ordered and self._yielded in self._buffer:
                self._yielded += 1
                return self._buffer.pop(self._yielded - 1)
            self._fill()
            if self._lease.client.finished():
                raise StopIteration
            slot, (seq, index), msg = self._pool.reply(self._lease.client)
            self._running[slot] -= 1
            self._finished += 1
            if msg[0] != "done":
                failure = reply_error(msg, slot, f"DataParallel.map: raised in batch {index}",
                                      f"batch {index} of DataParallel.map")
                if isinstance(failure, StopIteration):  # else taken for the end of the map
                    failure = _stop_iteration_error(failure, index)
                raise failure
            give(msg[3])
            out = received(msg[2], self._output_device)
            msg = None  # type: ignore[assignment]
            self._tick(seq)
            if not self._ordered:
                self._yielded += 1
                return index, out
            self._buffer[seq] = out

    def _fill(self) -> None:
        """Pull batches while the bounds allow, and send one to every idle worker."""
        while (
            not self._exhausted
            and self._seq - self._finished < self._max_inflight
            and self._seq - self._yielded < self._window
        ):
            try:
                index, batch = next(self._source)
            except StopIteration:
                self._exhausted = True
                break
            args, kwargs = _as_call(batch, self._kwargs)
            if self._lease.bar is not None:
                self._sizes[self._seq] = _items(args, kwargs, self._dim)
            self._pending.append((self._seq, index, args, kwargs))
            self._seq += 1
        for _ in range(_PER_WORKER):  # one batch to each worker, then a second each
            for slot in self._pool.slots:
                if not self._pending:
                    return
                if self._running[slot] < _PER_WORKER:
                    self._send(slot)

    def _send(self, slot: Slot) -> None:
        # A module changed in the loop over this map is sent again, to the batches after.
        self._pool.prepare(self._module, start=False)
        seq, index, args, kwargs = self._pending.popleft()
        try:
            data = dumps(("run", seq, self._method, args, kwargs, self._state,
                          replica_seed(self._seed, index), False))
        except Exception as exc:
            raise TypeError(
                f"DataParallel.map(workers='processes'): batch {index} cannot be sent "
                f"to a worker process: {type(exc).__name__}: {exc}; use workers='threads'"
            ) from exc
        try:
            self._pool.submit(self._lease.client, slot, (seq, index), data)
        except WorkerDiedError as exc:
            raise add_note(exc, f"dpmethods: while sending batch {index} of DataParallel.map; "
                           "the next map or call starts a fresh worker") from None
        self._running[slot] += 1

    def _tick(self, seq: int) -> None:
        bar = self._lease.bar
        if bar is None:
            return
        self._items += self._sizes.pop(seq, 0)
        elapsed = time.perf_counter() - self._t0
        if elapsed > 0:
            bar.set_postfix_str(f"{self._items / elapsed:.4g} items/s", refresh=False)
        bar.update(1)


def _check_method(wrapper: Any, method: Any) -> None:
    methods = wrapper._dpm_methods
    if not isinstance(method, str) or (method != "forward" and method not in methods):
        raise ValueError(
            f"map: method: expected 'forward' or the name of a parallel method of "
            f"{type(wrapper.module).__name__} {sorted(m for m in methods if m != 'forward')}, "
            f"got {type(method).__name__} {method!r}"
        )


def process_map(
    wrapper: Any, method: str, batches: Iterable[Any], kwargs: dict[str, Any], *,
    ordered: bool = True, progress: bool | str = False, prefetch: int = 2, shard: bool = False,
) -> Iterator[Any]:
    """``wrapper.map(method, batches, workers="processes", ...)``; see ``DataParallel.map``."""
    _check_options(ordered, progress, prefetch, shard)
    _check_method(wrapper, method)
    if not isinstance(batches, Iterable):
        raise TypeError(f"map: batches: expected an iterable, got {type(batches).__name__}")
    rank, world = _shard() if shard else (0, 1)
    source: Iterator[tuple[int, Any]] = itertools.islice(enumerate(batches), rank, None, world)
    try:
        total: int | None = len(range(rank, len(batches), world))  # type: ignore[arg-type]
    except TypeError:
        total = None
    return _ProcessMap(
        pool_for(wrapper), wrapper.module, method, source, dict(kwargs),
        ordered=ordered, prefetch=prefetch, dim=wrapper._options(method).dim,
        progress=_progress_factory(progress, total),
        output_device=as_device(wrapper.output_device),
    )
