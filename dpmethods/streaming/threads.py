"""The workers behind ``DataParallel.map``: one thread per replica, and the shared state.

A worker takes a batch from the shared queue when its replica is free, runs it whole
and puts the output, moved to ``output_device``, on the results queue. On CUDA it also
holds up to ``prefetch`` batches whose copies to its device run on a copy stream of its
own while it computes on another. The state (:class:`Run`) never refers to the
iterator the caller holds, so dropping that iterator lets its finalizer stop them.
"""

from __future__ import annotations

import collections
import functools
import queue
import threading
import time
from typing import Any

import torch
from torch import Tensor, nn

from dpmethods.core.call import split_on_oom
from dpmethods.core.compiled import one_at_a_time
from dpmethods.core.oom import Fit
from dpmethods.core.parallel_apply import ThreadState, add_note, record_streams
from dpmethods.core.replica_cache import CachedReplicas
from dpmethods.core.seeding import cuda_distinct, draw_seed, seed_cuda
from dpmethods.types import tree as _tree
from dpmethods.types.tree import move
from dpmethods.vocab.options import MethodOptions

__all__: list[str] = []

END = object()  # the iterable is exhausted, or the map stopped: a worker takes no more
_POLL_S = 0.5  # how often a waiting caller checks that the workers are still alive


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


class Run:
    """What the workers share with the iterator; it never refers to the iterator itself,
    so dropping the iterator lets its finalizer stop them."""

    def __init__(
        self,
        replicas: list[nn.Module],
        devices: list[torch.device | None],
        method: str,
        output_device: torch.device | None,
        depth: int,
        *,
        timeout: float | None = None,
        oom: MethodOptions | None = None,
    ) -> None:
        self.replicas, self.devices, self.method = replicas, devices, method
        self.width = len(replicas)
        # A hung replica's batches held ahead could not be given back: with a timeout,
        # none are held (on CUDA, copies then no longer overlap the compute).
        self.output_device, self.depth = output_device, depth if timeout is None else 1
        self.timeout, self.oom = timeout, oom
        self.busy: dict[int, tuple[int, int, float]] = {}  # replica -> (seq, index, started)
        self.dropped: set[int] = set()  # replicas that timed out: they take no more batches
        self.lock = threading.Lock()  # a replica's result against its timeout
        self.state = ThreadState.capture()
        # Distinct GPUs have a generator each: batch i is seeded from (seed, i) on
        # whichever runs it. CPU replicas share the caller's generator (docs/generate.md).
        self.seed = draw_seed() if cuda_distinct(devices) else None
        cuda = {d for d in [*devices, output_device] if d is not None and d.type == "cuda"}
        self.cuda = any(d is not None and d.type == "cuda" for d in devices)
        # Current streams are per thread: the workers order their own streams after the
        # caller's (which made the replicas), and outputs are recorded on the caller's.
        self.caller_streams = {d: torch.cuda.current_stream(d) for d in cuda}
        self.work: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.results: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.stopped = threading.Event()
        self.keep_errors = False  # errors='yield': a batch's exception is its output
        self.threads: list[threading.Thread] = []
        self.bar: Any = None

    def start(self) -> float:
        for r in range(len(self.replicas)):
            t = threading.Thread(target=_serve, args=(self, r), name=f"dpmethods-map-{r}", daemon=True)
            self.threads.append(t)
            t.start()
        return 0.0

    def end(self) -> None:
        """The iterable is exhausted: each worker takes no more once the queue is empty."""
        for _ in self.threads:
            self.work.put(END)

    def submit(self, seq: int, index: int, args: Any, kwargs: Any) -> None:
        events: list[Any] = []
        if self.cuda:  # pinned, for asynchronous uploads; ordered after their making
            args, kwargs = pin((args, kwargs))
            events = produced((args, kwargs))
        self.work.put((seq, index, args, kwargs, events))

    def take(self) -> tuple[int, int, Any]:
        """The next finished batch: ``(seq, index, output)``, or its error raised."""
        poll = _POLL_S if self.timeout is None else min(_POLL_S, self.timeout / 10)
        while True:
            try:
                seq, index, out, exc, r = self.results.get(timeout=poll)
                break
            except queue.Empty:
                late = self._timed_out()
                if late is not None:
                    seq, index, out, exc, r = late
                    break
                if not any(t.is_alive() for i, t in enumerate(self.threads) if i not in self.dropped):
                    raise RuntimeError(
                        "DataParallel.map: every worker thread has stopped with batches still pending"
                        + (f" (replicas {sorted(self.dropped)} timed out)" if self.dropped else "")
                    ) from None
        if exc is None:
            return seq, index, out
        where = f"replica {r} (device {self.devices[r]})"
        if self.keep_errors and isinstance(exc, Exception) and seq is not None:
            return seq, index, batch_error(exc, index, where)
        try:
            raise batch_error(exc, index, where)
        finally:
            exc = None  # the traceback holds this frame: don't hold the exception too

    def _timed_out(self) -> tuple[Any, ...] | None:
        """The error of a batch that passed the timeout; its replica is dropped."""
        if self.timeout is None:
            return None
        now = time.monotonic()
        with self.lock:
            for r, (seq, index, began) in self.busy.items():
                if now - began > self.timeout:
                    del self.busy[r]
                    self.dropped.add(r)
                    return seq, index, None, TimeoutError(
                        f"DataParallel.map: batch {index} ran longer than timeout={self.timeout} s on "
                        f"replica {r} (device {self.devices[r]}); a thread cannot be stopped, so "
                        f"replica {r} takes no more batches of this map"), r
        return None

    def stop(self) -> None:
        shutdown(self)


def batch_error(exc: BaseException, index: int | None, where: str) -> BaseException:
    """``exc`` of batch ``index`` (None: while starting), with a note naming ``where`` it ran.

    A StopIteration raised out of ``__next__`` would end the map, silently short (PEP 479
    turns it into a RuntimeError in generators for the same reason): it is re-raised as
    a RuntimeError.
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


def produced(obj: Any) -> list[Any]:
    """Events on the caller's current streams after the batch's CUDA tensors were made."""
    events = []
    for d in {t.device for t in _tree.flatten(obj)[1] if isinstance(t, Tensor) and t.is_cuda}:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(d))
        events.append(event)
    return events


def _stage(item: Any, device: torch.device | None, streams: Any) -> Any:
    """Start moving one batch to the replica's device; on CUDA, asynchronously."""
    seq, index, args, kwargs, produced = item
    if streams is None:
        return seq, index, move(args, device), move(kwargs, device), None
    copy, compute = streams
    for event in produced:
        copy.wait_event(event)
    record_streams((args, kwargs), copy)  # the caller may free them while the copy is pending
    with torch.cuda.device(device), torch.cuda.stream(copy):  # type: ignore[arg-type]
        args, kwargs = move((args, kwargs), device, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(copy)
    record_streams((args, kwargs), compute)
    return seq, index, args, kwargs, ready


def _run_cuda(run: Run, fn: Any, device: torch.device, stream: Any, batch: Any) -> Any:
    args, kwargs, ready = batch
    out_dev = run.output_device
    with torch.cuda.device(device), torch.cuda.stream(stream):
        stream.wait_event(ready)
        out = move(fn(*args, **kwargs), out_dev)
        # Simple and safe: the output is complete before the caller sees it.
        stream.synchronize()
        if out_dev is not None and out_dev.type == "cuda" and out_dev != device:
            torch.cuda.current_stream(out_dev).synchronize()
    if out_dev in run.caller_streams:
        record_streams(out, run.caller_streams[out_dev])
    return out


def _splitting(replica: nn.Module, run: Run, fn: Any, device: Any, fit: Fit, *args: Any, **kwargs: Any) -> Any:
    """``fn`` with on_oom='split': halved on this replica while it runs out of memory (a
    batch runs as it is: split, it is adapted by the method's hooks as a call is)."""
    names = getattr(replica, run.method)
    return split_on_oom(replica, run.method, run.oom, fn, device or "cpu", fit, args, kwargs,  # type: ignore[arg-type]
                        names=names, prepared=False)


def _serve(run: Run, r: int) -> None:
    """One replica's worker: take batches while free, run them, hand back the outputs."""
    replica, device = run.replicas[r], run.devices[r]
    streams = None
    try:
        fn = one_at_a_time(replica if run.method == "forward" else getattr(replica, run.method), replica)
        if run.oom is not None:
            fn = functools.partial(_splitting, replica, run, fn, device, Fit())
        if device is not None and device.type == "cuda":
            streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))  # copy, compute
            for s in streams:
                s.wait_stream(run.caller_streams[device])
    except BaseException as exc:  # the caller re-raises it, naming no batch
        run.stopped.set()
        run.results.put((None, None, None, exc, r))
        return
    # Only CUDA gains from holding batches ahead (their copies overlap the compute);
    # elsewhere a batch stays in the shared queue, free for whichever replica is idle.
    depth = run.depth if streams is not None else 1
    held: collections.deque[Any] = collections.deque()
    ended = False
    with run.state.applied():
        while not run.stopped.is_set():
            while not ended and len(held) < depth:
                try:
                    item = run.work.get(block=not held)
                except queue.Empty:
                    break
                if item is END:
                    ended = True
                    break
                try:
                    held.append(_stage(item, device, streams))
                except BaseException as exc:
                    held.append((item[0], item[1], exc, None, None))
            if not held or run.stopped.is_set():
                return
            seq, index, args, kwargs, ready = held.popleft()
            if run.timeout is not None:
                with run.lock:
                    run.busy[r] = (seq, index, time.monotonic())
            try:
                if isinstance(args, BaseException):
                    raise args
                if run.seed is not None:
                    seed_cuda([device], run.seed, base=index)  # type: ignore[list-item]
                if streams is None:
                    out = move(fn(*args, **kwargs), run.output_device)
                else:
                    out = _run_cuda(run, fn, device, streams[1], (args, kwargs, ready))  # type: ignore[arg-type]
                result: Any = (seq, index, out, None, r)
            except BaseException as exc:
                if not (run.keep_errors and isinstance(exc, Exception)):
                    run.stopped.set()  # the other workers take nothing more
                result = (seq, index, None, exc, r)
            if not _hand_back(run, r, result):
                return  # timed out: the caller has its TimeoutError already
            out = args = kwargs = result = None  # drop this batch before waiting for the next


def _hand_back(run: Run, r: int, result: Any) -> bool:
    """Put replica ``r``'s result for the caller; False if it timed out meanwhile."""
    if run.timeout is None:  # nothing to race with
        run.results.put(result)
        return True
    with run.lock:
        if r in run.dropped:
            return False
        del run.busy[r]
        run.results.put(result)
        return True


def shutdown(run: Run) -> None:
    """Stop the workers, drop pending batches and join every thread (idempotent)."""
    run.stopped.set()
    while True:
        try:
            run.work.get_nowait()
        except queue.Empty:
            break
    for _ in run.threads:
        run.work.put(END)
    me = threading.current_thread()
    for r, t in enumerate(run.threads):
        # The garbage collector may run this finalizer in a worker; a timed-out replica
        # may never return (a daemon thread: it does not hold up the exit).
        if t is not me and r not in run.dropped:
            t.join()
    if run.bar is not None:
        run.bar.close()
        run.bar = None
    # The map is over: cached replicas go back now, not when the iterator object dies,
    # so calls made while a finished iterator is still held reuse them (not one that a
    # timed-out thread may still be running).
    if not run.dropped:
        CachedReplicas.give_back(run.replicas)
    while True:
        try:
            run.results.get_nowait()
        except queue.Empty:
            break
