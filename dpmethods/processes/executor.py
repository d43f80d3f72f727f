"""A ``concurrent.futures.Executor`` of one worker process, on one duplex pipe.

Data flow::

  caller                                           |  the worker process
                                                   |
  submit(fn, *args) on the caller's thread:       |
    under the send lock, the Future joins the      |
    FIFO of pending ones, and (fn, args) is        |
    sent as one frame -----------------------------+--> receiver thread: reads every
                                                   |    frame at once into a local queue
                                                   |    (so a send never waits for a
                                                   |    busy worker)
                                                   |         |
                                                   |         v
                                                   |    main thread: runs the jobs in
                                                   |    turn: what fn(*args) returns, or
                                                   |    the exception it raised (any
  reader thread: each reply resolves the oldest <--+--- BaseException: SystemExit too)
    pending Future (its done callbacks run here);  |
    end of file or the process gone: every         |
    pending Future fails with BrokenExecutor       |

A job is sent at once and cannot be cancelled: its Future is running from ``submit``.
``shutdown()`` sends a stop frame: the worker finishes the job it runs, skips the ones
it holds, and leaves through the normal exit path; their Futures fail when its end of
the pipe closes.

Not ``concurrent.futures.ProcessPoolExecutor``: its management thread and its queue's
feeder thread take several thread switches per job in the caller (about 0.2 ms of CPU
on a 2-core host, twice a thread replica's whole batch), where one send on the
caller's thread and one reader thread cost a few tens of microseconds.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import pickle
import queue
import select
import signal
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing import connection as mp_connection
from typing import Any, ParamSpec, TypeVar

__all__ = ["WorkerExecutor", "serve"]

_P = ParamSpec("_P")
_T = TypeVar("_T")
_STOP = b"stop"  # a frame no pickled job can be (a pickle starts with its protocol opcode)
_LIVE: weakref.WeakSet[WorkerExecutor] = weakref.WeakSet()  # stopped at interpreter exit


class WorkerExecutor(cf.Executor):
    """One worker process running its jobs in the order submitted (see the module docstring).

    Args:
        context: a ``multiprocessing`` context (its ``Pipe`` and ``Process``).
        initializer: called in the worker with ``initargs`` before its first job.
        name: the process's name.

    Example:
        >>> import multiprocessing
        >>> executor = WorkerExecutor(multiprocessing.get_context("spawn"), print, ("ready",), "example")
        >>> executor.submit(bytes, b"x").result()
        b'x'
        >>> executor.shutdown()
    """

    def __init__(self, context: Any, initializer: Callable[..., None], initargs: tuple[Any, ...], name: str) -> None:
        self._send_lock = threading.Lock()  # a frame at a time; its Future joins in the same order
        self._pending: collections.deque[cf.Future[Any]] = collections.deque()
        self._since = time.monotonic()  # when the oldest pending job started
        self._broken = False
        self._shutdown = False
        ours, theirs = context.Pipe(duplex=True)
        self.process = context.Process(target=serve, args=(theirs, initializer, initargs), name=name)
        self.process.start()
        theirs.close()  # the worker's end lives in the worker only: its exit is our end of file
        self._conn = ours
        _LIVE.add(self)
        weakref.finalize(self, _send_stop, ours)  # dropped without shutdown(): the worker leaves
        threading.Thread(target=_read, args=(weakref.ref(self), ours, self.process.sentinel),
                         name=f"{name}-reader", daemon=True).start()

    def submit(self, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> cf.Future[_T]:
        """Send ``fn(*args, **kwargs)`` (``fn`` picklable: a module-level function) to the
        worker; its Future."""
        frame = pickle.dumps((fn, args, kwargs), pickle.HIGHEST_PROTOCOL)
        future: cf.Future[_T] = cf.Future()
        future.set_running_or_notify_cancel()  # sent at once: it can no longer be cancelled
        with self._send_lock:
            if self._broken:
                raise cf.BrokenExecutor(f"{self.process.name} is gone (exit code {self.process.exitcode})")
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if not self._pending:
                self._since = time.monotonic()  # an idle worker starts it now
            self._pending.append(future)
            try:
                self._conn.send_bytes(frame)
            except OSError:
                self._pending.pop()
                raise cf.BrokenExecutor(f"{self.process.name} is gone (exit code {self.process.exitcode})") from None
        return future

    def started(self, future: cf.Future[Any]) -> float | None:
        """When the worker started ``future``'s job (``time.monotonic()``), or None while
        it waits behind another job, or is finished."""
        try:
            return self._since if self._pending[0] is future else None
        except IndexError:
            return None

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Tell the worker to leave after the job it runs; ``wait``: join it."""
        with self._send_lock:
            if not self._shutdown and not self._broken:
                try:
                    self._conn.send_bytes(_STOP)
                except OSError:
                    pass
            self._shutdown = True
        if wait:
            self.process.join()

    def _resolve(self, frame: bytes) -> None:
        future = self._pending.popleft()
        self._since = time.monotonic()  # the next one starts as this one ends
        ok, value = pickle.loads(frame)
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def _break(self) -> None:
        with self._send_lock:
            self._broken = True
            failed = list(self._pending)
            self._pending.clear()
        self._conn.close()
        for future in failed:
            future.set_exception(cf.BrokenExecutor(f"{self.process.name} is gone"))


def _readable(conn: Any, sentinel: int) -> Callable[[], bool]:
    """A wait for the next reply: True once ``conn`` has one (or its end of file),
    False once the process is gone with nothing left to read. Not a read alone: a
    process the worker forked may hold its end of the pipe open after it died."""
    if hasattr(select, "poll"):
        poller = select.poll()  # made once: one system call a wait
        poller.register(conn.fileno(), select.POLLIN)
        poller.register(sentinel, select.POLLIN)
        fd = conn.fileno()
        return lambda: any(ready == fd for ready, _ in poller.poll())
    return lambda: conn in mp_connection.wait([conn, sentinel])  # pragma: no cover - Windows


def _read(ref: weakref.ref[WorkerExecutor], conn: Any, sentinel: int) -> None:
    """The caller's reader thread: replies, in order, until the worker is gone."""
    try:
        readable = _readable(conn, sentinel)
        while True:
            if not readable():
                break
            frame = conn.recv_bytes()
            executor = ref()
            if executor is None:
                return
            executor._resolve(frame)
            del executor
    except (EOFError, OSError):
        pass
    executor = ref()
    if executor is not None:
        executor._break()


def _send_stop(conn: Any) -> None:
    try:
        conn.send_bytes(_STOP)
    except OSError:
        pass


def stop_all_at_exit() -> None:
    """Send every live executor its stop frame (before ``multiprocessing`` joins its
    children at interpreter exit, which would wait for workers that wait for a job)."""
    for executor in list(_LIVE):
        executor.shutdown(wait=False)


threading._register_atexit(stop_all_at_exit)  # type: ignore[attr-defined]


def _receive(conn: Any, jobs: queue.SimpleQueue[bytes | None], stopping: threading.Event) -> None:
    """The worker's receiver thread: every frame into ``jobs`` as it arrives."""
    if hasattr(signal, "pthread_sigmask"):  # signals go to the main thread, which handles them
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        while True:
            frame = conn.recv_bytes()
            if frame == _STOP:
                stopping.set()
                break
            jobs.put(frame)
    except (EOFError, OSError):  # the caller is gone
        stopping.set()
    jobs.put(None)


def serve(conn: Any, initializer: Callable[..., None], initargs: tuple[Any, ...]) -> None:
    """The worker process: set up, then run each job and send its reply, until told to stop.

    A job's exception, any ``BaseException`` (a SystemExit from SIGTERM during a job
    among them), is its reply; the worker takes its next job.
    """
    initializer(*initargs)
    jobs: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    stopping = threading.Event()
    threading.Thread(target=_receive, args=(conn, jobs, stopping), name="dpmethods-receiver", daemon=True).start()
    while True:
        frame = jobs.get()
        if frame is None or stopping.is_set():
            return
        try:
            fn, args, kwargs = pickle.loads(frame)
            del frame
            reply = pickle.dumps((True, fn(*args, **kwargs)), pickle.HIGHEST_PROTOCOL)
        except BaseException as exc:
            reply = _error_reply(exc)
        conn.send_bytes(reply)


def _error_reply(exc: BaseException) -> bytes:
    try:
        return pickle.dumps((False, exc), pickle.HIGHEST_PROTOCOL)
    except Exception:
        return pickle.dumps((False, RuntimeError(f"{type(exc).__name__}: {exc}")), pickle.HIGHEST_PROTOCOL)
