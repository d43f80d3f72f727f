"""The process backend of the map's scheduler: the wrapper's worker processes.

Each slot is a worker of the wrapper's :class:`~dpmethods.processes.pool.ProcessPool`
(an executor of one process per device entry), holding two batches of this map: the one
it runs and the next, so it never waits for the caller between two. Not more: a worker
cannot give back a batch it holds, and one held behind a long batch waits for it while
another worker may be idle. But while the map's batches are short (their running
average under :data:`SHORT_S`), a batch costs about what its trip to the worker costs,
and a worker holds :data:`_DEEP`: a reply is ready whenever the caller looks, and a
worker runs several batches in a row without being woken for each (with as many
processes as cores, the caller and a worker otherwise take turns on one core, a batch
at a time). A ``prefetch`` given to the map is the most a worker holds. A batch
crosses as a :class:`~dpmethods.processes.messages.Request`; its output comes back
through :meth:`~dpmethods.processes.pool.Worker.reply` and is moved to
``output_device`` in the caller. A worker that hangs past the timeout is killed; a dead
worker is replaced by a fresh one (the scheduler sends its batches again).
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
from typing import Any

from torch import nn

from dpmethods.core.parallel_apply import ThreadState, add_note
from dpmethods.core.seeding import draw_seed, replica_seed
from dpmethods.processes.executor import ran, wait_replies
from dpmethods.processes.messages import Request, Split
from dpmethods.processes.pool import (
    ProcessPool,
    Unsendable,
    WorkerDiedError,
    drain,
    logging_levels,
    received,
)
from dpmethods.streaming.scheduler import PREFETCH, Batch
from dpmethods.vocab.options import MethodOptions

__all__ = ["SHORT_S", "ProcessBackend"]

_DEEP = 4  # batches of one map a worker holds while they are short
SHORT_S = 1e-3  # a batch shorter than this (its run on the worker) is short
_WEIGHT = 0.25  # of the last batch's run time in the map's running average


class ProcessBackend:
    """The map's slots as the worker processes of ``pool`` (see the module docstring).

    Args:
        pool: the wrapper's workers.
        module: the model the workers hold (sent again when it changed).
        method: the method's name, or ``"forward"``.
        output_device: where outputs go (None: where they are).
        prefetch: batches in flight per worker (None: two, or :data:`_DEEP` while short).
        oom: with ``on_oom="split"``, the method's options.
    """

    cancels = False  # a job is written to the worker's pipe at once: it runs, wherever it waits

    def __init__(self, pool: ProcessPool, module: nn.Module, method: str, output_device: Any, *,
                 prefetch: int | None, oom: MethodOptions | None) -> None:
        self.pool, self.module, self.method, self.output_device = pool, module, method, output_device
        self.width = len(pool.workers)  # slots
        self.asked = prefetch  # the map's prefetch (None: as the batches' run time says)
        self.run_s: float | None = None  # the batches' run time on the workers, a running average
        self.state = ThreadState.capture()  # the caller's modes at map(), as on threads
        self.levels = logging_levels()  # and its logging levels
        self.seed = draw_seed()  # batch i is seeded from (seed, i), whichever worker runs it
        # on_oom="split": a memory record per map, as on threads
        self.oom = None if oom is None else Split(self.seed, oom, prepared=False)

    @property
    def room(self) -> int:
        """Batches of this map on one worker: two, or :data:`_DEEP` while short (at most ``prefetch``)."""
        depth = _DEEP if self.run_s is not None and self.run_s < SHORT_S else PREFETCH
        return depth if self.asked is None else min(depth, self.asked)

    @property
    def prefetch(self) -> int:
        return self.room if self.asked is None else self.asked

    def start(self) -> float:
        return self.pool.prepare(self.module)

    def submit(self, slot: int, batch: Batch) -> cf.Future[Any]:
        request = Request(self.method, batch.args, batch.kwargs, self.state,
                          replica_seed(self.seed, batch.index), False, self.oom, self.levels)
        try:
            # A module changed in the loop over this map is sent again, to the batches after.
            return self.pool.submit(slot, request, self.module)
        except Unsendable as exc:
            raise exc.error("DataParallel.map(workers='processes')", f"batch {batch.index}") from exc.__cause__
        except WorkerDiedError as exc:
            raise add_note(exc, f"dpmethods: while sending batch {batch.index} of DataParallel.map; "
                           "the next map or call starts a fresh worker") from None

    def next_finished(self, finished: queue.SimpleQueue[cf.Future[Any]], timeout: float) -> cf.Future[Any] | None:
        wait_replies(lambda: not finished.empty(), timeout)  # this thread reads the replies
        try:
            return finished.get_nowait()
        except queue.Empty:
            return None

    def output(self, slot: int, future: cf.Future[Any], batch: Batch) -> Any:
        took = ran(future)
        if took is not None:
            self.run_s = took if self.run_s is None else self.run_s + _WEIGHT * (took - self.run_s)
        out = self.pool.workers[slot].reply(
            future, f"DataParallel.map: raised in batch {batch.index}", f"batch {batch.index} of DataParallel.map")
        return received(out, self.output_device)

    def started(self, slot: int, future: cf.Future[Any], batch: Batch) -> float | None:
        return self.pool.workers[slot].started(future)

    def hang(self, slot: int, batch: Batch, timeout: float) -> BaseException | None:
        self.pool.workers[slot].kill()  # its jobs fail: the scheduler replaces it
        return None

    def replace(self, slot: int) -> None:
        self.pool.prepare(self.module)  # a fresh worker, with the model

    def describe(self, slot: int) -> str:
        return self.pool.workers[slot].describe()

    def stop(self, dropped: set[int], running: list[cf.Future[Any]]) -> None:
        for future in running:  # its output is dropped when it arrives, its shared memory freed
            future.add_done_callback(drain)
