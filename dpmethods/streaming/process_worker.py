"""The loop of one worker process of ``workers="processes"`` (started with ``spawn``).

A worker owns one device. It receives its model once (or builds it with the
wrapper's ``factory``), then answers one request at a time on its pipe:

- ``("model", payload, device)`` / ``("factory", factory, device)``: (re)build the model;
  answer ``("ready",)`` or ``("failed", None, error, traceback)``;
- ``("run", seq, method, args, kwargs, state)``: run ``method`` on the model under the
  caller's grad, inference and autocast modes (``state``); answer ``("done", seq, output)``
  or ``("failed", seq, error, traceback)``;
- ``("stop",)``: exit at once, dropping the requests not run yet; the caller's end of
  the pipe closing: exit after them.

A thread of the worker receives the requests as they come (and fetches their shared
memory at once), so the caller's sends never wait for the batch running: the caller
may send the next batch, or another map's, while this one runs, and the replies still
go back in the order of the requests.

An output that requires grad is an error (autograd cannot cross processes): it is never
detached silently. The caller's Ctrl-C is the caller's to handle: workers ignore SIGINT
(it reaches the whole process group), so the pool outlives an interrupted map.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import traceback
from typing import Any

import torch
from torch import Tensor, nn

from dpmethods.streaming.process_io import dumps, loads
from dpmethods.streaming.threads import move
from dpmethods.types import tree as _tree

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
    kind, what, device = msg
    model = loads(what) if kind == "model" else what()
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


def _requires_grad(out: Any) -> bool:
    return any(isinstance(t, Tensor) and t.requires_grad for t in _tree.flatten(out)[1])


def _run(model: nn.Module, msg: tuple[Any, ...], device: torch.device) -> Any:
    _, _, method, args, kwargs, state = msg
    if device.type == "cuda":
        args, kwargs = move((args, kwargs), device)
    fn = model if method == "forward" else getattr(model, method)
    with state.applied():
        out = fn(*args, **kwargs)
    if _requires_grad(out):
        raise RuntimeError(grad_error(method))
    return out


def _failure(seq: Any, exc: BaseException) -> bytes:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        error = dumps(exc)
        loads(error)  # some exceptions pickle but can't be rebuilt (their __init__ args)
    except Exception:
        error = dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))
    return dumps(("failed", seq, error, text))


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
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        requests.put(msg)
        del msg
    requests.put(None)


def _answer(model: nn.Module | None, msg: tuple[Any, ...], dev: torch.device) -> tuple[nn.Module | None, bytes]:
    """The model after ``msg``, and the reply to send for it."""
    seq = msg[1] if msg[0] == "run" else None
    try:
        if msg[0] == "unreadable":
            raise RuntimeError(
                f"DataParallel(workers='processes'): a worker process could not unpickle a "
                f"request: {type(msg[1]).__name__}: {msg[1]}. Classes defined in __main__ of an "
                f"interactive session, or in modules the worker cannot import, can't cross "
                f"processes: define them in an importable module, or use workers='threads'"
            ) from msg[1]
        if msg[0] == "run":
            if model is None:
                raise RuntimeError("DataParallel: worker process got a batch before its model")
            return model, _done(seq, msg[2], _run(model, msg, dev))
        model = None  # the old one's memory goes first
        return _build(msg), dumps(("ready",))
    except BaseException as exc:
        return model, _failure(seq, exc)


def _done(seq: Any, method: str, out: Any) -> bytes:
    try:
        return dumps(("done", seq, out))
    except Exception as exc:
        raise TypeError(
            f"DataParallel(workers='processes'): the output of {method} cannot be sent back "
            f"from the worker process: {type(exc).__name__}: {exc}; return picklable values "
            f"(tensors, numbers, strings, ModelOutput...), or use workers='threads'"
        ) from exc


def serve(conn: Any, index: int, device: str, threads: int) -> None:
    """Worker ``index``'s loop on ``device``: build the model, then run requests."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if threads > 0:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
    threading.Thread(target=_receive, args=(conn, requests), name="dpmethods-receive", daemon=True).start()
    model: nn.Module | None = None
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
