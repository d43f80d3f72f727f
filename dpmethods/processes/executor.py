"""A ``concurrent.futures.Executor`` of one worker process, on one duplex pipe.

Data flow::

  caller                                           |  the worker process
                                                   |
  submit(fn, *args) on the caller's thread:        |
    under the send lock, the Future joins the      |
    FIFO of pending ones, and (fn, args) is        |
    written as one frame, without waiting ---------+--> main thread: reads a frame,
    (what the pipe cannot take at once goes,       |    runs the job: what fn(*args)
    in order, to a sender thread that waits        |    returns, or the exception it
    for room: a busy worker never blocks submit)   |    raised (any BaseException:
                                                   |    SystemExit too), and sends the
  reader thread: each reply resolves the oldest <--+--- reply; then the next frame
    pending Future (its done callbacks run here);  |
    end of file or the process gone: every         |
    pending Future fails with BrokenExecutor       |

A job is sent at once and cannot be cancelled: its Future is running from ``submit``.
``shutdown()`` sends a stop frame: the worker runs the jobs sent before it, then
leaves through the normal exit path.

Not ``concurrent.futures.ProcessPoolExecutor``: its management thread and its queue's
feeder thread take several thread switches per job in the caller (about 0.2 ms of CPU
on a 2-core host, twice a thread replica's whole batch), where a write on the caller's
thread and one reader thread cost a few tens of microseconds; and the worker reads its
jobs on the thread that runs them, with no thread switch either.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import os
import pickle
import select
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing import connection as mp_connection
from typing import Any, ParamSpec, TypeVar

__all__ = ["WorkerExecutor"]

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
        self.process = context.Process(target=_serve, args=(theirs, initializer, initargs), name=name)
        self.process.start()
        theirs.close()  # the worker's end lives in the worker only: its exit is our end of file
        self._conn = ours
        self._out = _Outbox(ours, name)
        _LIVE.add(self)
        weakref.finalize(self, self._out.last, _STOP)  # dropped without shutdown(): the worker leaves
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
                self._out.send(frame)
            except OSError:
                self._pending.pop()
                raise cf.BrokenExecutor(f"{self.process.name} is gone (exit code {self.process.exitcode})") from None
        return future

    def pending(self) -> list[cf.Future[Any]]:
        """The Futures of the jobs sent and not answered yet, in order."""
        with self._send_lock:
            return list(self._pending)

    def started(self, future: cf.Future[Any]) -> float | None:
        """When the worker started ``future``'s job (``time.monotonic()``), or None while
        it waits behind another job, or is finished."""
        try:
            return self._since if self._pending[0] is future else None
        except IndexError:
            return None

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Tell the worker to leave after the jobs sent; ``wait``: join it."""
        with self._send_lock:
            if not self._shutdown and not self._broken:
                self._out.last(_STOP)
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
        self._out.close()
        self._conn.close()
        for future in failed:
            future.set_exception(cf.BrokenExecutor(f"{self.process.name} is gone"))


class _Outbox:
    """The caller's end of the pipe for sending: each frame written at once from the
    thread that sends it, as far as the pipe takes it without waiting; the rest, and
    every frame after it while any is left, written by a sender thread (started when
    first needed) that waits for room. Frames go in the order sent; called under the
    executor's send lock."""

    def __init__(self, conn: Any, name: str) -> None:
        self._conn, self._name = conn, name
        self._socket: socket.socket | None = None
        if hasattr(socket, "MSG_DONTWAIT") and hasattr(socket, "AF_UNIX"):  # else every frame waits its turn
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(conn.fileno()))
        self._left: collections.deque[Any] = collections.deque()  # for the sender thread, in order
        self._ready = threading.Condition(threading.Lock())
        self._sender: threading.Thread | None = None
        self._failed: OSError | None = None  # set once closed: a send raises it
        self._closing = False

    def send(self, frame: bytes) -> None:
        """``frame`` with its length in front (as ``Connection.recv_bytes`` reads it)."""
        n = len(frame)
        with self._ready:
            if self._failed is not None:
                raise self._failed
            data: Any = frame  # as it is where Connection.send_bytes writes it (Windows)
            if self._socket is not None:
                header = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
                sent = 0
                if not self._left:
                    try:  # header and frame in one write, without copying the frame
                        sent = self._socket.sendmsg([header, frame], [], socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        pass
                    if sent == len(header) + n:
                        return
                data = memoryview(header + frame)[sent:]  # the rest, for the sender thread
            self._left.append(data)
            if self._sender is None:
                self._sender = threading.Thread(target=self._drain, name=f"{self._name}-sender", daemon=True)
                self._sender.start()
            self._ready.notify()

    def last(self, frame: bytes) -> None:
        """Send ``frame``, then close once everything is written."""
        try:
            self.send(frame)
        except OSError:
            pass
        with self._ready:
            self._closing = True
            if self._sender is None:
                self._close()
            else:
                self._ready.notify()

    def _drain(self) -> None:
        while True:
            with self._ready:
                while not self._left and not self._closing:
                    self._ready.wait()
                if not self._left:  # closing, and everything is written
                    self._close()
                    return
                data = self._left[0]  # stays first while it is written: later frames queue behind
            try:
                if self._socket is not None:
                    self._socket.sendall(data)
                else:  # pragma: no cover - Windows
                    self._conn.send_bytes(data)
            except OSError as exc:  # the worker is gone: the reader fails its Futures
                with self._ready:
                    self._failed = exc
                    self._left.clear()
                    self._close()
                return
            with self._ready:
                self._left.popleft()

    def close(self) -> None:
        """Close at once: the worker is gone, whatever is left unsent is dropped."""
        with self._ready:
            self._failed = self._failed or OSError("the worker is gone")
            self._left.clear()
            self._closing = True
            self._close()
            self._ready.notify()

    def _close(self) -> None:  # under self._ready
        self._failed = self._failed or OSError("sent its last frame")
        if self._socket is not None:
            self._socket.close()


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


def _stop_all_at_exit() -> None:
    """Send every live executor its stop frame (before ``multiprocessing`` joins its
    children at interpreter exit, which would wait for workers that wait for a job)."""
    for executor in list(_LIVE):
        executor.shutdown(wait=False)


threading._register_atexit(_stop_all_at_exit)  # type: ignore[attr-defined]


def _serve(conn: Any, initializer: Callable[..., None], initargs: tuple[Any, ...]) -> None:
    """The worker process: set up, then read each job, run it and send its reply, until
    told to stop (or the caller is gone).

    A job's exception, any ``BaseException`` (a SystemExit from SIGTERM during a job
    among them), is its reply; the worker takes its next job. A SIGTERM while it waits
    for a job ends the wait with SystemExit: the normal exit path.
    """
    initializer(*initargs)
    while True:
        try:
            frame = conn.recv_bytes()
        except (EOFError, OSError):  # the caller is gone
            return
        if frame == _STOP:
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
