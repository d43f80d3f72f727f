"""The thread backend of the map's scheduler: one worker thread per replica.

Each replica's slot is a single-thread executor (:class:`ReplicaThread`) that runs its
batches whole, in turn, under the caller's grad and autocast modes, and moves each
output to ``output_device``. A slot holds up to ``prefetch`` batches, so it starts the
next as soon as one ends (the scheduler moves one held behind a long batch to a slot
left idle); on CUDA their copies to its device run on a copy stream of its own, started
when they are submitted, while it computes on another. A thread cannot be stopped: a
replica that runs a batch past the timeout is dropped from the map, and with a timeout a
slot holds only the batch it runs.

Before each batch it submits, the backend looks at the module with a
:class:`~dpmethods.processes.state.Watch` (the look a process map takes, at little cost
while nothing changed); when the module changed in a way the replicas copied, it builds
them again as the map built them at its start, so the batches submitted after see the
change, while those submitted before finish on the replicas they were given.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from dpmethods.core.compiled import one_at_a_time
from dpmethods.core.oom import batch_runner
from dpmethods.core.parallel_apply import ThreadState, add_note, record_streams
from dpmethods.core.replica_cache import CachedReplicas
from dpmethods.core.replicate import fingerprint
from dpmethods.core.seeding import cuda_distinct, draw_seed, seed_cuda
from dpmethods.processes.state import Watch
from dpmethods.streaming.scheduler import PREFETCH, Batch, batch_error
from dpmethods.types import tree as _tree
from dpmethods.types.tree import move
from dpmethods.vocab.options import MethodOptions

__all__ = ["ReplicaThread", "ThreadBackend"]


def pin(obj: Any) -> Any:
    """``obj`` with its CPU tensor leaves in pinned memory, for asynchronous uploads."""
    spec, leaves = _tree.flatten(obj)
    if not any(isinstance(t, Tensor) and t.device.type == "cpu" for t in leaves):
        return obj
    pinned = [
        t.pin_memory() if isinstance(t, Tensor) and t.device.type == "cpu" and not t.is_pinned() else t
        for t in leaves
    ]
    return _tree.unflatten(spec, pinned)


def produced(obj: Any) -> list[Any]:
    """Events on the caller's current streams after the batch's CUDA tensors were made."""
    events = []
    for d in {t.device for t in _tree.flatten(obj)[1] if isinstance(t, Tensor) and t.is_cuda}:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(d))
        events.append(event)
    return events


class ReplicaThread(cf.Executor):
    """A single-thread executor whose thread is a daemon: ``ThreadPoolExecutor``'s
    threads are joined at interpreter exit, and a batch that hung past the timeout would
    hold up the exit. Its thread runs the jobs in turn inside ``context()``.

    Example:
        >>> ex = ReplicaThread("dpmethods-example", contextlib.nullcontext)
        >>> ex.submit(sum, [1, 2]).result()
        3
        >>> ex.shutdown()
    """

    def __init__(self, name: str, context: Callable[[], contextlib.AbstractContextManager[Any]]) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, args=(context,), name=name, daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> cf.Future[Any]:
        future: cf.Future[Any] = cf.Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def _serve(self, context: Callable[[], contextlib.AbstractContextManager[Any]]) -> None:
        with context():
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                future, fn, args, kwargs = job
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(result)
                job = future = result = None  # drop this batch before waiting for the next

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._jobs.put(None)
        if wait and self.thread is not threading.current_thread():
            self.thread.join()


class ThreadBackend:
    """The map's slots as replica threads (see the module docstring).

    Args:
        module: the module the map runs.
        replicate: builds its replicas, one per device (the map's ``replicate`` seam,
            from the replica cache where it lends them); None: the module itself runs,
            in one slot.
        devices: the replicas' devices (None: no device, the module as it is).
        method: the method's name, or ``"forward"``.
        output_device: where outputs go (None: where they are).
        prefetch: batches in flight per replica (None: :data:`~dpmethods.streaming.scheduler.PREFETCH`).
        timeout: seconds a batch may run, or None.
        oom: with ``on_oom="split"``, the method's options.
    """

    def __init__(
        self, module: nn.Module, replicate: Callable[[], list[nn.Module]] | None,
        devices: list[torch.device | None], method: str, output_device: torch.device | None, *,
        prefetch: int | None, timeout: float | None, oom: MethodOptions | None,
    ) -> None:
        self.module, self.replicate, self.devices, self.method = module, replicate, devices, method
        self.output_device, self.oom = output_device, oom
        self.state = ThreadState.capture()  # the caller's modes at map()
        self.watch: Watch | None = None  # the last look at the module (None: it runs itself)
        self.key: Any = None  # what the replicas were built from (_key)
        self.replicas: list[nn.Module] = [module]
        if replicate is not None:
            with self.state.applied():  # first the look, so a change made while they are built shows
                self.watch = Watch(module, versionless=True)
                self.replicas = replicate()
                # Lent from the cache: its key, the fingerprint the seam took as it lent them.
                self.key = CachedReplicas.key_of(self.replicas)
                if self.key is None:
                    self.key = self._key()
        self.width = len(self.replicas)  # slots
        # A batch held ahead starts as soon as the one before it ends, without waiting
        # for the caller's thread (on CUDA its copy overlaps the compute too); one held
        # behind a long batch moves to a replica that falls idle (Scheduler). With a
        # timeout none are held, so a hung replica holds no batch but its own.
        self.prefetch = PREFETCH if prefetch is None else prefetch
        self.room = self.prefetch if timeout is None else 1
        self.cancels = True  # a batch queued behind another is cancelled there, and moves
        self.timeout = timeout
        # Distinct GPUs have a generator each: batch i is seeded from (seed, i) on
        # whichever runs it. CPU replicas share the caller's generator (docs/generate.md).
        self.seed = draw_seed() if cuda_distinct(devices) else None
        cuda = {d for d in [*devices, output_device] if d is not None and d.type == "cuda"}
        # Current streams are per thread: the workers order their own streams after the
        # caller's (which made the replicas), and outputs are recorded on the caller's.
        self.caller_streams = {d: torch.cuda.current_stream(d) for d in cuda}
        self.began: list[tuple[int, float] | None] = [None] * self.width  # with a timeout: (seq, since)
        self.executors: list[ReplicaThread] = []
        self.runs: list[Callable[[Batch, Any], Any]] = []  # per slot: runs one batch there
        self.streams: list[tuple[Any, Any] | None] = []  # per slot on CUDA: (copy, compute)

    def _key(self) -> Any:
        """What the replicas copy of the module: its fingerprint (the replica cache's
        key), and under grad (no cache; the replicas' tensors then come from the
        module's through autograd) the ``requires_grad`` flags. A change the fingerprint
        does not show (an attribute object edited in place, a method patched on a
        class) the replicas share. An inference tensor counts without a version (it has
        none): its in-place updates are not seen, as writes through ``.data`` are not,
        and a module holding one is not built again before every batch."""
        key = fingerprint(self.module, versionless=True)
        if self.state.grad:
            key = (key, [p.requires_grad for p in self.module.parameters()])
        return key

    def start(self) -> float:
        for device in self.devices:
            streams = None
            if device is not None and device.type == "cuda":
                streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
                for s in streams:
                    s.wait_stream(self.caller_streams[device])
            self.streams.append(streams)
        self.runs = self._runners(self.replicas, None)
        for r in range(self.width):
            self.executors.append(ReplicaThread(f"dpmethods-map-{r}", self.state.applied))
        return 0.0

    def _runners(self, replicas: list[nn.Module], index: int | None) -> list[Callable[[Batch, Any], Any]]:
        """A runner per slot on ``replicas``, made before batch ``index`` (None: at the start)."""
        runs: list[Callable[[Batch, Any], Any]] = []
        for r, (replica, device) in enumerate(zip(replicas, self.devices)):
            try:
                runs.append(self._runner(r, replica, device))
            except BaseException as exc:
                raise batch_error(exc, index, self.describe(r)) from None
        return runs

    def _runner(self, r: int, replica: nn.Module, device: torch.device | None) -> Callable[[Batch, Any], Any]:
        fn = one_at_a_time(replica if self.method == "forward" else getattr(replica, self.method), replica)
        if self.oom is not None:  # a memory record per replica, as a worker keeps one per model
            fn = batch_runner(replica, self.method, self.oom, fn, device or "cpu", names=getattr(replica, self.method))
        return functools.partial(self._run, r, fn, device, self.streams[r])

    def _look(self, batch: Batch) -> None:
        """The module changed since the last look: if the replicas copied the change,
        build them again as the map did at its start, and the slots' runners on them.
        The batches submitted before hold the old runners: they finish on the old replicas."""
        assert self.replicate is not None
        with self.state.applied():
            watch, key = Watch(self.module, versionless=True), self._key()  # while the last key's objects live
            if key == self.key:
                self.watch = watch  # nothing the replicas copied: the next look costs no walk
                return
            # Cached replicas go back first: under a new key the cache builds new ones
            # (it never lends these again), and these are freed once their batches end.
            CachedReplicas.give_back(self.replicas)
            try:
                replicas = self.replicate()
            except BaseException as exc:
                add_note(exc, f"dpmethods: DataParallel.map: raised while building the replicas again "
                         f"before batch {batch.index} (the module changed)")
                raise
        self.runs = self._runners(replicas, batch.index)
        self.replicas, self.watch, self.key = replicas, watch, key
        for device, streams in zip(self.devices, self.streams):
            for s in streams or ():  # the new replicas were made on the caller's stream
                s.wait_stream(torch.cuda.current_stream(device))

    def _run(self, r: int, fn: Any, device: Any, streams: Any, batch: Batch, ready: Any) -> Any:
        """Run ``batch`` on replica ``r`` (in its thread)."""
        if self.timeout is not None:
            self.began[r] = (batch.seq, time.monotonic())
        if self.seed is not None:
            seed_cuda([device], self.seed, base=batch.index)
        if streams is None:
            return move(fn(*move(batch.args, device), **move(batch.kwargs, device)), self.output_device)
        out_dev = self.output_device
        with torch.cuda.device(device), torch.cuda.stream(streams[1]):
            streams[1].wait_event(ready[2])
            out = move(fn(*ready[0], **ready[1]), out_dev)
            # Simple and safe: the output is complete before the caller sees it.
            streams[1].synchronize()
            if out_dev is not None and out_dev.type == "cuda" and out_dev != device:
                torch.cuda.current_stream(out_dev).synchronize()
        if out_dev in self.caller_streams:
            record_streams(out, self.caller_streams[out_dev])
        return out

    def submit(self, slot: int, batch: Batch) -> cf.Future[Any]:
        if self.watch is not None and not self.watch.unchanged():  # one look, no walk while unchanged
            self._look(batch)
        streams = self.streams[slot]
        ready = None if streams is None else _stage(batch, self.devices[slot], streams)
        return self.executors[slot].submit(self.runs[slot], batch, ready)

    def next_finished(self, finished: queue.SimpleQueue[cf.Future[Any]], timeout: float) -> cf.Future[Any] | None:
        try:
            return finished.get(timeout=timeout)
        except queue.Empty:
            return None

    def output(self, slot: int, future: cf.Future[Any], batch: Batch) -> Any:
        try:
            return future.result()
        except BaseException as exc:
            raise batch_error(exc, batch.index, self.describe(slot))  # noqa: B904 - the same exception, noted

    def started(self, slot: int, future: cf.Future[Any], batch: Batch) -> float | None:
        began = self.began[slot]
        return began[1] if began is not None and began[0] == batch.seq else None

    def hang(self, slot: int, batch: Batch, timeout: float) -> BaseException | None:
        return TimeoutError(
            f"DataParallel.map: batch {batch.index} ran longer than timeout={timeout} s on "
            f"{self.describe(slot)}; a thread cannot be stopped, so replica {slot} takes no "
            "more batches of this map")

    def replace(self, slot: int) -> None:  # pragma: no cover - a thread does not die
        raise AssertionError("a replica thread does not die")

    def describe(self, slot: int) -> str:
        return f"replica {slot} (device {self.devices[slot]})"

    def stop(self, dropped: set[int], running: list[cf.Future[Any]]) -> None:
        """Join every thread but the dropped ones (a hung replica's may never return: a
        daemon, it does not hold up the exit), and give cached replicas back."""
        for r, executor in enumerate(self.executors):
            executor.shutdown(wait=r not in dropped)
        self.executors = []
        # The map is over: cached replicas go back now, not when the iterator object dies,
        # so calls made while a finished iterator is still held reuse them (not one that a
        # timed-out thread may still be running).
        if not dropped:
            CachedReplicas.give_back(self.replicas)


def _stage(batch: Batch, device: torch.device | None, streams: Any) -> tuple[Any, Any, Any]:
    """Start moving a batch to its replica's CUDA device on the copy stream; the event
    that tells the copy is done."""
    copy, compute = streams
    args, kwargs = pin((batch.args, batch.kwargs))  # pinned: asynchronous uploads
    for event in produced((args, kwargs)):  # ordered after their making
        copy.wait_event(event)
    record_streams((args, kwargs), copy)  # the caller may free them while the copy is pending
    with torch.cuda.device(device), torch.cuda.stream(copy):  # type: ignore[arg-type]
        args, kwargs = move((args, kwargs), device, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(copy)
    record_streams((args, kwargs), compute)
    return args, kwargs, ready
