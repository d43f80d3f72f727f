"""How many rounded terms lie on the path to one output of the tests' models.

``assert_close_to_reference`` (dpmethods.testing) bounds a parallel result's distance
from the one-device reference by ``terms`` (the products and sums that feed one output
element), the dtype's eps and the reference's magnitude. Errors of successive layers
add up to first order, so a network's ``terms`` is the sum of its layers' inner sizes.
"""

from __future__ import annotations

__all__ = ["mlp_terms", "transformer_terms"]


def mlp_terms(*inner: int, rows: int = 0) -> int:
    """Linear layers of these input sizes (each with a bias), plus the ``rows`` a mean
    or a weight gradient sums over."""
    return sum(n + 1 for n in inner) + rows


def transformer_terms(width: int, ff: int, seq: int, layers: int, rows: int = 0) -> int:
    """``layers`` blocks: the Q, K, V and output projections and two norms (``width`` each),
    the scores (``width``) and their weighted sum (``seq``), the MLP (``width + ff``); then
    the head (``width``) and the ``rows`` a mean or a weight gradient sums over."""
    return layers * (8 * width + ff + seq) + width + rows
