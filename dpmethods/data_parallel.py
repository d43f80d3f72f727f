"""``dpmethods.DataParallel``: torch's DataParallel for every parallel method, not just forward.

It subclasses ``torch.nn.DataParallel`` and overrides its four seams (``scatter``,
``replicate``, ``parallel_apply``, ``gather``) with method-aware versions, so it
also runs on CPU devices (``device_ids=["cpu"] * 4``) and on repeated GPU ids.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping, Sequence
from itertools import chain
from typing import Any

import torch
from torch import nn

from ._wrapping import _MethodWrapper
from .gather import gather as _gather
from .parallel_apply import WorkerPool
from .parallel_apply import parallel_apply as _parallel_apply
from .registry import MethodOptions, MethodsArg
from .replica_cache import CachedReplicas
from .replicate import cpu_replicas_mode, fingerprint
from .replicate import replicate as _replicate
from .scatter import ScatterResult, _as_device, scatter_call
from .utils import add_prefix

__all__ = ["DataParallel"]

DeviceId = int | str | torch.device


def _resolve_devices(device_ids: Sequence[DeviceId] | None) -> list[torch.device]:
    if device_ids is None:
        if not torch.cuda.is_available():
            return []  # as torch: without GPUs the wrapper is a plain call
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    if isinstance(device_ids, (str, int, torch.device)):
        raise TypeError(
            f"device_ids: expected a list of devices, got {type(device_ids).__name__} {device_ids!r}"
        )
    devices: list[torch.device] = []
    for i, d in enumerate(device_ids):
        if isinstance(d, bool) or not isinstance(d, (int, str, torch.device)):
            raise TypeError(
                f"device_ids[{i}]: expected an int, str or torch.device, got {type(d).__name__} {d!r}"
            )
        dev = _as_device(d)
        if dev.type == "cuda":
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            count = torch.cuda.device_count()
            if dev.index >= count:
                raise ValueError(
                    f"device_ids[{i}]: expected a CUDA device index below {count} "
                    f"(torch.cuda.device_count()), got {dev.index}"
                )
        elif dev.type != "cpu":
            raise ValueError(f"device_ids[{i}]: expected a CUDA or CPU device, got {dev}")
        devices.append(dev)
    if not devices:
        raise ValueError("device_ids: expected at least one device, got []")
    kinds = sorted({d.type for d in devices})
    if len(kinds) > 1:
        raise ValueError(
            f"device_ids: expected devices of one type, got {kinds}: {[str(d) for d in devices]}"
        )
    return devices


class DataParallel(_MethodWrapper, nn.DataParallel):
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
            The replicas' worker threads are kept too (daemon threads, stopped when the
            wrapper is garbage-collected).
        cpu_replicas: ``"shared"`` (CPU replicas use the module's tensors) or
            ``"distinct"`` (each CPU entry of ``device_ids`` gets its own parameter and
            buffer copies, through the autograd broadcast distinct GPUs get); default
            ``$DPMETHODS_CPU_REPLICAS``, else ``"shared"``. See docs/reliability.md.

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
        module: nn.Module,
        device_ids: Sequence[DeviceId] | None = None,
        output_device: DeviceId | None = None,
        dim: int = 0,
        methods: MethodsArg = None,
        *,
        cache_replicas: bool = False,
        cpu_replicas: str | None = None,
    ) -> None:
        # torch's __init__ turns into a passthrough without GPUs, so it can't take CPU devices.
        nn.Module.__init__(self)
        torch._C._log_api_usage_once("dpmethods.DataParallel")
        self.module = module
        self.dim = dim
        self.cache_replicas = bool(cache_replicas)
        self.cpu_replicas = cpu_replicas_mode(cpu_replicas)
        self._devices = _resolve_devices(device_ids)
        self._init_methods(module, methods)
        self._forward_options = self._dpm_methods.get("forward", MethodOptions(dim=dim))
        self._check_broadcast_names()
        self._replica_cache: CachedReplicas | None = None
        self._warned_small: set[tuple[int, int]] = set()
        # As torch: CUDA devices as indices; CPU devices (ours only) as torch.device.
        self.device_ids: list[int | torch.device] = [  # type: ignore[assignment]
            d.index if d.type == "cuda" else d for d in self._devices
        ]
        if not self._devices:
            return
        out = self._devices[0] if output_device is None else _as_device(output_device)
        self.output_device: int | torch.device = out.index if out.type == "cuda" else out  # type: ignore[assignment]
        self.src_device_obj = self._devices[0]
        if len(self._devices) == 1:
            self.module.to(self.src_device_obj)

    def _check_broadcast_names(self) -> None:
        for name, opts in self._dpm_methods.items():
            if not opts.broadcast:
                continue
            params = inspect.signature(getattr(type(self.module), name)).parameters
            if any(p.kind == p.VAR_KEYWORD for p in params.values()):
                continue
            unknown = [b for b in opts.broadcast if b not in params]
            if unknown:
                raise ValueError(
                    f"broadcast: {unknown} are not arguments of "
                    f"{type(self.module).__name__}.{name}; its arguments are "
                    f"{[p for p in params if p != 'self']}"
                )

    def _undecorated_warning(self, name: str) -> str | None:
        if len(self._devices) < 2:
            return None
        return (
            f"DataParallel: {type(self.module).__name__}.{name} is not a parallel method, so it "
            f"runs on {self.src_device_obj} only. Mark it with @dpmethods.parallel_method or "
            f"pass methods=[{name!r}] to run it on every device."
        )

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self._run_method("forward", inputs, kwargs)

    def _check_source_device(self) -> None:
        src = self.src_device_obj
        for t in chain(self.module.parameters(), self.module.buffers()):
            if t.device != src:
                named = chain(self.module.named_parameters(), self.module.named_buffers())
                where = next(n for n, v in named if v.device != src)
                raise RuntimeError(
                    f"DataParallel: module must have its parameters and buffers on device "
                    f"{src} (device_ids[0]), but {where!r} is on {t.device}"
                )

    def _run_method(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        fn = getattr(self.module, name)
        call = self.module if name == "forward" else fn  # forward through __call__, so hooks run
        if not self._devices:
            return call(*args, **kwargs)
        opts = self._dpm_methods.get(name, self._forward_options)
        key = fingerprint(self.module) if self._caching() else None
        cached = self._replica_cache
        if key is None or cached is None or cached.key != key:
            self._check_source_device()  # a cache hit means the devices were checked
        scattered = self.scatter(args, kwargs, self._devices, options=opts, fn=fn)
        inputs, kwargs_tup = scattered
        n = len(inputs)
        if n < len(self._devices) and scattered.sizes != [0]:
            small = (sum(scattered.sizes), len(self._devices))
            if small not in self._warned_small:
                self._warned_small.add(small)
                warnings.warn(
                    f"DataParallel: a batch of {small[0]} items on {small[1]} devices: only "
                    f"{n} replicas run, the other devices stay idle",
                    UserWarning,
                    stacklevel=3,
                )
        if len(self._devices) == 1:
            outputs = [call(*inputs[0], **kwargs_tup[0])]
        else:
            replicas = self.replicate(self.module, self._devices[:n], key=key)
            outputs = self.parallel_apply(replicas, inputs, kwargs_tup, method=name)
        total = sum(scattered.sizes)
        weights = [s / total for s in scattered.sizes] if total else None
        return self.gather(outputs, self.output_device, options=opts, weights=weights)

    # --- torch's seams, method-aware -------------------------------------------------

    def scatter(  # type: ignore[override]
        self,
        inputs: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        device_ids: Sequence[DeviceId],
        *,
        options: MethodOptions | None = None,
        fn: Any = None,
    ) -> ScatterResult:
        """Split a call's arguments per device; see :func:`dpmethods.scatter.scatter_call`.

        Returns ``(inputs, kwargs)`` per replica like torch, with ``.sizes`` (batch items
        per replica) attached.
        """
        opts = options or self._forward_options
        return scatter_call(
            tuple(inputs), dict(kwargs or {}), device_ids, opts.dim, opts.broadcast, fn
        )

    def _caching(self) -> bool:
        return self.cache_replicas and not torch.is_grad_enabled()

    def replicate(  # type: ignore[override]
        self, module: nn.Module, device_ids: Sequence[DeviceId], *, key: Any = None
    ) -> list[nn.Module]:
        """Replicas of ``module`` on ``device_ids``; cached under no_grad if ``cache_replicas``.

        ``key`` is ``fingerprint(module)`` when the caller has it already.
        """
        devices = [_as_device(d) for d in device_ids]
        prefix = devices == self._devices[: len(devices)]
        if not (self._caching() and module is self.module and prefix):
            return _replicate(
                module, devices, not torch.is_grad_enabled(), cpu_replicas=self.cpu_replicas
            )
        key = fingerprint(module) if key is None else key
        cached = self._replica_cache
        loan = cached.lend(len(devices)) if cached is not None and cached.key == key else None
        if loan is None and (cached is None or not cached.lent()):
            # Replicas for every device, so calls with smaller batches share them; built
            # outside inference mode, so their copies have version counters to check.
            with torch.inference_mode(False):
                replicas = _replicate(module, self._devices, True, cpu_replicas=self.cpu_replicas)
            cached = CachedReplicas(key, replicas, module)
            self._replica_cache = cached
            loan = cached.lend(len(devices))
        # Lent to another call (a thread, or an outer call): this call gets its own.
        if loan is None:
            return _replicate(module, devices, True, cpu_replicas=self.cpu_replicas)
        return loan

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_replica_cache"] = None  # rebuilt on demand; threads can't be copied
        state.pop("_workers", None)
        return state

    def parallel_apply(  # type: ignore[override]
        self,
        replicas: Sequence[nn.Module],
        inputs: Sequence[tuple[Any, ...]],
        kwargs: Sequence[dict[str, Any]],
        *,
        method: str = "forward",
    ) -> list[Any]:
        """Run ``method`` on every replica in parallel; see :func:`dpmethods.parallel_apply`.

        With ``cache_replicas`` the worker threads are kept between calls too.
        """
        workers = None
        if self.cache_replicas and len(self._devices) > 1:
            workers = self.__dict__.get("_workers")
            if workers is None:
                workers = self.__dict__["_workers"] = WorkerPool(len(self._devices) - 1)
        try:
            return _parallel_apply(
                replicas, method, inputs, kwargs, self._devices[: len(replicas)], workers
            )
        finally:
            CachedReplicas.give_back(replicas)

    def gather(  # type: ignore[override]
        self,
        outputs: Sequence[Any],
        output_device: DeviceId,
        *,
        options: MethodOptions | None = None,
        weights: Sequence[float] | None = None,
    ) -> Any:
        """Gather replica outputs by the method's ``gather`` option; see :func:`dpmethods.gather`."""
        opts = options or self._forward_options
        return _gather(
            outputs, output_device, opts.dim, mode=opts.gather, pad_value=opts.pad_value,
            weights=weights,
        )

    def load_state_dict(  # type: ignore[override]
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load a state dict saved from this wrapper or from the bare module."""
        return super().load_state_dict(add_prefix(state_dict, "module."), strict, assign)
