"""``DistributedDataParallel``: torch's DDP, running parallel methods through its forward."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpmethods.distributed.redirect import redirected_call
from dpmethods.wrapper.base import MethodWrapper, check_module
from dpmethods.wrapper.registry import MethodsArg

__all__ = ["DistributedDataParallel"]


class DistributedDataParallel(MethodWrapper, torch.nn.parallel.DistributedDataParallel):
    """``torch.nn.parallel.DistributedDataParallel`` whose parallel methods go through DDP.

    ``ddp.training_step(batch)`` runs DDP's own forward machinery (reducer
    preparation, buffer broadcast, ``find_unused_parameters``, ``static_graph``,
    ``no_sync``, ``join``) with the wrapped module's ``training_step`` in place of
    its ``forward``. As with ``forward``, nothing is scattered or gathered: each rank
    runs the method on its own batch. The methods are those decorated with
    :func:`dpmethods.parallel_method` (or registered with :func:`dpmethods.register`)
    plus those named in ``methods=``.

    Any other method of the module reached through the wrapper runs directly on the
    module, outside DDP, and warns once, at its first call with gradients enabled: its
    gradients are not all-reduced.
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
        return redirected_call(
            self, self.module, name, args, kwargs, where=f"{type(self).__name__}.{name}"
        )

    def _undecorated_warning(self, name: str) -> str | None:
        if not torch.is_grad_enabled():  # no_grad, inference_mode: no gradients to all-reduce
            return None
        return (
            f"{type(self).__name__}: {name!r} is not a parallel method, so it runs directly "
            f"on the wrapped {type(self.module).__name__}, outside DDP: its gradients are "
            f"not all-reduced across ranks. To run it through DDP, decorate it with "
            f"@dpmethods.parallel_method or pass methods=[{name!r}]. If it computes no "
            f"gradients, this warning can be ignored."
        )


