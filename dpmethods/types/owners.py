"""The class that owns a module's methods, through ``torch.compile``'s wrapper.

``torch.compile(model)`` returns an ``OptimizedModule`` that forwards attributes to the
model; decorated methods, options and signatures are the model's class's. Everything
that asks "whose methods are these" (the registry, the wrapper, the state dicts, the
integrations) asks here.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

__all__ = ["is_compiled_wrapper", "method_owner", "unwrap_compiled"]


def _optimized_module_class() -> type | None:
    # Only present once torch._dynamo is imported, which torch.compile does.
    cls = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)
    return cls if isinstance(cls, type) else None


def is_compiled_wrapper(module: Any) -> bool:
    """Whether ``module`` is the ``OptimizedModule`` that ``torch.compile(model)`` returns.

    Example:
        >>> import torch
        >>> is_compiled_wrapper(torch.nn.Linear(1, 1))
        False
    """
    cls = _optimized_module_class()
    return cls is not None and isinstance(module, cls)


def method_owner(module: nn.Module) -> type:
    """The class whose methods are ``module``'s: the model's, through ``torch.compile``.

    Args:
        module: a module, possibly the ``OptimizedModule`` of ``torch.compile(model)``.

    Example:
        >>> import torch
        >>> method_owner(torch.compile(torch.nn.Linear(1, 1))).__name__
        'Linear'
    """
    return type(unwrap_compiled(module))


def unwrap_compiled(module: Any) -> Any:
    """The module itself, through any number of ``torch.compile`` wrappers.

    Args:
        module: a module, possibly the ``OptimizedModule`` of ``torch.compile(model)``;
            anything else is returned as it is.

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(1, 1)
        >>> unwrap_compiled(torch.compile(lin)) is lin, unwrap_compiled(lin) is lin
        (True, True)
    """
    while is_compiled_wrapper(module):
        # Read through __dict__: OptimizedModule's __getattr__ forwards to the model.
        module = module.__dict__["_modules"]["_orig_mod"]
    return module
