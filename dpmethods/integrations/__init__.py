"""Built-in integrations: one module per library, loaded once its library is imported.

Each module here is written with the public extension API (:mod:`dpmethods.extending`
and :func:`dpmethods.register_type`), as an integration of your own would be. This
package only loads them: before the methods of a class are looked up, before a class
is first walked, and before a gather mode that dpmethods does not know is refused, the
integrations of the libraries imported by then are imported. None of them imports its library itself.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any

import torch

from dpmethods.vocab.loading import add_loader

__all__ = ["INTEGRATIONS", "load_imported", "registrations"]

# library import name -> the integration modules that know it.
INTEGRATIONS: dict[str, tuple[str, ...]] = {
    "transformers": (f"{__name__}.transformers", f"{__name__}.transformers.processes"),
    "sentence_transformers": (f"{__name__}.sentence_transformers",),
    "peft": (f"{__name__}.peft",),
    "diffusers": (f"{__name__}.diffusers",),
    "timm": (f"{__name__}.timm",),
    "open_clip": (f"{__name__}.open_clip",),
    "torchvision": (f"{__name__}.torchvision",),
}
_loaded: set[str] = set()


def load_imported() -> None:
    """Import the integration of every library imported since the last call.

    Example:
        >>> load_imported()
    """
    if torch.compiler.is_compiling():
        # An import can't be traced: the next eager call loads them (a rule registered
        # then clears the tree's lookups, so nothing stale is kept).
        return
    for library, modules in INTEGRATIONS.items():
        if library not in _loaded and library in sys.modules:
            _loaded.add(library)
            for module in modules:
                importlib.import_module(module)


def registrations() -> list[dict[str, Any]]:
    """Each integration as ``python -m dpmethods info`` reports it, installed or not.

    Importing an integration module imports nothing of its library, so each module's
    ``APPLIES_TO`` and ``METHODS`` are read from the module itself.

    Example:
        >>> sorted(r["library"] for r in registrations())[:2]
        ['diffusers', 'open_clip']
    """
    rows = []
    for library, modules in INTEGRATIONS.items():
        try:
            installed = importlib.util.find_spec(library) is not None
        except (ImportError, ValueError):
            installed = False
        described = [importlib.import_module(m) for m in modules]
        rows.append({
            "library": library, "installed": installed, "imported": library in sys.modules,
            "applies_to": "; ".join(filter(None, (getattr(m, "APPLIES_TO", "") for m in described))),
            "methods": "; ".join(filter(None, (getattr(m, "METHODS", "") for m in described))),
        })
    return rows


add_loader(load_imported)
