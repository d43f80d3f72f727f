"""The process backend of ``DataParallel.map`` (the iterator is :mod:`dpmethods.streaming.map`'s).

:class:`ProcessRun` sends each batch to a worker process of the wrapper's
:class:`~dpmethods.processes.pool.ProcessPool` with room, and takes the next finished
one. Outputs are moved to ``output_device`` in the caller; a batch nobody waits for any
more (a map stopped early) is dropped when it finishes, its shared memory freed.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import time
from typing import Any

from torch import nn

from dpmethods.core.parallel_apply import ThreadState, add_note
from dpmethods.core.seeding import draw_seed, replica_seed
from dpmethods.processes import worker as process_worker
from dpmethods.processes.calls import drain, received
from dpmethods.processes.pickling import dumps
from dpmethods.processes.pool import ProcessPool, Worker, WorkerDiedError
from dpmethods.streaming.threads import batch_error
from dpmethods.vocab.options import MethodOptions

__all__ = ["ProcessRun"]


_PER_WORKER = 2  # batches of one map sent to one worker and not answered yet


class ProcessRun:
    """A map's batches on the pool: each sent to a worker with room (at most
    :data:`_PER_WORKER` of this map's batches each: the one it runs and the next, so it
    never waits for the caller between two), the next finished one taken in turn. It
    never refers to the map's iterator, so dropping the iterator lets its finalizer stop it.

    A worker that dies while running a batch, or runs one longer than ``timeout``
    seconds (it is killed), is replaced by a fresh one; its batches are sent again, the
    one it was running up to ``retries`` times.
    """

    def __init__(
        self, pool: ProcessPool, module: nn.Module, method: str, output_device: Any, *,
        retries: int = 0, timeout: float | None = None, oom: MethodOptions | None = None,
    ) -> None:
        self.pool, self.module, self.method, self.output_device = pool, module, method, output_device
        self.retries, self.timeout, self.oom = retries, timeout, oom
        self.width = len(pool.workers)
        self.state = ThreadState.capture()  # the caller's modes at map(), as on threads
        self.seed = draw_seed()  # batch i is seeded from (seed, i), whichever worker runs it
        self.pending: collections.deque[tuple[int, int, Any, Any]] = collections.deque()
        # future -> (worker, seq, index, args, kwargs); kept to send it again
        self.futures: dict[cf.Future[bytes], tuple[Any, ...]] = {}
        self.running = {w: 0 for w in pool.workers}
        self.tries: dict[int, int] = {}  # seq -> the times its worker died running it
        self.hung: set[int] = set()  # seqs whose worker was killed for the timeout
        self.keep_errors = False  # errors='yield': a batch's exception is its output
        self.bar: Any = None

    def start(self) -> float:
        return self.pool.prepare(self.module)

    def end(self) -> None:
        """The iterable is exhausted (nothing to tell the workers)."""

    def submit(self, seq: int, index: int, args: Any, kwargs: Any) -> None:
        self.pending.append((seq, index, args, kwargs))
        self.submit_pending()

    def _send(self, w: Worker) -> None:
        # A module changed in the loop over this map is sent again, to the batches after.
        self.pool.prepare(self.module, start=False)
        seq, index, args, kwargs = self.pending.popleft()
        try:
            oom = None if self.oom is None else (self.seed, self.oom, False)  # a record per map, as on threads
            data = dumps((self.method, args, kwargs, self.state, replica_seed(self.seed, index), False, oom))
        except Exception as exc:
            raise TypeError(
                f"DataParallel.map(workers='processes'): batch {index} cannot be sent "
                f"to a worker process: {type(exc).__name__}: {exc}; use workers='threads'"
            ) from exc
        try:
            future = w.submit(process_worker.run, data)
        except WorkerDiedError as exc:
            raise add_note(exc, f"dpmethods: while sending batch {index} of DataParallel.map; "
                           "the next map or call starts a fresh worker") from None
        self.futures[future] = (w, seq, index, args, kwargs)
        self.running[w] += 1

    def take(self) -> tuple[int, int, Any]:
        """The next finished batch: ``(seq, index, output)``, or its error raised."""
        while True:
            # The oldest first: of a dead worker's jobs, the one it was running.
            done = next((f for f in self.futures if f.done()), None)
            if done is None:
                if not self.futures:  # every batch taken: a caller's bug, never a hang
                    raise RuntimeError("DataParallel.map: take() with no batch in flight")
                self._kill_hung()
                poll = 1.0 if self.timeout is None else min(1.0, self.timeout / 10)
                cf.wait(list(self.futures), timeout=poll, return_when=cf.FIRST_COMPLETED)
                continue
            w, seq, index = self.futures[done][:3]
            try:
                out = w.reply(done, f"DataParallel.map: raised in batch {index}", f"batch {index} of DataParallel.map")
            except WorkerDiedError as exc:
                failure = self._replace(w, seq, index, exc)
                if failure is None:
                    continue  # sent again
                out = failure
            except StopIteration as exc:  # else taken for the end of the map
                out = batch_error(exc, index, w.describe())
            except Exception as exc:
                out = exc  # its note names the batch and the worker
            finally:
                if done in self.futures:
                    del self.futures[done]
                    self.running[w] -= 1
            if isinstance(out, BaseException) and not (self.keep_errors and isinstance(out, Exception)):
                raise out
            self.submit_pending()
            return seq, index, out if isinstance(out, BaseException) else received(out, self.output_device)

    def _kill_hung(self) -> None:
        """Kill each worker whose running batch passed the timeout (then it counts as dead).

        The clock of a batch starts when its worker starts it: after the jobs queued
        before it, a stopped map's batch or a call's chunk included."""
        if self.timeout is None:
            return
        now = time.monotonic()
        for f, (w, seq, *_) in self.futures.items():
            began = w.started(f)
            if began is not None and now - began > self.timeout and seq not in self.hung and w.process is not None:
                self.hung.add(seq)
                w.process.kill()

    def _replace(self, w: Worker, seq: int, index: int, exc: WorkerDiedError) -> BaseException | None:
        """Worker ``w`` died running batch ``seq``: start a fresh one and send its batches
        again; the batch's error once it used up its retries (None while it has some)."""
        timed_out = seq in self.hung
        how = (f"it ran longer than timeout={self.timeout} s on {w.describe()}, which was killed"
               if timed_out else f"{exc.what or exc} while running it")
        self.hung.discard(seq)
        tries = self.tries[seq] = self.tries.get(seq, 0) + 1
        # Every job the dead worker held failed with it: they go again, in their order.
        mine = [(f, v) for f, v in self.futures.items() if v[0] is w]
        for f, _ in mine:
            del self.futures[f]
        self.running[w] = 0
        again = [(v[1], v[2], v[3], v[4]) for _, v in mine if v[1] != seq or tries <= self.retries]
        self.pending.extendleft(reversed(again))
        self.pool.prepare(self.module)  # a fresh worker, with the model
        if tries <= self.retries:
            self.submit_pending()
            return None
        error: BaseException = (TimeoutError if timed_out else WorkerDiedError)(
            f"DataParallel.map: batch {index} failed {tries} time(s) (retries={self.retries}): "
            f"{how}; a fresh worker replaced it"
        )
        error.__cause__ = exc
        return error

    def submit_pending(self) -> None:
        """Send pending batches to the least busy workers while one has room."""
        while self.pending:
            w = min(self.pool.workers, key=self.running.__getitem__)
            if self.running[w] >= _PER_WORKER:
                return
            self._send(w)

    def stop(self) -> None:
        """Drop the pending batches; the running ones finish and are dropped (idempotent)."""
        self.pending.clear()
        for f in self.futures:
            if not f.cancel():
                f.add_done_callback(drain)
        self.futures.clear()
        if self.bar is not None:
            self.bar.close()
            self.bar = None
