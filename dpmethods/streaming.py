"""Streaming inference over many batches: the machinery behind ``DataParallel.map``.

Each batch runs whole on one replica, taken by whichever replica is free: one worker
thread per replica pulls from a shared queue, so a replica that finished a short
batch starts the next one instead of waiting for the others (dynamic load
balancing). The caller's thread pulls batches from the iterable as the iterator is
consumed, never more than ``prefetch`` per replica ahead of the finished ones, so
an endless iterable uses bounded memory. On CUDA, the caller pins each batch and a
worker copies its next batches to its device on a copy stream of its own while it
computes on another (``prefetch`` batches held per replica). Outputs are moved to
``output_device`` by the worker; in order, they pass through a reorder buffer that
is bounded too.

Closing the iterator (``close()``, ``break``, garbage collection, an exception)
stops the workers: pending batches are dropped, each worker finishes at most the
batch it is running, and every thread is joined before ``close()`` returns.
"""

from __future__ import annotations

import collections
import itertools
import queue
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from . import _tree
from .parallel_apply import ReplicaError, _ThreadState
from .scatter import _as_device

__all__ = ["map_batches"]

_END = object()  # the iterable is exhausted, or the map stopped: a worker takes no more
_REORDER = 2  # in order, outputs wait for at most this many windows of in-flight batches
_POLL_S = 0.5  # how often a waiting caller checks that the workers are still alive


def _as_call(batch: Any, kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A batch as call arguments: Mapping -> keywords, tuple -> positional, else one."""
    if isinstance(batch, Mapping):
        bad = [k for k in batch if not isinstance(k, str)]
        if bad:
            raise TypeError(
                f"map: batches: a Mapping batch is passed as keyword arguments, so its keys "
                f"must be str, got {type(bad[0]).__name__} {bad[0]!r}"
            )
        clash = sorted(set(batch) & set(kwargs))
        if clash:
            raise TypeError(
                f"map: batch keys {clash} are also keyword arguments of map(); "
                "give each argument once"
            )
        return (), {**batch, **kwargs}
    if isinstance(batch, tuple):
        return batch, kwargs
    return (batch,), kwargs


def _items(args: tuple[Any, ...], kwargs: dict[str, Any], dim: int) -> int:
    """Items in a batch, for the progress bar: the first batched tensor's size on ``dim``."""
    for leaf in _tree.flatten((args, kwargs))[1]:
        if isinstance(leaf, Tensor) and -leaf.dim() <= dim < leaf.dim():
            return int(leaf.shape[dim])
    first = args[0] if args else next(iter(kwargs.values()), None)
    if isinstance(first, (list, tuple)):  # e.g. sentence-transformers' list of texts
        return len(first)
    return 1


def _move(obj: Any, device: torch.device | None, non_blocking: bool = False) -> Any:
    """``obj`` with its tensor leaves on ``device``; ``obj`` itself when none has to move."""
    if device is None:
        return obj
    spec, leaves = _tree.flatten(obj)
    if not any(isinstance(t, Tensor) and t.device != device for t in leaves):
        return obj
    moved = [t.to(device, non_blocking=non_blocking) if isinstance(t, Tensor) else t for t in leaves]
    return _tree.unflatten(spec, moved)


def _pin(obj: Any) -> Any:
    """``obj`` with its CPU tensor leaves in pinned memory, for asynchronous uploads."""
    spec, leaves = _tree.flatten(obj)
    if not any(isinstance(t, Tensor) and t.device.type == "cpu" for t in leaves):
        return obj
    pinned = [
        t.pin_memory() if isinstance(t, Tensor) and t.device.type == "cpu" and not t.is_pinned() else t
        for t in leaves
    ]
    return _tree.unflatten(spec, pinned)


def _record(obj: Any, stream: Any) -> None:
    # Memory made on one stream and read on another must not be reused too early.
    for t in _tree.flatten(obj)[1]:
        if isinstance(t, Tensor) and t.is_cuda:
            t.record_stream(stream)


def _annotate(exc: BaseException, index: int, replica: int, device: Any) -> BaseException:
    note = f"dpmethods: DataParallel.map: raised in batch {index} on replica {replica} (device {device})"
    if hasattr(exc, "add_note"):
        exc.add_note(note)
        return exc
    wrapped = ReplicaError(note)  # pragma: no cover - Python 3.10 has no notes
    wrapped.__cause__ = exc
    return wrapped


class _Run:
    """What the workers share with the iterator; it never refers to the iterator itself,
    so dropping the iterator lets its finalizer stop them."""

    def __init__(
        self,
        replicas: list[nn.Module],
        devices: list[torch.device | None],
        method: str,
        output_device: torch.device | None,
        depth: int,
    ) -> None:
        self.replicas, self.devices, self.method = replicas, devices, method
        self.output_device, self.depth = output_device, depth
        self.state = _ThreadState.capture()
        self.cuda = any(d is not None and d.type == "cuda" for d in devices)
        self.caller_stream = (
            torch.cuda.current_stream(output_device)
            if output_device is not None and output_device.type == "cuda"
            else None
        )
        self.work: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.results: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.bar: Any = None

    def start(self) -> None:
        for r in range(len(self.replicas)):
            t = threading.Thread(target=_serve, args=(self, r), name=f"dpmethods-map-{r}", daemon=True)
            self.threads.append(t)
            t.start()


def _stage(run: _Run, item: Any, device: torch.device | None, streams: Any) -> Any:
    """Start moving one batch to the replica's device; on CUDA, asynchronously."""
    seq, index, args, kwargs = item
    if streams is None:
        return seq, index, _move(args, device), _move(kwargs, device), None
    copy, compute = streams
    with torch.cuda.stream(copy):
        args, kwargs = _move((args, kwargs), device, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(copy)
    _record((args, kwargs), compute)
    return seq, index, args, kwargs, ready


def _serve(run: _Run, r: int) -> None:
    """One replica's worker: take batches while free, run them, hand back the outputs."""
    replica, device = run.replicas[r], run.devices[r]
    fn = replica if run.method == "forward" else getattr(replica, run.method)
    cuda = device is not None and device.type == "cuda"
    streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if cuda else None
    # Only CUDA gains from holding batches ahead (their copies overlap the compute);
    # elsewhere a batch stays in the shared queue, free for whichever replica is idle.
    depth = run.depth if cuda else 1
    held: collections.deque[Any] = collections.deque()
    ended = False
    with run.state.applied():
        while not run.stop.is_set():
            while not ended and len(held) < depth:
                try:
                    item = run.work.get(block=not held)
                except queue.Empty:
                    break
                if item is _END:
                    ended = True
                    break
                try:
                    held.append(_stage(run, item, device, streams))
                except BaseException as exc:
                    held.append((item[0], item[1], exc, None, None))
            if not held or run.stop.is_set():
                return
            seq, index, args, kwargs, ready = held.popleft()
            try:
                if isinstance(args, BaseException):
                    raise args
                if streams is None:
                    out = _move(fn(*args, **kwargs), run.output_device)
                else:
                    with torch.cuda.device(device), torch.cuda.stream(streams[1]):
                        streams[1].wait_event(ready)
                        out = _move(fn(*args, **kwargs), run.output_device)
                        streams[1].synchronize()  # the caller may read it on any stream
                    if run.caller_stream is not None:
                        _record(out, run.caller_stream)
                run.results.put((seq, index, out, None, r))
            except BaseException as exc:
                run.stop.set()  # the other workers take nothing more
                run.results.put((seq, index, None, exc, r))
            out = args = kwargs = None  # drop this batch before waiting for the next


def _shutdown(run: _Run) -> None:
    """Stop the workers, drop pending batches and join every thread (idempotent)."""
    run.stop.set()
    while True:
        try:
            run.work.get_nowait()
        except queue.Empty:
            break
    for _ in run.threads:
        run.work.put(_END)
    me = threading.current_thread()
    for t in run.threads:
        if t is not me:  # the garbage collector may run this finalizer in a worker
            t.join()
    if run.bar is not None:
        run.bar.close()
        run.bar = None
    while True:
        try:
            run.results.get_nowait()
        except queue.Empty:
            break


class _MapIterator(Iterator[Any]):
    """The iterator ``DataParallel.map`` returns; also a context manager that closes it."""

    def __init__(
        self,
        run: _Run,
        source: Iterator[tuple[int, Any]],
        kwargs: dict[str, Any],
        *,
        ordered: bool,
        prefetch: int,
        dim: int,
        progress: Any,
    ) -> None:
        self._run, self._source, self._kwargs = run, source, kwargs
        self._ordered, self._dim, self._progress = ordered, dim, progress
        self._max_inflight = prefetch * len(run.replicas)
        self._window = _REORDER * self._max_inflight
        self._seq = self._yielded = self._inflight = self._items = 0
        self._exhausted = self._closed = False
        self._buffer: dict[int, Any] = {}
        self._sizes: dict[int, int] = {}
        self._t0 = 0.0
        self._finalizer = weakref.finalize(self, _shutdown, run)

    def __iter__(self) -> _MapIterator:
        return self

    def __enter__(self) -> _MapIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers and join their threads; the iterator is then exhausted."""
        self._closed = True
        self._finalizer()
        self._buffer.clear()

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        try:
            return self._next()
        except BaseException:  # StopIteration, a failed batch, KeyboardInterrupt...
            self.close()
            raise

    def _next(self) -> Any:
        run = self._run
        if not run.threads:
            if self._progress is not None:
                run.bar = self._progress()
            self._t0 = time.perf_counter()
            run.start()
        while True:
            if self._ordered and self._yielded in self._buffer:
                self._yielded += 1
                return self._buffer.pop(self._yielded - 1)
            self._fill()
            if self._inflight == 0:
                raise StopIteration
            seq, index, out, exc, r = self._receive()
            self._inflight -= 1
            if exc is not None:
                try:
                    raise _annotate(exc, index, r, run.devices[r])
                finally:
                    exc = None  # the traceback holds this frame: don't hold the exception too
            self._tick(seq)
            if not self._ordered:
                self._yielded += 1
                return index, out
            self._buffer[seq] = out

    def _fill(self) -> None:
        """Pull batches while the in-flight and reorder bounds allow."""
        run = self._run
        while (
            not self._exhausted
            and self._inflight < self._max_inflight
            and self._seq - self._yielded < self._window
        ):
            try:
                index, batch = next(self._source)
            except StopIteration:
                self._exhausted = True
                for _ in run.threads:
                    run.work.put(_END)
                return
            args, kwargs = _as_call(batch, self._kwargs)
            if run.bar is not None:
                self._sizes[self._seq] = _items(args, kwargs, self._dim)
            if run.cuda:
                args, kwargs = _pin((args, kwargs))
            run.work.put((self._seq, index, args, kwargs))
            self._seq += 1
            self._inflight += 1

    def _receive(self) -> Any:
        run = self._run
        while True:
            try:
                return run.results.get(timeout=_POLL_S)
            except queue.Empty:
                if not any(t.is_alive() for t in run.threads):
                    raise RuntimeError(
                        f"DataParallel.map: every worker thread has stopped with "
                        f"{self._inflight} batches still pending"
                    ) from None

    def _tick(self, seq: int) -> None:
        bar = self._run.bar
        if bar is None:
            return
        self._items += self._sizes.pop(seq, 0)
        elapsed = time.perf_counter() - self._t0
        if elapsed > 0:
            bar.set_postfix_str(f"{self._items / elapsed:.4g} items/s", refresh=False)
        bar.update(1)


def _progress_factory(progress: bool | str, total: int | None) -> Any:
    if progress is False:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        raise ImportError(
            "DataParallel.map: progress=True needs tqdm; install it with `pip install tqdm`"
        ) from None
    desc = progress if isinstance(progress, str) else None
    return lambda: tqdm(total=total, desc=desc, unit="batch", dynamic_ncols=True)


def _shard() -> tuple[int, int]:
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "DataParallel.map: shard=True: expected torch.distributed to be initialized "
            "(init_process_group, e.g. under torchrun), but it is not"
        )
    return dist.get_rank(), dist.get_world_size()


def _check_options(ordered: Any, progress: Any, prefetch: Any, shard: Any) -> None:
    for name, value in (("ordered", ordered), ("shard", shard)):
        if not isinstance(value, bool):
            raise TypeError(f"map: {name}: expected a bool, got {type(value).__name__} {value!r}")
    if not isinstance(progress, (bool, str)):
        raise TypeError(
            f"map: progress: expected a bool or a str (the bar's description), got "
            f"{type(progress).__name__} {progress!r}"
        )
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
        raise ValueError(
            f"map: prefetch: expected an int >= 1 (batches in flight per replica), got "
            f"{type(prefetch).__name__} {prefetch!r}"
        )


def map_batches(
    wrapper: Any,
    method: str,
    batches: Iterable[Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    ordered: bool = True,
    progress: bool | str = False,
    prefetch: int = 2,
    shard: bool = False,
) -> Iterator[Any]:
    """Run ``method`` of a :class:`dpmethods.DataParallel` over ``batches``; see ``DataParallel.map``.

    Args:
        wrapper: the DataParallel whose replicas run the batches.
        method: a parallel method's name, or ``"forward"``.
        batches: any iterable; a Mapping batch is passed as keyword arguments, a tuple
            as positional arguments, anything else as the one positional argument.
        kwargs: keyword arguments passed to every call.
        ordered: yield outputs in input order; else ``(index, output)`` as they finish.
        progress: show a tqdm bar; a str is its description.
        prefetch: batches in flight per replica.
        shard: under torch.distributed, take batch i on rank ``i % world_size`` only.

    Example:
        >>> import torch, dpmethods
        >>> dp = dpmethods.DataParallel(torch.nn.Linear(4, 2), device_ids=["cpu", "cpu"])
        >>> outs = map_batches(dp, "forward", [torch.ones(3, 4), torch.ones(1, 4)])
        >>> [tuple(o.shape) for o in outs]
        [(3, 2), (1, 2)]
    """
    _check_options(ordered, progress, prefetch, shard)
    module: nn.Module = wrapper.module
    methods: dict[str, Any] = wrapper._dpm_methods
    if not isinstance(method, str) or (method != "forward" and method not in methods):
        hint = ""
        if callable(getattr(type(module), "map", None)):
            hint = f"; to call {type(module).__name__}.map itself, use .module.map(...)"
        raise ValueError(
            f"map: method: expected 'forward' or the name of a parallel method of "
            f"{type(module).__name__} {sorted(m for m in methods if m != 'forward')}, "
            f"got {type(method).__name__} {method!r}{hint}"
        )
    if not isinstance(batches, Iterable):
        raise TypeError(f"map: batches: expected an iterable, got {type(batches).__name__}")
    opts = wrapper._options(method)
    devices: list[torch.device] = list(wrapper._devices)
    # As a call: outputs on output_device; without devices (no GPU) a plain call.
    output_device = _as_device(wrapper.output_device) if devices else None
    replicas: list[nn.Module] = [module]  # one device: the module itself, no copies
    if len(devices) > 1:
        wrapper._check_source_device()
        # Built once for the whole map; under no_grad from the replica cache.
        replicas = wrapper.replicate(module, devices)
    source: Iterator[tuple[int, Any]] = enumerate(batches)
    total = len(batches) if hasattr(batches, "__len__") else None  # type: ignore[arg-type]
    if shard:
        rank, world = _shard()
        source = itertools.islice(source, rank, None, world)
        if total is not None:
            total = len(range(rank, total, world))
    run = _Run(replicas, [*devices] or [None], method, output_device, prefetch)
    return _MapIterator(
        run,
        source,
        dict(kwargs or {}),
        ordered=ordered,
        prefetch=prefetch,
        dim=opts.dim,
        progress=_progress_factory(progress, total),
    )
