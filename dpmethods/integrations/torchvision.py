"""torchvision: detection models take a list of images and return one dict per image.

``forward(images, targets=None)`` of the R-CNN family (Faster, Mask, Keypoint R-CNN),
RetinaNet, FCOS and SSD/SSDlite splits ``images`` and ``targets`` item by item. In eval
the per-image detections are extended in order; in training the loss dict is averaged
over the replicas weighted by their images. Each replica pads its own images to its
largest one, so results equal the full batch only where the images pad to the same
size (see docs/real_models.md).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from dpmethods.extending import (
    Call,
    MethodOptions,
    gather,
    register_gather_mode,
    register_method_finder,
)

__all__: list[str] = []

APPLIES_TO = "detection models (R-CNN family, RetinaNet, FCOS, SSD/SSDlite)"
METHODS = "forward (split on images and targets; detections extended, losses averaged)"

_DETECTORS = (
    ("torchvision.models.detection.generalized_rcnn", "GeneralizedRCNN"),  # the R-CNN family
    ("torchvision.models.detection.retinanet", "RetinaNet"),
    ("torchvision.models.detection.fcos", "FCOS"),
    ("torchvision.models.detection.ssd", "SSD"),  # SSDlite too
)


def _join_detections(outputs: list[Any], device: Any, call: Call | None) -> Any:
    sizes = list(call.sizes) if call is not None and len(call.sizes) == len(outputs) else None
    if isinstance(outputs[0], Mapping):  # training: a dict of 0-dim losses
        return gather(outputs, device, mode="mean", sizes=sizes)
    return gather(outputs, device, mode="extend", sizes=sizes)


register_gather_mode("torchvision_detection", _join_detections)

_OPTIONS = MethodOptions(split=("images", "targets"), gather="torchvision_detection")


def _detection_methods(cls: type) -> dict[str, MethodOptions]:
    bases = (getattr(sys.modules.get(module), name, None) for module, name in _DETECTORS)
    if any(isinstance(b, type) and issubclass(cls, b) for b in bases):
        return {"forward": _OPTIONS}
    return {}


register_method_finder(_detection_methods)
