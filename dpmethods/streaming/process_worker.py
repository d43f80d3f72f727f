"""The loop of one worker process of ``workers="processes"`` (started with ``spawn``).

A worker owns one device. It receives its model once (or builds it with the
wrapper's ``factory``), then answers one request at a time on its pipe:

- ``("model", payload, device, marks)`` / ``("factory", factory, device, marks)``:
  (re)build the model, and mark the batch-coupled classes the caller marked (``marks``);
  answer ``("ready", [])`` or ``("failed", None, error, traceback, [])``;
- ``("run", seq, method, args, kwargs, state, seed, split)``: run ``method`` on the model
  under the caller's grad, inference and autocast modes (``state``), the torch RNG seeded
  with ``seed`` (if not None), as one replica of a split call if ``split``; answer
  ``("done", seq, output, warnings)`` or ``("failed", seq, error, traceback, warnings)``,
  ``warnings`` being what the method warned, for the caller to give (:func:`give`);
- ``("stop",)``: exit now, dropping the requests not run yet; the caller's end of
  the pipe closing: exit after them. Either way the worker leaves through the normal
  exit path (multiprocessing's finalizers run: no named semaphore or shared-memory
  file of its own is left behind); so does SIGTERM.

A thread of the worker receives the requests as they come (and fetches their shared
memory at once), so the caller's sends never wait for the batch running: the caller
may send the next batch, or another map's, while this one runs, and the replies still
go back in the order of the requests.

An output holding a tensor that requires grad, inside any object, is an error (autograd
cannot cross processes): it is never detached silently. The caller's Ctrl-C is the caller's to handle: workers ignore SIGINT
(it reaches the whole process group), so the pool outlives an interrupted map.
"""

from __future__ import annotations

import queue
import signal
import sys
import threading
import traceback
import warnings
from typing import Any

import torch
from torch import nn

from dpmethods import warn_once
from dpmethods._loading import load_pending
from dpmethods.streaming.process_io import OutputRequiresGrad, dumps, loads
from dpmethods.streaming.process_state import rebuilt
from dpmethods.streaming.threads import move
from dpmethods.types.coupled_modules import mark_batch_coupled, split_call

__all__: list[str] = []


def _own_buffers(model: nn.Module) -> None:
    # Workers map the same shared parameters; a module in training mode updates its
    # buffers in place (BatchNorm's running stats), so each worker gets its own copies.
    for m in model.modules():
        if m.training:
            for name, b in m._buffers.items():
                if b is not None:
                    m._buffers[name] = b.clone()


def _build(msg: tuple[Any, ...]) -> nn.Module:
    kind, what, device, marked = msg
    for cls, text in marked.items():
        mark_batch_coupled(cls, what=text)
    model = loads(what) if kind == "model" else what()
    load_pending()  # the integrations of the libraries the model imported: their rules
    rebuilt(model)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"factory: expected a callable that returns an nn.Module, got "
            f"{type(model).__name__} from {what!r}"
        )
    if device.type == "cuda" or kind == "factory":
        model.to(device)
    _own_buffers(model)
    return model


def grad_error(method: str) -> str:
    """The message for an output that requires grad in a worker process."""
    return (
        f"DataParallel(workers='processes'): the output of {method} requires grad, but "
        f"autograd cannot cross processes, and the output would lose its graph. Run it "
        f"under torch.no_grad() or torch.inference_mode(), or use workers='threads' to "
        f"backpropagate through it"
    )


def _run(model: nn.Module, msg: tuple[Any, ...], device: torch.device) -> Any:
    _, _, method, args, kwargs, state, seed, split = msg
    if device.type == "cuda":
        args, kwargs = move((args, kwargs), device)
    if seed is not None:
        torch.manual_seed(seed)
    fn = model if method == "forward" else getattr(model, method)
    with state.applied(), split_call(split):
        return fn(*args, **kwargs)


_MODULES: dict[str, str | None] = {}  # a warning's file -> its module's name


def _module_of(filename: str) -> str | None:
    if filename not in _MODULES:
        _MODULES[filename] = next(
            (name for name, m in list(sys.modules.items()) if getattr(m, "__file__", None) == filename),
            None,
        )
    return _MODULES[filename]


def _warned(seen: list[warnings.WarningMessage]) -> list[tuple[Any, ...]]:
    """What the method warned, for the caller: text, category, place, and whether it was
    a dpmethods warn-once (the caller keeps that record, so it is forgotten here)."""
    once = warn_once.take_given()
    return [
        (str(w.message), w.category, w.filename, w.lineno, _module_of(w.filename), str(w.message) in once)
        for w in seen
    ]


def give(warned: list[tuple[Any, ...]]) -> None:
    """Give, in the caller, the warnings a worker's method raised: through the caller's
    filters and the registry of the module that warned, as a replica thread's would be;
    dpmethods' warn-once warnings once per caller process.

    Example:
        >>> give([])
    """
    for text, category, filename, lineno, module, once in warned:
        if once and not warn_once.first_time(text):
            continue
        globals_ = vars(sys.modules[module]) if module in sys.modules else None
        registry = globals_.setdefault("__warningregistry__", {}) if globals_ is not None else None
        warnings.warn_explicit(text, category, filename, lineno, module=module, registry=registry)


def _failure(seq: Any, exc: BaseException, warned: list[tuple[Any, ...]]) -> bytes:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        error = dumps(exc)
        loads(error)  # some exceptions pickle but can't be rebuilt (their __init__ args)
    except Exception:
        error = dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))
    return dumps(("failed", seq, error, text, warned))


def _receive(conn: Any, requests: queue.SimpleQueue[Any]) -> None:
    """Put each request on ``requests`` as it arrives; ``None`` once there are no more."""
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            break  # the caller is gone
        try:
            msg = loads(data)
        except BaseException as exc:  # a class this process can't import: that request fails
            msg = ("unreadable", exc)
        del data
        if msg[0] == "stop":
            # Every earlier request was received (its shared memory fetched), so nothing of
            # the caller's is half-taken: exit now, without running the requests queued.
            requests.put(None)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)  # type: ignore[arg-type]
            return
        requests.put(msg)
        del msg
    requests.put(None)


def _answer(model: nn.Module | None, msg: tuple[Any, ...], dev: torch.device) -> tuple[nn.Module | None, bytes]:
    """The model after ``msg``, and the reply to send for it."""
    seq = msg[1] if msg[0] == "run" else None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # the caller's filters decide (see give)
        try:
            if msg[0] == "unreadable":
                raise RuntimeError(
                    f"DataParallel(workers='processes'): a worker process could not unpickle a "
                    f"request: {type(msg[1]).__name__}: {msg[1]}. Classes defined in __main__ of "
                    f"an interactive session, or in modules the worker cannot import, can't cross "
                    f"processes: define them in an importable module, or use workers='threads'"
                ) from msg[1]
            if msg[0] == "run":
                if model is None:
                    raise RuntimeError("DataParallel: worker process got a batch before its model")
                out = _run(model, msg, dev)
                return model, _done(seq, msg[2], out, _warned(seen))
            model = None  # the old one's memory goes first
            return _build(msg), dumps(("ready", _warned(seen)))
        except SystemExit:
            raise
        except BaseException as exc:
            return model, _failure(seq, exc, _warned(seen))


def _done(seq: Any, method: str, out: Any, warned: list[tuple[Any, ...]]) -> bytes:
    try:
        return dumps(("done", seq, out, warned), output=True)
    except OutputRequiresGrad as exc:
        raise RuntimeError(grad_error(method) + f" ({exc})") from None
    except Exception as exc:
        raise TypeError(
            f"DataParallel(workers='processes'): the output of {method} cannot be sent back "
            f"from the worker process: {type(exc).__name__}: {exc}; return picklable values "
            f"(tensors, numbers, strings, ModelOutput...), or use workers='threads'"
        ) from exc


_exiting = False


def _on_sigterm(signum: int, frame: Any) -> None:
    # Leave through the normal exit path (finalizers run), unless already on it.
    if not _exiting:
        raise SystemExit(0)


def serve(conn: Any, index: int, device: str, threads: int) -> None:
    """Worker ``index``'s loop on ``device``: build the model, then run requests."""
    global _exiting
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    if threads > 0:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
    threading.Thread(target=_receive, args=(conn, requests), name="dpmethods-receive", daemon=True).start()
    model: nn.Module | None = None
    try:
        while True:
            msg = requests.get()
            if msg is None:
                return
            model, reply = _answer(model, msg, dev)
            msg = None  # drop this request's inputs before waiting
            try:
                conn.send_bytes(reply)
            except (BrokenPipeError, OSError):
                return
            del reply
    finally:
        _exiting = True
