"""Classes named ``"module:Class"`` before their module is imported.

An integration may register something for a library's class without importing the
library: it names the class, and the registration waits until the module is in
``sys.modules``. :func:`register_type` and ``mark_batch_coupled`` both take such names.
"""

from __future__ import annotations

import sys
from typing import Any, TypeVar

__all__ = ["check_class_path", "take_imported"]

_T = TypeVar("_T")


def check_class_path(where: str, path: str) -> None:
    """Refuse a name that is not ``"module:Class"``, saying so as ``where``.

    Example:
        >>> check_class_path("register_type", "torch.nn:Linear")
    """
    if path.count(":") != 1 or not all(path.split(":")):
        raise ValueError(f"{where}: cls: expected a class or 'module:Class', got {path!r}")


def take_imported(pending: dict[str, _T]) -> list[tuple[Any, _T]]:
    """Remove from ``pending`` the names whose module is imported by now, and return
    ``(the named object or None, its value)`` for each.

    Example:
        >>> take_imported({"sys:version_info": 1})[0][1]
        1
    """
    found = []
    for path, value in list(pending.items()):
        module_name, _, qualname = path.partition(":")
        module = sys.modules.get(module_name)
        if module is not None:
            del pending[path]
            found.append((getattr(module, qualname, None), value))
    return found
