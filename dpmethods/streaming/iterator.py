"""What ``DataParallel.map`` returns: an iterator of the outputs that is also a context
manager closing it, and the sink of the ``checkpoint=`` stage.

Any exception out of ``__next__`` (the end, a failed batch, KeyboardInterrupt...) closes
the map before it propagates. Closing (``close()``, ``with``, ``break`` then garbage
collection) runs the map's ``stop`` and then writes the checkpoint's record, through a
``weakref.finalize`` that never refers to the iterator, so dropping the iterator stops
the map too.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

from dpmethods.streaming.resume import Checkpoint

__all__ = ["MapIterator"]


class MapIterator(Iterator[Any]):
    """The base of a map's iterator: a subclass gives :meth:`_next` (the next output to
    yield, with ``self._index`` set to its index) and :meth:`_dropped`.

    Args:
        stop: stops the map; it must not refer to the iterator.
        checkpoint: the map's ``checkpoint=`` stage, opened here; or None.
        ordered: outputs in order (else ``(index, output)`` pairs).

    Example:
        >>> class Squares(MapIterator):
        ...     def __init__(self, n):
        ...         super().__init__(lambda: print("stopped"), None, ordered=True)
        ...         self._left = iter(range(n))
        ...     def _next(self):
        ...         self._index = next(self._left)
        ...         return self._index ** 2
        >>> with Squares(5) as it:
        ...     next(it), next(it)
        (0, 1)
        stopped
    """

    _index = 0  # the index of the output _next returned last

    def __init__(self, stop: Callable[[], None], checkpoint: Checkpoint | None, *, ordered: bool) -> None:
        self._ordered, self._checkpoint = ordered, checkpoint
        self._closed = self._primed = False
        self._last: int | None = None  # the output returned last: taken once asked past
        self._finalizer = weakref.finalize(self, _stop, stop, checkpoint)
        if checkpoint is not None:
            try:
                checkpoint.open()
            except BaseException:
                self.close()
                raise

    def __iter__(self) -> MapIterator:
        return self

    def __enter__(self) -> MapIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the map (and write its checkpoint); the iterator is then exhausted."""
        self._closed = True
        self._finalizer()
        self._dropped()

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        try:
            if self._checkpoint is None:
                return self._next()
            return self._next_recorded(self._checkpoint)
        except BaseException:
            self.close()
            raise

    def _next_recorded(self, checkpoint: Checkpoint) -> Any:
        if self._last is not None:  # asked past: taken
            checkpoint.taken(self._last)
            self._last = None
        if not self._primed:
            self._primed = True
            if not checkpoint.prime():  # nothing to run: the workers are not started
                checkpoint.finish()
                raise StopIteration
        try:
            out = self._next()
        except StopIteration:
            checkpoint.finish()
            raise
        if not isinstance(out if self._ordered else out[1], BaseException):
            self._last = self._index  # a failed batch (errors="yield") is not taken: it runs again
        return out

    def _next(self) -> Any:
        raise NotImplementedError

    def _dropped(self) -> None:
        """Drop the outputs held (closed)."""


def _stop(stop: Callable[[], None], checkpoint: Checkpoint | None) -> None:
    try:
        stop()
    finally:
        if checkpoint is not None:
            checkpoint.close()
