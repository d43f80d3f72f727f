"""The parameter names of a method, for binding a call's arguments by name.

``broadcast=`` and ``split=`` name parameters; a call's positional arguments are matched
to them through the method's signature, read once per function and cached weakly.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

from torch import nn

__all__: list[str] = []


class _Params(NamedTuple):
    positional: tuple[str, ...]  # positional parameter names, in order
    star: str | None  # the name of *args
    names: frozenset[str]  # every named parameter
    double_star: str | None  # the name of **kwargs


# Weak keys: a cached signature must not keep a method (and, through its `super()`
# cell, its class) alive after the class is gone.
_PARAMETERS: weakref.WeakKeyDictionary[Callable[..., Any], _Params] = weakref.WeakKeyDictionary()


def _parameters(func: Callable[..., Any]) -> _Params:
    try:
        return _PARAMETERS[func]
    except (KeyError, TypeError):  # TypeError: not weakly referenceable
        pass
    params = _read_parameters(func)
    with contextlib.suppress(TypeError):
        _PARAMETERS[func] = params
    return params


def _read_parameters(func: Callable[..., Any]) -> _Params:
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return _Params((), None, frozenset(), None)
    return _Params(
        tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)),
        next((p.name for p in params if p.kind == p.VAR_POSITIONAL), None),
        frozenset(p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)),
        next((p.name for p in params if p.kind == p.VAR_KEYWORD), None),
    )


def signature_of(fn: Callable[..., Any] | None) -> _Params:
    """The parameters a call of ``fn`` binds (without ``self`` for a bound method).

    Example:
        >>> import torch
        >>> signature_of(torch.nn.Linear(1, 1)).positional  # a module: its forward's
        ('input',)
    """
    if fn is None:
        return _Params((), None, frozenset(), None)
    if isinstance(fn, nn.Module):  # a child module named in methods=: its forward's names
        fn = fn.forward
    func = getattr(fn, "__func__", fn)
    params = _parameters(func)
    if func is not fn:  # a bound method: `self` is not passed
        params = params._replace(positional=params.positional[1:])
    return params


def argument_names(params: _Params, n_args: int) -> list[str]:
    """The parameter name of each positional argument, ``args[i]`` past ``*args``."""
    named = min(len(params.positional), n_args)
    names = list(params.positional[:named])
    names.extend(f"{params.star or 'args'}[{i}]" for i in range(n_args - named))
    return names
