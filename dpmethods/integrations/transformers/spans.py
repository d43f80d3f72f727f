"""Extractive question answering's loss, joined over the replicas as the full batch's.

``*ForQuestionAnswering`` heads clamp ``start_positions`` and ``end_positions`` to the
sequence length ``L`` and ignore a position equal to it (an answer outside the input);
the loss is ``(start + end) / 2``, each a cross-entropy averaged over the rows whose
position counts. When every replica's start and end positions count the same rows,
replica ``r``'s loss joins with weight ``counted_r / counted``, exactly; otherwise no one
weight per replica gives the full-batch loss, and the losses stay per replica.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from torch import Tensor

__all__ = ["is_span_loss", "span_weights", "start_length"]

_POSITIONS = ("start_positions", "end_positions")


def is_span_loss(model: Any, source: str, given: Mapping[str, Any]) -> bool:
    """Whether ``model``'s forward computes the question-answering loss for this call.

    ``source`` is its forward's source: the heads that compute it themselves name
    ``ignored_index``; the others use transformers' ``ForQuestionAnsweringLoss``.

    Example:
        >>> import torch
        >>> is_span_loss(torch.nn.Linear(2, 2), "", {"start_positions": torch.zeros(2)})
        False
    """
    if not all(isinstance(given.get(k), Tensor) for k in _POSITIONS):
        return False
    losses = sys.modules.get("transformers.loss.loss_utils")
    qa_loss = getattr(losses, "ForQuestionAnsweringLoss", None)
    return "ignored_index" in source or (
        qa_loss is not None and getattr(model, "loss_function", None) is qa_loss
    )


def start_length(outputs: list[Any]) -> int | None:
    """``L``: the length of the first replica's ``start_logits`` (None if it has none)."""
    first = outputs[0]
    if isinstance(first, Mapping):
        logits = first.get("start_logits")
    else:  # return_dict=False: (loss, start_logits, end_logits, ...)
        logits = first[1] if len(first) > 1 else None
    return int(logits.shape[-1]) if isinstance(logits, Tensor) else None


def span_weights(given: Mapping[str, Any], length: int, sizes: list[int]) -> list[float] | None:
    """Each replica's weight, or None when its start and end positions count different rows.

    Example:
        >>> import torch
        >>> given = {"start_positions": torch.tensor([0, 9, 2, 1]), "end_positions": torch.tensor([1, 9, 3, 2])}
        >>> span_weights(given, 9, [2, 2])  # row 1 is ignored by both losses
        [0.3333333333333333, 0.6666666666666666]
        >>> span_weights({**given, "end_positions": torch.tensor([1, 2, 3, 2])}, 9, [2, 2]) is None
        True
    """
    counts = []
    for name in _POSITIONS:
        positions = given[name]
        if positions.dim() > 1:  # as the heads do: [n, 1] -> [n]
            positions = positions.squeeze(-1)
        counted = positions.clamp(0, length) != length
        counts.append([int(part.sum()) for part in counted.split(sizes)])
    if counts[0] != counts[1]:
        return None
    total = sum(counts[0])
    return [c / total for c in counts[0]] if total else [1.0 / len(sizes)] * len(sizes)
