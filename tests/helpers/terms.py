"""How many rounded terms lie on the path to one output of the tests' models.

``assert_close_to_reference`` (dpmethods.testing) bounds a parallel result's distance
from the one-device reference by ``terms`` (the products and sums that feed one output
element), the dtype's eps and the reference's magnitude. Errors of successive layers
add up to first order, so a network's ``terms`` is the sum of its layers' inner sizes.
"""

from __future__ import annotations

__all__ = ["FASTER_RCNN_TERMS", "RETINANET_TERMS", "mlp_terms", "transformer_terms"]

# torchvision's fasterrcnn_mobilenet_v3_large_fpn: the MobileNetV3 backbone's 1x1 and
# depthwise convs (about 6000 in all), the RPN's 3x3x256 conv, the box head's
# 256x7x7 -> 1024 -> 1024 MLP and its predictor.
FASTER_RCNN_TERMS = 6000 + 2304 + 12544 + 2 * 1024
# retinanet_resnet50_fpn: 16 bottlenecks (1x1 convs of up to 2048 channels, 3x3 convs of
# up to 512: about 3600 each), the FPN's 3x3x256 conv and the heads' five 3x3x256 convs.
RETINANET_TERMS = 16 * 3600 + 2304 + 5 * 2304


def mlp_terms(*inner: int, rows: int = 0) -> int:
    """Linear layers of these input sizes (each with a bias), plus the ``rows`` a mean
    or a weight gradient sums over."""
    return sum(n + 1 for n in inner) + rows


def transformer_terms(width: int, ff: int, seq: int, layers: int, rows: int = 0) -> int:
    """``layers`` blocks: the Q, K, V and output projections and two norms (``width`` each),
    the scores (``width``) and their weighted sum (``seq``), the MLP (``width + ff``); then
    the head (``width``) and the ``rows`` a mean or a weight gradient sums over."""
    return layers * (8 * width + ff + seq) + width + rows
