"""A transformers model's call, as its methods see it: the call's arguments by name."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["bound_arguments"]


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
