"""A call through ``DataParallel``: the flow between its seams, and the state the wrapper
keeps across calls (cached replicas and their threads, what fits in each replica's memory
(:class:`~dpmethods.core.oom.Fit`), the warnings given).

:func:`run_method` is the flow of one call: the ``prepare`` hook, then each stage
through the wrapper's seam (scatter, replicate, parallel_apply, gather), then ``finish``.
:func:`replicas_for` and :func:`apply_on` are what the replicate and parallel_apply seams
do; the stages themselves are in :mod:`dpmethods.core`, which keeps no state of a
wrapper's.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dpmethods.core.call import CallContext, current, entered
from dpmethods.core.devices import DeviceLike, as_device
from dpmethods.core.oom import Fit, ShareRunner, split_on_oom
from dpmethods.core.parallel_apply import ReplicaThreads, parallel_apply
from dpmethods.core.replica_cache import CachedReplicas
from dpmethods.core.replicate import fingerprint, replicate
from dpmethods.vocab.call_hooks import Call, check_prepared
from dpmethods.vocab.gather_modes import mode_check
from dpmethods.vocab.options import MethodOptions

__all__ = ["apply_on", "replicas_for", "run_method", "run_plain", "share_runner"]


def run_method(
    wrapper: Any, name: str, fn: Callable[..., Any], args: tuple[Any, ...],
    kwargs: dict[str, Any], opts: MethodOptions, key: Any,
    remote: Callable[[Sequence[Any], Sequence[Any]], list[Any]] | None,
) -> Any:
    """Run method ``name`` of ``wrapper.module`` through the wrapper's torch seams.

    Args:
        wrapper: the wrapper (``scatter``, ``replicate``, ``parallel_apply``, ``gather``,
            ``module``, ``device_ids``, ``output_device``).
        fn: the bound method (``forward`` runs through the module's ``__call__``).
        key: the replica-cache fingerprint, or None.
        remote: runs the shares in worker processes instead of replicas, or None.
    """
    finish = None
    if opts.hooks is not None and opts.hooks.prepare is not None:
        args, kwargs, finish = check_prepared(opts.hooks.prepare(
            args, kwargs, Call(wrapper.module, name, args, kwargs, (), opts)
        ), opts.hooks.prepare)
    with entered(CallContext(wrapper, name, opts, fn, key, args=args, kwargs=kwargs)) as ctx:
        check = mode_check(opts.gather)  # a named mode refuses what it can't join, before the work
        if check is not None:
            check(ctx.seen(wrapper.module))
        # torch's seams, with torch's signatures; the rest of the call is in ctx.
        inputs, kwargs_tup = wrapper.scatter(args, kwargs, wrapper.device_ids)
        if not inputs and not kwargs_tup:
            inputs, kwargs_tup = ((),), ({},)
        _warn_small(wrapper, ctx.sizes, len(inputs))
        if remote is not None:
            outputs = remote(inputs, kwargs_tup)
        elif len(wrapper.device_ids) == 1:
            call = wrapper.module if name == "forward" else fn  # forward: hooks run
            run = share_runner(wrapper, ctx)
            outputs = [call(*inputs[0], **kwargs_tup[0]) if run is None else run(0, call, inputs[0], kwargs_tup[0])]
        else:
            replicas = wrapper.replicate(wrapper.module, wrapper.device_ids[: len(inputs)])
            outputs = wrapper.parallel_apply(replicas, inputs, kwargs_tup)
        out = wrapper.gather(outputs, wrapper.output_device)
    return out if finish is None else finish(out)


def _warn_small(wrapper: Any, sizes: list[int], n: int) -> None:
    if n >= len(wrapper.device_ids) or sum(sizes) == 0:
        return
    small = (sum(sizes), len(wrapper.device_ids))
    warned: set[tuple[int, int]] = wrapper._warned_small
    if small not in warned:
        warned.add(small)
        warnings.warn(
            f"DataParallel: a batch of {small[0]} items on {small[1]} devices: only "
            f"{n} replicas run, the other devices stay idle",
            UserWarning,
            stacklevel=5,
        )


def replicas_for(wrapper: Any, module: Any, device_ids: Sequence[DeviceLike]) -> list[Any]:
    """What the replicate seam does: fresh replicas, or (``cache_replicas`` under
    ``no_grad``, of the wrapped module on a prefix of its devices) a loan of cached ones."""
    devices = [as_device(d) for d in device_ids]
    grad = torch.is_grad_enabled()
    own = wrapper._devices
    if not (wrapper.cache_replicas and not grad and module is wrapper.module and devices == own[: len(devices)]):
        return replicate(module, devices, not grad, cpu_replicas=wrapper.cpu_replicas)
    ctx = current(wrapper)
    key = ctx.key if ctx is not None and ctx.key is not None else fingerprint(module)
    cached, loan = CachedReplicas.lend_or_build(
        wrapper._replica_cache, key, module, own, len(devices),
        lambda devs: replicate(module, devs, True, cpu_replicas=wrapper.cpu_replicas),
    )
    wrapper._replica_cache = cached
    return loan


def apply_on(wrapper: Any, replicas: Sequence[Any], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
    """What the parallel_apply seam does: the current method on every replica, as
    torch's seam takes its arguments (``kwargs`` None, bare inputs); with
    ``cache_replicas`` the replicas' threads are kept between calls."""
    n = len(replicas)
    inputs = [x if isinstance(x, (tuple, list)) else (x,) for x in inputs]
    kwargs = [{}] * n if kwargs is None else kwargs
    ctx = current(wrapper)
    kept = None
    if wrapper.cache_replicas and len(wrapper._devices) > 1:
        kept = wrapper._replica_threads
        if kept is None:
            kept = wrapper._replica_threads = ReplicaThreads(len(wrapper._devices) - 1)
    try:
        return parallel_apply(
            replicas, ctx.name if ctx is not None else "forward", inputs, kwargs,
            wrapper._devices[:n], kept, call_share=share_runner(wrapper, ctx),
        )
    finally:
        CachedReplicas.give_back(replicas)


def share_runner(wrapper: Any, ctx: CallContext | None) -> ShareRunner | None:
    """With ``on_oom="split"``, how replica ``i`` runs its share (see
    :class:`~dpmethods.core.oom.ShareRunner`), with what fits kept by the wrapper across
    calls; None otherwise."""
    if ctx is None or wrapper.on_oom != "split":
        return None
    return ShareRunner(wrapper.module, ctx.name, ctx.options, wrapper._devices, wrapper._oom_fits,
                       list(ctx.sizes), ctx.fn)


def run_plain(wrapper: Any, name: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A wrapper without devices (no GPU): a plain call, split as a map's batch would be
    with ``on_oom="split"``."""
    call = wrapper.module if name == "forward" else fn  # forward: the module's hooks run
    if wrapper.on_oom != "split":
        return call(*args, **kwargs)
    return split_on_oom(wrapper.module, name, wrapper._options(name), call, "cpu",
                        Fit.kept(wrapper._oom_fits, (0, name)), args, kwargs, names=fn, prepared=False)
