"""The worker processes of ``workers="processes"``: one per device entry, kept with the wrapper.

Each device entry gets a :class:`~dpmethods.processes.executor.WorkerExecutor`, a
``concurrent.futures`` executor of one process (started from a fork server, or
spawned: :func:`start_method`). One worker runs its jobs in the order they were
submitted, so the model sent (:func:`~dpmethods.processes.worker.load`) is the one the
batches after it run on (:func:`~dpmethods.processes.worker.run`), and maps and calls
share the workers as they share a thread wrapper's replicas: each job has its own
``Future``. The first map or call that needs them starts them; the module goes once,
as one shared-memory copy of its tensors (or each worker builds it with ``factory``),
and again when its fingerprint or state digest changed
(:mod:`~dpmethods.processes.state`): a :class:`~dpmethods.processes.state.Watch` of it
tells at little cost, before each batch, that nothing changed since the last look.

:meth:`ProcessPool.submit` is a batch's or a share's way out: the look at the module
(sending it again if it changed), the request pickled, the job sent; :meth:`Worker.reply`
its way back.

A worker that dies (killed, a segfault, out of memory) breaks its executor: every job
it held fails, with an error naming the worker, its device and its exit code, and the
next map or call starts a fresh one. A worker sent SIGTERM while it runs a job (``kill
<pid>``) replies and leaves (:class:`~dpmethods.processes.executor.WorkerLeft`): the
same error, saying so, where the job's SystemExit would otherwise end the caller.
``close()``, garbage collection of the pool and interpreter exit shut the executors
down: the workers exit through the normal path (terminated after a few seconds if a
job still runs).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from multiprocessing import connection as mp_connection
from typing import Any

import torch
from torch import Tensor, nn

from dpmethods.core.parallel_apply import add_note
from dpmethods.core.replicate import fingerprint
from dpmethods.processes import worker as process_worker
from dpmethods.processes.classes import ClassState, class_state, classes_of
from dpmethods.processes.executor import NotStarted, WorkerExecutor
from dpmethods.processes.messages import Done, Load, Logged, Request, Warned
from dpmethods.processes.pickling import check_factory as check_factory  # for DataParallel
from dpmethods.processes.pickling import dumps, loads, model_payloads
from dpmethods.processes.state import Watch, state_digest
from dpmethods.types import tree as _tree
from dpmethods.types.coupled_modules import Mark, class_marks, marks
from dpmethods.vocab import warn_once
from dpmethods.vocab.loading import load_pending

__all__: list[str] = []

WORKERS = ("threads", "processes")
_LOG = logging.getLogger("dpmethods")
_PRELOAD = ["torch", "dpmethods.processes.worker"]  # what the fork server imports once (see preload)
_STOP_S = 3.0  # how long close() lets busy workers finish before terminating them
UNGUARDED_MAIN_EXIT = 86  # a worker that found itself running an unguarded main module
_UNGUARDED = "without `if __name__ == \"__main__\":`"
_MODEL_HINT = (
    "while building its model (a class defined in __main__ of an interactive session, or "
    "inside `if __name__ == \"__main__\":`, cannot be imported by a worker process: define "
    "it at the top level of a module, or pass factory=, or use workers='threads')"
)
_START_HINT = (
    "dpmethods: a worker that dies while it starts has usually failed in multiprocessing's "
    "start-up (its traceback is on stderr, above): each worker runs the main module again, "
    "so a script must start its work under `if __name__ == \"__main__\":`, "
    "and a program read from stdin cannot be run again; run it from a file with that guard, "
    "or use workers='threads'"
)


class WorkerDiedError(RuntimeError):
    """A worker process died (killed, a segfault, out of memory) or was stopped (SIGTERM)
    while the caller waited; ``what`` says which worker and how, as the message does
    after its prefix."""

    def __init__(self, message: str, what: str = "", started: bool = True) -> None:
        super().__init__(message)
        self.what = what
        self.started = started  # False: the job waited behind another when the worker went


class Unsendable(TypeError):
    """A request that cannot be pickled for a worker; its ``__cause__`` is pickling's error."""

    def error(self, where: str, what: str) -> TypeError:
        """The error the user sees: ``what`` (a batch of a map, a call's arguments) of
        ``where`` cannot be sent, why, and the fix; raise it from pickling's error
        (``self.__cause__``).

        Threads run the method on the caller's own objects and pickle nothing, so they
        give the answer one device gives for arguments that cannot cross processes.

        Example:
            >>> print(Unsendable("TypeError: boom").error("DataParallel.map", "batch 3"))
            DataParallel.map: batch 3 cannot be sent to a worker process: TypeError: boom; use workers='threads'
        """
        return TypeError(f"{where}: {what} cannot be sent to a worker process: {self}; use workers='threads'")


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


def check_not_in_spawned_main() -> None:
    """Leave a worker process quietly if it is running an unguarded script's main module.

    Each worker runs the script's main module again; a script without the
    main guard then reaches its map or call again there, whose own workers
    multiprocessing would refuse to start (a traceback from each worker). The worker
    exits instead, with :data:`UNGUARDED_MAIN_EXIT`, and the caller's error says why.
    Not through SystemExit: a fork server's child that raises it while it starts
    leaves with exit code 1.
    """
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()  # what the script printed before, as a normal exit would
            except Exception:
                pass
        os._exit(UNGUARDED_MAIN_EXIT)


def start_method() -> Any:
    """The ``multiprocessing`` context workers start from: ``forkserver`` where the
    platform has it (Linux, macOS), else ``spawn``; never ``fork``, which breaks CUDA
    and threads.

    The fork server is a fresh interpreter that imports torch and dpmethods' worker
    once, then forks each worker from that state (never initializing CUDA): a worker
    starts in a fraction of a second, where a spawned one imports torch itself (about a
    second of CPU each). Either way each worker imports the script's main module again
    (not the server: its preload, :func:`preload`, leaves ``__main__`` out), and gets the caller's
    environment as it is at the worker's start (:func:`~dpmethods.processes.worker.init`).

    Example:
        >>> start_method().get_start_method() in ("forkserver", "spawn")
        True
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)  # read when the server starts (the first worker)
    return context


def preload(*modules: str) -> list[str]:
    """Have the fork server import ``modules`` too, once, so that each worker forked from
    it has them already (a model's library: seconds of import per worker otherwise);
    the list the server will import. Read when the server starts, at the first worker
    of the process: later calls change nothing for a running server.

    Example:
        >>> preload()[:2]  # with no module, the list as it stands
        ['torch', 'dpmethods.processes.worker']
    """
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)
    return list(_PRELOAD)


class Worker:
    """One device entry's worker: its executor and process, and the model it holds."""

    def __init__(self, index: int, device: torch.device) -> None:
        self.index, self.device = index, device
        self.executor: WorkerExecutor | None = None
        self.process: Any = None  # its multiprocessing process; None before start and after close
        self.pid: int | None = None  # as the worker told it, answering its model
        self.key: Any = None  # what model it holds; None until it answered the load

    def describe(self, executor: WorkerExecutor | None = None) -> str:
        """This worker, or the one ``executor`` ran, which a fresh one may have replaced."""
        if executor is not None and executor is not self.executor:
            pid = executor.process.pid
        else:  # told by the worker once it answered its model; before, the started process's
            pid = self.pid if self.pid is not None or self.process is None else self.process.pid
        return f"worker {self.index} (pid {pid}, device {self.device})"

    def usable(self) -> bool:
        process, executor = self.process, self.executor
        # Broken: gone, or leaving (its process may not have exited yet).
        return executor is not None and not executor.broken and process is not None and _exit_code(process) is None

    def kill(self) -> None:
        """Kill the worker's process (SIGKILL); its jobs then fail."""
        process = self.process
        if process is not None:
            process.kill()

    def start(self, threads: int) -> None:
        self.key, self.pid = None, None
        # The child's OpenMP reads OMP_NUM_THREADS when it imports torch, long before
        # init runs: left unset, every worker's imports run on all cores at once. A
        # user's own setting is kept.
        unset = "OMP_NUM_THREADS" not in os.environ
        if unset:
            os.environ["OMP_NUM_THREADS"] = str(threads)
        try:
            self.executor = WorkerExecutor(start_method(), process_worker.init,
                                           (str(self.device), threads, dict(os.environ)),
                                           f"dpmethods-worker-{self.index}")
        finally:
            if unset:
                os.environ.pop("OMP_NUM_THREADS", None)
        self.process = self.executor.process

    def submit(self, fn: Callable[[bytes], bytes], data: bytes) -> cf.Future[bytes]:
        if self.executor is None:
            raise self.died()
        try:
            return self.executor.submit(fn, data)
        except RuntimeError:  # broken (cf.BrokenExecutor), or shut down by close()
            raise self.died() from None

    def started(self, future: cf.Future[bytes]) -> float | None:
        """When this worker started running ``future``'s job (``time.monotonic()``), or
        None while it is queued behind another job (of any map or call) or finished."""
        executor = self.executor
        return executor.started(future) if executor is not None else None

    def died(self, executor: WorkerExecutor | None = None) -> WorkerDiedError:
        """The error for this worker being gone, with its exit code; ``executor``: the one
        that ran the failed job, where a map may have started a fresh one since."""
        if self.process is None:
            self.key = None
            return WorkerDiedError("DataParallel(workers='processes'): the worker processes were "
                                   "closed (dp.close()) while a map or call was using them")
        if executor is None or executor is self.executor:
            executor, self.key = self.executor, None
        where = self.describe(executor)
        left = executor.left if executor is not None else None
        if left is not None:  # a job ended it: it replied, and left (WorkerLeft)
            how = ("was stopped by SIGTERM (SystemExit)" if isinstance(left, process_worker.Terminated)
                   else f"left after its job raised {type(left).__name__}")
            what = f"{where} {how}"
            return WorkerDiedError(f"DataParallel(workers='processes'): {what}", what)
        code = _reaped(executor.process if executor is not None else self.process, 5)
        if code == UNGUARDED_MAIN_EXIT:
            return WorkerDiedError(
                f"DataParallel(workers='processes'): {where} stopped while starting: "
                f"each worker runs the script's main module again, and this script "
                f"starts its work {_UNGUARDED}, so it reached DataParallel again there. Start "
                f"the script's work under that guard (a program read from stdin cannot use "
                f"processes), or use workers='threads'"
            )
        why = ""
        if code is not None and code < 0:
            try:
                why = f" ({signal.Signals(-code).name})"
            except ValueError:
                pass
        what = f"{where} died with exit code {code}{why}"
        return WorkerDiedError(f"DataParallel(workers='processes'): {what}", what)

    def reply(self, future: cf.Future[bytes], raised: str, running: str) -> Any:
        """The output of a finished job (its :class:`~dpmethods.processes.messages.Done`),
        its warnings given here; a failure raised with ``raised`` (the job's exception)
        or ``running`` (the worker died, or was stopped: never its SystemExit) in its note."""
        try:
            data = future.result()
        except (cf.BrokenExecutor, cf.CancelledError) as gone:  # WorkerLeft too
            died = self.died(getattr(future, "executor", None))
            if isinstance(gone, NotStarted):
                died.started = False
                where = f"before {running} started (it waited behind another job)"
            else:
                where = f"while running {running}"
            raise add_note(died, f"dpmethods: {where}; the next map or call starts a fresh worker") from None
        msg = loads(data)
        give_records(msg.logged)
        try:
            give_warnings(msg.warned)
        except Exception as warned:  # a warning the caller's filters make an error (-W error)
            raise add_note(warned, f"dpmethods: {raised} on {self.describe()}") from None
        if isinstance(msg, Done):
            return msg.output
        exc = loads(msg.error)
        note = f"dpmethods: {raised} on {self.describe()}; the worker's traceback:\n{msg.traceback}"
        raise add_note(exc, note)


def give_warnings(warned: Sequence[Warned]) -> None:
    """Give, in the caller, the warnings a worker's job raised: through the caller's
    filters and the registry of the module that warned, as a replica thread's would be;
    dpmethods' warn-once warnings once per caller process.

    Example:
        >>> give_warnings([])
    """
    for w in warned:
        if w.once and not warn_once.first_time(w.text):
            continue
        globals_ = vars(sys.modules[w.module]) if w.module in sys.modules else None
        registry = globals_.setdefault("__warningregistry__", {}) if globals_ is not None else None
        warnings.warn_explicit(w.text, w.category, w.filename, w.lineno, module=w.module, registry=registry)


_PROBE = 3  # a level no logger uses: the root's cached answer for it marks levels unchanged
_levels: Any = None


def logging_levels() -> tuple[Any, ...]:
    """This process's logging levels, for the workers to set on their loggers: what
    ``logging.disable`` turned off, the root's level and each named logger's that is set.

    Taken again only after a level changed: ``setLevel`` and ``logging.disable`` clear
    every logger's cached answers, the root's answer for :data:`_PROBE` among them.

    Example:
        >>> logging_levels()[1] == logging.getLogger().level
        True
    """
    global _levels
    root = logging.getLogger()
    if _levels is not None and _PROBE in getattr(root, "_cache", ()):
        return _levels  # type: ignore[no-any-return]
    named = tuple(sorted(
        (name, logger.level) for name, logger in list(logging.root.manager.loggerDict.items())
        if isinstance(logger, logging.Logger) and logger.level != logging.NOTSET
    ))
    _levels = (logging.root.manager.disable, root.level, named)
    root.isEnabledFor(_PROBE)  # cached until a level changes
    return _levels  # type: ignore[no-any-return]


def give_records(logged: Sequence[Logged]) -> None:
    """Handle, in the caller, the records a worker's job logged: through the caller's
    level, filters and handlers of the logger that logged them, as a replica thread's
    would be; one logged by a ``*_once`` function (transformers' ``warning_once``), which
    each worker gives once, once per caller process.

    Example:
        >>> give_records([])
    """
    for r in logged:
        logger = logging.getLogger(None if r.name == "root" else r.name)
        if not logger.isEnabledFor(r.levelno):
            continue
        if r.once and not warn_once.first_time(f"dpmethods-logged {r.name} {r.levelno} {r.message}"):
            continue
        record = logger.makeRecord(r.name, r.levelno, r.pathname, r.lineno, r.message, (), None,
                                   func=r.func, sinfo=r.stack_info)
        record.exc_text = r.exc_text
        logger.handle(record)


def received(obj: Any, device: torch.device | None) -> Any:
    """An output as the caller keeps it: on ``device``, and owning its CUDA memory."""
    if type(obj) is Tensor and not obj.is_cuda and (device is None or obj.device == device):
        return obj  # one tensor, where it goes already
    spec, leaves = _tree.flatten(obj)
    if not any(isinstance(t, Tensor) and (t.is_cuda or (device is not None and t.device != device))
               for t in leaves):
        return obj  # nothing to move or to copy: the output as it was unpickled
    out = []
    for t in leaves:
        if isinstance(t, Tensor):
            moved = t.to(device) if device is not None and t.device != device else t
            # A CUDA tensor from a worker holds the worker's memory (CUDA IPC): copy it.
            t = moved.clone() if moved is t and t.is_cuda else moved
        out.append(t)
    return _tree.unflatten(spec, out)


def drain(future: cf.Future[bytes]) -> None:
    """Fetch and drop the reply of a job nobody waits for (its shared memory is freed)."""
    if not future.cancelled() and future.exception() is None:
        try:
            loads(future.result())
        except Exception:  # pragma: no cover - the worker may be gone
            pass


def stop_all(workers: Sequence[Worker], grace: float = _STOP_S) -> None:
    """Shut every executor down; a worker still busy after ``grace`` seconds is terminated."""
    procs: list[Any] = []
    for w in workers:
        if w.executor is not None:
            procs.append(w.process)
            w.executor.shutdown(wait=False)
        w.executor = w.process = w.pid = w.key = None
    deadline = time.monotonic() + grace
    for p in procs:
        if _reaped(p, max(0.0, deadline - time.monotonic())) is None:
            p.terminate()  # SIGTERM: the worker's normal exit path
            if _reaped(p, 2) is None:
                p.kill()
                _reaped(p, None)


_POLLS: weakref.WeakKeyDictionary[Any, threading.Lock] = weakref.WeakKeyDictionary()
_POLLS_LOCK = threading.Lock()


def _exit_code(process: Any) -> int | None:
    """``process.exitcode``, read by one thread at a time: a forkserver's child's status
    comes once through a pipe (two reads at once lose it), and of two ``waitpid`` of a
    spawned one only one gets it."""
    with _POLLS_LOCK:
        lock = _POLLS.setdefault(process, threading.Lock())
    with lock:
        code = process.exitcode
        if code is not None:
            process.join(0)  # status stored: multiprocessing forgets the child
        return code  # type: ignore[no-any-return]


def _reaped(process: Any, timeout: float | None) -> int | None:
    """``process``'s exit code once it exited within ``timeout``, else None."""
    if not mp_connection.wait([process.sentinel], timeout):
        return None
    end = time.monotonic() + 1.0
    while (code := _exit_code(process)) is None and time.monotonic() < end:
        time.sleep(0.005)  # exited (its sentinel is ready); a poll of multiprocessing's own stores it
    return code


class ProcessPool:
    """The wrapper's worker processes, one per device; see the module docstring.

    Args:
        devices: one worker per entry (``["cpu"] * 2`` gives two CPU workers).
        factory: if given, each worker calls it to build its model; the module is
            then never sent (and changes to it are not seen).

    Example:
        >>> pool = ProcessPool([torch.device("cpu")] * 2)
        >>> len(pool.workers), pool.started()
        (2, False)
        >>> pool.close()
    """

    def __init__(self, devices: Sequence[torch.device], factory: Any = None) -> None:
        self.workers = [Worker(i, d) for i, d in enumerate(devices)]
        self.factory = factory
        self._setup = threading.RLock()  # one start-up or model update at a time
        self._seen: list[Any] = []  # what the workers' model was built from (see prepare)
        # The last look at the module, the key it gave and its marks; every live worker holds it.
        self._looked: tuple[Watch, Any, dict[type, Mark]] | None = None
        self._finalizer = weakref.finalize(self, stop_all, self.workers)

    def __reduce__(self) -> Any:  # a copy (of a wrapper) gets a fresh pool, not started
        return (ProcessPool, ([w.device for w in self.workers], self.factory))

    def started(self) -> bool:
        return any(w.executor is not None for w in self.workers)

    def submit(self, slot: int, request: Request, module: nn.Module | None = None) -> cf.Future[bytes]:
        """Send ``request`` to worker ``slot``; with ``module``, the workers get it again
        first if it changed since the last look (a map's batch).

        Raises :class:`Unsendable` (pickling's error its cause) for a request that cannot
        be pickled, :class:`WorkerDiedError` for a worker that is gone.
        """
        if module is not None and not self._current(module):  # the look, with no lock while unchanged
            self.prepare(module, start=False)
        try:
            data = dumps(request)
        except Exception as exc:
            raise Unsendable(f"{type(exc).__name__}: {exc}") from exc
        return self.workers[slot].submit(process_worker.run, data)

    def close(self) -> None:
        """Stop every worker; the next :meth:`prepare` starts fresh ones."""
        with self._setup:
            stop_all(self.workers)

    def prepare(self, module: nn.Module, *, start: bool = True) -> float:
        """Bring every worker to ``module``'s state, starting missing ones if ``start``.

        Returns the seconds spent starting workers. With ``start=False`` (before each
        batch of a running map) only live workers whose model is stale get it again.
        """
        with self._setup:
            t0 = time.perf_counter()
            check_not_in_spawned_main()
            fresh = [w for w in self.workers if not w.usable()] if start else []
            load_pending()  # the integrations' rules for what stays in this process
            if not fresh and self._current(module):
                return 0.0
            self._looked = None
            watch = Watch(module)  # first: a change made while the module is read shows next time
            marked = marks(module)  # the worker marks them too: its replicas warn as threads do
            kept: list[Any] = []  # the tensors the digest saw, by id
            state: Any = "factory"
            classes: ClassState | None = None
            if self.factory is None:
                classes = class_state(classes_of(module.modules()))  # a class changed here is set there too
                state = (fingerprint(module), state_digest(module, kept), classes.key())
            key = (state, tuple(marked.items()))
            stale = [w for w in self.workers if w in fresh or (w.key != key and w.executor is not None)]
            if not stale:
                for w in self.workers:
                    w.key = key if w.executor is not None else w.key  # the same key, one object
                self._looked = (watch, key, marked)
                return 0.0
            threads = max(1, torch.get_num_threads() // len(self.workers))
            for w in fresh:  # first: they import while the module is pickled here
                stop_all([w])
                w.start(threads)
            try:
                messages = self._model_messages(module, len(stale), marked, classes)
            except BaseException:  # a module that can't be sent fails at once
                stop_all(fresh, grace=0.0)
                raise
            futures = [(w, w.submit(process_worker.load, m)) for w, m in zip(stale, messages)]
            messages.clear()
            self._wait_loaded(futures, key, fresh)
            # The fingerprint and the digest hold identities: keep what they saw alive, so no
            # new object can take an old one's id (and its place in them) unnoticed.
            self._seen = [v for m in module.modules() for d in (m.__dict__, m._parameters, m._buffers)
                          for v in d.values()] + kept
            self._looked = (watch, key, marked)
            if not fresh:
                return 0.0
            elapsed = time.perf_counter() - t0
            _LOG.debug("dpmethods: started %d worker processes (%s) in %.2f s", len(fresh),
                       start_method().get_start_method(), elapsed)
            return elapsed

    def _current(self, module: nn.Module) -> bool:
        """Whether every live worker holds ``module`` as it is, by the last look's
        :class:`~dpmethods.processes.state.Watch` (no walk of the module)."""
        if self._looked is None:
            return False
        watch, key, marked = self._looked
        return (
            watch.module is module and watch.unchanged() and class_marks(watch.classes) == marked
            and all(w.key is key for w in self.workers if w.executor is not None)
        )

    def _model_messages(self, module: nn.Module, n: int, marked: dict[type, Mark],
                        classes: ClassState | None) -> list[bytes]:
        if self.factory is not None:
            return [dumps(Load("factory", self.factory, marked, None))] * n
        return [dumps(Load("model", p, marked, classes)) for p in model_payloads(module, n)]

    def _wait_loaded(self, futures: list[tuple[Worker, cf.Future[bytes]]], key: Any, fresh: list[Worker]) -> None:
        failure: BaseException | None = None
        for w, future in futures:
            try:
                w.pid = w.reply(future, f"DataParallel(workers='processes'): raised {_MODEL_HINT}", "")
                w.key = key
            except WorkerDiedError as exc:
                exc.__notes__ = []  # its exit code says it all
                stopped = w.executor is not None and w.executor.left is not None  # SIGTERM: not its start
                if w in fresh and _UNGUARDED not in str(exc) and not stopped:
                    add_note(exc, _START_HINT)
                failure = failure or exc
            except Exception as exc:
                failure = failure or exc
        if failure is not None:
            raise failure from None
