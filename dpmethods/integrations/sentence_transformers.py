"""sentence-transformers: losses that couple the items of their batch.

In-batch-negatives losses (``MultipleNegativesRankingLoss`` and its cached and
symmetric relatives, GIST), batch-mined triplet losses and pairwise-ranking losses
(CoSENT, AnglE) compare every item of the batch with the others: run on a replica's
share they see fewer negatives and give a different loss, so they are warned about.
"""

from __future__ import annotations

from dpmethods.extending import mark_batch_coupled

__all__: list[str] = []

_LOSSES = "sentence_transformers.sentence_transformer.losses"
_COUPLED = {
    "in-batch negatives": (
        "MultipleNegativesRankingLoss", "CachedMultipleNegativesRankingLoss",
        "MultipleNegativesSymmetricRankingLoss", "CachedMultipleNegativesSymmetricRankingLoss",
        "GISTEmbedLoss", "CachedGISTEmbedLoss", "MegaBatchMarginLoss",
        "ContrastiveTensionLossInBatchNegatives",
    ),
    "triplets mined within the batch": (
        "BatchAllTripletLoss", "BatchHardTripletLoss", "BatchSemiHardTripletLoss",
        "BatchHardSoftMarginTripletLoss",
    ),
    "pairs ranked across the batch": ("CoSENTLoss", "AnglELoss"),
}

for _what, _names in _COUPLED.items():
    for _name in _names:
        mark_batch_coupled(f"{_LOSSES}:{_name}", what=_what)
