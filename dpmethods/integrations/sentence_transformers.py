"""sentence-transformers: ``encode`` with no configuration, and batch-coupled losses.

``SentenceTransformer.encode`` (and ``encode_query``, ``encode_document``) splits its
sentences (the first argument: ``sentences`` before 6.x, ``inputs`` in 6.x) and extends
the per-item results in order (numpy arrays and tensors are joined too). One string is
one input, and gives one embedding. ``precision="int8"``/``"uint8"`` calibrates its
ranges on all the embeddings of the call, so the replicas compute float32 embeddings and
they are quantized once, on the gathered batch, as on one device.

In-batch-negatives losses (``MultipleNegativesRankingLoss`` and its cached and
symmetric relatives, GIST), batch-mined triplet losses and pairwise-ranking losses
(CoSENT, AnglE) compare every item of the batch with the others: run on a replica's
share they see fewer negatives and give a different loss, so they are warned about.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch

from dpmethods.extending import (
    Call,
    CallHooks,
    MethodOptions,
    mark_batch_coupled,
    register_method_finder,
)

__all__: list[str] = []

APPLIES_TO = "SentenceTransformer; in-batch-negatives, batch-mined and pairwise losses"
METHODS = (
    "encode, encode_query, encode_document (split on the sentences, per-item results "
    "extended, int8/uint8 calibrated on the whole batch)"
)
_CALIBRATED = ("int8", "uint8")  # precisions whose ranges come from the whole batch


def _encode_methods(cls: type) -> dict[str, MethodOptions]:
    st = getattr(sys.modules.get("sentence_transformers"), "SentenceTransformer", None)
    if not (isinstance(st, type) and issubclass(cls, st)):
        return {}
    found = {}
    for name in ("encode", "encode_query", "encode_document"):
        if not inspect.isfunction(inspect.getattr_static(cls, name, None)):
            continue
        first = next(iter(list(inspect.signature(getattr(cls, name)).parameters)[1:]), None)
        if first is not None:
            # Results are per item: a list (token embeddings, tensors) is extended, never zipped.
            hooks = CallHooks(prepare=_Encode(first))
            found[name] = MethodOptions(split=(first,), gather="extend", hooks=hooks)
    return found


class _Encode:
    """``prepare`` of ``encode``: one string as one input; int8/uint8 on the whole batch."""

    def __init__(self, first: str) -> None:
        self.first = first

    def __eq__(self, other: object) -> bool:  # options compare equal per argument name
        return isinstance(other, _Encode) and other.first == self.first

    def __hash__(self) -> int:
        return hash(self.first)

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any], call: Call) -> Any:
        one = False
        if args and isinstance(args[0], str):
            args, one = ([args[0]], *args[1:]), True
        elif isinstance(kwargs.get(self.first), str):
            kwargs, one = {**kwargs, self.first: [kwargs[self.first]]}, True
        precision = kwargs.get("precision")
        if precision not in _CALIBRATED:
            return args, kwargs, (lambda out: out[0]) if one else None
        finish = _Quantize(
            precision, bool(kwargs.get("convert_to_tensor", False)),
            bool(kwargs.get("convert_to_numpy", True)), one,
        )
        return args, {**kwargs, "precision": "float32"}, finish


class _Quantize:
    """Quantize the gathered float32 embeddings once, then convert as ``encode`` does."""

    def __init__(self, precision: str, to_tensor: bool, to_numpy: bool, one: bool) -> None:
        self.precision, self.to_tensor, self.to_numpy, self.one = precision, to_tensor, to_numpy, one

    @property
    def advice(self) -> str:
        """What item mode's refusal of ``encode(precision=...)`` adds: how to quantize over all."""
        return (
            f"encode with precision='float32' (the default), then "
            f"sentence_transformers.quantize_embeddings(numpy.stack(outputs), precision={self.precision!r}) "
            f"gives what model.encode(texts, precision={self.precision!r}) gives"
        )

    def __call__(self, out: Any) -> Any:
        quantize = sys.modules["sentence_transformers"].quantize_embeddings
        if len(out):
            out = quantize(out, precision=self.precision)
        if self.to_tensor:
            out = torch.as_tensor(out)
        elif not self.to_numpy and not isinstance(out, list):
            out = list(torch.from_numpy(out))
        return out[0] if self.one else out


register_method_finder(_encode_methods)

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
        mark_batch_coupled(f"{_LOSSES}:{_name}", what=_what, missing_ok=True)  # by version
