"""Built-in integrations: one module per library, loaded once its library is imported.

Each module here is written with the public extension API (:mod:`dpmethods.extending`
and :func:`dpmethods.register_type`), as an integration of your own would be. This
package only loads them: before the methods of a class are looked up, and before a
type or a gather mode that dpmethods does not know is refused, the integrations of the
libraries imported by then are imported. None of them imports its library itself.
"""

from __future__ import annotations

import importlib
import sys

from dpmethods import gather_modes, registry

__all__ = ["INTEGRATIONS", "load_imported"]

# library import name -> the integration modules that know it.
INTEGRATIONS: dict[str, tuple[str, ...]] = {
    "transformers": ("dpmethods.integrations.known_methods",),
    "sentence_transformers": ("dpmethods.integrations.known_methods", f"{__name__}.sentence_transformers"),
    "peft": ("dpmethods.integrations.known_methods",),
    "diffusers": ("dpmethods.integrations.known_methods",),
    "timm": ("dpmethods.integrations.known_methods",),
    "open_clip": ("dpmethods.integrations.known_methods", f"{__name__}.open_clip"),
    "torchvision": (f"{__name__}.torchvision",),
}
_loaded: set[str] = set()


def load_imported() -> None:
    """Import the integration of every library imported since the last call.

    Example:
        >>> load_imported()
    """
    for library, modules in INTEGRATIONS.items():
        if library not in _loaded and library in sys.modules:
            _loaded.add(library)
            for module in modules:
                importlib.import_module(module)


registry.before_lookup.append(load_imported)
gather_modes.on_unknown_mode.append(lambda name: load_imported())
