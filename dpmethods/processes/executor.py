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
  a thread that waits (Future.result(),        <---+--- reply and when it finished;
    exception(), wait_replies()) reads the         |    then the next frame (after a
    replies of every live executor while it waits: |    BaseException that is not an
    each resolves the oldest pending Future of     |    Exception: it leaves instead)
    its executor (its done callbacks run there);   |
    end of file or the process gone, or a reply    |
    that says the worker leaves (WorkerLeft):      |
    every pending Future fails with BrokenExecutor |
    (the jobs that had not started: NotStarted)    |

Replies are read by the threads that wait for them, one at a time: the first to wait
reads for every executor, the others wait for it to read theirs (and one of them reads
once it stops). A reader thread of our own would take the GIL from the thread that
waits at each reply, and hand it back: two thread switches per job, more than a small
job's own cost in the caller. A Future nobody waits for is resolved by the next wait of
any thread; waiting on these Futures through ``concurrent.futures.wait`` or
``as_completed`` alone reads nothing.

A job is sent at once and cannot be cancelled: its Future is running from ``submit``.
``shutdown()`` sends a stop frame: the worker runs the jobs sent before it, then
leaves through the normal exit path. A job that raised a ``BaseException`` that is not
an ``Exception`` (a ``SystemExit`` from SIGTERM) tells the worker to go: it replies,
then leaves the same way; that job's Future fails with :class:`WorkerLeft` (the job's
exception its ``raised``), never with the exception itself, which would end the caller
as if it were the caller's own, and the executor is broken at once.

Not ``concurrent.futures.ProcessPoolExecutor``: its management thread and its queue's
feeder thread take several thread switches per job in the caller, where a write on
the caller's thread costs a few microseconds; and the worker reads its jobs on the
thread that runs them, with no thread switch either.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import math
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

__all__ = ["NotStarted", "WorkerExecutor", "WorkerLeft", "ran", "wait_replies"]

_P = ParamSpec("_P")
_T = TypeVar("_T")
_STOP = b"stop"  # a frame no pickled job can be (a pickle starts with its protocol opcode)
_LIVE: weakref.WeakSet[WorkerExecutor] = weakref.WeakSet()  # stopped at interpreter exit


class WorkerLeft(cf.BrokenExecutor):
    """A job's failure when it ended its worker: it raised ``raised``, a
    ``BaseException`` that is not an ``Exception`` (a ``SystemExit`` from SIGTERM), and
    the worker left after replying."""

    def __init__(self, message: str, raised: BaseException) -> None:
        super().__init__(message)
        self.raised = raised


class NotStarted(cf.BrokenExecutor):
    """A job's failure when its worker went before it started: it waited behind another
    job, which was running (or which ended the worker)."""


class WorkerExecutor(cf.Executor):
    """One worker process running its jobs in the order submitted (see the module docstring).

    Args:
        context: a ``multiprocessing`` context (its ``Pipe`` and ``Process``).
        initializer: called in the worker with ``initargs`` before its first job.
        name: the process's name.

    Example:
        >>> from dpmethods.processes.pool import start_method  # the context workers start from
        >>> executor = WorkerExecutor(start_method(), print, ("ready",), "example")
        >>> executor.submit(bytes, b"x").result()
        b'x'
        >>> executor.shutdown()
    """

    def __init__(self, context: Any, initializer: Callable[..., None], initargs: tuple[Any, ...], name: str) -> None:
        self._send_lock = threading.Lock()  # a frame at a time; its Future joins in the same order
        self._pending: collections.deque[_Reply] = collections.deque()  # sent, not answered
        self._finished_at = 0.0  # when the worker finished its last job read (time.monotonic())
        self._broken = False
        self._shutdown = False
        self.left: BaseException | None = None  # what a job raised that ended the worker (WorkerLeft)
        ours, theirs = context.Pipe(duplex=True)
        self.process = context.Process(target=_serve, args=(theirs, initializer, initargs), name=name)
        self.process.start()
        theirs.close()  # the worker's end lives in the worker only: its exit is our end of file
        self._conn = ours
        self._out = _Outbox(ours, name)
        _LIVE.add(self)
        weakref.finalize(self, self._out.last, _STOP)  # dropped without shutdown(): the worker leaves

    def submit(self, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> cf.Future[_T]:
        """Send ``fn(*args, **kwargs)`` (``fn`` picklable: a module-level function) to the
        worker; its Future."""
        frame = pickle.dumps((fn, args, kwargs), pickle.HIGHEST_PROTOCOL)
        future = _Reply(self)
        future.set_running_or_notify_cancel()  # sent at once: it can no longer be cancelled
        with self._send_lock:
            if self._broken:
                raise cf.BrokenExecutor(f"{self.process.name} is gone (exit code {self.process.exitcode})")
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
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
        it waits behind another job, or is finished.

        A job starts when it was sent or when the job before it finished, whichever is
        later; the worker tells the second with its reply (``time.monotonic()`` is the
        host's monotonic clock, one for all its processes)."""
        try:
            first = self._pending[0]
        except IndexError:
            return None
        return self._began(first) if first is future else None

    def _began(self, first: _Reply) -> float:
        """When the worker started ``first``, the oldest job not answered."""
        return max(first.sent, self._finished_at)

    @property
    def broken(self) -> bool:
        """Whether the worker is gone, or leaving: no job can be sent to it any more."""
        return self._broken

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Tell the worker to leave after the jobs sent; ``wait``: join it."""
        with self._send_lock:
            if not self._shutdown and not self._broken:
                self._out.last(_STOP)
            self._shutdown = True
        if wait:
            self.process.join()

    def _read(self, conn_ready: bool) -> None:
        """Read one reply and resolve its Future, called by the thread that reads
        (:class:`_Inbox`) once the pipe (``conn_ready``) or the process's sentinel is ready."""
        if not conn_ready and not self._conn.poll():  # gone, with nothing left to read
            self._break("its process is gone")
            return
        try:
            frame = self._conn.recv_bytes()
        except (EOFError, OSError):
            self._break("its process is gone")
            return
        except BaseException:  # a KeyboardInterrupt inside a frame: the pipe is out of step for good
            self.process.kill()
            self._break("the caller was interrupted while reading a reply, and killed it")
            raise
        future = self._pending.popleft()
        began = self._began(future)
        try:
            ok, value, finished_at = pickle.loads(frame)
        except BaseException as exc:  # the pipe is in step: this job's reply alone is lost
            future.set_exception(exc if isinstance(exc, Exception) else
                                 RuntimeError(f"reading the reply was interrupted ({type(exc).__name__})"))
            if not isinstance(exc, Exception):
                raise
            return
        self._finished_at = min(finished_at, time.monotonic())
        future.ran = max(0.0, self._finished_at - began)
        if ok:
            future.set_result(value)
        elif isinstance(value, Exception):
            future.set_exception(value)
        else:  # the worker leaves after this reply (see _serve): nothing more will come
            self.left = value
            why = f"its job raised {type(value).__name__}, and it left"
            future.set_exception(WorkerLeft(f"{self.process.name} is gone: {why}", value))
            self._break(why, running=False)

    def _break(self, why: str, running: bool = True) -> None:
        """The worker is gone: every pending job fails, the first as the one it was
        running (``running``), the others as :class:`NotStarted`."""
        with self._send_lock:
            self._broken = True
            failed = list(self._pending)
            self._pending.clear()
        self._out.close()
        self._conn.close()
        for k, future in enumerate(failed):
            kind = cf.BrokenExecutor if k == 0 and running else NotStarted
            future.set_exception(kind(f"{self.process.name} is gone: {why}"))
        with _INBOX.changed:  # a thread waiting for a pending Future, told
            _INBOX.changed.notify_all()


class _Reply(cf.Future):  # type: ignore[type-arg]
    """A job's Future: waiting for it reads the replies (:func:`wait_replies`)."""

    def __init__(self, executor: WorkerExecutor) -> None:
        super().__init__()
        self.sent = time.monotonic()  # when it was sent (see WorkerExecutor.started)
        self.executor = executor  # that runs its job (kept alive while it can be waited on)
        self.ran: float | None = None  # seconds the worker ran its job, once its reply was read

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            wait_replies(self.done, timeout)
        return super().result(timeout=0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.done():
            wait_replies(self.done, timeout)
        return super().exception(timeout=0)


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
        # Set once closed: each send raises a copy. Raised itself, it would keep a
        # traceback, and through its frames this outbox: a reference cycle.
        self._failed: OSError | None = None
        self._closing = False

    def send(self, frame: bytes) -> None:
        """``frame`` with its length in front (as ``Connection.recv_bytes`` reads it)."""
        n = len(frame)
        with self._ready:
            if self._failed is not None:
                raise OSError(*self._failed.args)
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
                    self._failed = OSError(*exc.args)  # without exc's traceback (see __init__)
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


class _Inbox:
    """Reads the replies of every live executor for the threads that wait: one thread
    at a time reads (``reading``) until what it waits for is done, the others wait on
    ``changed``, told after each read, and one of them takes over when it stops. The
    Futures' done callbacks run in the thread that reads: they must not wait for a job."""

    def __init__(self) -> None:
        self.changed = threading.Condition(threading.Lock())  # told after each read, and when reading stops
        self.reading = False  # a thread reads (under changed)

    def wait(self, done: Callable[[], bool], timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.changed:
            while not done():
                if not self.reading:
                    self.reading = True
                    break
                left = _left(deadline)
                if left == 0.0:
                    return False
                self.changed.wait(left)
            else:
                return True
        try:
            while not done():
                left = _left(deadline)
                if self._read(left):
                    with self.changed:
                        self.changed.notify_all()
                else:  # no executor to read from: only a break can resolve it now
                    with self.changed:
                        self.changed.wait(left)
                if left == 0.0:  # what was ready is read
                    break
        finally:
            with self.changed:
                self.reading = False
                self.changed.notify_all()
        return done()

    def _read(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` for replies of any live executor, and read them; False
        if no executor is left to read from."""
        executors = [e for e in list(_LIVE) if not e._broken]
        if not executors:
            return False
        for executor, conn_ready in _ready(executors, timeout):
            if not executor._broken:
                executor._read(conn_ready)
        return True


def ran(future: cf.Future[Any]) -> float | None:
    """The seconds the worker ran ``future``'s job (from its start, as
    :meth:`WorkerExecutor.started` tells it, to its reply), None until its reply was read
    (or for a Future of another executor).

    Example:
        >>> ran(cf.Future()) is None
        True
    """
    return future.ran if isinstance(future, _Reply) else None


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _ready(executors: list[WorkerExecutor], timeout: float | None) -> list[tuple[WorkerExecutor, bool]]:
    """The executors whose pipe (True) or process's sentinel (False) is ready, waiting up
    to ``timeout``. Not the pipe alone: a process the worker forked may hold its end of
    the pipe open after it died."""
    if hasattr(select, "poll"):
        poller = select.poll()
        owner: dict[int, tuple[WorkerExecutor, bool]] = {}
        for e in executors:
            for fd, conn_ready in ((e._conn.fileno(), True), (e.process.sentinel, False)):
                owner[fd] = (e, conn_ready)
                poller.register(fd, select.POLLIN)
        ready = [owner[fd] for fd, _ in poller.poll(None if timeout is None else math.ceil(timeout * 1000))]
    else:  # pragma: no cover - Windows
        waits = {e._conn: (e, True) for e in executors} | {e.process.sentinel: (e, False) for e in executors}
        ready = [waits[w] for w in mp_connection.wait(list(waits), timeout)]
    conns = {e for e, conn_ready in ready if conn_ready}
    return [(e, c) for e, c in ready if c or e not in conns]  # a pipe with data first: read it


_INBOX = _Inbox()


def wait_replies(done: Callable[[], bool], timeout: float | None) -> bool:
    """Read the replies of every live executor until ``done()`` is true, for at most
    ``timeout`` seconds (None: no limit; 0: what is ready); ``done()``.

    ``done`` is called under a lock each time a reply was read: a check of state that
    replies change (a Future's ``done``, a queue the done callbacks fill).

    Example:
        >>> wait_replies(lambda: True, 0.0)
        True
    """
    return _INBOX.wait(done, timeout)


def _stop_all_at_exit() -> None:
    """Send every live executor its stop frame (before ``multiprocessing`` joins its
    children at interpreter exit, which would wait for workers that wait for a job)."""
    for executor in list(_LIVE):
        executor.shutdown(wait=False)


threading._register_atexit(_stop_all_at_exit)  # type: ignore[attr-defined]


def _serve(conn: Any, initializer: Callable[..., None], initargs: tuple[Any, ...]) -> None:
    """The worker process: set up, then read each job, run it and send its reply, until
    told to stop (or the caller is gone).

    A job's exception is its reply, and the worker takes its next job. A
    ``BaseException`` that is not an ``Exception`` (a SystemExit from SIGTERM during a
    job) is its reply too, and then the worker leaves through the normal exit path: it
    was told to go, and the caller's Future fails with :class:`WorkerLeft`. A SIGTERM
    while it waits for a job ends the wait with SystemExit: the same exit path.
    """
    initializer(*initargs)
    while True:
        try:
            frame = conn.recv_bytes()
        except (EOFError, OSError):  # the caller is gone
            return
        if frame == _STOP:
            return
        leave = False
        try:
            fn, args, kwargs = pickle.loads(frame)
            del frame
            reply = pickle.dumps((True, fn(*args, **kwargs), time.monotonic()), pickle.HIGHEST_PROTOCOL)
        except BaseException as exc:
            reply = _error_reply(exc)
            leave = not isinstance(exc, Exception)
        conn.send_bytes(reply)
        if leave:
            return


def _error_reply(exc: BaseException) -> bytes:
    try:
        return pickle.dumps((False, exc, time.monotonic()), pickle.HIGHEST_PROTOCOL)
    except Exception:  # the same kind, so the caller knows a worker that leaves
        error = (RuntimeError if isinstance(exc, Exception) else BaseException)(f"{type(exc).__name__}: {exc}")
        return pickle.dumps((False, error, time.monotonic()), pickle.HIGHEST_PROTOCOL)
