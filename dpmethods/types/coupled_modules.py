"""Modules that couple the items of their batch: in-batch-negatives and contrastive losses.

Such a loss (sentence-transformers' ``MultipleNegativesRankingLoss``, open_clip's
``ClipLoss``) builds a similarity matrix over the whole batch. Run in a replica on its
share of the batch it sees fewer negatives, and its value is a different loss: the
average of the replicas' losses is not the full-batch loss. Only a 0-dim loss reaches
the gather, so nothing in the output shows it. :func:`mark_batch_coupled` marks a
module class as such: the first time one of its instances runs on a part of a batch
(a replica's share of a call over several replicas, or a half of an out-of-memory
split), a one-time warning names the class and the pattern that gives the full-batch
loss (gather the embeddings, compute the loss outside).

The mark wraps the class's ``forward`` once; outside a part of a batch it costs one
thread-local read per call of that class's forward, and nothing for other classes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from torch import nn

from dpmethods.types.named_classes import check_class_path, when_class_imported
from dpmethods.vocab.warn_once import warn_once

__all__ = [
    "Mark", "class_marks", "is_batch_coupled", "mark_batch_coupled", "marks", "part_of_batch",
]


@dataclasses.dataclass(frozen=True)
class Mark:
    """What couples a marked class's batch, and what to do instead, for its warning.

    Example:
        >>> Mark("in-batch negatives").advice is None
        True
    """

    what: str  # what couples the batch
    advice: str | None = None  # None: a loss's (gather the features, compute it outside)


_state = threading.local()
_MARKED: dict[type, Mark] = {}  # class -> its mark
_WRAPPED = "__dpmethods_batch_coupled__"


@contextlib.contextmanager
def part_of_batch(active: bool) -> Iterator[None]:
    """Mark this thread as running a part of a batch (``active``): a replica's share of a
    call over several replicas, or a half of a share that ran out of memory. A marked
    class's ``forward`` warns there.

    Example:
        >>> with part_of_batch(True):
        ...     pass
    """
    before = getattr(_state, "active", False)
    _state.active = active
    try:
        yield
    finally:
        _state.active = before


def is_batch_coupled(cls: type) -> bool:
    """Whether ``cls`` (or a base) was marked with :func:`mark_batch_coupled`.

    Example:
        >>> is_batch_coupled(nn.Linear)
        False
    """
    return any(k in _MARKED for k in cls.__mro__)


def marks(module: nn.Module) -> dict[type, Mark]:
    """The marked classes among ``module``'s submodules' classes and their bases, with
    their marks: what a worker process marks again before it runs them.

    Example:
        >>> marks(nn.Linear(2, 2))
        {}
    """
    return class_marks({type(m) for m in module.modules()})


def class_marks(classes: Iterable[type]) -> dict[type, Mark]:
    """:func:`marks` of a module whose submodules' classes are ``classes``.

    Example:
        >>> class_marks({nn.Linear, nn.ReLU})
        {}
    """
    return {k: _MARKED[k] for cls in classes for k in cls.__mro__ if k in _MARKED}


def mark_batch_coupled(
    cls: type | str, *, what: str = "it computes over the whole batch", advice: str | None = None,
    missing_ok: bool = False,
) -> None:
    """Mark ``cls`` as a module whose output couples the items of its batch.

    Args:
        cls: an ``nn.Module`` subclass (a loss with in-batch negatives, say), or
            ``"module:Class"`` for a class whose module may not be imported yet: it is
            marked once that module is imported (checked when a wrapper is made).
        what: what couples the batch, for the warning (``"in-batch negatives"``).
        advice: the warning's last sentences, what gives the full-batch result; None
            for a loss: gather the embeddings or features, compute the loss outside.
        missing_ok: with ``"module:Class"``, a class that its module (imported already)
            lacks is skipped instead of refused: for a class only some versions of a
            library have.

    Example:
        >>> import torch
        >>> class InBatchLoss(torch.nn.Module):
        ...     def forward(self, a, b):
        ...         return torch.nn.functional.cross_entropy(a @ b.T, torch.arange(len(a)))
        >>> mark_batch_coupled(InBatchLoss, what="in-batch negatives")
        >>> is_batch_coupled(InBatchLoss)
        True
    """
    if not isinstance(what, str):
        raise TypeError(f"mark_batch_coupled: what: expected a str, got {type(what).__name__} {what!r}")
    if advice is not None and not isinstance(advice, str):
        raise TypeError(f"mark_batch_coupled: advice: expected a str or None, got {type(advice).__name__} {advice!r}")
    mark = Mark(what, advice)
    if isinstance(cls, str):
        check_class_path("mark_batch_coupled", cls, missing_ok)
        when_class_imported(cls, functools.partial(_mark_found, mark=mark))
        return
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"mark_batch_coupled: cls: expected an nn.Module subclass, got {cls!r}")
    _MARKED[cls] = mark
    forward = cls.forward  # its own or a base's
    if getattr(forward, _WRAPPED, False):
        return  # a marked base's forward: it warns, naming this class

    @functools.wraps(forward)
    def coupled_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if getattr(_state, "active", False):
            _warn(type(self))
        return forward(self, *args, **kwargs)

    setattr(coupled_forward, _WRAPPED, True)
    cls.forward = coupled_forward  # type: ignore[method-assign]


def _mark_found(cls: Any, mark: Mark) -> None:
    if isinstance(cls, type) and issubclass(cls, nn.Module):  # None: missing_ok's skip
        mark_batch_coupled(cls, what=mark.what, advice=mark.advice)


def _warn(cls: type) -> None:
    mark = next((_MARKED[k] for k in cls.__mro__ if k in _MARKED), Mark(""))
    if mark.advice is None:
        advice = (
            f" (a loss averaged over replicas is a different loss). Gather the embeddings or "
            f"features with dpmethods (a parallel method that returns them) and run "
            f"{cls.__name__} outside, on the whole batch."
        )
    else:
        advice = f". {mark.advice}"
    warn_once(
        f"DataParallel: {cls.__name__} couples the items of its batch ({mark.what}), but it ran "
        f"in a replica on that replica's share of the batch only, so its result is not "
        f"the full-batch one{advice}",
        stacklevel=3,
    )
