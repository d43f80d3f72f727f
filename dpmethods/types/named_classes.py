"""Classes named ``"module:Class"`` before their module is imported.

An integration may register something for a library's class without importing the
library: it names the class, and the registration waits until the module is in
``sys.modules`` (:func:`when_class_imported`, through the one table of what waits on an
import, :mod:`dpmethods.vocab.loading`). :func:`~dpmethods.types.rules.register_type`
and :func:`~dpmethods.types.coupled_modules.mark_batch_coupled` both take such names.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Callable
from typing import Any

from dpmethods.vocab.loading import when_imported

__all__ = ["check_class_path", "when_class_imported"]


def check_class_path(where: str, path: str, missing_ok: bool = False) -> None:
    """Refuse a name that is not ``"module:Class"``, saying so as ``where``, and (unless
    ``missing_ok``) a class that its module, imported already, lacks: a typo that would
    otherwise register nothing without a word.

    Example:
        >>> check_class_path("register_type", "torch.nn:Linear")
        >>> check_class_path("register_type", "torch.nn:Lineer")
        Traceback (most recent call last):
        ...
        ValueError: register_type: cls: expected a class of torch.nn (imported), got 'torch.nn:Lineer', which it lacks: did you mean 'torch.nn:Linear'?
    """
    if path.count(":") != 1 or not all(path.split(":")):
        raise ValueError(f"{where}: cls: expected a class or 'module:Class', got {path!r}")
    module_name, _, qualname = path.partition(":")
    module = sys.modules.get(module_name)
    if module is None or missing_ok or _lookup(module, qualname) is not None:
        return
    owner_name, _, name = qualname.rpartition(".")
    owner = _lookup(module, owner_name) if owner_name else module
    names = [n for n in dir(owner) if not n.startswith("_")] if owner is not None else []
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"{owner_name}." if owner_name else ""
    raise ValueError(
        f"{where}: cls: expected a class of {module_name} (imported), got {path!r}, which it "
        "lacks" + (f": did you mean '{module_name}:{hint}{close[0]}'?" if close else "")
    )


def _lookup(module: Any, qualname: str) -> Any:
    """``module``'s object at the dotted ``qualname``, or None."""
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def when_class_imported(path: str, apply: Callable[[Any], object]) -> None:
    """``apply(the class named path)`` once its module is imported: now if it is. The
    class is None where the module lacks it (``missing_ok``).

    Example:
        >>> when_class_imported("collections:OrderedDict", lambda cls: print(cls.__name__))
        OrderedDict
    """
    module_name, _, qualname = path.partition(":")

    def step() -> None:
        apply(_lookup(sys.modules[module_name], qualname))

    if module_name in sys.modules:
        step()
    else:
        when_imported(module_name, step)
