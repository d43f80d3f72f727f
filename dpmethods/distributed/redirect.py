"""Forward redirection: run a module method through a wrapper that only knows ``forward``.

DDP, Accelerate and DeepSpeed do their per-step work (reducer preparation, buffer
broadcast, input casting) in their ``forward`` and then call ``self.module(...)``.
To give a method such as ``training_step`` the same treatment, the inner module's
``forward`` is replaced, for one call, by a shim that runs the method; the wrapper is
then called normally. This is the trick of Lightning Fabric's
``_redirection_through_forward``.

The shim puts the original ``forward`` back *before* the method body runs, so a
method that calls ``self(x)`` reaches the real ``forward`` and does not recurse; a
``finally`` restores it as well when the wrapper raises before reaching the shim.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["redirected_call"]

_MISSING = object()


def redirected_call(
    call: Callable[..., Any],
    inner: nn.Module,
    name: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    where: str,
) -> Any:
    """Call ``call(*args, **kwargs)`` with ``inner.forward`` standing for ``inner.<name>``.

    Args:
        call: the wrapper's call (``wrapper.__call__`` or an unbound equivalent).
        inner: the module whose ``forward`` the wrapper ends up calling.
        name: the method of ``inner`` to run in its place.
        args: positional arguments, passed through the wrapper to the method.
        kwargs: keyword arguments, passed through the wrapper to the method.
        where: how to name the caller in error messages.

    Example:
        >>> import torch
        >>> class Net(torch.nn.Module):
        ...     def forward(self, x):
        ...         return x
        ...     def double(self, x):
        ...         return 2 * x
        >>> net = Net()
        >>> redirected_call(net, net, "double", (torch.ones(1),), {}, where="demo").item()
        2.0
    """
    if name == "forward":
        return call(*args, **kwargs)
    method = getattr(inner, name)
    # An instance-level forward (Accelerate's fp32 conversion, a user patch) must come
    # back exactly as it was; otherwise the class's forward is found again on deletion.
    saved = inner.__dict__.get("forward", _MISSING)
    restored = False
    reached = False

    def restore() -> None:
        nonlocal restored
        if restored:
            return
        restored = True
        if saved is _MISSING:
            inner.__dict__.pop("forward", None)
        else:
            inner.__dict__["forward"] = saved

    def shim(*a: Any, **k: Any) -> Any:
        nonlocal reached
        reached = True
        restore()
        return method(*a, **k)

    # Written to __dict__ directly: nn.Module.__setattr__ would be fine for a function,
    # but this keeps the save/restore symmetric and skips its type dispatch.
    inner.__dict__["forward"] = shim
    try:
        out = call(*args, **kwargs)
    finally:
        restore()
    if not reached:
        raise RuntimeError(
            f"{where}: expected the wrapper's forward to call the forward of the inner "
            f"{type(inner).__name__} once, but it never did, so {name!r} did not run. "
            "Routing works only for wrappers whose forward ends in `self.module(...)`; "
            "pass module= if the wrapped module is not the wrapper's `.module`."
        )
    return out
