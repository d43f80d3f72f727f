"""Negatives given as indices into the whole batch's frames (wav2vec 2.0's pretraining).

``Wav2Vec2ForPreTraining`` (and its Conformer variant) takes ``sampled_negative_indices``
``[batch, frames, negatives]``, indices into its quantized features flattened to
``[batch * frames, d]``: row ``b``'s negatives, as transformers' ``_sample_negative_indices``
draws them, lie in ``[b * frames, (b + 1) * frames)``. A replica holds its rows' features
only, numbered from 0, so :data:`NEGATIVE_SHARES` re-bases each replica's rows of the
indices to its share, and refuses, before any replica runs, an index outside them (a
negative drawn from another replica's rows, which no replica can score).
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import Tensor

from dpmethods.extending import Call, CallHooks, unwrap_compiled

__all__ = ["NEGATIVE_SHARES", "takes_negatives"]

_NAME = "sampled_negative_indices"


def takes_negatives(cls: type) -> bool:
    """Whether ``cls.forward`` takes ``sampled_negative_indices``."""
    try:
        return _NAME in inspect.signature(cls.forward).parameters  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError):
        return False


def _rebase(args: tuple[Any, ...], kwargs: dict[str, Any], start: int, call: Call) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``per_replica``: the replica's rows of the indices, counted from its first frame."""
    model = unwrap_compiled(call.module)
    names = [n for n in inspect.signature(model.forward).parameters if n != "self"]
    position = names.index(_NAME) if _NAME in names else len(args)
    value = kwargs.get(_NAME) if position >= len(args) else args[position]
    if not isinstance(value, Tensor) or value.dim() < 2 or value.shape[0] == 0:
        return args, kwargs
    rows, frames = value.shape[0], value.shape[1]
    rebased = value - start * frames
    outside = ((rebased < 0) | (rebased >= rows * frames)).flatten(1).any(1)
    if bool(outside.any()):
        row = start + int(outside.nonzero()[0])
        raise ValueError(
            f"DataParallel: {type(model).__name__}.forward: {_NAME} indexes the whole batch's "
            f"frames flattened ({frames} per row), and row {row} draws negatives outside the "
            f"rows its replica holds (rows {start} to {start + rows - 1}): expected indices in "
            f"[{start * frames}, {(start + rows) * frames}) for those rows, as transformers' "
            "_sample_negative_indices draws each row's negatives from its own frames; negatives "
            "from other rows need every row's features, so run such a call on one device"
        )
    if position < len(args):
        return (*args[:position], rebased, *args[position + 1:]), kwargs
    return args, {**kwargs, _NAME: rebased}


NEGATIVE_SHARES = CallHooks(per_replica=_rebase)
"""The hooks that give each replica its rows' ``sampled_negative_indices``, re-based."""
