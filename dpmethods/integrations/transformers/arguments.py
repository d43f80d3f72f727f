"""A transformers model's call, as its methods see it: the call's arguments by name.

A wrapper whose ``forward`` hands the call on to a transformers model (a peft
``PeftModel``) registers a delegate (:func:`register_forward_delegate`): the loss,
its plan and its labels are then read from the model that computes them, with the
arguments it is given (:func:`forward_call`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from dpmethods.extending import unwrap_compiled

__all__ = ["ForwardDelegate", "bound_arguments", "forward_call", "register_forward_delegate"]

ForwardDelegate = Callable[
    [Any, tuple[Any, ...], Mapping[str, Any]], tuple[Any, tuple[Any, ...], dict[str, Any]] | None
]

_DELEGATES: list[ForwardDelegate] = []


def bound_arguments(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments of ``fn(*args, **kwargs)`` by name, its ``**kwargs`` merged in.

    Example:
        >>> import torch
        >>> bound_arguments(torch.nn.Linear(2, 2).forward, (torch.ones(1, 2),), {})["input"].shape
        torch.Size([1, 2])
    """
    given = dict(kwargs)
    if args:  # keywords alone are named already
        try:
            bound = inspect.signature(fn).bind_partial(*args, **kwargs)
            given = dict(bound.arguments)
            given.update(given.pop("kwargs", {}) or {})
        except (TypeError, ValueError):
            pass
    return given


def register_forward_delegate(fn: ForwardDelegate) -> None:
    """Register ``fn(module, args, kwargs) -> (model, args, kwargs) | None``: the model
    that ``module.forward(*args, **kwargs)`` hands the call to, and the arguments it
    gets, or None where ``module`` computes its output itself.

    Example:
        >>> register_forward_delegate(None)
        Traceback (most recent call last):
        ...
        TypeError: register_forward_delegate: fn: expected a callable fn(module, args, kwargs), got NoneType None
    """
    if not callable(fn):
        raise TypeError(
            f"register_forward_delegate: fn: expected a callable fn(module, args, kwargs), "
            f"got {type(fn).__name__} {fn!r}"
        )
    if fn not in _DELEGATES:
        _DELEGATES.append(fn)


def forward_call(
    module: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """The model that computes ``module.forward(*args, **kwargs)``'s output, with its
    arguments: ``module`` itself (its compiled wrapper unwrapped) unless a delegate
    says it hands the call on.

    Example:
        >>> import torch
        >>> linear = torch.nn.Linear(2, 2)
        >>> forward_call(linear, (1,), {})[0] is linear
        True
    """
    model = unwrap_compiled(module)
    for fn in _DELEGATES:
        found = fn(model, args, kwargs)
        if found is not None:
            return forward_call(*found)  # a wrapper of a wrapper: the innermost model
    return model, args, dict(kwargs)
