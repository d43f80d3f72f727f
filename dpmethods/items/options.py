"""The options of item mode, checked once, before any item is read."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sized
from dataclasses import dataclass
from typing import Any

from dpmethods.streaming.source import Indexed
from dpmethods.types.digests import digest

__all__ = ["AUTO", "WINDOW_BATCHES", "ItemOptions", "callable_name", "item_options"]

AUTO = "auto"  # window: 64 batches' worth of items
WINDOW_BATCHES = 64


@dataclass(frozen=True)
class ItemOptions:
    """How ``map`` batches single items (see :func:`item_options`).

    Example:
        >>> ItemOptions(batch_size=32).window_items()
        2048
        >>> ItemOptions(max_tokens=512).window_tokens()
        32768
    """

    batch_size: int | None = None
    max_tokens: int | None = None
    length: Callable[[Any], Any] | None = None
    collate: Callable[[list[Any]], Any] | None = None
    window: int | str | None = AUTO
    trim: bool = False

    def window_items(self) -> int | None:
        """Items per window, or None: counted by tokens (or the whole input)."""
        if isinstance(self.window, int):
            return self.window
        if self.window == AUTO and self.batch_size is not None:
            return WINDOW_BATCHES * self.batch_size
        return None

    def window_tokens(self) -> int | None:
        """The sum of lengths that closes a window (``max_tokens`` alone; an empty item
        counts 1, the row it takes), or None."""
        if self.window == AUTO and self.batch_size is None and self.max_tokens is not None:
            return WINDOW_BATCHES * self.max_tokens
        return None

    def identity(self) -> dict[str, Any]:
        """What of these options shapes each item's output, as a resumable map records it
        (:class:`~dpmethods.streaming.record.Identity`): ``trim``, the ``collate`` by name
        (None: the default), and with both, the ``length`` by name (None: the default),
        which then tells each item's own positions where the batch has no
        ``attention_mask``. The batch cut (``batch_size``, ``max_tokens``, ``window``)
        may change from one run to the next.

        Example:
            >>> ItemOptions(batch_size=8, trim=True).identity()
            {'trim': True, 'collate': None}
            >>> ItemOptions(batch_size=8, collate=sorted, trim=True, length=len).identity()
            {'trim': True, 'collate': 'builtins.sorted', 'length': 'builtins.len'}
        """
        identity: dict[str, Any] = {"trim": self.trim, "collate": callable_name(self.collate)}
        if self.trim and self.collate is not None:
            identity["length"] = callable_name(self.length)
        return identity


def callable_name(fn: Callable[..., Any] | None) -> str | None:
    """A name of ``fn`` that is the same on every run: its module and qualified name (a
    callable object's class; a ``functools.partial``'s function and a digest of its
    arguments); None for None.

    Example:
        >>> import functools, operator
        >>> callable_name(operator.add), callable_name(None)
        ('_operator.add', None)
        >>> a, b = functools.partial(sorted, reverse=True), functools.partial(sorted, reverse=False)
        >>> callable_name(a).startswith("functools.partial(builtins.sorted, "), callable_name(a) == callable_name(b)
        (True, False)
    """
    if fn is None:
        return None
    if isinstance(fn, functools.partial):
        return f"functools.partial({callable_name(fn.func)}, {digest((fn.args, fn.keywords)):08x})"
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not isinstance(qualname, str):  # a callable object (a tokenizer): its class
        module, qualname = type(fn).__module__, type(fn).__qualname__
    return f"{module}.{qualname}"


def _positive(name: str, value: Any, what: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"map: {name}: expected None or an int >= 1 ({what}), got "
                         f"{type(value).__name__} {value!r}")


def item_options(
    batches: Iterable[Any], *, batch_size: Any = None, max_tokens: Any = None, length: Any = None,
    collate: Any = None, window: Any = AUTO, trim: Any = False,
) -> ItemOptions | None:
    """The item-mode options of a ``map`` call, checked; None when it maps batches
    (neither ``batch_size`` nor ``max_tokens``).

    Example:
        >>> item_options([], batch_size=8, window=None).window
        >>> item_options([]) is None
        True
        >>> item_options([], max_tokens=0)
        Traceback (most recent call last):
        ...
        ValueError: map: max_tokens: expected None or an int >= 1 (padded positions per batch, rows x longest), got int 0
    """
    _positive("batch_size", batch_size, "items per batch")
    _positive("max_tokens", max_tokens, "padded positions per batch, rows x longest")
    for name, value in (("length", length), ("collate", collate)):
        if value is not None and not callable(value):
            raise TypeError(f"map: {name}: expected None or a callable, got {type(value).__name__} {value!r}")
    if not isinstance(trim, bool):
        raise TypeError(f"map: trim: expected a bool, got {type(trim).__name__} {trim!r}")
    if window is not None and window != AUTO:
        _positive("window", window, f"items sorted together; or {AUTO!r}")
    if batch_size is None and max_tokens is None:
        given = {n: v for n, v in (("length", length), ("collate", collate), ("trim", trim))
                 if v not in (None, False)}
        if window != AUTO:
            given["window"] = window
        if given:
            name, value = next(iter(given.items()))
            raise TypeError(
                f"map: {name}: applies to items (with batch_size= or max_tokens=), but neither "
                f"was given, so batches are read as batches; got {name}={value!r}"
            )
        return None
    if window is None and not isinstance(batches, (Sized, Indexed)):
        raise TypeError(
            f"map: window: None sorts the whole input at once, so it needs a sized input "
            f"(with len()), got {type(batches).__name__}; pass window=N for a stream"
        )
    return ItemOptions(batch_size, max_tokens, length, collate, window, trim)
