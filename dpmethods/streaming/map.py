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

import itertools
import queue
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from dpmethods.core.devices import as_device, check_source_device
from dpmethods.core.parallel_apply import add_note
from dpmethods.streaming.threads import END, Run, pin, produced, shutdown
from dpmethods.types import tree as _tree

__all__ = ["map_batches"]

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


def _annotate(exc: BaseException, index: int | None, replica: int, device: Any) -> BaseException:
    where = "while starting" if index is None else f"in batch {index}"
    return add_note(exc, f"dpmethods: DataParallel.map: raised {where} on replica {replica} (device {device})")


def _stop_iteration_error(exc: StopIteration, index: int | None) -> RuntimeError:
    where = "while starting" if index is None else f"in batch {index}"
    err = RuntimeError(
        f"DataParallel.map: the method raised StopIteration {where}; it is re-raised as a "
        "RuntimeError so it is not taken for the end of the map"
    )
    err.__cause__ = exc
    return err


class MapIteratorBase(Iterator[Any]):
    """What the thread map's and the process map's iterators share: closing.

    A subclass sets ``_closed``, ``_finalizer`` (stops its workers) and ``_buffer`` in its
    ``__init__`` and defines ``_next()``. Any exception out of ``_next`` (the end, a failed
    batch, KeyboardInterrupt...) closes the map before it propagates.
    """

    _closed: bool
    _finalizer: Any
    _buffer: dict[int, Any]

    def __iter__(self) -> MapIteratorBase:
        return self

    def __enter__(self) -> MapIteratorBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers; the iterator is then exhausted."""
        self._closed = True
        self._finalizer()
        self._buffer.clear()

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        try:
            return self._next()
        except BaseException:
            self.close()
            raise

    def _next(self) -> Any:
        raise NotImplementedError


class _MapIterator(MapIteratorBase):
    """The iterator ``DataParallel.map`` returns; also a context manager that closes it."""

    def __init__(
        self,
        run: Run,
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
        self._finalizer = weakref.finalize(self, shutdown, run)

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
                if isinstance(exc, StopIteration):
                    # Raised out of __next__ it would end the map, silently short (PEP 479
                    # turns it into a RuntimeError in generators for the same reason).
                    exc = _stop_iteration_error(exc, index)
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
                    run.work.put(END)
                return
            args, kwargs = _as_call(batch, self._kwargs)
            if run.bar is not None:
                self._sizes[self._seq] = _items(args, kwargs, self._dim)
            events: list[Any] = []
            if run.cuda:  # pinned, for asynchronous uploads; ordered after their making
                args, kwargs = pin((args, kwargs))
                events = produced((args, kwargs))
            run.work.put((self._seq, index, args, kwargs, events))
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
    rank, world = _shard() if shard else (0, 1)
    source: Iterator[tuple[int, Any]] = itertools.islice(enumerate(batches), rank, None, world)
    try:
        total: int | None = len(range(rank, len(batches), world))  # type: ignore[arg-type]
    except TypeError:  # no len(), e.g. a generator or a DataLoader of an IterableDataset
        total = None
    opts = wrapper._options(method)
    devices: list[torch.device] = list(wrapper._devices)
    # As a call: outputs on output_device; without devices (no GPU) a plain call.
    output_device = as_device(wrapper.output_device) if devices else None
    replicas: list[nn.Module] = [module]  # one device: the module itself, no copies
    if len(devices) > 1:
        check_source_device(module, devices[0])
        # Built once for the whole map; under no_grad from the replica cache.
        replicas = wrapper.replicate(module, devices)
    run = Run(replicas, [*devices] or [None], method, output_device, prefetch)
    return _MapIterator(
        run,
        source,
        dict(kwargs or {}),
        ordered=ordered,
        prefetch=prefetch,
        dim=opts.dim,
        progress=_progress_factory(progress, total),
    )
