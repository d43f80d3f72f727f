"""The worker processes of ``workers="processes"``: one per device entry, kept with the wrapper.

The first map or call that needs them starts them (``spawn``: never ``fork``, which
breaks CUDA and threads); later ones reuse them. Each worker gets the module once, as
one shared-memory copy of its tensors (see :mod:`dpmethods.streaming.process_io`), or builds it
with the wrapper's ``factory``; when the module's
:func:`~dpmethods.core.replicate.fingerprint` changes (parameters, buffers, attributes,
hooks), the next map or call sends it again.

Maps and calls share the workers, as they share a thread wrapper's replicas: a call
inside a loop over a map, or two maps zipped together, each get their own
:class:`~dpmethods.streaming.process_slot.Client`. Each worker answers its requests in
the order they were sent, so every reply is delivered to the client whose request it
answers, whoever reads it. One caller thread reads at a time; it waits on every busy
worker's pipe and on its process sentinel together, so a worker that dies is seen at
once, and every request it held is answered with an error naming it and its exit code;
the next use starts a fresh one. A map stopped early (``break``, ``close()``, an error)
leaves its running batches to finish: their replies are read and dropped, so stopping
never waits. ``close()``, garbage collection of the pool and interpreter exit stop and
join every worker (terminating one that does not exit within a few seconds).
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
import weakref
from multiprocessing import connection as mp_connection
from typing import Any

import torch
from torch import Tensor, nn

from dpmethods._loading import load_pending
from dpmethods.core.parallel_apply import _ThreadState, add_note
from dpmethods.core.replicate import fingerprint
from dpmethods.core.seeding import draw_seed, replica_seed
from dpmethods.streaming.process_io import check_factory as check_factory  # for DataParallel
from dpmethods.streaming.process_io import dumps, loads, model_payloads
from dpmethods.streaming.process_slot import (
    UNGUARDED_MAIN_EXIT,
    UNGUARDED_MAIN_EXIT_TEXT,
    Client,
    Slot,
    WorkerDiedError,
    stop_all,
)
from dpmethods.streaming.process_state import state_digest
from dpmethods.streaming.process_worker import give
from dpmethods.types import tree as _tree
from dpmethods.types.coupled_modules import marks

__all__: list[str] = []

WORKERS = ("threads", "processes")
START_METHOD = "spawn"
_LOG = logging.getLogger("dpmethods")
_POLL_S = 1.0  # a waiting caller wakes this often (Ctrl-C lands promptly)
_MODEL_HINT = (
    "while building its model (a class defined in __main__ of an interactive session, or "
    "inside `if __name__ == \"__main__\":`, cannot be imported by a spawned process: define "
    "it at the top level of a module, or pass factory=, or use workers='threads')"
)
_START_HINT = (
    "dpmethods: a worker that dies while it starts has usually failed in multiprocessing's "
    "spawn start-up (its traceback is on stderr, above): spawn runs the main module again "
    "in each worker, so a script must start its work under `if __name__ == \"__main__\":`, "
    "and a program read from stdin cannot be run again; run it from a file with that guard, "
    "or use workers='threads'"
)


def _start_failure(exc: WorkerDiedError, fresh: bool) -> BaseException:
    """A worker that died while it started: the hint, unless its exit code said why."""
    return add_note(exc, _START_HINT) if fresh and UNGUARDED_MAIN_EXIT_TEXT not in str(exc) else exc


def check_not_in_spawned_main() -> None:
    """Leave a worker process quietly if it is running an unguarded script's main module.

    ``spawn`` runs the script's main module again in each worker; a script without
    ``if __name__ == "__main__":`` then reaches its map or call again there, whose own
    workers multiprocessing would refuse to start (a traceback from each worker). The
    worker exits instead, with :data:`UNGUARDED_MAIN_EXIT`, and the caller's error says why.
    """
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise SystemExit(UNGUARDED_MAIN_EXIT)


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


def reply_error(msg: tuple[Any, ...], slot: Slot, raised: str, running: str) -> BaseException:
    """The exception of a ``("failed", seq, error, traceback)`` or ``("lost", text)`` reply.

    ``raised`` and ``running`` name the request in the note of each: ``"DataParallel.map:
    raised in batch 3"`` and ``"batch 3 of DataParallel.map"``.
    """
    if msg[0] == "lost":
        return add_note(WorkerDiedError(msg[1]), f"dpmethods: while running {running}; the next "
                        "map or call starts a fresh worker")
    _, _, error, text, warned = msg
    give(warned)
    try:
        exc = loads(error)
    except Exception as e:  # pragma: no cover - the worker checks it loads
        exc = RuntimeError(f"(the worker's exception could not be rebuilt: {e!r})")
    return add_note(exc, f"dpmethods: {raised} on {slot.describe()}; the worker's traceback:\n{text}")


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
        self.slots = [Slot(i, d) for i, d in enumerate(devices)]
        self.factory = factory
        self._setup = threading.RLock()  # one start-up or model update at a time
        self._cond = threading.Condition()
        self._reading = False  # a caller thread is waiting on the pipes
        self._seen: list[Any] = []  # what the workers' model was built from (see prepare)
        self._finalizer = weakref.finalize(self, stop_all, self.slots)

    def started(self) -> bool:
        return any(s.process is not None for s in self.slots)

    def close(self) -> None:
        """Stop and join every worker; the next :meth:`prepare` starts fresh ones."""
        with self._setup:
            stop_all(self.slots)

    def prepare(self, module: nn.Module, *, start: bool = True) -> float:
        """Bring every worker to ``module``'s state, starting missing ones if ``start``.

        Returns the seconds spent starting workers (0 if none had to start). With
        ``start=False`` (before each batch of a running map) only live workers whose
        model is stale are sent the module again: a dead one is its map's error.
        """
        with self._setup:
            t0 = time.perf_counter()
            fresh = [s for s in self.slots if not s.usable()] if start else []
            # The fingerprint sees assignments by identity; the digest, attribute objects
            # edited in place (a config) and requires_grad flags, which a worker's copy
            # would not share.
            load_pending()  # the integrations' rules for what stays in this process
            marked = marks(module)  # the worker marks them too: its replicas warn as threads do
            state: Any = (fingerprint(module), state_digest(module)) if self.factory is None else "factory"
            key = (state, tuple(marked.items()))
            stale = [s for s in self.slots if s in fresh or (s.key != key and s.usable())]
            if not stale:
                return 0.0
            # Pickled before any worker starts: a module that can't be sent fails at once.
            messages = self._model_messages(module, stale, marked)
            if fresh:
                ctx = torch.multiprocessing.get_context(START_METHOD)
                threads = max(1, torch.get_num_threads() // len(self.slots))
                for s in fresh:
                    s.stop()
                    s.start(ctx, threads)
            self._send_model(stale, messages, key, fresh)
            # The fingerprint holds identities: keep what it saw alive, so no new object
            # can take an old one's id (and its place in the fingerprint) unnoticed.
            self._seen = _identities(module)
            if not fresh:
                return 0.0
            elapsed = time.perf_counter() - t0
            _LOG.debug("dpmethods: started %d worker processes (%s) in %.2f s",
                       len(fresh), START_METHOD, elapsed)
            return elapsed

    def _model_messages(self, module: nn.Module, slots: list[Slot], marked: dict[type, str]) -> list[bytes]:
        if self.factory is not None:
            return [dumps(("factory", self.factory, s.device, marked)) for s in slots]
        payloads = model_payloads(module, len(slots))
        return [dumps(("model", p, s.device, marked)) for p, s in zip(payloads, slots)]

    def _send_model(
        self, slots: list[Slot], messages: list[bytes], key: Any, fresh: list[Slot]
    ) -> None:
        # A client of its own: the replies of the caller's batches are not mixed in. A
        # worker still running earlier requests builds the new model after them.
        client = Client()
        for s, m in zip(slots, messages):
            s.key = None  # until it answers "ready"
            try:
                s.send(client, "model", m)
            except WorkerDiedError as exc:
                raise _start_failure(exc, s in fresh) from None
        messages.clear()
        failure = None
        for _ in slots:
            slot, _, msg = self.reply(client)
            if msg[0] == "ready":
                give(msg[1])
                slot.key = key
            elif failure is None and msg[0] == "lost":  # it died: its exit code says why
                failure = _start_failure(WorkerDiedError(msg[1]), slot in fresh)
            elif failure is None:
                failure = reply_error(
                    msg, slot, f"DataParallel(workers='processes'): raised {_MODEL_HINT}", ""
                )
        if failure is not None:
            raise failure from None

    def submit(self, client: Client, slot: Slot, tag: Any, data: bytes) -> None:
        """Send one request of ``client`` to ``slot``; :meth:`reply` returns its answer."""
        slot.send(client, tag, data)

    def reply(self, client: Client) -> tuple[Slot, Any, tuple[Any, ...]]:
        """The next ``(slot, tag, reply)`` for ``client``, reading for others meanwhile."""
        while True:
            with self._cond:
                while not client.inbox and self._reading:
                    self._cond.wait(_POLL_S)
                if client.inbox:
                    return client.inbox.popleft()
                if client.finished():
                    raise RuntimeError("DataParallel(workers='processes'): waiting for a reply "
                                       "with no request in flight")
                self._reading = True
            try:
                self._read_one()
            finally:
                with self._cond:
                    self._reading = False
                    self._cond.notify_all()

    def _read_one(self) -> None:
        busy = [s for s in self.slots if s.tickets]
        closed = [s for s in busy if s.conn is None]
        for s in closed:
            s.abandon(str(s.died()))
        if closed:
            return
        # Every live pipe, not only the busy ones: another thread may send a request
        # meanwhile, and its reply must wake this wait, not the next poll.
        conns = {s.conn: s for s in self.slots if s.conn is not None and (s.tickets or not s.broken)}
        sentinels = {s.process.sentinel: s for s in busy}
        for ready in mp_connection.wait([*conns, *sentinels], timeout=_POLL_S):
            slot = conns.get(ready) or sentinels.get(ready)  # type: ignore[call-overload]
            if slot is not None:
                slot.read()
                return


def _identities(module: nn.Module) -> list[Any]:
    return [v for m in module.modules() for d in (m.__dict__, m._parameters, m._buffers) for v in d.values()]


def pool_for(wrapper: Any) -> ProcessPool:
    """The wrapper's pool, made (not started) on first use."""
    check_not_in_spawned_main()
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


def call_chunks(wrapper: Any, name: str, inputs: Any, kwargs: Any) -> list[Any]:
    """Run one scattered call: chunk i on worker i, outputs in chunk order (for gather)."""
    pool, client = pool_for(wrapper), Client()
    try:
        pool.prepare(wrapper.module)
        state, seed, split = _ThreadState.capture(), draw_seed(), len(inputs) > 1
        slots = pool.slots[: len(inputs)]
        for s, a, k in zip(slots, inputs, kwargs):
            try:
                data = dumps(("run", s.index, name, tuple(a), dict(k), state, replica_seed(seed, s.index), split))
            except Exception as exc:
                raise TypeError(
                    f"DataParallel.{name}(workers='processes'): its arguments cannot be sent "
                    f"to a worker process: {type(exc).__name__}: {exc}; use workers='threads'"
                ) from exc
            pool.submit(client, s, s.index, data)
        outputs: list[Any] = [None] * len(slots)
        for _ in slots:
            slot, chunk, msg = pool.reply(client)
            if msg[0] != "done":
                raise reply_error(msg, slot, f"DataParallel.{name}: raised in chunk {chunk}",
                                  f"chunk {chunk} of DataParallel.{name}")
            give(msg[3])
            outputs[chunk] = received(msg[2], None)
        return outputs
    finally:
        client.close()
