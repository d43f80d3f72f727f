"""Parallel methods under DistributedDataParallel, FSDP2 and other forward-only wrappers.

``ddp.module.training_step(batch)`` skips DDP's forward, so the reducer never
prepares for backward: gradients are not all-reduced and ranks drift apart, or the
next step fails with "Expected to have finished reduction in the prior iteration".
The wrappers here run such methods *through* the wrapper's own forward (see
:mod:`dpmethods.distributed.redirect`), so every feature of the wrapper's forward applies.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from dpmethods._wrapping import _MethodWrapper, check_module
from dpmethods.distributed.redirect import _redirected_call
from dpmethods.registry import MethodsArg, parallel_methods, resolve_methods
from dpmethods.warn_once import warn_once

__all__ = [
    "DistributedDataParallel",
    "fully_shard",
    "register_fsdp_methods",
    "route",
]


class DistributedDataParallel(_MethodWrapper, torch.nn.parallel.DistributedDataParallel):
    """``torch.nn.parallel.DistributedDataParallel`` whose parallel methods go through DDP.

    ``ddp.training_step(batch)`` runs DDP's own forward machinery (reducer
    preparation, buffer broadcast, ``find_unused_parameters``, ``static_graph``,
    ``no_sync``, ``join``) with the wrapped module's ``training_step`` in place of
    its ``forward``. As with ``forward``, nothing is scattered or gathered: each rank
    runs the method on its own batch. The methods are those decorated with
    :func:`dpmethods.parallel_method` (or registered with :func:`dpmethods.register`)
    plus those named in ``methods=``.

    Any other method of the module reached through the wrapper runs directly on the
    module, outside DDP, and warns once: its gradients are not all-reduced.
    Other attributes are forwarded to the module.

    Forward hooks registered on the wrapped module run around the method too, since
    the method is called where DDP calls the module. With ``static_graph=True`` every
    call must use the same set of parameters in the same order, whichever method runs.
    As for ``forward``, a call may run collectives (the buffer broadcast), so every
    rank must make the same calls; call the module itself for rank-local work.

    Args:
        module: the module to wrap.
        *args: DDP's positional arguments (``device_ids``, ``output_device``, ...).
        methods: more parallel methods: ``["training_step"]``, or
            ``{"training_step": {}}`` (DataParallel's options are accepted; DDP does
            not scatter, so they have no effect here).
        **kwargs: DDP's keyword arguments (``find_unused_parameters``,
            ``static_graph``, ``process_group``, ``broadcast_buffers``, ...), passed
            through unchanged.

    Example:
        >>> import torch, dpmethods
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = torch.nn.Linear(4, 1)
        ...     @dpmethods.parallel_method
        ...     def training_step(self, x, y):
        ...         return torch.nn.functional.mse_loss(self.lin(x), y)
        >>> import torch.distributed as dist  # one process here; torchrun starts several
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> ddp = dpmethods.DistributedDataParallel(Net())
        >>> x, y = torch.randn(8, 4), torch.randn(8, 1)
        >>> ddp.training_step(x, y).backward()  # through DDP's forward: all-reduced
        >>> ddp.module.lin.weight.grad is not None
        True
        >>> dist.destroy_process_group()
    """

    def __init__(
        self, module: nn.Module, *args: Any, methods: MethodsArg = None, **kwargs: Any
    ) -> None:
        # DDP's own signature is passed through untouched, so every torch version's
        # arguments keep working without being listed here.
        check_module(module)
        super().__init__(module, *args, **kwargs)
        self._init_methods(module, methods)

    def _run_method(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # Calling the wrapper itself (not DDP.forward) keeps hooks on the DDP module
        # and whatever torch adds to __call__ in later versions.
        return _redirected_call(
            self, self.module, name, args, kwargs, where=f"{type(self).__name__}.{name}"
        )

    def _undecorated_warning(self, name: str) -> str | None:
        return (
            f"{type(self).__name__}: {name!r} is not a parallel method, so it runs directly "
            f"on the wrapped {type(self.module).__name__}, outside DDP: its gradients are "
            f"not all-reduced across ranks. To run it through DDP, decorate it with "
            f"@dpmethods.parallel_method or pass methods=[{name!r}]. If it computes no "
            f"gradients, this warning can be ignored."
        )


# --------------------------------------------------------------------------- route


class _Router:
    """The object returned by :func:`route`; see there."""

    __slots__ = ("_module", "_wrapper")
    _module: nn.Module
    _wrapper: Callable[..., Any]

    def __init__(self, wrapper: Callable[..., Any], module: nn.Module) -> None:
        object.__setattr__(self, "_wrapper", wrapper)
        object.__setattr__(self, "_module", module)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name in _Router.__slots__ or name.startswith("__"):
            # Unset slots (copy, pickle) and protocol lookups must not recurse here.
            raise AttributeError(name)
        module = self._module
        try:
            attr = getattr(module, name)
        except AttributeError:
            raise AttributeError(
                f"route({type(self._wrapper).__name__}): the wrapped "
                f"{type(module).__name__} has no attribute {name!r}"
            ) from None
        if not (inspect.ismethod(attr) and attr.__self__ is module):
            raise AttributeError(
                f"route({type(self._wrapper).__name__}).{name}: expected a method of the "
                f"wrapped {type(module).__name__}, got {type(attr).__name__}; read "
                f"attributes from the module itself"
            )
        wrapper = self._wrapper
        where = f"route({type(wrapper).__name__}).{name}"

        @functools.wraps(attr)
        def call(*args: Any, **kwargs: Any) -> Any:
            return _redirected_call(wrapper, module, name, args, kwargs, where=where)

        return call

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"route(...) objects are read-only; cannot set {name!r}")

    def __dir__(self) -> list[str]:
        cls = type(self._module)
        return sorted(
            n
            for n in dir(cls)
            if not n.startswith("_") and inspect.isfunction(inspect.getattr_static(cls, n, None))
        )

    def __repr__(self) -> str:
        return f"route({type(self._wrapper).__name__} -> {type(self._module).__name__})"


def route(wrapper: Callable[..., Any], module: nn.Module | None = None) -> Any:
    """Run methods of a wrapped module through the wrapper's ``forward``.

    For forward-only wrappers other than DDP (Accelerate's, DeepSpeed's engine, plain
    ``torch.nn.parallel.DistributedDataParallel``): ``route(wrapper).training_step(b)``
    sets the module's ``forward`` to ``training_step`` for one call, calls
    ``wrapper(b)``, and the wrapper's forward does its per-step work before calling
    the module. ``forward`` is restored before the method body runs (so a method that
    calls ``self(x)`` reaches the real forward) and also when the wrapper raises.

    Limits: the wrapper's forward must end up calling the inner module's
    ``__call__`` or ``forward`` exactly once with the arguments it was given
    (a ``RuntimeError`` says so when it never calls it); anything the wrapper does to
    the outputs of ``forward`` it does to the method's outputs; one call at a time:
    it is not thread-safe, and must not be nested on the same module.

    Args:
        wrapper: the wrapper to call; its ``forward`` must call ``module``.
        module: the module whose methods are routed; defaults to ``wrapper.module``, or
            to ``wrapper`` itself when it is a module without ``.module`` (a model that
            ``accelerator.prepare`` returned unwrapped in one process).

    Returns:
        An object whose attributes are the module's methods, routed through ``wrapper``.

    Example:
        >>> import torch
        >>> class Net(torch.nn.Module):
        ...     def forward(self, x):
        ...         return x
        ...     def double(self, x):
        ...         return 2 * x
        >>> class Wrapper(torch.nn.Module):
        ...     def __init__(self, module):
        ...         super().__init__()
        ...         self.module = module
        ...     def forward(self, *args, **kwargs):
        ...         return self.module(*args, **kwargs)
        >>> route(Wrapper(Net())).double(torch.ones(1)).item()
        2.0
    """
    if not callable(wrapper):
        raise TypeError(f"route: wrapper: expected a callable module, got {type(wrapper).__name__}")
    if module is None:
        module = getattr(wrapper, "module", None)
        if module is None and isinstance(wrapper, nn.Module):
            # A bare model (accelerator.prepare(model) in one process returns the model
            # itself): route through its own __call__, so its hooks run.
            module = wrapper
            if "forward" in wrapper.__dict__:
                warn_once(
                    f"route: {type(wrapper).__name__} has no `.module`, so methods are routed "
                    "through the model itself, and its instance-level forward (a patch such "
                    "as Accelerate's mixed-precision wrapper) is not run around them; wrap "
                    "the call yourself (e.g. in torch.autocast) if the patch matters",
                    stacklevel=3,
                )
        if module is None:
            raise TypeError(
                f"route: expected the wrapper to have a `.module`, but "
                f"{type(wrapper).__name__} has none; pass module= explicitly"
            )
    if not isinstance(module, nn.Module):
        raise TypeError(f"route: module: expected an nn.Module, got {type(module).__name__}")
    return _Router(wrapper, module)


# --------------------------------------------------------------------------- FSDP2


def _fsdp_api() -> tuple[Callable[..., Any], Callable[[nn.Module, str], None], type[Any]]:
    """``fully_shard``, ``register_fsdp_forward_method`` and ``FSDPModule`` of this torch."""
    try:  # torch >= 2.6
        from torch.distributed.fsdp import (  # type: ignore[attr-defined]
            FSDPModule,
            register_fsdp_forward_method,
        )
        from torch.distributed.fsdp import fully_shard as shard
    except ImportError:  # torch 2.4, 2.5
        from torch.distributed._composable.fsdp import (  # type: ignore[no-redef]
            FSDPModule,
            register_fsdp_forward_method,
        )
        from torch.distributed._composable.fsdp import fully_shard as shard  # type: ignore[no-redef]
    return shard, register_fsdp_forward_method, FSDPModule


# Names already registered per module: FSDP's registration wraps the method again on
# each call, which would all-gather twice.
_FSDP_DONE: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()


def register_fsdp_methods(module: nn.Module, methods: MethodsArg = None) -> list[str]:
    """Register the parallel methods of a module tree already sharded with FSDP2.

    Every module in ``module.modules()`` that was sharded (is an ``FSDPModule``, i.e.
    ``fully_shard`` was called on it) gets each of its parallel methods registered with
    ``register_fsdp_forward_method``, so calling the method all-gathers the module's
    parameters before and reshards after, as ``forward`` does. Decorated methods of
    modules that were not sharded themselves are left alone: their parameters belong
    to a sharded ancestor, which has them unsharded only while one of its own forward
    methods runs. Registering twice is harmless.

    Args:
        module: the root of the tree.
        methods: more parallel methods of ``module`` itself (``["generate"]``); the
            root must then be sharded.

    Returns:
        The registered methods as dotted paths (``"generate"``, ``"decoder.step"``).

    Example:
        >>> import torch, dpmethods, torch.distributed as dist
        >>> from torch.distributed.fsdp import fully_shard  # torch >= 2.6
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = torch.nn.Linear(4, 1)
        ...     @dpmethods.parallel_method
        ...     def training_step(self, x, y):
        ...         return torch.nn.functional.mse_loss(self.lin(x), y)
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = Net()
        >>> _ = fully_shard(model)  # torch's own
        >>> dpmethods.register_fsdp_methods(model)
        ['training_step']
        >>> dist.destroy_process_group()
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"register_fsdp_methods: module: expected an nn.Module, got {type(module).__name__}"
        )
    _, register, fsdp_module = _fsdp_api()
    if not isinstance(module, fsdp_module):
        if methods is not None:
            raise ValueError(
                f"register_fsdp_methods: methods= names methods of {type(module).__name__}, "
                f"so it must be sharded (an FSDPModule), but it is not; call "
                f"fully_shard(module) first"
            )
        if not any(isinstance(m, fsdp_module) for m in module.modules()):
            raise ValueError(
                f"register_fsdp_methods: module: expected a tree with modules sharded by "
                f"fully_shard, got {type(module).__name__} with none; call fully_shard first"
            )
    done: list[str] = []
    for path, sub in module.named_modules():
        if not isinstance(sub, fsdp_module):
            continue
        found = resolve_methods(sub, methods) if sub is module else parallel_methods(type(sub))
        registered = _FSDP_DONE.setdefault(sub, set())
        for name in found:
            if name == "forward":
                continue
            if isinstance(sub._modules.get(name), nn.Module):
                # The model's class, not the FSDP<cls> class fully_shard made of it.
                cls = next(k for k in type(sub).__mro__ if not issubclass(k, fsdp_module))
                raise ValueError(
                    f"register_fsdp_methods: methods: {name!r} is a submodule of "
                    f"{cls.__name__}, not a method; FSDP2 runs methods only. Shard it "
                    f"too (fully_shard(module.{name})) and call it directly, or call it from a "
                    f"method of {cls.__name__} named in methods="
                )
            if name not in registered:
                register(sub, name)
                registered.add(name)
            done.append(f"{path}.{name}" if path else name)
    return done


def fully_shard(
    module: nn.Module | Iterable[nn.Module], *, methods: MethodsArg = None, **kwargs: Any
) -> Any:
    """``torch.distributed.fsdp.fully_shard``, then :func:`register_fsdp_methods`.

    Call it bottom-up as the torch function (layers first, the root last); each call
    registers the parallel methods of the modules sharded so far in ``module``'s tree.

    Args:
        module: the module (or, where torch accepts it, list of modules) to shard.
        methods: more parallel methods of ``module`` itself, as in
            :func:`register_fsdp_methods`.
        **kwargs: ``fully_shard``'s keyword arguments (``mesh``,
            ``reshard_after_forward``, ``mp_policy``, ...), passed through unchanged.

    Returns:
        What ``fully_shard`` returns: the module, now an ``FSDPModule``.

    Example:
        >>> import torch, dpmethods, torch.distributed as dist
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)])
        ...     def forward(self, x):
        ...         return self.layers[1](self.layers[0](x))
        ...     @dpmethods.parallel_method
        ...     def training_step(self, x, y):
        ...         return torch.nn.functional.mse_loss(self(x), y)
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = Net()
        >>> for layer in model.layers:
        ...     _ = dpmethods.fully_shard(layer)
        >>> type(dpmethods.fully_shard(model)).__name__
        'FSDPNet'
        >>> model.training_step(torch.randn(8, 4), torch.randn(8, 1)).backward()
        >>> dist.destroy_process_group()
    """
    if methods is not None and not isinstance(module, nn.Module):
        raise TypeError(
            f"fully_shard: methods= applies to one module, but module is a "
            f"{type(module).__name__}; register per module with register_fsdp_methods"
        )
    shard, _, _ = _fsdp_api()
    out = shard(module, **kwargs)
    roots = [module] if isinstance(module, nn.Module) else list(module)
    for root in roots:
        register_fsdp_methods(root, methods)
    return out
