"""The worker processes of ``workers="processes"``: one per device entry, kept with the wrapper.

The first map or call that needs them starts them (``spawn``: never ``fork``, which
breaks CUDA and threads); later ones reuse them. Each worker gets the module once, as
one shared-memory copy of its tensors (see :mod:`dpmethods.streaming.process_io`), or builds it
with the wrapper's ``factory``; when the module's
:func:`~dpmethods.core.replicate.fingerprint` changes (parameters, buffers, attributes,
hooks), the next map or call sends it again.

One map or call uses the pool at a time. A map stopped early (``break``, ``close()``,
an error) leaves its running batches to finish; their results are read and dropped
when the pool is next used, so stopping never waits. The caller waits on each
worker's pipe and on its process sentinel together, so a worker that dies is seen at
once, and the error names it and its exit code; the next use starts a fresh one.
``close()``, garbage collection of the pool and interpreter exit stop and join every
worker (terminating one that does not exit within a few seconds).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import weakref
from multiprocessing import connection as mp_connection
from typing import Any

import torch
from torch import Tensor, nn

from dpmethods.core.parallel_apply import _ThreadState, add_note
from dpmethods.core.replicate import fingerprint
from dpmethods.streaming.process_io import check_factory as check_factory  # for DataParallel
from dpmethods.streaming.process_io import dumps, loads, model_payloads
from dpmethods.streaming.process_worker import serve
from dpmethods.types import tree as _tree

__all__: list[str] = []

WORKERS = ("threads", "processes")
START_METHOD = "spawn"
_LOG = logging.getLogger("dpmethods")
_POLL_S = 1.0  # a waiting caller wakes this often (Ctrl-C lands promptly)
_STOP_S = 3.0  # how long close() lets idle workers exit before terminating them


def check_workers(value: Any, name: str = "workers") -> str:
    """``value`` if it is ``"threads"`` or ``"processes"``; else a ``ValueError``.

    Example:
        >>> check_workers("processes")
        'processes'
    """
    if not isinstance(value, str) or value not in WORKERS:
        raise ValueError(
            f"{name}: expected 'threads' or 'processes', got {type(value).__name__} {value!r}"
        )
    return value


class WorkerDiedError(RuntimeError):
    """A worker process died (killed, a segfault, out of memory) while the caller waited."""


class _Slot:
    """One device entry's worker: its process, its end of the pipe, its replies owed."""

    def __init__(self, index: int, device: torch.device) -> None:
        self.index, self.device = index, device
        self.process: Any = None
        self.conn: Any = None
        self.owed = 0  # requests sent whose replies were not read yet
        self.key: Any = None  # what model it holds: a fingerprint, "factory", or None
        self.broken = False  # dead, or its pipe is mid-message: restart before use

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
        self.process, self.conn, self.owed, self.key, self.broken = process, ours, 0, None, False

    def send(self, data: bytes) -> None:
        try:
            self.conn.send_bytes(data)
        except (BrokenPipeError, ConnectionError, OSError, EOFError):
            raise self.died() from None
        except BaseException:
            self.broken = True  # interrupted mid-message
            raise
        self.owed += 1

    def read(self) -> tuple[Any, ...]:
        """The next reply (the caller saw the pipe or the sentinel ready)."""
        try:
            if not self.conn.poll(0):
                raise EOFError
            data = self.conn.recv_bytes()
        except (EOFError, ConnectionError, OSError):
            raise self.died() from None
        except BaseException:
            self.broken = True
            raise
        self.owed -= 1
        return loads(data)  # type: ignore[no-any-return]

    def died(self) -> WorkerDiedError:
        self.broken = True
        self.process.join(timeout=5)
        code = self.process.exitcode
        why = ""
        if code is not None and code < 0:
            try:
                why = f" ({signal.Signals(-code).name})"
            except ValueError:
                pass
        error = WorkerDiedError(f"DataParallel(workers='processes'): {self.describe()} died "
                                f"with exit code {code}{why}")
        error.slot = self  # type: ignore[attr-defined]
        return error

    def stop(self) -> None:
        """Terminate and join at once (kill if needed), and forget the process."""
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
        self.owed, self.broken = 0, False


def _stop_all(slots: list[_Slot]) -> None:
    """Ask idle workers to exit, give them a moment, then terminate and join the rest."""
    for s in slots:
        if s.usable() and s.owed == 0:
            try:
                s.conn.send_bytes(dumps(("stop",)))
            except (OSError, EOFError):
                pass
    deadline = time.monotonic() + _STOP_S
    for s in slots:
        if s.process is not None and s.owed == 0 and not s.broken:
            s.process.join(timeout=max(0.0, deadline - time.monotonic()))
    for s in slots:
        s.stop()


def wait_any(slots: list[_Slot]) -> tuple[_Slot, tuple[Any, ...]]:
    """The next reply from any of ``slots``, each owing one; ``WorkerDiedError`` if one died."""
    if any(s.conn is None for s in slots):
        raise RuntimeError(
            "DataParallel(workers='processes'): the worker processes were closed "
            "(dp.close()) while a map or call was using them"
        )
    conns = {s.conn: s for s in slots}
    sentinels = {s.process.sentinel: s for s in slots}
    while True:
        ready = mp_connection.wait([*conns, *sentinels], timeout=_POLL_S)
        for r in ready:
            slot = conns.get(r) or sentinels.get(r)  # type: ignore[call-overload]
            if slot is not None:
                return slot, slot.read()


def remote_error(msg: tuple[Any, ...], where: str, slot: _Slot) -> BaseException:
    """The exception of a ``("failed", seq, error, traceback)`` reply, with a note."""
    _, _, error, text = msg
    try:
        exc = loads(error)
    except Exception as e:  # pragma: no cover - _failure checks it loads
        exc = RuntimeError(f"(the worker's exception could not be rebuilt: {e!r})")
    return add_note(exc, f"dpmethods: {where} on {slot.describe()}; the worker's traceback:\n{text}")


def received(obj: Any, device: torch.device | None) -> Any:
    """An output as the caller keeps it: on ``device``, and owning its CUDA memory."""
    spec, leaves = _tree.flatten(obj)
    if not any(isinstance(t, Tensor) for t in leaves):
        return obj
    out = []
    for t in leaves:
        if isinstance(t, Tensor):
            moved = t.to(device) if device is not None else t
            # A CUDA tensor from a worker holds the worker's memory (CUDA IPC): copy it.
            t = moved.clone() if moved is t and t.is_cuda else moved
        out.append(t)
    return _tree.unflatten(spec, out)


class ProcessPool:
    """The wrapper's worker processes, one per device; see the module docstring.

    Args:
        devices: one worker per entry (``["cpu"] * 2`` gives two CPU workers).
        factory: if given, each worker calls it to build its model; the module is
            then never sent (and changes to it are not seen).

    Example:
        >>> import torch
        >>> pool = ProcessPool([torch.device("cpu")] * 2)
        >>> len(pool.slots), pool.started()
        (2, False)
        >>> pool.close()
    """

    def __init__(self, devices: list[torch.device], factory: Any = None) -> None:
        self.slots = [_Slot(i, d) for i, d in enumerate(devices)]
        self.factory = factory
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _stop_all, self.slots)

    def started(self) -> bool:
        return any(s.process is not None for s in self.slots)

    def close(self) -> None:
        """Stop and join every worker; the next :meth:`open` starts fresh ones."""
        _stop_all(self.slots)

    def open(self, module: nn.Module) -> float:
        """Hold the pool for one map or call, with every worker running ``module``'s state.

        Returns the seconds spent starting workers (0 if none had to start).
        """
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(
                "DataParallel(workers='processes'): the worker processes are busy with "
                "another map or call of this wrapper (one at a time); finish or close() "
                "that map first, or pass workers='threads' to this one"
            )
        try:
            return self._ready(module)
        except BaseException:
            self._lock.release()
            raise

    def release(self) -> None:
        self._lock.release()

    def _ready(self, module: nn.Module) -> float:
        t0 = time.perf_counter()
        for s in self.slots:
            # Replies of a map stopped early: read (so their shared memory is freed) and dropped.
            while s.owed and s.usable():
                try:
                    wait_any([s])
                except WorkerDiedError:
                    break
        fresh = [s for s in self.slots if not s.usable()]
        key = "factory" if self.factory is not None else fingerprint(module)
        stale = [s for s in self.slots if s in fresh or s.key != key]
        # Pickled before any worker starts: a module that can't be sent fails at once.
        messages = self._model_messages(module, stale) if stale else []
        if fresh:
            ctx = torch.multiprocessing.get_context(START_METHOD)
            threads = max(1, torch.get_num_threads() // len(self.slots))
            for s in fresh:
                s.stop()
                s.start(ctx, threads)
        if stale:
            self._send_model(stale, messages)
            for s in stale:
                s.key = key
        if not fresh:
            return 0.0
        elapsed = time.perf_counter() - t0
        _LOG.debug(
            "dpmethods: started %d worker processes (%s) in %.2f s", len(fresh), START_METHOD, elapsed
        )
        return elapsed

    def _model_messages(self, module: nn.Module, slots: list[_Slot]) -> list[bytes]:
        if self.factory is not None:
            return [dumps(("factory", self.factory, s.device)) for s in slots]
        payloads = model_payloads(module, len(slots))
        return [dumps(("model", p, s.device)) for p, s in zip(payloads, slots)]

    def _send_model(self, slots: list[_Slot], messages: list[bytes]) -> None:
        for s, m in zip(slots, messages):
            s.send(m)
        messages.clear()
        waiting = list(slots)
        while waiting:
            slot, msg = wait_any(waiting)
            waiting.remove(slot)
            if msg[0] == "failed":
                for s in waiting:  # a fresh start for all: their replies are owed
                    s.broken = True
                slot.broken = True
                hint = (
                    "while building its model (a class defined in __main__ of an interactive "
                    "session cannot be imported by a spawned process: define it in a module, or "
                    "pass factory=, or use workers='threads')"
                )
                raise remote_error(msg, f"DataParallel(workers='processes'): raised {hint}", slot)


def pool_for(wrapper: Any) -> ProcessPool:
    """The wrapper's pool, made (not started) on first use."""
    pool = wrapper.__dict__.get("_process_pool")
    if pool is None:
        pool = wrapper.__dict__["_process_pool"] = ProcessPool(
            list(wrapper._devices), wrapper.__dict__.get("_dpm_factory")
        )
    return pool  # type: ignore[no-any-return]


def close_pool(wrapper: Any) -> None:
    """Stop and join the wrapper's workers, if it has any."""
    pool = wrapper.__dict__.pop("_process_pool", None)
    if pool is not None:
        pool.close()


def call_chunks(
    wrapper: Any, name: str, inputs: Any, kwargs: Any
) -> list[Any]:
    """Run one scattered call: chunk i on worker i, outputs in chunk order (for gather)."""
    pool = pool_for(wrapper)
    pool.open(wrapper.module)
    try:
        state = _ThreadState.capture()
        slots = pool.slots[: len(inputs)]
        for s, a, k in zip(slots, inputs, kwargs):
            try:
                data = dumps(("run", s.index, name, tuple(a), dict(k), state))
            except Exception as exc:
                raise TypeError(
                    f"DataParallel.{name}(workers='processes'): its arguments cannot be sent "
                    f"to a worker process: {type(exc).__name__}: {exc}; use workers='threads'"
                ) from exc
            s.send(data)
        outputs: list[Any] = [None] * len(slots)
        waiting = list(slots)
        while waiting:
            try:
                slot, msg = wait_any(waiting)
            except WorkerDiedError as exc:
                raise add_note(exc, f"dpmethods: while running DataParallel.{name}'s chunk "
                               f"{exc.slot.index}; the next call starts a fresh worker") from None  # type: ignore[attr-defined]
            waiting.remove(slot)
            if msg[0] == "failed":
                raise remote_error(msg, f"DataParallel.{name}: raised in chunk {slot.index}", slot)
            outputs[slot.index] = received(msg[2], None)
        return outputs
    finally:
        pool.release()
