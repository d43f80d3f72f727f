"""One worker process of ``workers="processes"`` as the caller sees it: a :class:`Slot`.

A slot owns the process, the caller's end of its pipe, and the tickets of the
requests sent to it whose replies were not read yet, in the order they were sent.
A worker answers its requests one at a time, in that order, so the reply read next
always belongs to the oldest ticket: that is how several maps and calls share one
worker (see :mod:`dpmethods.streaming.process_pool`). When the process dies, or its
pipe is left mid-message, every ticket is answered with a ``("lost", text)`` reply,
so each map or call waiting on it raises instead of waiting for ever.
"""

from __future__ import annotations

import collections
import signal
import threading
import time
from typing import Any, NamedTuple

import torch

from dpmethods.streaming.process_io import dumps, loads
from dpmethods.streaming.process_worker import serve

__all__: list[str] = []

_STOP_S = 3.0  # how long close() lets idle workers exit before terminating them
# The exit code of a worker that found itself running an unguarded script's main module
# (see process_pool.check_not_in_spawned_main), and what its error then says.
UNGUARDED_MAIN_EXIT = 86
UNGUARDED_MAIN_EXIT_TEXT = "without `if __name__ == \"__main__\":`"


class WorkerDiedError(RuntimeError):
    """A worker process died (killed, a segfault, out of memory) while the caller waited."""


class Client:
    """One map or call's share of the pool: the replies read for it, its tickets owed.

    Its counts change in two threads at once: the thread that sends its requests, and
    whichever thread reads replies for the pool. A reply goes into the inbox and its debt
    is paid in one step, under a lock: were the debt paid while the reply was still being
    unpickled, the map would look finished (nothing owed, nothing read) and end short,
    silently.

    Example:
        >>> c = Client()
        >>> c.expect(); c.owed, c.finished()
        (1, False)
        >>> c.answer(None, "a reply"); c.owed, c.inbox.popleft(), c.finished()
        (0, (None, None, 'a reply'), True)
    """

    def __init__(self) -> None:
        self.inbox: collections.deque[tuple[Any, Any, tuple[Any, ...]]] = collections.deque()
        self.owed = 0
        self.closed = False
        self._lock = threading.Lock()

    def expect(self) -> None:
        """One more request was sent for it."""
        with self._lock:
            self.owed += 1

    def withdraw(self) -> None:
        """A request counted by :meth:`expect` was not sent after all."""
        with self._lock:
            self.owed -= 1

    def answer(self, tag: Any, reply: Any, slot: Any = None) -> None:
        """One owed reply arrived: kept in the inbox unless the client was closed."""
        with self._lock:
            if not self.closed:
                self.inbox.append((slot, tag, reply))
            self.owed -= 1

    def finished(self) -> bool:
        """Nothing owed and nothing unread: a map of this client has ended."""
        with self._lock:
            return not self.owed and not self.inbox

    def close(self) -> None:
        """Drop what was read for it; replies still owed are read and dropped on arrival."""
        with self._lock:
            self.closed = True
            self.inbox.clear()


class _Ticket(NamedTuple):
    client: Client
    tag: Any  # the client's name for the request (a batch's seq, a chunk's index)


class Slot:
    """One device entry's worker: its process, its end of the pipe, its tickets."""

    def __init__(self, index: int, device: torch.device) -> None:
        self.index, self.device = index, device
        self.process: Any = None
        self.conn: Any = None
        self.tickets: collections.deque[_Ticket] = collections.deque()
        self.key: Any = None  # what model it holds: a fingerprint, "factory", or None
        self.broken = False  # dead, or its pipe is mid-message: restart before use
        self._send_lock = threading.Lock()  # one message on the pipe at a time

    def describe(self) -> str:
        pid = self.process.pid if self.process is not None else None
        return f"worker {self.index} (pid {pid}, device {self.device})"

    def usable(self) -> bool:
        return not self.broken and self.process is not None and self.process.is_alive()

    def start(self, ctx: Any, threads: int) -> None:
        ours, theirs = ctx.Pipe(duplex=True)
        process = ctx.Process(
            target=serve, args=(theirs, self.index, str(self.device), threads),
            name=f"dpmethods-worker-{self.index}", daemon=True,
        )
        process.start()
        theirs.close()
        self.process, self.conn, self.key, self.broken = process, ours, None, False

    def send(self, client: Client, tag: Any, data: bytes) -> None:
        """Send one request for ``client``; its reply will carry ``tag``."""
        with self._send_lock:
            if not self.usable():
                raise self.died()
            self.tickets.append(_Ticket(client, tag))
            client.expect()
            try:
                self.conn.send_bytes(data)
            except (BrokenPipeError, ConnectionError, OSError, EOFError):
                self.tickets.pop()
                client.withdraw()
                raise self.died() from None
            except BaseException:
                self.tickets.pop()
                client.withdraw()
                self.broken = True  # interrupted mid-message: the pipe is unusable
                raise

    def read(self) -> None:
        """Read the next reply (the caller saw the pipe or the sentinel ready) and deliver it."""
        try:
            if not self.conn.poll(0):
                raise EOFError
            data = self.conn.recv_bytes()
        except (EOFError, ConnectionError, OSError):
            self.abandon(str(self.died()))  # an idle worker's end, too: it is then not watched
            return
        except BaseException:
            self.broken = True
            self.abandon(f"DataParallel(workers='processes'): reading the reply of {self.describe()} "
                         "was interrupted; the next use starts a fresh worker")
            raise
        ticket = self._next_ticket()
        if ticket is None:  # a reply to no request: the protocol is broken, start afresh
            self.broken = True
            return
        reply = loads(data)  # even for a closed client: its shared memory is fetched and freed
        ticket.client.answer(ticket.tag, reply, self)

    def died(self) -> WorkerDiedError:
        """The error for this slot's process being gone (joined, with its exit code)."""
        self.broken = True
        if self.process is None:
            return WorkerDiedError("DataParallel(workers='processes'): the worker processes were "
                                   "closed (dp.close()) while a map or call was using them")
        self.process.join(timeout=5)
        code = self.process.exitcode
        why = ""
        if code is not None and code < 0:
            try:
                why = f" ({signal.Signals(-code).name})"
            except ValueError:
                pass
        if code == UNGUARDED_MAIN_EXIT:
            return WorkerDiedError(
                f"DataParallel(workers='processes'): {self.describe()} stopped while starting: "
                f"spawn runs the script's main module again in each worker, and this script "
                f"starts its work {UNGUARDED_MAIN_EXIT_TEXT}, so it reached DataParallel again "
                f"there. Start the script's work under that guard (a program read from stdin "
                f"cannot use processes), or use workers='threads'"
            )
        return WorkerDiedError(f"DataParallel(workers='processes'): {self.describe()} died "
                               f"with exit code {code}{why}")

    def abandon(self, text: str) -> None:
        """Answer every ticket with ``("lost", text)``: its reply will never come."""
        self.broken = True
        while (ticket := self._next_ticket()) is not None:
            ticket.client.answer(ticket.tag, ("lost", text), self)

    def _next_ticket(self) -> _Ticket | None:
        # close() in one thread may abandon the tickets while another reads: never pop twice.
        try:
            return self.tickets.popleft()
        except IndexError:
            return None

    def stop(self) -> None:
        """Terminate and join at once (kill if needed), and forget the process."""
        if self.tickets:
            self.abandon(str(self.died()) if self.process is not None and not self.process.is_alive()
                         else "DataParallel(workers='processes'): the worker processes were closed "
                         "(dp.close()) while a map or call was using them")
        if self.process is not None:
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(timeout=2)
            if self.process.is_alive():
                self.process.kill()
            self.process.join()
        if self.conn is not None:
            self.conn.close()
        self.process = self.conn = self.key = None
        self.broken = False


def stop_all(slots: list[Slot]) -> None:
    """Ask every worker to exit, give them a moment, then terminate and join the rest.

    A worker exits on ``("stop",)`` even mid-batch, once it has received every request
    sent before it: terminating it while it fetches a request's shared memory would
    leave the caller's resource sharer a broken connection (a traceback at exit).
    """
    asked = [s for s in slots if s.usable()]
    for s in asked:
        try:
            with s._send_lock:
                s.conn.send_bytes(dumps(("stop",)))
        except (OSError, EOFError):
            pass
    deadline = time.monotonic() + _STOP_S
    for s in asked:
        s.process.join(timeout=max(0.0, deadline - time.monotonic()))
    for s in slots:
        s.stop()
