"""Unwrapping and state-dict helpers that work across our wrappers and torch's."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["add_prefix", "load_state_dict", "strip_prefix", "unwrap"]


def unwrap(model: nn.Module) -> nn.Module:
    """The innermost module under DataParallel, DDP, our wrappers and ``torch.compile``.

    Args:
        model: a module, possibly wrapped several times.

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(1, 1)
        >>> unwrap(torch.nn.DataParallel(lin)) is lin
        True
    """
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(model, (nn.DataParallel, DistributedDataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile
            model = model._orig_mod  # type: ignore[assignment]
        else:
            return model


def strip_prefix(state_dict: Mapping[str, Any], prefix: str = "module.") -> OrderedDict[str, Any]:
    """A copy of ``state_dict`` with ``prefix`` removed from every key that has it.

    Args:
        state_dict: e.g. saved from a wrapped model.
        prefix: the prefix to remove (repeatedly, for nested wrappers).

    Example:
        >>> list(strip_prefix({"module.w": 1, "b": 2}))
        ['w', 'b']
    """
    out: OrderedDict[str, Any] = OrderedDict()
    for key, value in state_dict.items():
        while prefix and key.startswith(prefix):
            key = key[len(prefix) :]
        out[key] = value
    return out


def add_prefix(state_dict: Mapping[str, Any], prefix: str = "module.") -> Mapping[str, Any]:
    """``state_dict`` with ``prefix`` on every key, unless its keys already have it.

    Args:
        state_dict: e.g. saved from a bare model.
        prefix: the wrapper's prefix.

    Example:
        >>> list(add_prefix({"w": 1}))
        ['module.w']
    """
    if not state_dict or all(k.startswith(prefix) for k in state_dict):
        return state_dict
    return OrderedDict((prefix + k, v) for k, v in strip_prefix(state_dict, prefix).items())


def load_state_dict(
    model: nn.Module,
    state_dict: Mapping[str, Any] | str | os.PathLike[str],
    strict: bool = True,
) -> Any:
    """Load a checkpoint into ``model``, wrapped or not, whether it was saved wrapped or not.

    A path is read with ``torch.load(..., weights_only=True)``.

    Args:
        model: the target, bare or wrapped.
        state_dict: a state dict or the path of a saved one.
        strict: as in ``nn.Module.load_state_dict``.

    Example:
        >>> import torch
        >>> a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        >>> _ = load_state_dict(b, torch.nn.DataParallel(a).state_dict())
        >>> torch.equal(a.weight, b.weight)
        True
    """
    if isinstance(state_dict, (str, os.PathLike)):
        state_dict = torch.load(state_dict, map_location="cpu", weights_only=True)
    assert isinstance(state_dict, Mapping)
    return unwrap(model).load_state_dict(strip_prefix(state_dict), strict=strict)
