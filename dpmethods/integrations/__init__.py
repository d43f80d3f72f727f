"""Built-in integrations: one module per library, loaded once its library is imported.

Each module here is written with the public extension API (:mod:`dpmethods.extending`
and :func:`dpmethods.register_type`), as an integration of your own would be. This
package only loads them, each as a step that waits for its library
(:func:`dpmethods.vocab.loading.when_imported`): before the methods of a class are
looked up, before a class is first walked, and before a gather mode that dpmethods does
not know is refused, the integrations of the libraries imported by then are imported.
None of them imports its library itself.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from typing import Any

from dpmethods.vocab.loading import when_imported

__all__ = ["INTEGRATIONS", "registrations"]

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


def _import_all(modules: tuple[str, ...]) -> None:
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


for _library, _modules in INTEGRATIONS.items():
    when_imported(_library, functools.partial(_import_all, _modules))
