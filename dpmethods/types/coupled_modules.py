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
import functools
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from torch import nn

from dpmethods.types.named_classes import check_class_path, when_class_imported
from dpmethods.vocab.warn_once import warn_once

__all__ = [
    "class_marks", "is_batch_coupled", "mark_batch_coupled", "marks", "part_of_batch",
]

_state = threading.local()
_MARKED: dict[type, str] = {}  # class -> what couples its batch, for the message
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


def marks(module: nn.Module) -> dict[type, str]:
    """The marked classes among ``module``'s submodules' classes and their bases, with
    what couples their batch: what a worker process marks again before it runs them.

    Example:
        >>> marks(nn.Linear(2, 2))
        {}
    """
    return class_marks({type(m) for m in module.modules()})


def class_marks(classes: Iterable[type]) -> dict[type, str]:
    """:func:`marks` of a module whose submodules' classes are ``classes``.

    Example:
        >>> class_marks({nn.Linear, nn.ReLU})
        {}
    """
    return {k: _MARKED[k] for cls in classes for k in cls.__mro__ if k in _MARKED}


def mark_batch_coupled(
    cls: type | str, *, what: str = "it computes over the whole batch", missing_ok: bool = False
) -> None:
    """Mark ``cls`` as a module whose output couples the items of its batch.

    Args:
        cls: an ``nn.Module`` subclass (a loss with in-batch negatives, say), or
            ``"module:Class"`` for a class whose module may not be imported yet: it is
            marked once that module is imported (checked when a wrapper is made).
        what: what couples the batch, for the warning (``"in-batch negatives"``).
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
    if isinstance(cls, str):
        check_class_path("mark_batch_coupled", cls, missing_ok)
        when_class_imported(cls, functools.partial(_mark_found, what=what))
        return
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"mark_batch_coupled: cls: expected an nn.Module subclass, got {cls!r}")
    _MARKED[cls] = what
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


def _mark_found(cls: Any, what: str) -> None:
    if isinstance(cls, type) and issubclass(cls, nn.Module):  # None: missing_ok's skip
        mark_batch_coupled(cls, what=what)


def _warn(cls: type) -> None:
    what = next((_MARKED[k] for k in cls.__mro__ if k in _MARKED), "")
    warn_once(
        f"DataParallel: {cls.__name__} couples the items of its batch ({what}), but it ran "
        f"in a replica on that replica's share of the batch only, so its result is not "
        f"the full-batch one (a loss averaged over replicas is a different loss). Gather "
        f"the embeddings or features with dpmethods (a parallel method that returns them) "
        f"and run {cls.__name__} outside, on the whole batch.",
        stacklevel=3,
    )
