"""timm: ``forward_features``, ``forward_head`` and ``forward_intermediates`` of every
timm model.

timm models share no base class, so they are known by the package their class comes
from. ``forward_intermediates`` (timm's feature extraction) returns the final features
and a list of feature maps, or the list alone: each joined along the batch.
"""

from __future__ import annotations

import inspect

from dpmethods.extending import MethodOptions, register_method_finder

__all__: list[str] = []

APPLIES_TO = "timm models"
METHODS = "forward_features, forward_head, forward_intermediates"


def _timm_methods(cls: type) -> dict[str, MethodOptions]:
    if not any(k.__module__.split(".")[0] == "timm" for k in cls.__mro__):
        return {}
    return {
        name: MethodOptions()
        for name in ("forward_features", "forward_head", "forward_intermediates")
        if inspect.isfunction(inspect.getattr_static(cls, name, None))
    }


register_method_finder(_timm_methods)
