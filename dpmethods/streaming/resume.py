"""Resumable maps: ``DataParallel.map(..., checkpoint=path)``, a stage of the map.

A :class:`Checkpoint` skips the done batches at the map's source and records the taken
ones at its sink (the map's iterator, :class:`~dpmethods.streaming.iterator.MapIterator`).
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
file (``path`` with ``.rank{r}-of-{n}``); a map without a record of its own where there
are records of another sharding (unsharded, another world size) is refused.
"""

from __future__ import annotations

import collections
import glob
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from dpmethods.streaming.record import Identity, Record
from dpmethods.streaming.source import count, rank_and_world
from dpmethods.types.digests import digest

__all__ = ["Checkpoint"]

LOOKAHEAD = 32  # batches to run held back while the input is checked before the first runs


class _Source(Iterator[tuple[int, Any]]):
    """The batches not taken yet, as ``(index, batch)``, each checked against the record
    as it is read."""

    record: Record  # set once the map's arguments were checked

    def __init__(self, batches: Iterable[Any]) -> None:
        self._batches: Iterable[Any] | None = batches
        self._pairs: Iterator[tuple[int, Any]] = iter(())
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
        return pair


class Checkpoint:
    """The ``checkpoint=`` stage of a map: the batches not taken yet at its source
    (:attr:`pending`), each taken output recorded at its sink (:meth:`taken`).

    An output counts as taken when the next one is asked for, or at the end; a failed
    batch (``errors="yield"``) is not taken, and runs again. Before the first batch runs,
    :meth:`prime` reads the input as far as the record had read it. :meth:`close` writes
    the record and releases it.

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "squares.json")
        >>> def squares():
        ...     stage = Checkpoint(path, Identity.of("square", range(5)), range(5))
        ...     stage.open()
        ...     try:
        ...         if stage.prime():
        ...             for i, x in stage.pending:
        ...                 yield i, x * x
        ...                 stage.taken(i)
        ...             stage.finish()
        ...     finally:
        ...         stage.close()
        >>> it = squares()
        >>> next(it), next(it)  # 0 was taken; 1 was returned but not asked past
        ((0, 0), (1, 1))
        >>> it.close()
        >>> list(squares())
        [(1, 1), (2, 4), (3, 9), (4, 16)]
        >>> list(squares())
        []
    """

    def __init__(self, path: str | os.PathLike[str], identity: Identity, batches: Iterable[Any],
                 total: int | None = None) -> None:
        self.base = Path(path)  # as given: the records of every sharding are named after it
        self.path, self.identity = _rank_path(path, identity.shard), identity
        self.pending = _Source(batches)  # the batches to run, as (index, batch)
        self.total = total  # this rank's batches, done or not (None: the input has no len())
        self.record: Record | None = None  # opened once the map's arguments were checked

    @staticmethod
    def of(path: str | os.PathLike[str], method: str, batches: Iterable[Any], kwargs: Mapping[str, Any],
           model: Any, shard: bool, items: Mapping[str, Any] | None = None) -> Checkpoint:
        """The stage of the map of ``method`` of ``model`` over ``batches`` (``shard``:
        this rank's batches only, with a record per rank; ``items``: in item mode, what
        shapes each item's output, :meth:`dpmethods.items.ItemOptions.identity`)."""
        rank = rank_and_world() if shard else None
        identity = Identity.of(method, batches, dict(kwargs), model, rank, items)
        return Checkpoint(path, identity, batches, count(batches, *(rank or (0, 1))))

    def open(self) -> None:
        """Open the record: another map's, one in use, or none where the map has records
        of another sharding, is refused."""
        if not self.path.exists():
            _refuse_other_shardings(self.base, self.identity.shard)
        self.record = self.pending.record = Record(self.path, self.identity)

    def prime(self) -> bool:
        """Read the input as far as the record had read it (refusing another input before
        any batch runs); False when nothing is left to run."""
        self.pending.prime()
        return not self.pending.empty

    @property
    def done(self) -> int:
        """How many batches the record counts as done (0 before it is opened): where a
        resumed map's progress bar starts."""
        return len(self.record.done) if self.record is not None else 0

    def taken(self, index: int) -> None:
        """The consumer took batch ``index``'s output."""
        self.record.taken(index)  # type: ignore[union-attr]

    def finish(self) -> None:
        """The map ran to its end."""
        self.record.finished = True  # type: ignore[union-attr]

    def close(self) -> None:
        """Write the record and release it (idempotent)."""
        record, self.record = self.record, None
        if record is not None:
            record.close()


def _refuse_other_shardings(path: Path, shard: tuple[int, int] | None) -> None:
    """Refuse to start the map at ``path`` afresh where it has records of another
    sharding (unsharded, or over another world size): it would run and yield again every
    batch those recorded as taken."""
    names = re.compile(re.escape(path.name) + r"\.rank(\d+)-of-(\d+)")
    found = [p for p in path.parent.glob(glob.escape(path.name) + ".rank*-of-*")
             if (m := names.fullmatch(p.name)) and (shard is None or int(m[2]) != shard[1])]
    if shard is not None and path.exists():
        found.append(path)
    if not found:
        return
    mine = "unsharded" if shard is None else f"sharded over {shard[1]} rank{'s' if shard[1] > 1 else ''}"
    raise ValueError(
        f"map: checkpoint: {str(path)!r}: this map is {mine} and has no record, but records of "
        f"another sharding exist ({', '.join(sorted(repr(p.name) for p in found))}); starting "
        f"afresh would run again the batches they record as taken. A map resumes with the "
        f"sharding it started with (shard= and the world size): run it so, or delete those "
        f"files to start over"
    )


def _rank_path(path: str | os.PathLike[str], shard: tuple[int, int] | None) -> Path:
    if shard is None:
        return Path(path)
    rank, world = shard
    return Path(f"{os.fspath(path)}.rank{rank}-of-{world}")
