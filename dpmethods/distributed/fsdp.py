"""FSDP2: ``fully_shard`` plus the registration of a sharded tree's parallel methods."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from dpmethods.wrapper.registry import MethodsArg, parallel_methods, resolve_methods

__all__ = ["fully_shard", "register_fsdp_methods"]


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
        >>> dpmethods.distributed.register_fsdp_methods(model)
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
