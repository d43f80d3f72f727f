"""Resumable maps: ``DataParallel.map(..., checkpoint=path)``.

The map's :class:`~dpmethods.streaming.record.Record` says which batches' outputs the
consumer has taken; it is written every few seconds and when the map ends, stops or is
closed. An output counts as taken once the consumer asked for the next one, or once the
map is exhausted: after a crash or a ``break`` the last output taken may come again (at
least once), and nothing that was not taken is skipped.

Run the same map again with the same file and the batches recorded as done are read
from ``batches`` (to stay aligned, and checked) but neither computed nor yielded; an
ordered map yields the rest in order, ``ordered=False`` yields ``(index, output)`` with
the original indices. A finished map yields nothing. Before the first batch runs, the
input is read as far as the record had read it, each batch checked against the record,
holding back at most ``LOOKAHEAD`` batches to run: another map, another order or a
shorter input is refused before any work. With ``shard=True`` each rank keeps its own
file (``path`` with ``.rank{r}-of-{n}``).
"""

from __future__ import annotations

import collections
import os
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from dpmethods.streaming.map import Indexed, rank_and_world
from dpmethods.streaming.record import Identity, Record
from dpmethods.types.digests import digest

__all__ = ["Resumable", "checkpointed"]

LOOKAHEAD = 32  # batches to run held back while the input is checked before the first runs


class _Source(Iterator[tuple[int, Any]]):
    """The batches not taken yet, as ``(index, batch)``, each checked against the record
    as it is read (``original`` gets the indices given out, for an ordered map)."""

    record: Record  # set once the map's arguments were checked

    def __init__(self, batches: Iterable[Any], original: collections.deque[int] | None) -> None:
        self._batches: Iterable[Any] | None = batches
        self._pairs: Iterator[tuple[int, Any]] = iter(())
        self._original = original
        self._held: collections.deque[tuple[int, Any]] = collections.deque()
        self._read = 0  # batches of the input read
        self.ended = False

    def prime(self) -> None:
        """Read the input as far as the record had read it (holding back at most
        ``LOOKAHEAD`` batches to run), before any batch runs."""
        while not self.ended and self._read < self.record.checked and len(self._held) < LOOKAHEAD:
            pair = self._next_pending()
            if pair is not None:
                self._held.append(pair)

    @property
    def empty(self) -> bool:
        return self.ended and not self._held

    def _next_pending(self) -> tuple[int, Any] | None:
        """The next batch of the input if it is to run; None if it is done or another
        rank's, or the input ended."""
        if self._batches is not None:  # iterated here, not before: a DataLoader starts its workers
            self._pairs, self._batches = enumerate(self._batches), None
        try:
            i, batch = next(self._pairs)
        except StopIteration:
            self.ended = True
            self.record.check_end(self._read)
            return None
        self._read = i + 1
        record = self.record
        shard = record.identity.shard
        if shard is not None and i % shard[1] != shard[0]:
            return None
        record.check_batch(i, digest(batch))
        return None if i in record.done else (i, batch)

    def __next__(self) -> tuple[int, Any]:
        pair = self._held.popleft() if self._held else None
        while pair is None:
            if self.ended:
                raise StopIteration
            pair = self._next_pending()
        if self._original is not None:
            self._original.append(pair[0])
        return pair


class Resumable(Iterator[Any]):
    """The outputs of ``run(pending batches)``, skipping and recording taken batches; also
    a context manager that closes it, as the map's own iterator is.

    An output counts as taken when the next one is asked for, or at the end. Closing it
    (``close()``, ``with``, an error, garbage collection) stops ``run``, writes the record
    and releases it.

    Args:
        run: runs the map (unsharded) over the batches given, as
            :class:`~dpmethods.streaming.map.Indexed` ``(index, batch)`` pairs, yielding
            outputs in order or ``(index, output)`` pairs.
        batches: the map's input.
        path: the record's file.
        identity: the map's identity, checked against the record and recorded.
        ordered: whether ``run`` yields outputs in order.

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "squares.json")
        >>> run = lambda pairs: (x * x for _, x in pairs)
        >>> square = Identity.of("square", range(5))
        >>> it = Resumable(run, range(5), path=path, identity=square, ordered=True)
        >>> next(it), next(it), next(it)
        (0, 1, 4)
        >>> it.close()  # 0 and 1 were taken; 4 was returned but not asked past
        >>> list(Resumable(run, range(5), path=path, identity=square, ordered=True))
        [4, 9, 16]
        >>> list(Resumable(run, range(5), path=path, identity=square, ordered=True))
        []
    """

    def __init__(
        self, run: Callable[[Iterable[Any]], Iterator[Any]], batches: Iterable[Any], *,
        path: str | os.PathLike[str], identity: Identity, ordered: bool,
    ) -> None:
        self._ordered = ordered
        self._original: collections.deque[int] = collections.deque()  # ordered: indices to come
        self._last: int | None = None  # the output returned last, taken when asked past
        self._started = False
        # The batches to run never refer to self: dropping the iterator finalizes it.
        self._source = _Source(batches, self._original if ordered else None)
        self._outputs = run(Indexed(self._source))  # checks the map's arguments first
        try:
            self._record = self._source.record = Record(_rank_path(path, identity.shard), identity)
        except BaseException:
            getattr(self._outputs, "close", lambda: None)()
            raise
        # Not self: a dropped iterator writes its record too.
        self._finalizer = weakref.finalize(self, _stop, self._outputs, self._record)

    def __next__(self) -> Any:
        if self._last is not None:  # asked past: taken
            self._record.taken(self._last)
            self._last = None
        try:
            if not self._started:
                self._started = True
                self._source.prime()  # refuses another input before any batch runs
                if self._source.empty:  # nothing to run: the workers are not started
                    raise StopIteration
            item = next(self._outputs)
        except StopIteration:
            self._record.finished = True
            self.close()
            raise
        except BaseException:
            self.close()
            raise
        index = self._original.popleft() if self._ordered else item[0]
        if not isinstance(item if self._ordered else item[1], BaseException):
            self._last = index  # a failed batch (errors="yield") is not taken: it runs again
        return item

    def close(self) -> None:
        """Stop the map, write the record and release it (idempotent)."""
        self._finalizer()

    def __enter__(self) -> Resumable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stop(outputs: Iterator[Any], record: Record) -> None:
    try:
        close = getattr(outputs, "close", None)
        if close is not None:
            close()
    finally:
        record.close()


def _rank_path(path: str | os.PathLike[str], shard: tuple[int, int] | None) -> Path:
    if shard is None:
        return Path(path)
    rank, world = shard
    return Path(f"{os.fspath(path)}.rank{rank}-of-{world}")


def checkpointed(
    run_map: Callable[..., Iterator[Any]], method: str, batches: Iterable[Any],
    checkpoint: str | os.PathLike[str], model: Any, kwargs: dict[str, Any], *, ordered: bool,
    shard: bool, **options: Any,
) -> Resumable:
    """``run_map(method, pending, ordered=..., **options, **kwargs)`` (a
    ``DataParallel.map`` of ``model``) made resumable through the record in
    ``checkpoint``; sharding is done here, per rank."""
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(
            f"map: checkpoint: expected a file path (str or os.PathLike), got "
            f"{type(checkpoint).__name__} {checkpoint!r}"
        )
    rank = rank_and_world() if shard else None
    return Resumable(
        lambda pending: run_map(method, pending, ordered=ordered, shard=False, **options, **kwargs),
        batches, path=checkpoint, identity=Identity.of(method, batches, kwargs, model, rank), ordered=ordered,
    )
