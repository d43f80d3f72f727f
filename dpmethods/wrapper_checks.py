"""Checks of a wrapper's configuration, made when it is built or before a call."""

from __future__ import annotations

import inspect
from itertools import chain
from typing import Any

import torch
from torch import nn

from dpmethods.options import MethodOptions
from dpmethods.types.owners import method_owner

__all__ = ["check_argument_names", "check_source_device"]


def check_argument_names(module: nn.Module, methods: dict[str, MethodOptions]) -> None:
    """Refuse ``broadcast``/``split`` names that are not arguments of their method.

    Example:
        >>> check_argument_names(nn.Linear(2, 2), {"forward": MethodOptions(broadcast="input")})
    """
    for name, opts in methods.items():
        if not opts.broadcast and not opts.split:
            continue
        params = inspect.signature(getattr(method_owner(module), name)).parameters
        if any(p.kind == p.VAR_KEYWORD for p in params.values()):
            continue
        for option, names in (("broadcast", opts.broadcast), ("split", opts.split)):
            unknown = [b for b in names if b not in params]
            if unknown:
                raise ValueError(
                    f"{option}: {unknown} are not arguments of "
                    f"{type(module).__name__}.{name}; its arguments are "
                    f"{[p for p in params if p != 'self']}"
                )


def check_source_device(module: nn.Module, src: torch.device) -> None:
    """Refuse a module with a parameter or buffer off ``device_ids[0]``, naming it.

    Example:
        >>> check_source_device(nn.Linear(2, 2), torch.device("cpu"))
    """
    tensors: Any = chain(module.parameters(), module.buffers())
    for t in tensors:
        if t.device != src:
            named = chain(module.named_parameters(), module.named_buffers())
            where = next(n for n, v in named if v.device != src)
            raise RuntimeError(
                f"DataParallel: module must have its parameters and buffers on device "
                f"{src} (device_ids[0]), but {where!r} is on {t.device}"
            )
