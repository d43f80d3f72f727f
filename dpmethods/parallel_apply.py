"""Parallel apply: run one named method on every replica, one thread per replica.

Each thread gets the caller's grad mode, inference mode and autocast state, and on
CUDA the caller's current stream for that device. A second replica on the same
GPU runs on a side stream of its own, ordered after the caller's stream on entry
and before it on exit. A failure in a replica is re-raised in the caller as the
same exception object, with its original traceback and a note naming the replica
and device; every thread is joined first, so none is left behind.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import _tree

__all__ = ["ReplicaError", "parallel_apply"]

_SIDE_STREAMS: dict[tuple[int, int], Any] = {}
_SIDE_STREAMS_LOCK = threading.Lock()


class ReplicaError(RuntimeError):
    """Raised ``from`` on Python < 3.11, where exceptions have no notes, to name the replica."""


@dataclass(frozen=True)
class _ThreadState:
    grad: bool
    inference: bool
    autocast: tuple[tuple[str, torch.dtype], ...]

    @classmethod
    def capture(cls) -> _ThreadState:
        autocast = tuple(
            (kind, torch.get_autocast_dtype(kind))
            for kind in ("cuda", "cpu")
            if torch.is_autocast_enabled(kind)
        )
        return cls(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.inference:
                stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.set_grad_enabled(self.grad))
            for kind, dtype in self.autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype))
            yield


def _side_stream(device: torch.device, k: int) -> Any:
    key = (device.index if device.index is not None else torch.cuda.current_device(), k)
    with _SIDE_STREAMS_LOCK:
        stream = _SIDE_STREAMS.get(key)
        if stream is None:
            stream = _SIDE_STREAMS[key] = torch.cuda.Stream(key[0])
    return stream


def _streams(devices: Sequence[torch.device]) -> list[Any]:
    """The stream of each replica: the caller's current one, or a side stream for repeats."""
    streams: list[Any] = []
    used: dict[torch.device, int] = {}
    for d in devices:
        if d.type != "cuda":
            streams.append(None)
            continue
        k = used.get(d, 0)
        used[d] = k + 1
        streams.append(torch.cuda.current_stream(d) if k == 0 else _side_stream(d, k))
    return streams


def _record(obj: Any, stream: Any) -> None:
    for leaf in _tree.flatten(obj)[1]:
        if isinstance(leaf, torch.Tensor) and leaf.is_cuda:
            leaf.record_stream(stream)


def _device_context(device: torch.device, stream: Any) -> Any:
    if stream is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.cuda.device(device))
    stack.enter_context(torch.cuda.stream(stream))
    return stack


def _annotate(exc: BaseException, index: int, device: torch.device) -> BaseException:
    note = f"dpmethods: raised in replica {index} on device {device}"
    if hasattr(exc, "add_note"):
        exc.add_note(note)
        return exc
    wrapped = ReplicaError(note)  # pragma: no cover - Python 3.10
    wrapped.__cause__ = exc
    return wrapped


def parallel_apply(
    replicas: Sequence[nn.Module],
    method: str,
    inputs: Sequence[tuple[Any, ...]],
    kwargs: Sequence[dict[str, Any]],
    devices: Sequence[torch.device],
) -> list[Any]:
    """Call ``getattr(replica, method)(*inputs[i], **kwargs[i])`` on every replica in parallel.

    Args:
        replicas: one module per device.
        method: the method name (``"forward"`` calls the replica itself, so hooks run).
        inputs: positional arguments per replica.
        kwargs: keyword arguments per replica.
        devices: the device of each replica.

    Example:
        >>> import torch
        >>> reps = [torch.nn.Identity(), torch.nn.Identity()]
        >>> parallel_apply(reps, "forward", [(1,), (2,)], [{}, {}], [torch.device("cpu")] * 2)
        [1, 2]
    """
    n = len(replicas)
    if not (len(inputs) == len(kwargs) == len(devices) == n):
        raise ValueError(
            f"parallel_apply: expected as many inputs, kwargs and devices as replicas ({n}), "
            f"got {len(inputs)} inputs, {len(kwargs)} kwargs and {len(devices)} devices"
        )
    streams = _streams(devices)
    callers = [torch.cuda.current_stream(d) if s is not None else None for d, s in zip(devices, streams)]
    for i, (s, c) in enumerate(zip(streams, callers)):
        if s is not None and c is not None and s != c:
            s.wait_stream(c)
            _record((inputs[i], kwargs[i]), s)  # the caller's chunks are read on s
    state = _ThreadState.capture()
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def work(i: int) -> None:
        try:
            with state.applied(), _device_context(devices[i], streams[i]):
                replica = replicas[i]
                fn = replica if method == "forward" else getattr(replica, method)
                results[i] = fn(*inputs[i], **kwargs[i])
        except BaseException as exc:
            errors[i] = exc

    if n == 1:
        work(0)
    else:
        threads = [
            threading.Thread(target=work, args=(i,), name=f"dpmethods-replica-{i}", daemon=True)
            for i in range(n)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for s, c in zip(streams, callers):
        if s is not None and c is not None and s != c:
            c.wait_stream(s)
    failed = next((i for i, e in enumerate(errors) if e is not None), None)
    if failed is not None:
        exc = errors[failed]
        errors.clear()
        try:
            raise _annotate(exc, failed, devices[failed])  # type: ignore[arg-type]
        finally:
            exc = None  # the traceback holds this frame: don't let it hold the exception too
    return results
