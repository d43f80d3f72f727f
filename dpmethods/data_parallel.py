"""``dpmethods.DataParallel``: torch's DataParallel for every parallel method, not just forward.

It subclasses ``torch.nn.DataParallel`` and overrides its four seams (``scatter``,
``replicate``, ``parallel_apply``, ``gather``) with method-aware versions, so it
also runs on CPU devices (``device_ids=["cpu"] * 4``) and on repeated GPU ids.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from dpmethods.core import devices as _placement
from dpmethods.core.call import current, gather_outputs, scatter_shares
from dpmethods.core.devices import DeviceLike
from dpmethods.core.oom import Fit, check_on_oom
from dpmethods.core.parallel_apply import ReplicaThreads
from dpmethods.core.replica_cache import CachedReplicas
from dpmethods.core.replicate import cpu_replicas_mode, fingerprint
from dpmethods.items import item_options, map_items
from dpmethods.processes.calls import call_shares
from dpmethods.processes.pool import ProcessPool, check_factory, check_workers
from dpmethods.state_dicts import load_matched
from dpmethods.streaming.map import MapTarget, map_batches
from dpmethods.streaming.options import MapOptions
from dpmethods.wrapper import call as _flow
from dpmethods.wrapper.base import MethodWrapper, check_argument_names, check_flag, check_module
from dpmethods.wrapper.registry import MethodOptions, MethodsArg

__all__ = ["DataParallel"]

_T = TypeVar("_T", bound=nn.Module)


class DataParallel(MethodWrapper, nn.DataParallel[_T]):
    """Data parallelism for ``forward`` and every parallel method of the module.

    A drop-in replacement for ``torch.nn.DataParallel``: ``forward``, ``.module``,
    ``state_dict`` keys with the ``module.`` prefix and ``device_ids`` are as in torch.
    Each parallel method (marked ``@parallel_method``, registered with
    :func:`dpmethods.register`, or named in ``methods=``) is an attribute that
    scatters its arguments, replicates the module, runs the method on every replica
    in parallel and gathers the outputs onto ``output_device``.

    Args:
        module: the module to parallelize.
        device_ids: CUDA devices (ints or devices, repeats allowed) or CPU devices
            (``["cpu"] * 4``). Default: all GPUs; without GPUs, a plain call.
        output_device: where outputs are gathered (default ``device_ids[0]``).
        dim: the batch dimension of ``forward`` when it is not decorated.
        methods: more parallel methods, ``["generate"]`` or
            ``{"generate": {"gather": "pad", "pad_value": 0}}``.
        cache_replicas: keep replicas between calls under ``torch.no_grad()``; they are
            rebuilt whenever a parameter, buffer, attribute or mode of the module changes.
            The replicas' threads are kept too (daemon threads, stopped when the
            wrapper is garbage-collected).
        cpu_replicas: ``"shared"`` (CPU replicas use the module's tensors) or
            ``"distinct"`` (each CPU entry of ``device_ids`` gets its own parameter and
            buffer copies, through the autograd broadcast distinct GPUs get); default
            ``$DPMETHODS_CPU_REPLICAS``, else ``"shared"``. See docs/reliability.md.
        workers: ``"threads"`` (default) or ``"processes"``: one worker process per device
            runs maps and inference calls, past the GIL (outputs must not require grad);
            ``map(workers=)`` overrides it per map. See docs/map.md; ``close()`` stops them.
        factory: with processes, a picklable zero-argument callable that builds the
            module in each worker, instead of sending it (changes to it are then not seen).
        on_oom: ``"raise"`` (default) or ``"split"``: a share that raises ``torch.OutOfMemoryError``
            runs in halves, as a call over two devices would (docs/options.md).

    Tensors are split along the method's ``dim``; other arguments go whole to every
    replica (an iterator is read once, each replica getting its own). Without GPUs,
    CUDA ``device_ids`` are ignored (with one warning) and the wrapper is a plain call,
    as in torch. Every call goes through ``scatter``, ``replicate``, ``parallel_apply``
    and ``gather`` with torch's signatures, so a subclass may override them as for
    ``torch.nn.DataParallel``; the method and its options travel with the call.

    Example:
        >>> import torch, dpmethods
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = torch.nn.Linear(4, 2)
        ...     @dpmethods.parallel_method
        ...     def encode(self, x):
        ...         return self.lin(x)
        >>> dp = dpmethods.DataParallel(Net(), device_ids=["cpu", "cpu"])
        >>> dp.encode(torch.randn(5, 4)).shape
        torch.Size([5, 2])
    """

    def __init__(
        self,
        module: _T,
        device_ids: Sequence[DeviceLike] | None = None,
        output_device: DeviceLike | None = None,
        dim: int = 0,
        methods: MethodsArg = None,
        *,
        cache_replicas: bool = False,
        cpu_replicas: str | None = None,
        workers: str = "threads",
        factory: Callable[[], nn.Module] | None = None,
        on_oom: str = "raise",
    ) -> None:
        # torch's __init__ turns into a passthrough without GPUs, so it can't take CPU devices.
        check_module(module)
        nn.Module.__init__(self)
        torch._C._log_api_usage_once("dpmethods.DataParallel")
        self.module = module
        MethodOptions(dim=dim)  # checks dim
        check_flag("cache_replicas", cache_replicas)
        self.dim = dim
        self.cache_replicas = cache_replicas
        self.cpu_replicas = cpu_replicas_mode(cpu_replicas)
        self.workers = check_workers(workers)
        self.on_oom = check_on_oom(on_oom)
        self._devices = _placement.resolve_devices(device_ids)
        self.__dict__["_process_pool"] = ProcessPool(self._devices, check_factory(factory))
        self._init_call_state()
        self._init_methods(module, methods)
        check_argument_names(self.module, self._dpm_methods)
        self._replica_cache: CachedReplicas | None = None
        # As torch: CUDA devices as indices; CPU devices (ours only) as torch.device.
        self.device_ids: list[int | torch.device] = [  # type: ignore[assignment]
            d.index if d.type == "cuda" else d for d in self._devices
        ]
        if not self._devices:
            return
        out = _placement.resolve_output_device(output_device, self._devices)
        self.output_device: int | torch.device = out.index if out.type == "cuda" else out  # type: ignore[assignment]
        self.src_device_obj = self._devices[0]
        if len(self._devices) == 1:
            self.module.to(self.src_device_obj)

    def _init_call_state(self) -> None:
        """The state kept across calls (:mod:`dpmethods.wrapper.call`), empty."""
        self._replica_threads: ReplicaThreads | None = None  # cache_replicas: the replicas' threads, kept
        self._oom_fits: dict[tuple[int, str], Fit] = {}  # on_oom: (replica, method) -> what fits
        self._warned_small: set[tuple[int, int]] = set()  # (items, devices) warned as too few
        self._dim_options: MethodOptions | None = None  # an undecorated forward's, for self.dim

    def __setstate__(self, state: dict[str, Any]) -> None:
        # The call state is never pickled: it starts empty. A pickle without on_oom (version
        # 0.1.0's) keeps the behaviour it was made with: out-of-memory errors raise.
        self._init_call_state()
        self.on_oom = "raise"
        super().__setstate__(state)
        if "_process_pool" not in self.__dict__:  # 0.1.0's: its worker processes, not started
            self.__dict__["_process_pool"] = ProcessPool(self._devices)

    def _undecorated_warning(self, name: str) -> str | None:
        return None if len(self._devices) < 2 else (
            f"DataParallel: {type(self.module).__name__}.{name} is not a parallel method, so it "
            f"runs on {self.src_device_obj} only. Mark it with @dpmethods.parallel_method or "
            f"pass methods=[{name!r}] to run it on every device."
        )

    def _submodule_warning(self, name: str) -> str | None:
        return None if len(self._devices) < 2 else (
            f"DataParallel: {name} is a submodule of the wrapped {type(self.module).__name__}, "
            f"returned as it is, so calling it runs on {self.src_device_obj} only. Pass "
            f"methods=[{name!r}] to run dp.{name}(...) on every device, or read "
            f"dp.module.{name} to mean the submodule itself."
        )

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self._run_method("forward", inputs, kwargs)

    def map(
        self, method: str, batches: Iterable[Any], /, *, ordered: bool = True, progress: bool | str = False,
        prefetch: int | None = None, shard: bool = False, workers: str | None = None, retries: int = 1, timeout: float | None = None,
        errors: str = "raise", on_oom: str = "raise", checkpoint: str | os.PathLike[str] | None = None,
        batch_size: int | None = None, max_tokens: int | None = None, length: Callable[[Any], int] | None = None,
        collate: Callable[[list[Any]], Any] | None = None, window: int | str | None = "auto", trim: bool = False,
        **kwargs: Any,
    ) -> Iterator[Any]:
        """Run ``method`` over many batches, each whole on whichever replica is free: an
        iterator of the outputs on ``output_device`` (``close()`` it to stop early).

        Args (docs/map.md has each one's behaviour and cost):
            method: a parallel method's name, or ``"forward"``.
            batches: any iterable; a Mapping batch gives keyword arguments, a tuple positional ones.
            ordered: outputs in input order; if False, ``(index, output)`` as they finish.
            progress: a tqdm bar of batches and items per second; a str is its title.
            prefetch: batches in flight per replica (memory stays bounded); None: two, and on
                worker processes four while the batches run under 1 ms each.
            shard: under torch.distributed, only batch i with ``i % world_size == rank``.
            workers: ``"threads"`` or ``"processes"``; default: the wrapper's.
            retries: runs of a batch again on a fresh worker process after its worker died.
            timeout: seconds a batch may run (processes: killed, retried; threads: raised).
            errors: ``"raise"``, or ``"yield"``: a failed batch's exception in its place.
            on_oom: ``"raise"``, or ``"split"``: a batch out of memory runs in halves.
            checkpoint: a file recording the map and the outputs taken: its rerun skips them.
            batch_size: item mode (docs/map.md#items-of-mixed-lengths): ``batches`` are items, sorted by length, this many a batch at most.
            max_tokens: item mode: at most this many padded positions (rows x longest) a batch.
            length: an item's cost (an int); collate: a list of items -> one batch.
            window: items sorted together (``"auto"``: 64 batches' worth; None: all).
            trim: each item's output cut to its own length where it has the padded length.
            **kwargs: passed to every call (a name clashing with an option: docs/map.md).

        Example:
            >>> import torch, dpmethods
            >>> dp = dpmethods.DataParallel(torch.nn.Linear(4, 2), device_ids=["cpu"] * 2)
            >>> with torch.no_grad():
            ...     outs = list(dp.map("forward", [torch.randn(3, 4) for _ in range(5)]))
            >>> len(outs), outs[0].shape
            (5, torch.Size([3, 2]))
        """
        items = item_options(batches, batch_size=batch_size, max_tokens=max_tokens, length=length,
                             collate=collate, window=window, trim=trim)
        options = MapOptions(ordered=ordered, progress=progress, prefetch=prefetch, shard=shard, workers=workers,
                             retries=retries, timeout=timeout, errors=errors, on_oom=on_oom, checkpoint=checkpoint)
        processes = check_workers(self.workers if options.workers is None else options.workers) == "processes"
        target = MapTarget(
            self.module, methods={"forward": self._options("forward"), **self._dpm_methods}, devices=self._devices,
            output_device=getattr(self, "output_device", None), replicate=self.replicate,
            pool=self._process_pool if processes and self._devices else None,
        )
        if items is not None:  # the map's batches are cut from the items
            return map_items(target, method, batches, items, options, kwargs)
        return map_batches(target, method, batches, kwargs, options)

    def _options(self, name: str) -> MethodOptions:
        opts = self._dpm_methods.get(name)
        if opts is not None:
            return opts
        # Undecorated forward: ``self.dim`` as it is now (torch reads it per call too).
        cached = self._dim_options
        if cached is None or cached.dim != self.dim:
            cached = self._dim_options = MethodOptions(dim=self.dim)
        return cached

    def _run_method(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        fn = getattr(self.module, name)
        if not self.device_ids:
            return _flow.run_plain(self, name, fn, args, kwargs)
        key = fingerprint(self.module) if self._caching() else None
        cached = self._replica_cache
        if key is None or cached is None or cached.key != key:
            _placement.check_source_device(self.module, self.src_device_obj)  # a cache hit means the devices were checked
        remote = None
        if self.workers == "processes" and (len(self.device_ids) > 1 or self._process_pool.factory):
            remote = functools.partial(call_shares, self._process_pool, self.module, name,
                                       oom=self._options(name) if self.on_oom == "split" else None)
        return _flow.run_method(self, name, fn, args, kwargs, self._options(name), key, remote)

    # --- torch's seams, torch's signatures, method-aware through the current call ----

    def scatter(
        self,
        inputs: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        device_ids: Sequence[DeviceLike],
    ) -> Any:
        """Split a call's arguments per device; see :func:`dpmethods.core.scatter.scatter_call`.

        Returns ``(inputs, kwargs)``: per replica, a tuple of positional arguments and
        a dict of keyword arguments, as torch's ``DataParallel.scatter``.
        """
        ctx = current(self)
        opts = ctx.options if ctx is not None else self._options("forward")
        return scatter_shares(self.module, ctx, opts, inputs, kwargs, device_ids)

    def _caching(self) -> bool:
        return self.cache_replicas and not torch.is_grad_enabled()

    def replicate(self, module: nn.Module, device_ids: Sequence[DeviceLike]) -> list[nn.Module]:  # type: ignore[override]
        """Replicas of ``module`` on ``device_ids``; cached under no_grad if ``cache_replicas``."""
        return _flow.replicas_for(self, module, device_ids)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_replica_cache"] = None  # rebuilt on demand; threads can't be copied
        state["_replica_threads"] = None  # threads can't be copied; a copy starts its own
        return state

    def close(self) -> None:
        """Stop and join the worker processes of ``workers="processes"`` (if started).

        The next map or call that needs them starts fresh ones.

        Example:
            >>> import torch, dpmethods
            >>> dp = dpmethods.DataParallel(torch.nn.Linear(2, 2), ["cpu"] * 2, workers="processes")
            >>> dp.close()
        """
        self._process_pool.close()

    def parallel_apply(  # type: ignore[override]
        self, replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Any = None
    ) -> list[Any]:
        """Run the current method on every replica in parallel; see :func:`dpmethods.parallel.parallel_apply`.

        As torch: ``kwargs`` may be None, and an input that is not a tuple or list is
        the replica's only argument. With ``cache_replicas`` the replicas' threads are kept.
        """
        return _flow.apply_on(self, replicas, inputs, kwargs)

    def gather(self, outputs: Any, output_device: DeviceLike) -> Any:  # type: ignore[override]
        """Gather replica outputs by the method's ``gather`` option; see :func:`dpmethods.parallel.gather`."""
        ctx = current(self)
        opts = ctx.options if ctx is not None else self._options("forward")
        return gather_outputs(self.module, ctx, opts, outputs, output_device)

    def load_state_dict(  # type: ignore[override]
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load a state dict saved from this wrapper, the bare module or ``torch.compile``
        (see :func:`dpmethods.load_state_dict`): wrapper prefixes matched once each."""
        return load_matched(
            super().load_state_dict, self.state_dict(keep_vars=True).keys(), state_dict,
            strict, assign=assign,
        )
