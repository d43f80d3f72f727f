"""timm: ``forward_features`` and ``forward_head`` of every timm model.

timm models share no base class, so they are known by the package their class comes
from.
"""

from __future__ import annotations

import inspect

from dpmethods.extending import MethodOptions, register_method_finder

__all__: list[str] = []

APPLIES_TO = "timm models"
METHODS = "forward_features, forward_head"


def _timm_methods(cls: type) -> dict[str, MethodOptions]:
    if not any(k.__module__.split(".")[0] == "timm" for k in cls.__mro__):
        return {}
    return {
        name: MethodOptions()
        for name in ("forward_features", "forward_head")
        if inspect.isfunction(inspect.getattr_static(cls, name, None))
    }


register_method_finder(_timm_methods)
