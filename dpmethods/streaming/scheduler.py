"""The map's scheduler: one loop over ``concurrent.futures`` executors, for threads and processes.

Data flow (one batch, left to right and back)::

  caller's thread                                           |  a slot's executor
                                                            |  (one per replica or worker)
  source: (index, batch)     BatchIterator._fill            |
  [checkpoint: done ones  -> pulls while in flight <         |
   skipped, resume.py]        prefetch x width, and the      |
                              reorder window allows          |
                                   |                         |
                                   v                         |
                             Scheduler.pending (deque) ------+--> backend.submit(slot, batch)
                             submitted to the least busy     |    threads.py: a thread per
                             slot while it has room          |      replica (CUDA streams,
                                                             |      seeding inside)
                                                             |    processes.py: a worker
                                                             |      process (a Request)
                             Scheduler.finished (queue) <----+--- each Future, when done
                             take: the next finished one;    |
                             on no news, the deadlines        |
                             (timeout: backend.hang) ---------+--> threads: the replica is
                             a dead worker: backend.replace,  |    dropped; processes: the
                             its batches sent again under     |    worker is killed, and
                             retries                          |    replaced
                                   |                         |
                                   v                         |
  outputs <- BatchIterator: reorder buffer (ordered), progress bar, errors="yield"
  [checkpoint: taken ones recorded, iterator.py]

The backends (:mod:`~dpmethods.streaming.threads`, :mod:`~dpmethods.streaming.processes`)
differ only in how a batch is submitted and read back, and in what happens to a slot
that hangs or dies; order, prefetch, retries, timeouts, ``errors=``, progress and stop
are here. The scheduler never refers to the iterator, so dropping the iterator lets its
finalizer stop the map.

Closing the iterator stops the scheduler: pending batches are dropped, queued ones
cancelled, and each slot finishes at most the batch it is running (threads are joined;
a process's output is dropped when it arrives).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import queue
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from torch import Tensor

from dpmethods.core.parallel_apply import add_note
from dpmethods.processes.pool import WorkerDiedError
from dpmethods.streaming.iterator import MapIterator
from dpmethods.streaming.resume import Checkpoint
from dpmethods.types import tree as _tree

__all__ = ["PREFETCH", "Backend", "Batch", "BatchIterator", "Scheduler", "batch_error"]

PREFETCH = 2  # batches of a map per slot, by default: the one it runs and the next
_REORDER = 2  # in order, outputs wait for at most this many windows of in-flight batches
_POLL_S = 0.5  # how often a waiting caller looks at the deadlines and the slots


class Batch:
    """One batch of the map: its place in the map (``seq``), its index (seeds, notes,
    ``ordered=False`` pairs) and its call's arguments."""

    __slots__ = ("args", "index", "kwargs", "seq")

    def __init__(self, seq: int, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.seq, self.index, self.args, self.kwargs = seq, index, args, kwargs


class Backend(Protocol):
    """How batches run on a map's slots (replicas or worker processes)."""

    width: int  # slots
    cancels: bool  # whether a batch submitted and not started yet can be cancelled

    @property
    def prefetch(self) -> int:
        """Batches of this map pulled per slot and not taken, at most (read before each pull)."""

    @property
    def room(self) -> int:
        """Batches of this map submitted to one slot and not taken, at most (read before each submit)."""

    def start(self) -> float:
        """Start the slots; the seconds spent starting workers."""

    def submit(self, slot: int, batch: Batch) -> cf.Future[Any]:
        """Send ``batch`` to ``slot``'s executor."""

    def next_finished(self, finished: queue.SimpleQueue[cf.Future[Any]], timeout: float) -> cf.Future[Any] | None:
        """The next Future put in ``finished`` (by its done callback), waiting at most
        ``timeout`` seconds for one (None if none came)."""

    def output(self, slot: int, future: cf.Future[Any], batch: Batch) -> Any:
        """``batch``'s output as the caller keeps it, or its error raised with a note
        naming the batch and where it ran (``WorkerDiedError``: the slot's worker died)."""

    def started(self, slot: int, future: cf.Future[Any], batch: Batch) -> float | None:
        """When ``slot`` started running ``batch`` (``time.monotonic()``), None if not yet."""

    def hang(self, slot: int, batch: Batch, timeout: float) -> BaseException | None:
        """``slot`` ran ``batch`` past ``timeout``: threads drop the slot and give the
        batch's error; processes kill the worker (None: its death shows as a failure)."""

    def replace(self, slot: int) -> None:
        """Start a fresh worker in place of ``slot``'s dead one."""

    def describe(self, slot: int) -> str:
        """``slot`` in an error message."""

    def stop(self, dropped: set[int], running: list[cf.Future[Any]]) -> None:
        """The map is over: let the slots go (``dropped``: the ones that hung;
        ``running``: batches that could not be cancelled, their outputs dropped)."""


def batch_error(exc: BaseException, index: int | None, where: str) -> BaseException:
    """``exc`` of batch ``index`` (None: while starting), with a note naming ``where`` it ran.

    A StopIteration raised out of ``__next__`` would end the map, silently short (PEP 479
    turns it into a RuntimeError in generators for the same reason): it is re-raised as
    a RuntimeError.

    Example:
        >>> str(batch_error(StopIteration(), 3, "replica 0 (device cpu)")).split(";")[0]
        'DataParallel.map: the method raised StopIteration in batch 3'
    """
    at = "while starting" if index is None else f"in batch {index}"
    if isinstance(exc, StopIteration):
        err = RuntimeError(
            f"DataParallel.map: the method raised StopIteration {at}; it is re-raised as a "
            "RuntimeError so it is not taken for the end of the map"
        )
        err.__cause__ = exc
        exc = err
    return add_note(exc, f"dpmethods: DataParallel.map: raised {at} on {where}")


class Scheduler:
    """A map's batches on a backend's slots: each submitted to the least busy slot with
    room, the next finished one taken in turn (see the module docstring).

    A slot's worker process that dies while running a batch, or runs one longer than
    ``timeout`` seconds (it is killed), is replaced; its batches are sent again, the one
    it was running up to ``retries`` times. A replica thread that runs a batch longer
    than ``timeout`` is dropped, its batch a ``TimeoutError``.
    """

    def __init__(self, backend: Backend, *, retries: int, timeout: float | None, keep_errors: bool) -> None:
        self.backend = backend  # how a batch runs on a slot, and what happens to a bad one
        self.retries = retries  # runs again of a batch whose worker died or hung running it
        self.timeout = timeout  # seconds a batch may run, or None
        self.keep_errors = keep_errors  # errors="yield": a batch's exception is its output
        self.pending: collections.deque[Batch] = collections.deque()  # pulled, not submitted yet
        self.inflight: dict[cf.Future[Any], tuple[Batch, int]] = {}  # submitted, not taken (in order)
        self.busy = [0] * backend.width  # per slot: this map's batches in flight there
        self.slots = list(range(backend.width))  # the slots that take batches
        self.finished: queue.SimpleQueue[cf.Future[Any]] = queue.SimpleQueue()  # as they finish
        self.tries: dict[int, int] = {}  # seq -> the times its worker died or hung running it
        self.hung: set[int] = set()  # seqs whose slot ran them past the timeout
        self.dropped: set[int] = set()  # slots that hung (threads): they take no more batches
        self.bar: Any = None  # the progress bar, made once the slots started
        self.poll = _POLL_S if timeout is None else min(_POLL_S, timeout / 10)
        self.looked = time.monotonic()  # when the deadlines were last looked at

    def start(self) -> float:
        return self.backend.start()

    def submit(self, batch: Batch) -> None:
        self.pending.append(batch)
        self._submit_pending()

    def _submit_pending(self) -> None:
        """Send pending batches to the least busy slots while one has room; with none
        pending, move a batch that waits behind another to a slot left idle."""
        busy, room = self.busy, self.backend.room
        while self.pending and self.slots:
            slot = min(self.slots, key=busy.__getitem__)
            if busy[slot] >= room:
                return
            batch = self.pending.popleft()
            future = self.backend.submit(slot, batch)
            self.inflight[future] = (batch, slot)
            busy[slot] += 1
            future.add_done_callback(self.finished.put)
        if (self.backend.cancels and self.slots and room > 1 and not self.pending
                and not busy[min(self.slots, key=busy.__getitem__)]):
            self._steal()

    def _steal(self) -> None:
        """A slot is idle while another holds a batch it has not started (behind a long
        one, it would wait for it): the last such batch is cancelled there and sent again."""
        for future, (batch, slot) in reversed(self.inflight.items()):
            if self.busy[slot] > 1 and future.cancel():  # its done callback puts it in finished: skipped
                del self.inflight[future]
                self.busy[slot] -= 1
                self.pending.append(batch)
                self._submit_pending()
                return

    def take(self) -> tuple[Batch, Any]:
        """The next finished batch and its output (under ``errors="yield"``, its
        exception), or its error raised."""
        while True:
            late = self._overdue()
            future = None if late is not None else self.backend.next_finished(self.finished, self.poll)
            if future is not None:
                entry = self.inflight.pop(future, None)
                if entry is None:  # a dropped slot's, or a dead worker's batch sent again
                    continue
                batch, slot = entry
                self.busy[slot] -= 1
                out = self._output(slot, future, batch)
                if out is _AGAIN:
                    continue
            else:
                late = late or self._look()
                if late is None:
                    continue
                batch, out = late
            if isinstance(out, BaseException) and not (self.keep_errors and isinstance(out, Exception)):
                raise out
            self._submit_pending()
            return batch, out

    def _output(self, slot: int, future: cf.Future[Any], batch: Batch) -> Any:
        try:
            return self.backend.output(slot, future, batch)
        except WorkerDiedError as exc:
            failure = self._replace(slot, batch, exc)
            return _AGAIN if failure is None else failure
        except StopIteration as exc:  # else taken for the end of the map
            return batch_error(exc, batch.index, self.backend.describe(slot))
        except BaseException as exc:  # its note names the batch and where it ran
            return exc

    def _overdue(self) -> tuple[Batch, BaseException] | None:
        """With a timeout, the deadlines looked at once a poll interval even while other
        batches keep finishing (a hung slot would otherwise hold its batch until they all
        had): a batch past the timeout, as :meth:`_look`."""
        if self.timeout is None or time.monotonic() - self.looked < self.poll:
            return None
        return self._past_deadline(self.timeout)

    def _look(self) -> tuple[Batch, BaseException] | None:
        """No batch finished for a while: a batch past the timeout (threads: its error);
        an error if no slot is left to run the batches."""
        if not self.inflight and not self.pending:
            raise RuntimeError("DataParallel.map: take() with no batch in flight")
        if self.timeout is not None:
            late = self._past_deadline(self.timeout)
            if late is not None:
                return late
        if not self.slots:
            raise RuntimeError(
                "DataParallel.map: every worker thread has stopped with batches still pending "
                f"(replicas {sorted(self.dropped)} timed out)"
            )
        return None

    def _past_deadline(self, timeout: float) -> tuple[Batch, BaseException] | None:
        """The first batch each slot runs, checked against the timeout. The clock of a
        batch starts when its slot starts it (after the jobs queued before it there, a
        stopped map's or a call's included)."""
        now, seen = time.monotonic(), set()
        self.looked = now
        for future, (batch, slot) in list(self.inflight.items()):
            if slot in seen or future.done():
                continue
            seen.add(slot)
            began = self.backend.started(slot, future, batch)
            if began is None or now - began <= timeout or batch.seq in self.hung:
                continue
            self.hung.add(batch.seq)
            error = self.backend.hang(slot, batch, timeout)
            if error is not None:  # the slot is dropped: its batches go to the others
                self._drop(slot)
                return batch, error
        return None

    def _drop(self, slot: int) -> None:
        self.dropped.add(slot)
        self.slots.remove(slot)
        mine = [(f, b) for f, (b, s) in self.inflight.items() if s == slot]
        for f, _ in mine:
            del self.inflight[f]
        # Those queued behind the hung one go to the other slots, first.
        self.pending.extendleft(reversed([b for f, b in mine if f.cancel()]))
        self.busy[slot] = 0

    def _replace(self, slot: int, batch: Batch, exc: WorkerDiedError) -> BaseException | None:
        """``slot``'s worker died holding ``batch``, this map's first there: start a fresh
        one and send its batches again; the batch's error once it used up its retries
        (None while it has some). A batch that had not started (it waited behind another
        map's batch or a call's share) is not charged a try."""
        timed_out = batch.seq in self.hung
        where = self.backend.describe(slot)
        how = (f"it ran longer than timeout={self.timeout} s on {where}, which was killed"
               if timed_out else f"{exc.what or exc} while running it")
        self.hung.discard(batch.seq)
        tries = self.tries.get(batch.seq, 0) + (exc.started or timed_out)
        self.tries[batch.seq] = tries
        # Every batch the dead worker held failed with it: they go again, in their order.
        mine = [b for f, (b, s) in self.inflight.items() if s == slot]
        self.inflight = {f: v for f, v in self.inflight.items() if v[1] != slot}
        self.busy[slot] = 0
        again = [b for b in [batch, *mine] if b.seq != batch.seq or tries <= self.retries]
        self.pending.extendleft(reversed(again))
        self.backend.replace(slot)
        if tries <= self.retries:
            self._submit_pending()
            return None
        error: BaseException = (TimeoutError if timed_out else WorkerDiedError)(
            f"DataParallel.map: batch {batch.index} failed {tries} time(s) (retries={self.retries}): "
            f"{how}; a fresh worker replaced it"
        )
        error.__cause__ = exc
        return error

    def stop(self) -> None:
        """Drop the pending batches, cancel the queued ones; a running one finishes and
        is dropped (idempotent)."""
        self.pending.clear()
        running = [f for f in self.inflight if not f.cancel()]
        self.inflight.clear()
        self.slots = []
        self.backend.stop(self.dropped, running)
        if self.bar is not None:
            self.bar.close()
            self.bar = None


_AGAIN = object()  # a dead worker's batch, sent again


def _as_call(batch: Any, kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A batch as call arguments: Mapping -> keywords, tuple -> positional, else one.

    Example:
        >>> _as_call({"x": 1}, {"y": 2}), _as_call((1, 2), {}), _as_call(1, {})
        (((), {'x': 1, 'y': 2}), ((1, 2), {}), ((1,), {}))
    """
    if isinstance(batch, Mapping):
        bad = [k for k in batch if not isinstance(k, str)]
        if bad:
            raise TypeError(
                f"map: batches: a Mapping batch is passed as keyword arguments, so its keys "
                f"must be str, got {type(bad[0]).__name__} {bad[0]!r}"
            )
        clash = sorted(set(batch) & set(kwargs))
        if clash:
            raise TypeError(
                f"map: batch keys {clash} are also keyword arguments of map(); "
                "give each argument once"
            )
        return (), {**batch, **kwargs}
    if isinstance(batch, tuple):
        return batch, kwargs
    return (batch,), kwargs


def _items(args: tuple[Any, ...], kwargs: dict[str, Any], dim: int) -> int:
    """Items in a batch, for the progress bar: the first batched tensor's size on ``dim``."""
    for leaf in _tree.flatten((args, kwargs))[1]:
        if isinstance(leaf, Tensor) and -leaf.dim() <= dim < leaf.dim():
            return int(leaf.shape[dim])
    first = args[0] if args else next(iter(kwargs.values()), None)
    if isinstance(first, (list, tuple)):  # e.g. sentence-transformers' list of texts
        return len(first)
    return 1


class BatchIterator(MapIterator):
    """The iterator of a map of batches: pulls batches from the source while the bounds
    allow, gives them to the :class:`Scheduler`, and yields the outputs in order (or
    ``(index, output)`` as they finish), with a progress bar. An error reading the
    source is raised once the batches read before it are yielded (a KeyboardInterrupt
    at once)."""

    def __init__(
        self, scheduler: Scheduler, source: Iterator[tuple[int, Any]], kwargs: dict[str, Any], *,
        ordered: bool, dim: int, progress: Callable[[], Any] | None, checkpoint: Checkpoint | None,
    ) -> None:
        self._scheduler, self._source, self._kwargs = scheduler, source, kwargs
        self._dim, self._progress = dim, progress
        self._seq = self._yielded = self._inflight = self._items = 0
        self._exhausted = self._started = False
        self._failed: Exception | None = None  # the source's error, raised after the batches before it
        self._buffer: dict[int, tuple[int, Any]] = {}  # ordered: seq -> (index, output) waiting
        self._sizes: dict[int, int] = {}  # seq -> items, for the progress bar
        self._t0 = 0.0
        super().__init__(scheduler.stop, checkpoint, ordered=ordered)

    def _dropped(self) -> None:
        self._buffer.clear()

    def _start(self) -> None:
        self._started = True
        startup = self._scheduler.start()
        if self._progress is not None:  # after the start-up: a failed one leaves no bar
            bar = self._scheduler.bar = self._progress()
            if startup:  # reported once, by the map that paid it
                bar.set_postfix_str(f"workers started in {startup:.1f} s", refresh=True)
        self._t0 = time.perf_counter()

    def _next(self) -> Any:
        if not self._started:
            self._start()
        while True:
            if self._ordered and self._yielded in self._buffer:
                self._yielded += 1
                self._index, out = self._buffer.pop(self._yielded - 1)
                return out
            self._fill()
            if self._inflight == 0:
                if self._failed is not None:
                    failed, self._failed = self._failed, None
                    raise failed
                raise StopIteration
            batch, out = self._scheduler.take()
            self._inflight -= 1
            if self._scheduler.bar is not None:
                self._tick(batch.seq)
            if not self._ordered:
                self._yielded += 1
                self._index = batch.index
                return batch.index, out
            self._buffer[batch.seq] = (batch.index, out)

    def _fill(self) -> None:
        """Pull batches while the in-flight bound (the backend's prefetch per slot) and
        the reorder bound (:data:`_REORDER` times that) allow."""
        scheduler = self._scheduler
        backend = scheduler.backend
        while not self._exhausted:
            inflight = backend.prefetch * backend.width  # pulled and not taken, at most
            if self._inflight >= inflight or self._seq - self._yielded >= _REORDER * inflight:
                return
            try:
                index, batch = next(self._source)
            except StopIteration:
                self._exhausted = True
                return
            except Exception as exc:  # the batches read before it still run, and are given
                if self._inflight == 0:
                    raise
                self._exhausted, self._failed = True, exc
                return
            args, kwargs = _as_call(batch, self._kwargs)
            if scheduler.bar is not None:
                self._sizes[self._seq] = _items(args, kwargs, self._dim)
            scheduler.submit(Batch(self._seq, index, args, kwargs))
            self._seq += 1
            self._inflight += 1

    def _tick(self, seq: int) -> None:
        bar = self._scheduler.bar
        self._items += self._sizes.pop(seq, 0)
        elapsed = time.perf_counter() - self._t0
        if elapsed > 0:
            bar.set_postfix_str(f"{self._items / elapsed:.4g} items/s", refresh=False)
        bar.update(1)
