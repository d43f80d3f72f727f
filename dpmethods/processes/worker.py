"""What runs inside a worker process of ``workers="processes"``.

Each worker is the one process of a :class:`~dpmethods.processes.executor.WorkerExecutor`,
so it runs its jobs in the order they were submitted: "load the model" before the
batches that need it. :func:`init` sets the process up; :func:`load` (re)builds the
model from the caller's module (one shared-memory copy of its tensors) or from the
wrapper's ``factory``; :func:`run` runs one batch or share. Both take and return
bytes pickled by :mod:`~dpmethods.processes.pickling` (small tensors inline, large ones
in shared memory): the records of :mod:`~dpmethods.processes.messages` (a
:class:`~dpmethods.processes.messages.Load` or a
:class:`~dpmethods.processes.messages.Request` in, a
:class:`~dpmethods.processes.messages.Done` or a
:class:`~dpmethods.processes.messages.Failed` back).

The warnings a method raises, and the records it logs (a library's ``logger.warning``),
are recorded and given again in the caller (:meth:`dpmethods.processes.pool.Worker.reply`),
through the caller's filters, levels and handlers, as a replica thread's would be: a
library the caller silenced stays silent, and a record the caller's log file takes is
in it. Each job sets the caller's logging levels first (:func:`_set_levels`), so that
the worker makes the records the caller's loggers would show.
An output holding a tensor that requires grad, inside any object, is an error (autograd
cannot cross processes): never detached silently. Workers ignore SIGINT (the caller's
Ctrl-C is the caller's); on a CPU device they run under ``SCHED_BATCH`` where there is
one (:func:`_run_as_batch`), and leave through the normal exit path, on the executor's
shutdown and on SIGTERM alike, so what their methods made (named semaphores) is freed.
A SIGTERM during a job (``kill <pid>`` of a stuck worker) ends the job with
:class:`Terminated`: the worker replies with it and leaves, and the caller sees a worker
that died (:meth:`dpmethods.processes.pool.Worker.died`), never a SystemExit of its own.
A ``SystemExit`` or ``KeyboardInterrupt`` the method raises itself is the job's failure,
raised in the caller as a replica thread's would be; the worker takes its next job.
A worker whose caller is gone (killed: no shutdown will ever come) leaves too
(:func:`_watch_parent`).
"""

from __future__ import annotations

import _thread
import contextlib
import gc
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from multiprocessing.connection import wait as wait_for
from typing import Any

import torch
from torch import nn

from dpmethods.core.oom import Fit, split_on_oom
from dpmethods.processes import classes
from dpmethods.processes.messages import Done, Failed, Load, Logged, Request, Warned
from dpmethods.processes.pickling import OutputRequiresGrad, dumps, loads
from dpmethods.processes.state import rebuilt
from dpmethods.types.coupled_modules import mark_batch_coupled, part_of_batch
from dpmethods.types.tree import move
from dpmethods.vocab import warn_once as warn_once
from dpmethods.vocab.loading import load_pending

__all__ = ["Terminated", "init", "load", "rebuilt_error", "run"]

_model: nn.Module | None = None
_device = torch.device("cpu")
_MODULES: dict[str, str | None] = {}  # a warning's file -> its module's name
_LOGGED: list[logging.LogRecord] | None = None  # the records the running job logged; None between jobs
_LEVELS: Any = None  # the caller's logging levels, as last set here
_SET: set[str] = set()  # the loggers whose level the caller's set here
_FITS: dict[tuple[str, Any], Fit] = {}  # on_oom='split': the memory records, while the model lives
_loads = 0  # models built in this process
_in_job = False  # a load or a batch is running (SIGTERM then ends the job, and the worker replies before it leaves)
_leaving = False  # SIGTERM reached the worker between jobs, or ended a job: it is on its way out
_terminated = False  # SIGTERM reached the worker during the job that runs
_ORPHAN_POLL_S = 1.0  # how often a worker checks that its caller still lives
_ORPHAN_GRACE_S = 5.0  # how long an orphaned worker's normal exit may take before it is cut short


class Terminated(SystemExit):
    """SIGTERM reached the worker: a ``SystemExit(0)``, the normal exit path. Raised in a
    job, it ends the job, and the worker leaves once it replied with it
    (:func:`dpmethods.processes.executor._serve`); the caller's error names it
    (:meth:`dpmethods.processes.pool.Worker.died`)."""


def _on_sigterm(signum: int, frame: Any) -> None:
    global _leaving, _terminated
    if _leaving:
        return  # let the exit it began finish its finalizers
    # In a job, it ends the job (each SIGTERM again, should the method catch it); the
    # worker then replies and leaves (_recorded).
    _terminated = _in_job
    _leaving = not _in_job
    raise Terminated(0)  # the normal exit path: finalizers run


def _parent_gone(sentinel: Any, ppid: int) -> bool:
    if sentinel is not None:
        gone = bool(wait_for([sentinel], _ORPHAN_POLL_S))
    else:
        time.sleep(_ORPHAN_POLL_S)
        gone = False
    return gone or (os.name == "posix" and os.getppid() != ppid)


def _watch_parent() -> None:
    """Leave once the caller's process is gone (SIGKILL, a crash): no shutdown will come.

    The parent's sentinel (its end of the pipe the worker was started through) reaches
    EOF when the caller dies; the parent pid is watched too. SIGTERM, again every quarter second, takes the main
    thread out of a job or of its wait for the next one through the normal exit path;
    one that does not end within :data:`_ORPHAN_GRACE_S` (a job in a long native call)
    is cut short. Not ``PR_SET_PDEATHSIG``: it fires when the *thread* that started the
    worker exits, and a map may be started from a short-lived thread.
    """
    parent = multiprocessing.parent_process()
    sentinel = getattr(parent, "sentinel", None)
    ppid = os.getppid()  # the caller, or the fork server (which leaves with the caller)
    gone = False
    while not gone:
        gone = _parent_gone(sentinel, ppid)
    deadline = time.monotonic() + _ORPHAN_GRACE_S
    main = threading.main_thread().ident
    while time.monotonic() < deadline:
        if hasattr(signal, "pthread_kill") and main is not None:
            signal.pthread_kill(main, signal.SIGTERM)  # a blocked read returns to the handler
        else:  # pragma: no cover - Windows
            _thread.interrupt_main(signal.SIGTERM)
        time.sleep(0.25)
    os._exit(1)


def init(device: str, threads: int, environ: dict[str, str] | None = None) -> None:
    """Set up this worker process for ``device`` (the executor's initializer), with the
    caller's ``environ`` (a worker forked from the fork server has the server's)."""
    global _device
    if environ is not None and environ != os.environ:
        os.environ.clear()
        os.environ.update(environ)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    threading.Thread(target=_watch_parent, name="dpmethods-parent-watch", daemon=True).start()
    torch.set_num_threads(max(1, threads))
    _record_logging()
    _device = torch.device(device)
    if _device.type == "cuda":
        torch.cuda.set_device(_device)
    else:
        _run_as_batch()


def _run_as_batch() -> None:
    """Run this CPU worker under ``SCHED_BATCH`` where there is one (Linux).

    A worker on the CPU computes what the caller's thread feeds it. Under the default
    policy, a worker woken by a batch on the core where the caller runs takes the core
    from the caller at once; with as many processes as cores, the two then take turns
    there, a batch at a time, while the other core idles. ``SCHED_BATCH`` changes only
    that: a woken worker waits for its turn, or for an idle core, and never takes the
    core from the thread that feeds it. Its share of the CPU is unchanged. Where the
    policy cannot be set (another OS, a sandbox that forbids it), the worker runs as it is.
    """
    batch = getattr(os, "SCHED_BATCH", None)
    if batch is None:
        return
    try:
        os.sched_setscheduler(0, batch, os.sched_param(0))
    except OSError:
        pass


def _build(msg: Load) -> nn.Module:
    if msg.classes is not None:
        classes.set_values(msg.classes)  # the caller's changes to the model's classes, first
    for cls, mark in msg.marks.items():
        mark_batch_coupled(cls, what=mark.what, advice=mark.advice)
    kind, what = msg.kind, msg.what
    if kind == "model":
        with warnings.catch_warnings():
            # torch's own rebuild of some tensors (a quantized one) warns of torch's
            # internals (TypedStorage, its deprecations): the caller's model warned of none.
            warnings.filterwarnings("ignore", module=r"torch\.")
            model = loads(what)
    else:
        model = what()
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"factory: expected a callable that returns an nn.Module, got "
            f"{type(model).__name__} from {what!r}"
        )
    load_pending()  # the integrations of the libraries the model imported: their rules
    rebuilt(model)
    if msg.classes is not None:
        classes.check(msg.classes, model)
    if _device.type == "cuda" or kind == "factory":
        model.to(_device)
    # Workers map the same shared parameters and buffers. A method may update buffers in
    # place (BatchNorm's running stats in training mode, a static cache, a scratch
    # buffer), so each worker gets its own buffer copies, as a device of its own has.
    for m in model.modules() if kind == "model" else ():  # a factory's model is the worker's own
        for name, b in m._buffers.items():
            if b is not None and not b.is_cuda:  # a CUDA worker's were copied to its device
                m._buffers[name] = b.clone()
    return model


def grad_error(method: str) -> str:
    """The message for an output that requires grad in a worker process."""
    return (
        f"DataParallel(workers='processes'): the output of {method} requires grad, but "
        f"autograd cannot cross processes, and the output would lose its graph. Run it "
        f"under torch.no_grad() or torch.inference_mode(), or use workers='threads' to "
        f"backpropagate through it"
    )


def _module_of(filename: str) -> str | None:
    if filename not in _MODULES:
        _MODULES[filename] = next(
            (n for n, m in list(sys.modules.items()) if getattr(m, "__file__", None) == filename), None
        )
    return _MODULES[filename]


def _record_logging() -> None:
    """In a job, a record a logger of this process passed (its level and filters) goes
    to the job's reply instead of this process's handlers: the caller's handle it."""
    handlers = logging.Logger.callHandlers

    def call_handlers(self: logging.Logger, record: logging.LogRecord) -> None:
        sink = _LOGGED
        if sink is None:
            handlers(self, record)
        else:
            sink.append(record)

    logging.Logger.callHandlers = call_handlers  # type: ignore[method-assign]


def _set_levels(levels: Any) -> None:
    """Set the caller's logging levels (:func:`dpmethods.processes.pool.logging_levels`)
    on this process's loggers, so that they make the records the caller's would (an
    ``info`` where the caller shows it), and no others; a logger the caller no longer
    sets a level on has its level unset again."""
    global _LEVELS
    if levels is None or levels == _LEVELS:
        return
    disable, root, named = levels
    logging.disable(disable)
    logging.getLogger().setLevel(root)
    names = {name for name, _ in named}
    for name in _SET - names:
        logging.getLogger(name).setLevel(logging.NOTSET)
    for name, level in named:
        logging.getLogger(name).setLevel(level)
    _SET.clear()
    _SET.update(names)
    _LEVELS = levels


def _logged() -> tuple[Logged, ...]:
    """What the running job logged, for the caller."""
    return tuple(_sent_record(r) for r in list(_LOGGED or ()))


def _sent_record(r: logging.LogRecord) -> Logged:
    try:
        message = r.getMessage()
    except Exception as exc:  # its arguments do not fit its format: as logging reports it
        message = f"{r.msg!r} % {r.args!r} could not be formatted: {type(exc).__name__}: {exc}"
    exc_text = r.exc_text
    if exc_text is None and r.exc_info:
        exc_text = logging.Formatter().formatException(r.exc_info)
    once = isinstance(r.funcName, str) and r.funcName.endswith("_once")
    return Logged(r.name, r.levelno, message, r.pathname, r.lineno, r.funcName, exc_text, r.stack_info, once)


def _warned(seen: list[warnings.WarningMessage]) -> tuple[Warned, ...]:
    """What a job warned, for the caller; a dpmethods warn-once warning is forgotten
    here (the caller keeps that record)."""
    once = warn_once.take_given()
    return tuple(
        Warned(*_sendable(str(w.message), w.category), w.filename, w.lineno, _module_of(w.filename),
               str(w.message) in once)
        for w in seen
    )


def _sendable(text: str, category: type[Warning]) -> tuple[str, type[Warning]]:
    """The warning as the caller can be given it: its own category where the caller can
    import it (one defined inside a function cannot be), else a UserWarning naming it."""
    try:
        pickle.dumps(category)
    except Exception:
        return f"{category.__module__}.{category.__qualname__}: {text}", UserWarning
    return text, category


def _failure(exc: BaseException, warned: tuple[Warned, ...]) -> bytes:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return dumps(Failed(_error(exc), text, warned, _logged()))


def _error(exc: BaseException) -> bytes:
    """``exc`` pickled for the caller, as its own class wherever the caller can import it:
    one whose ``__init__`` takes other arguments than its ``args`` (keyword-only ones,
    a message built from two), which pickle rebuilds by calling it with ``args``, goes
    as its class, ``args`` and attributes, set on an instance made without ``__init__``;
    else a RuntimeError with its text."""
    for sent in (exc, _Copied(exc)):
        try:
            error = dumps(sent)
            loads(error)  # some exceptions pickle but can't be rebuilt (their __init__ args)
        except Exception:
            continue
        return error
    return dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))


class _Copied:
    """An exception pickled as its class, ``args`` and ``__dict__`` (its notes among them)."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __reduce__(self) -> tuple[Any, ...]:
        return rebuilt_error, (type(self.exc), self.exc.args, dict(vars(self.exc)))


def rebuilt_error(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    """An exception of ``cls`` with ``args`` and attributes ``state``, made without its
    ``__init__`` (see :func:`_error`).

    Example:
        >>> class Coded(ValueError):
        ...     def __init__(self, *, code):
        ...         super().__init__(f"code {code}")
        ...         self.code = code
        >>> e = rebuilt_error(Coded, ("code 3",), {"code": 3})
        >>> type(e).__name__, str(e), e.code
        ('Coded', 'code 3', 3)
    """
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(state)
    return exc


def _job(data: bytes, body: Any) -> bytes:
    global _in_job, _terminated, _LOGGED
    _terminated = False
    _in_job = True
    _LOGGED = []
    try:
        return _recorded(data, body)
    finally:
        _in_job = False
        _LOGGED = None


def _recorded(data: bytes, body: Any) -> bytes:
    global _leaving
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # the caller's filters decide (pool.Worker.reply)
        try:
            try:
                msg = loads(data)
            except Exception as exc:  # a class this process can't import: this job fails
                raise RuntimeError(
                    f"DataParallel(workers='processes'): a worker process could not unpickle a "
                    f"request: {type(exc).__name__}: {exc}. Classes defined in __main__ of an "
                    f"interactive session, or in modules the worker cannot import, can't cross "
                    f"processes: define them in an importable module, or use workers='threads'"
                ) from exc
            del data
            return body(msg, seen)
        except BaseException as exc:
            if _terminated:  # SIGTERM ended the job, however the method let it out
                _leaving = True  # further SIGTERMs ignored: the worker replies, then leaves
                if isinstance(exc, Terminated):
                    raise
                raise Terminated(0) from exc
            # The method's own SystemExit or KeyboardInterrupt too: raised in the caller
            # (as on threads), and this worker takes its next job.
            return _failure(exc, _warned(seen))


@contextlib.contextmanager
def _first_build() -> Iterator[None]:
    """The first model's build without the cyclic collector, then what it left frozen.

    That build imports the model's libraries: hundreds of thousands of long-lived
    objects, which the collector would scan again and again as they come (importing
    sentence-transformers: 4.2-4.4 s of CPU with it, 3.7-3.9 s without it, the one full
    collection at the end included). The collection before the freeze frees the
    build's cyclic garbage, so nothing frozen is garbage.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        gc.freeze()  # later collections skip them (a method's loop collects often)
        if enabled:
            gc.enable()


def load(data: bytes) -> bytes:
    """Build the model from a :class:`~dpmethods.processes.messages.Load`; the reply's
    output is this process's pid."""
    global _model, _loads

    def body(msg: Load, seen: list[Any]) -> bytes:
        global _model
        _model = _build(msg)
        return dumps(Done(os.getpid(), _warned(seen), _logged()))

    _model = None  # the old one's memory goes first
    _FITS.clear()
    _loads += 1
    if _loads == 2:
        gc.unfreeze()  # the first model may hold cycles: they can be collected again
    with _first_build() if _loads == 1 else contextlib.nullcontext():
        return _job(data, body)


def _seed(seed: int) -> None:
    """Seed the generators this worker's methods draw from: the CPU's and its device's.

    Not ``torch.manual_seed``: it also queues a seeding of every CUDA device, with the
    stack it was called from formatted, for a CUDA that is not initialized, which costs
    a CPU worker more than a small batch.
    """
    torch.default_generator.manual_seed(seed)
    if _device.type != "cpu":
        torch.get_device_module(_device).manual_seed(seed)


def run(data: bytes) -> bytes:
    """Run a :class:`~dpmethods.processes.messages.Request` on the model; with its
    ``oom`` a batch that runs out of memory is split by the method's options, the memory
    record kept under ``oom.key`` (see :func:`dpmethods.core.oom.split_on_oom`)."""

    def body(msg: Request, seen: list[Any]) -> bytes:
        method, args, kwargs, seed, oom = msg.method, msg.args, msg.kwargs, msg.seed, msg.oom
        if _model is None:
            raise RuntimeError("DataParallel: worker process got a batch before its model")
        if _device.type == "cuda":
            args, kwargs = move((args, kwargs), _device)
        if seed is not None:
            _seed(seed)
        _set_levels(msg.levels)
        fn = _model if method == "forward" else getattr(_model, method)
        with msg.state.applied(), part_of_batch(msg.part_of_batch):
            if oom is None:
                out = fn(*args, **kwargs)
            else:
                fit = Fit.kept(_FITS, (method, oom.key))
                out = split_on_oom(_model, method, oom.options, fn, _device, fit, args, kwargs,
                                   names=getattr(_model, method), prepared=oom.prepared)
        try:
            return dumps(Done(out, _warned(seen), _logged()), output=True, grad=msg.state.grad)
        except OutputRequiresGrad as exc:
            raise RuntimeError(grad_error(method) + f" ({exc})") from None
        except Exception as exc:
            raise TypeError(
                f"DataParallel(workers='processes'): the output of {method} cannot be sent "
                f"back from the worker process: {type(exc).__name__}: {exc}; return picklable "
                f"values (tensors, numbers, strings, ModelOutput...), or use workers='threads'"
            ) from exc

    return _job(data, body)
