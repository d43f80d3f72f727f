"""``route``: parallel methods through any forward-only wrapper (Accelerate, DeepSpeed)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from dpmethods.distributed.redirect import redirected_call
from dpmethods.vocab.warn_once import warn_once

__all__ = ["route"]


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
            return redirected_call(wrapper, module, name, args, kwargs, where=where)

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


