"""Streaming inference over many batches: ``DataParallel.map``'s entry.

Each batch runs whole on one replica, taken by whichever replica is free, so a replica
that finished a short batch starts the next one instead of waiting for the others
(dynamic load balancing). The wrapper gives what the map runs on as one value, a
:class:`MapTarget`; :func:`map_batches` checks the map, builds its stages and returns
their iterator: the source (:mod:`~dpmethods.streaming.source`; with
``checkpoint=``, the batches not taken yet: :mod:`~dpmethods.streaming.resume`), the
scheduler (:mod:`~dpmethods.streaming.scheduler`: order, prefetch, retries, timeouts,
``errors=``, progress, stop) over one of two backends, worker threads
(:mod:`~dpmethods.streaming.threads`) or worker processes
(:mod:`~dpmethods.streaming.processes`). The caller's thread pulls batches from the
iterable as the iterator is consumed, never more than ``prefetch`` per replica ahead of
the finished ones, so an endless iterable uses bounded memory; in order, outputs pass
through a reorder buffer that is bounded too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dpmethods.core.devices import as_device, check_source_device
from dpmethods.processes.calls import check_sendable
from dpmethods.processes.pool import ProcessPool
from dpmethods.streaming.options import MapOptions
from dpmethods.streaming.processes import ProcessBackend
from dpmethods.streaming.resume import Checkpoint
from dpmethods.streaming.scheduler import Backend, BatchIterator, Scheduler
from dpmethods.streaming.source import indexed
from dpmethods.streaming.threads import ThreadBackend
from dpmethods.vocab.options import MethodOptions

__all__ = ["MapTarget", "map_batches"]


@dataclass(frozen=True)
class MapTarget:
    """What a map runs on, as its wrapper gives it (``DataParallel.map`` builds one per map).

    Attributes:
        module: the module whose replicas (or worker processes) run the batches.
        methods: each parallel method's options by name; a method not in it (an
            undecorated ``"forward"``, which a map always accepts) has ``MethodOptions()``.
        devices: one replica per device; none: the module runs itself in one thread.
        output_device: where outputs go (None: the first device).
        replicate: ``replicate(module, devices)`` builds the replicas of a map on threads
            (the wrapper's seam of that name); None: the module itself, no copies.
        pool: the worker processes the map runs in; None: threads.

    Example:
        >>> import torch
        >>> from dpmethods.vocab.options import MethodOptions
        >>> target = MapTarget(torch.nn.Linear(4, 2), {"forward": MethodOptions(dim=1)})
        >>> target.options("forward").dim, target.options("encode").dim
        (1, 0)
    """

    module: nn.Module
    methods: Mapping[str, MethodOptions] = field(default_factory=dict)
    devices: Sequence[torch.device] = ()
    output_device: Any = None
    replicate: Callable[[nn.Module, list[torch.device]], list[nn.Module]] | None = None
    pool: ProcessPool | None = None

    def options(self, method: str) -> MethodOptions:
        """``method``'s options (its split ``dim``, its rules for ``on_oom="split"``)."""
        found = self.methods.get(method)
        return found if found is not None else MethodOptions()

    def check_method(self, method: Any) -> None:
        """Refuse a ``method`` that is neither ``"forward"`` nor a parallel method's name."""
        if isinstance(method, str) and (method == "forward" or method in self.methods):
            return
        module, hint = self.module, ""
        if callable(getattr(type(module), "map", None)):
            hint = f"; to call {type(module).__name__}.map itself, use .module.map(...)"
        raise ValueError(
            f"map: method: expected 'forward' or the name of a parallel method of "
            f"{type(module).__name__} {sorted(m for m in self.methods if m != 'forward')}, "
            f"got {type(method).__name__} {method!r}{hint}"
        )


def progress_bar(
    progress: bool | str, total: int | None, unit: str, checkpoint: Checkpoint | None = None
) -> Callable[[], Any] | None:
    """What makes the map's tqdm bar (None: no bar), counting ``unit``s; a resumed map's
    starts at what its ``checkpoint`` counts as done, read when the bar is made."""
    if progress is False:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        raise ImportError(
            "DataParallel.map: progress=True needs tqdm; install it with `pip install tqdm`"
        ) from None
    desc = progress if isinstance(progress, str) else None
    return lambda: tqdm(total=total, initial=checkpoint.done if checkpoint is not None else 0, desc=desc,
                        unit=unit, dynamic_ncols=True)


def _replicas(module: nn.Module, replicate: Callable[[nn.Module, list[torch.device]], list[nn.Module]],
              devices: list[torch.device]) -> list[nn.Module]:
    """A thread map's replicas of ``module``, through the wrapper's ``replicate`` seam."""
    check_source_device(module, devices[0])
    return replicate(module, devices)


def _backend(target: MapTarget, method: str, options: MapOptions, oom: MethodOptions | None) -> Backend:
    """The map's slots: the worker processes of ``target.pool``, else a thread per replica."""
    devices = list(target.devices)
    # As a call: outputs on output_device; without devices (no GPU) a plain call.
    out = target.output_device
    out_dev = as_device(out if out is not None else devices[0]) if devices else None
    if target.pool is not None:
        return ProcessBackend(target.pool, target.module, method, out_dev, prefetch=options.prefetch, oom=oom)
    module, replicate = target.module, target.replicate
    build = None  # one device: the module itself, no copies
    if len(devices) > 1 and replicate is not None:  # under no_grad from the replica cache; again when the module changed
        build = functools.partial(_replicas, module, replicate, devices)
    elif len(devices) > 1:
        check_source_device(module, devices[0])
    return ThreadBackend(module, build, [*devices] or [None], method, out_dev, prefetch=options.prefetch,
                         timeout=options.timeout, oom=oom)


def map_batches(
    target: MapTarget,
    method: str,
    batches: Iterable[Any],
    kwargs: Mapping[str, Any] | None = None,
    options: MapOptions | None = None,
) -> BatchIterator:
    """Run ``method`` of ``target.module`` over ``batches``, as ``options`` say; see ``DataParallel.map``.

    Args:
        target: what the map runs on: the module, its methods' options, the devices and
            the worker processes, if any.
        method: a parallel method's name, or ``"forward"``.
        batches: any iterable; a Mapping batch is passed as keyword arguments, a tuple
            as positional arguments, anything else as the one positional argument.
        kwargs: keyword arguments passed to every call.
        options: the map's options (``workers`` is the wrapper's to read: ``target.pool``).

    Example:
        >>> import torch
        >>> outs = map_batches(MapTarget(torch.nn.Linear(4, 2)), "forward", [torch.ones(3, 4), torch.ones(1, 4)])
        >>> [tuple(o.shape) for o in outs]
        [(3, 2), (1, 2)]
    """
    options = options if options is not None else MapOptions()
    oom = None
    if options.on_oom == "split":  # the method's rules cut and join its halves
        oom = target.options(method)
        if target.pool is not None:  # before any batch runs, not in the first batch's error
            check_sendable(oom, "DataParallel.map(workers='processes', on_oom='split')", method)
    target.check_method(method)
    if not isinstance(batches, Iterable):
        raise TypeError(f"map: batches: expected an iterable, got {type(batches).__name__}")
    kwargs = dict(kwargs or {})
    checkpoint = None
    source: Iterator[tuple[int, Any]]
    if options.checkpoint is not None:  # the record counts batches here; sharded per rank
        checkpoint = Checkpoint.of(options.checkpoint, method, batches, kwargs, target.module, options.shard)
        source, total = checkpoint.pending, checkpoint.total
    else:
        source, total = indexed(batches, options.shard)
    backend = _backend(target, method, options, oom)
    scheduler = Scheduler(backend, retries=options.retries, timeout=options.timeout,
                          keep_errors=options.errors == "yield")
    return BatchIterator(scheduler, source, kwargs, ordered=options.ordered, dim=target.options(method).dim,
                         progress=progress_bar(options.progress, total, "batch", checkpoint), checkpoint=checkpoint)
