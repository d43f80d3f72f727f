"""Parallel apply: run one named method on every replica, one thread per replica.

Replica 0 runs in the caller's thread; the others run in threads started for the
call and joined before it returns, or, for cached replicas, in a :class:`ReplicaThreads`
kept with them. Each thread gets the caller's grad mode, inference mode and autocast
state, and on CUDA the caller's current stream for that device. A second replica on
the same GPU runs on a side stream of its own, ordered after the caller's stream on
entry and before it on exit. A failure in a replica is re-raised in the caller as
the same exception object, with its original traceback and a note naming the
replica and device, after every replica has finished.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dpmethods.core.compiled import takes_turns
from dpmethods.core.seeding import cuda_distinct, draw_seed, seed_cuda
from dpmethods.types import tree as _tree
from dpmethods.types.coupled_modules import part_of_batch

__all__ = ["ReplicaError", "ReplicaThreads", "ThreadState", "add_note", "parallel_apply", "record_streams"]

_SIDE_STREAMS: dict[tuple[int, int], Any] = {}
# Context factories entered around each replica's call, in its thread: the seam for
# dpmethods.testing's per-replica recording. Empty, it costs one check per replica.
REPLICA_CONTEXTS: list[Callable[[int, Sequence[nn.Module]], contextlib.AbstractContextManager[Any]]] = []
_NOTHING = contextlib.nullcontext()
_SIDE_STREAMS_LOCK = threading.Lock()


class ReplicaError(RuntimeError):
    """Raised ``from`` on Python < 3.11, where exceptions have no notes, to name the replica."""


@dataclass(frozen=True)
class ThreadState:
    """The caller's grad mode, inference mode, autocast state and default dtype, to apply
    in the thread (or worker process) that runs a replica for it. The default dtype is
    the whole process's: a replica thread has the caller's already, a worker process
    takes it for each job.

    Example:
        >>> import torch
        >>> with torch.no_grad():
        ...     state = ThreadState.capture()
        >>> with state.applied():
        ...     torch.is_grad_enabled()
        False
    """

    grad: bool
    inference: bool
    autocast: tuple[tuple[str, torch.dtype], ...]
    dtype: torch.dtype = torch.float32  # torch.get_default_dtype()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:  # with each batch to a worker process
        return ThreadState, (self.grad, self.inference, self.autocast, self.dtype)

    @classmethod
    def capture(cls) -> ThreadState:
        """The current thread's state."""
        autocast = tuple(
            (kind, torch.get_autocast_dtype(kind))
            for kind in ("cuda", "cpu")
            if torch.is_autocast_enabled(kind)
        )
        return cls(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast, torch.get_default_dtype())

    def applied(self) -> contextlib.AbstractContextManager[Any]:
        """This state in the current thread (a no-op where it holds already)."""
        same_dtype = self.dtype == torch.get_default_dtype()
        if (
            not self.autocast
            and same_dtype
            and self.inference == torch.is_inference_mode_enabled()
            and self.grad == torch.is_grad_enabled()
        ):
            return _NOTHING  # the caller's own thread, or a kept thread from the last call
        if not self.autocast and not self.inference and same_dtype:
            return torch.set_grad_enabled(self.grad)  # the common case, without a stack
        stack = contextlib.ExitStack()
        if not same_dtype:  # a worker process whose caller set another default dtype
            stack.enter_context(_default_dtype(self.dtype))
        if self.inference:
            stack.enter_context(torch.inference_mode())
        stack.enter_context(torch.set_grad_enabled(self.grad))
        for kind, dtype in self.autocast:
            stack.enter_context(torch.autocast(kind, dtype=dtype))
        return stack


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _serve(tasks: queue.SimpleQueue[Any]) -> None:
    while True:
        task = tasks.get()
        if task is None:
            return
        fn, i, done, finished = task
        del task
        try:
            fn(i)
        finally:
            del fn  # drop the call's replicas, inputs and outputs before waiting again
            finished[i] = True  # before the token: _wait trusts flags, not token counts
            done.put(i)


def _stop(tasks: list[queue.SimpleQueue[Any]]) -> None:
    for q in tasks:
        q.put(None)


def _wait(done: queue.SimpleQueue[int], finished: list[bool], queued: int) -> None:
    """Wait for tasks ``1..queued``; if interrupted, still wait for them, then raise.

    Ctrl-C lands in the caller's thread while the kept threads still run the call's
    replicas. Returning at once would let the next call race them on the same
    replicas, so the interrupt waits for them first. The wait after an interrupt
    reads the threads' flags, not the tokens: the interrupt may land just after a
    token was taken. A second interrupt while waiting propagates; tokens are per
    call and each thread runs its tasks in order, so later calls are still right.
    """
    try:
        for _ in range(queued):
            done.get()
    except BaseException:
        while not all(finished[1 : queued + 1]):
            with contextlib.suppress(queue.Empty):
                done.get(timeout=0.05)
        raise


def _join(threads: Sequence[threading.Thread]) -> None:
    """Join ``threads``; if interrupted, join them all before raising (see :func:`_wait`)."""
    try:
        for t in threads:
            t.join()
    except BaseException:
        for t in threads:
            t.join()
        raise


# Kept threads alive in this process, so a forked child can reset them (its threads are gone).
_KEPT: weakref.WeakSet[ReplicaThreads] = weakref.WeakSet()


class ReplicaThreads:
    """Threads kept between calls, for replicas that are kept too (``cache_replicas``).

    Starting and joining a thread per replica costs more than a tiny model's whole
    call; kept threads take the work instead. They stop when this object is
    garbage-collected or :meth:`close` is called. A call that finds them busy
    (re-entered from a replica, or from another thread) uses fresh threads.

    Each call gets its own completion queue, and an interrupted call (Ctrl-C)
    waits for its in-flight tasks before raising, so a later call never sees an
    earlier call's work. In a child made by ``os.fork()`` the threads are gone;
    it starts new ones on its first call there.

    Args:
        size: the number of threads (replicas beyond the caller's own).

    Example:
        >>> threads = ReplicaThreads(1)
        >>> seen = []
        >>> threads.run(seen.append, 2)
        True
        >>> sorted(seen)
        [0, 1]
        >>> threads.close()
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._start()
        _KEPT.add(self)

    def _start(self) -> None:
        self._forked = False
        self._tasks: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in range(self.size)]
        self._threads = [
            threading.Thread(target=_serve, args=(q,), name=f"dpmethods-replica-thread-{i + 1}", daemon=True)
            for i, q in enumerate(self._tasks)
        ]
        for t in self._threads:
            t.start()
        self._finalizer = weakref.finalize(self, _stop, self._tasks)

    def _after_fork(self) -> None:
        # The child has only the forking thread: the kept threads, and whoever held the
        # lock, are gone. Start afresh, unless they were closed.
        alive = self._finalizer.alive
        self._finalizer.detach()
        self._lock = threading.Lock()
        self._threads = []
        self._forked = alive  # threads start on the next call, not inside the fork handler

    def close(self) -> None:
        """Stop the threads and wait for them."""
        self._finalizer()
        for t in self._threads:
            t.join()

    def run(self, fn: Any, n: int) -> bool:
        """Run ``fn(0)`` here and ``fn(1..n-1)`` on the kept threads; False if busy or too few."""
        if n - 1 > self.size or not self._lock.acquire(blocking=False):
            return False
        try:
            if self._forked:
                self._start()
            if not self._finalizer.alive:
                return False
            done: queue.SimpleQueue[int] = queue.SimpleQueue()
            finished = [False] * n
            queued = 0
            try:
                for i in range(1, n):
                    self._tasks[i - 1].put((fn, i, done, finished))
                    queued = i
                fn(0)
            finally:
                _wait(done, finished, queued)
        finally:
            self._lock.release()
        return True


def _reset_after_fork() -> None:
    for kept in list(_KEPT):
        kept._after_fork()
    global _SIDE_STREAMS_LOCK
    _SIDE_STREAMS_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def _side_stream(device: torch.device, k: int) -> Any:
    key = (device.index if device.index is not None else torch.cuda.current_device(), k)
    with _SIDE_STREAMS_LOCK:
        stream = _SIDE_STREAMS.get(key)
        if stream is None:
            stream = _SIDE_STREAMS[key] = torch.cuda.Stream(key[0])
    return stream


def _streams(devices: Sequence[torch.device]) -> list[Any]:
    """The stream of each replica: the caller's current one, or a side stream for repeats."""
    streams: list[Any] = []
    used: dict[torch.device, int] = {}
    for d in devices:
        if d.type != "cuda":
            streams.append(None)
            continue
        k = used.get(d, 0)
        used[d] = k + 1
        streams.append(torch.cuda.current_stream(d) if k == 0 else _side_stream(d, k))
    return streams


def record_streams(obj: Any, stream: Any) -> None:
    """Mark every CUDA tensor in ``obj`` as used on ``stream``: memory made on one
    stream and read on another must not be reused before that stream is done with it.

    Example:
        >>> record_streams([1, None], None)  # no CUDA tensor: nothing to do
    """
    for leaf in _tree.flatten(obj)[1]:
        if isinstance(leaf, torch.Tensor) and leaf.is_cuda:
            leaf.record_stream(stream)


def _device_context(device: torch.device, stream: Any) -> Any:
    if stream is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.cuda.device(device))
    stack.enter_context(torch.cuda.stream(stream))
    return stack


def _entered(i: int, replicas: Sequence[nn.Module]) -> contextlib.AbstractContextManager[Any]:
    if not REPLICA_CONTEXTS:
        return _NOTHING
    stack = contextlib.ExitStack()
    for factory in list(REPLICA_CONTEXTS):
        stack.enter_context(factory(i, replicas))
    return stack


def add_note(exc: BaseException, note: str, replace: str | None = None) -> BaseException:
    """``exc`` with ``note`` added (on Python 3.10, a ``ReplicaError`` raised from it).

    Notes starting with ``replace`` are dropped first: an exception object raised again
    in a later call (a cached exception) must not collect one note per call.

    Example:
        >>> add_note(ValueError("x"), "dpmethods: in replica 1").__notes__
        ['dpmethods: in replica 1']
    """
    if hasattr(exc, "add_note"):
        notes = getattr(exc, "__notes__", None)
        if notes is not None and replace is not None:
            notes[:] = [n for n in notes if not n.startswith(replace)]
        exc.add_note(note)
        return exc
    wrapped = ReplicaError(note)  # pragma: no cover - Python 3.10 has no notes
    wrapped.__cause__ = exc
    return wrapped


def _annotate(exc: BaseException, index: int, device: torch.device) -> BaseException:
    prefix = "dpmethods: raised in replica "
    return add_note(exc, f"{prefix}{index} on device {device}", replace=prefix)


def _ordered_streams(
    devices: Sequence[torch.device], inputs: Sequence[Any], kwargs: Sequence[Any],
) -> tuple[list[Any], list[Any]]:
    """Each replica's side stream, ordered after the caller's current stream (None on CPU)."""
    streams = _streams(devices)
    callers = [torch.cuda.current_stream(d) if s is not None else None for d, s in zip(devices, streams)]
    for i, (s, c) in enumerate(zip(streams, callers)):
        if s is not None and c is not None and s != c:
            s.wait_stream(c)
            record_streams((inputs[i], kwargs[i]), s)  # the caller's shares are read on s
    return streams, callers


def parallel_apply(
    replicas: Sequence[nn.Module],
    method: str,
    inputs: Sequence[tuple[Any, ...]],
    kwargs: Sequence[dict[str, Any]],
    devices: Sequence[torch.device],
    threads: ReplicaThreads | None = None,
    *,
    call_share: Callable[[int, Callable[..., Any], Any, Any], Any] | None = None,
) -> list[Any]:
    """Call ``getattr(replica, method)(*inputs[i], **kwargs[i])`` on every replica in parallel.

    Args:
        replicas: one module per device.
        method: the method name (``"forward"`` calls the replica itself, so hooks run).
        inputs: positional arguments per replica.
        kwargs: keyword arguments per replica.
        devices: the device of each replica.
        threads: threads kept between calls, to run the call on; by default threads are
            started for this call.
        call_share: ``call_share(i, fn, inputs[i], kwargs[i])`` runs replica ``i``'s
            method ``fn`` instead (out-of-memory splitting).

    Example:
        >>> import torch
        >>> reps = [torch.nn.Identity(), torch.nn.Identity()]
        >>> parallel_apply(reps, "forward", [(1,), (2,)], [{}, {}], [torch.device("cpu")] * 2)
        [1, 2]
    """
    n = len(replicas)
    if not (len(inputs) == len(kwargs) == len(devices) == n):
        raise ValueError(
            f"parallel_apply: expected as many inputs, kwargs and devices as replicas ({n}), "
            f"got {len(inputs)} inputs, {len(kwargs)} kwargs and {len(devices)} devices"
        )
    streams, callers = _ordered_streams(devices, inputs, kwargs)
    state = ThreadState.capture()
    if n > 1:
        seed_cuda(devices, draw_seed() if cuda_distinct(devices) else None)
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def work(i: int) -> None:
        try:
            with state.applied(), _device_context(devices[i], streams[i]), _entered(i, replicas), \
                    part_of_batch(n > 1):
                replica = replicas[i]
                fn = replica if method == "forward" else getattr(replica, method)
                results[i] = fn(*inputs[i], **kwargs[i]) if call_share is None else call_share(i, fn, inputs[i], kwargs[i])
        except BaseException as exc:
            errors[i] = exc

    if n == 1:
        work(0)
    elif any(map(takes_turns, replicas)):
        for i in range(n):  # compiled code on a torch that can't compile in threads
            work(i)
    elif threads is None or not threads.run(work, n):
        spawned = [
            threading.Thread(target=work, args=(i,), name=f"dpmethods-replica-{i}", daemon=True)
            for i in range(1, n)
        ]
        try:
            for t in spawned:
                t.start()
            work(0)  # the caller's thread runs replica 0
        finally:
            _join([t for t in spawned if t.ident is not None])
    for s, c in zip(streams, callers):
        if s is not None and c is not None and s != c:
            c.wait_stream(s)
    failed = next((i for i, e in enumerate(errors) if e is not None), None)
    if failed is not None:
        exc = errors[failed]
        errors.clear()
        try:
            raise _annotate(exc, failed, devices[failed])  # type: ignore[arg-type]
        finally:
            exc = None  # the traceback holds this frame: don't let it hold the exception too
    return results
