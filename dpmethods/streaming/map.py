"""Streaming inference over many batches: the machinery behind ``DataParallel.map``.

Each batch runs whole on one replica, taken by whichever replica is free, so a replica
that finished a short batch starts the next one instead of waiting for the others
(dynamic load balancing). One iterator does the ordering, the prefetch bound, the
progress bar, sharding and closing, over one of two backends that differ only in
"submit a batch" and "take the next finished one": worker threads over a shared queue
(:class:`~dpmethods.streaming.threads.Run`) or worker processes
(:class:`~dpmethods.streaming.process_map.ProcessRun`). The caller's thread pulls
batches from the iterable as the iterator is consumed, never more than ``prefetch``
per replica ahead of the finished ones, so an endless iterable uses bounded memory; in
order, outputs pass through a reorder buffer that is bounded too.

Closing the iterator (``close()``, ``break``, garbage collection, an exception) stops
the backend: pending batches are dropped, and each worker finishes at most the batch it
is running (threads are joined) or, a process, that batch and the one its executor
already took (their outputs are dropped when they arrive).
"""

from __future__ import annotations

import difflib
import itertools
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from dpmethods.core.devices import as_device, check_source_device
from dpmethods.core.oom import check_on_oom
from dpmethods.processes.calls import check_sendable
from dpmethods.processes.pool import ProcessPool
from dpmethods.streaming.process_map import ProcessRun
from dpmethods.streaming.threads import Run
from dpmethods.types import tree as _tree
from dpmethods.vocab.options import MethodOptions

__all__ = ["Indexed", "map_batches", "rank_and_world"]

_ERRORS = ("raise", "yield")
_REORDER = 2  # in order, outputs wait for at most this many windows of in-flight batches


class Indexed:
    """Batches given as ``(index, batch)`` pairs: the map gives each batch that index
    (seeds, notes, ``ordered=False`` pairs) instead of its position, so a resumed map's
    batches keep their input indices.

    Example:
        >>> import torch
        >>> outs = map_batches(torch.nn.Identity(), "forward", Indexed([(7, torch.ones(1))]), ordered=False)
        >>> [(i, o.tolist()) for i, o in outs]
        [(7, [1.0])]
    """

    def __init__(self, pairs: Iterable[tuple[int, Any]]) -> None:
        self.pairs = pairs

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        return iter(self.pairs)


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


class _MapIterator(Iterator[Any]):
    """The iterator ``DataParallel.map`` returns; also a context manager that closes it.

    Any exception out of ``__next__`` (the end, a failed batch, KeyboardInterrupt...)
    closes the map before it propagates.
    """

    def __init__(
        self, run: Any, source: Iterator[tuple[int, Any]], kwargs: dict[str, Any], *,
        ordered: bool, prefetch: int, dim: int, progress: Any,
    ) -> None:
        self._run, self._source, self._kwargs = run, source, kwargs
        self._ordered, self._dim, self._progress = ordered, dim, progress
        self._max_inflight = prefetch * run.width
        self._window = _REORDER * self._max_inflight
        self._seq = self._yielded = self._inflight = self._items = 0
        self._exhausted = self._closed = self._started = False
        self._buffer: dict[int, Any] = {}
        self._sizes: dict[int, int] = {}
        self._t0 = 0.0
        self._finalizer = weakref.finalize(self, run.stop)  # never refers to the iterator

    def __iter__(self) -> _MapIterator:
        return self

    def __enter__(self) -> _MapIterator:
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

    def _start(self) -> None:
        self._started = True
        startup = self._run.start()
        if self._progress is not None:  # after the start-up: a failed one leaves no bar
            self._run.bar = self._progress()
            if startup:  # reported once, by the map that paid it
                self._run.bar.set_postfix_str(f"workers started in {startup:.1f} s", refresh=True)
        self._t0 = time.perf_counter()

    def _next(self) -> Any:
        if not self._started:
            self._start()
        while True:
            if self._ordered and self._yielded in self._buffer:
                self._yielded += 1
                return self._buffer.pop(self._yielded - 1)
            self._fill()
            if self._inflight == 0:
                raise StopIteration
            seq, index, out = self._run.take()
            self._inflight -= 1
            self._tick(seq)
            if not self._ordered:
                self._yielded += 1
                return index, out
            self._buffer[seq] = out

    def _fill(self) -> None:
        """Pull batches while the in-flight and reorder bounds allow."""
        while (
            not self._exhausted
            and self._inflight < self._max_inflight
            and self._seq - self._yielded < self._window
        ):
            try:
                index, batch = next(self._source)
            except StopIteration:
                self._exhausted = True
                self._run.end()
                return
            args, kwargs = _as_call(batch, self._kwargs)
            if self._run.bar is not None:
                self._sizes[self._seq] = _items(args, kwargs, self._dim)
            self._run.submit(self._seq, index, args, kwargs)
            self._seq += 1
            self._inflight += 1

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


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size, for ``shard=True`` (torch.distributed must
    be initialized).

    Example:
        >>> try:
        ...     rank_and_world()
        ... except RuntimeError as exc:  # no process group in this process
        ...     print(str(exc).split(": ")[1])
        shard=True
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "DataParallel.map: shard=True: expected torch.distributed to be initialized "
            "(init_process_group, e.g. under torchrun), but it is not"
        )
    return dist.get_rank(), dist.get_world_size()


def _check_method(module: nn.Module, method: Any, methods: list[str]) -> None:
    if not isinstance(method, str) or (method != "forward" and method not in methods):
        hint = ""
        if callable(getattr(type(module), "map", None)):
            hint = f"; to call {type(module).__name__}.map itself, use .module.map(...)"
        raise ValueError(
            f"map: method: expected 'forward' or the name of a parallel method of "
            f"{type(module).__name__} {sorted(m for m in methods if m != 'forward')}, "
            f"got {type(method).__name__} {method!r}{hint}"
        )


def _check_options(ordered: Any, progress: Any, prefetch: Any, shard: Any, errors: Any,
                   retries: Any, timeout: Any) -> None:
    if errors not in _ERRORS:
        close = difflib.get_close_matches(str(errors), _ERRORS, n=1)
        raise ValueError(f"map: errors: expected one of {list(_ERRORS)}, got {errors!r}"
                         + (f": did you mean {close[0]!r}?" if close else ""))
    for name, value in (("ordered", ordered), ("shard", shard)):
        if not isinstance(value, bool):
            raise TypeError(f"map: {name}: expected a bool, got {type(value).__name__} {value!r}")
    if not isinstance(progress, (bool, str)):
        raise TypeError(
            f"map: progress: expected a bool or a str (the bar's description), got "
            f"{type(progress).__name__} {progress!r}"
        )
    for name, value, least, what in (("prefetch", prefetch, 1, "batches in flight per replica"),
                                     ("retries", retries, 0, "runs again after a worker died")):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"map: {name}: expected an int >= {least} ({what}), got "
                             f"{type(value).__name__} {value!r}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not 0 < timeout < float("inf")):
        raise ValueError(f"map: timeout: expected None or a number of seconds > 0, got "
                         f"{type(timeout).__name__} {timeout!r}")


def _backend(
    module: nn.Module, method: str, devices: list[torch.device], output_device: Any,
    replicate: Any, pool: ProcessPool | None, prefetch: int, **options: Any,
) -> Any:
    """The map's workers: processes of ``pool``, else a thread per replica."""
    # As a call: outputs on output_device; without devices (no GPU) a plain call.
    out_dev = as_device(output_device if output_device is not None else devices[0]) if devices else None
    if pool is not None:
        return ProcessRun(pool, module, method, out_dev, **options)
    replicas: list[nn.Module] = [module]  # one device: the module itself, no copies
    if len(devices) > 1:
        check_source_device(module, devices[0])
        # Built once for the whole map; under no_grad from the replica cache.
        replicas = replicate(module, devices) if replicate is not None else replicas
    options.pop("retries")  # a thread does not die
    return Run(replicas, [*devices] or [None], method, out_dev, prefetch, **options)


def map_batches(
    module: nn.Module,
    method: str,
    batches: Iterable[Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    methods: Iterable[str] = (),
    options: Callable[[str], Any] | None = None,
    devices: Sequence[torch.device] = (),
    output_device: Any = None,
    replicate: Callable[[nn.Module, list[torch.device]], list[nn.Module]] | None = None,
    pool: ProcessPool | None = None,
    ordered: bool = True,
    progress: bool | str = False,
    prefetch: int = 2,
    shard: bool = False,
    retries: int = 0,
    timeout: float | None = None,
    errors: str = "raise",
    on_oom: str = "raise",
) -> Iterator[Any]:
    """Run ``method`` of ``module`` over ``batches``; see ``DataParallel.map``.

    Args:
        module: the module whose replicas (or worker processes) run the batches.
        method: a parallel method's name, or ``"forward"``.
        batches: any iterable; a Mapping batch is passed as keyword arguments, a tuple
            as positional arguments, anything else as the one positional argument.
        kwargs: keyword arguments passed to every call.
        methods: the names of the parallel methods (``method`` must be one, or ``"forward"``).
        options: ``options(method)`` gives the method's options (its ``dim``).
        devices: one replica per device; none: the module runs itself in one thread.
        output_device: where outputs go (default: the first device).
        replicate: ``replicate(module, devices)`` builds the replicas (threads).
        pool: worker processes to run the batches in, instead of threads.
        ordered: yield outputs in input order; else ``(index, output)`` as they finish.
        progress: show a tqdm bar; a str is its description.
        prefetch: batches in flight per replica.
        shard: under torch.distributed, take batch i on rank ``i % world_size`` only.
        retries: times a batch runs again on a fresh worker process after its worker
            died running it (threads do not die).
        timeout: seconds a batch may run, or None. Processes: the worker is killed and
            replaced, the batch retried under ``retries``, then a ``TimeoutError``.
            Threads: a ``TimeoutError`` (a thread cannot be stopped), and that replica
            takes no more batches of this map.
        errors: ``"raise"`` (a failed batch stops the map) or ``"yield"`` (its exception
            is yielded in its place, and the map goes on).
        on_oom: ``"raise"``, or ``"split"``: a batch that raises ``torch.OutOfMemoryError``
            runs in halves on its replica, cut and joined by the method's rules.

    Example:
        >>> import torch
        >>> outs = map_batches(torch.nn.Linear(4, 2), "forward", [torch.ones(3, 4), torch.ones(1, 4)])
        >>> [tuple(o.shape) for o in outs]
        [(3, 2), (1, 2)]
    """
    _check_options(ordered, progress, prefetch, shard, errors, retries, timeout)
    oom = None
    if check_on_oom(on_oom) == "split":  # the method's rules cut and join its halves
        oom = options(method) if options is not None else MethodOptions()
        if pool is not None:  # before any batch runs, not in the first batch's error
            check_sendable(oom, "DataParallel.map(workers='processes', on_oom='split')", method)
    _check_method(module, method, list(methods))
    if not isinstance(batches, Iterable):
        raise TypeError(f"map: batches: expected an iterable, got {type(batches).__name__}")
    rank, world = rank_and_world() if shard else (0, 1)
    pairs = iter(batches) if isinstance(batches, Indexed) else enumerate(batches)
    source: Iterator[tuple[int, Any]] = itertools.islice(pairs, rank, None, world)
    try:
        total: int | None = len(range(rank, len(batches), world))  # type: ignore[arg-type]
    except TypeError:  # no len(), e.g. a generator or a DataLoader of an IterableDataset
        total = None
    run = _backend(module, method, list(devices), output_device, replicate, pool, prefetch,
                   retries=retries, timeout=timeout, oom=oom)
    run.keep_errors = errors == "yield"
    dim = options(method).dim if options is not None else 0
    return _MapIterator(run, source, dict(kwargs or {}), ordered=ordered, prefetch=prefetch,
                        dim=dim, progress=_progress_factory(progress, total))
