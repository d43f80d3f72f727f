"""Resumable maps: ``DataParallel.map(..., checkpoint=path)``.

The map records which batches' outputs the consumer has taken in a small JSON file,
replaced atomically (written to a temporary file, then renamed) every few seconds and
when the map ends, stops or is closed. An output counts as taken once the consumer asked
for the next one, or once the map is exhausted: after a crash or a ``break`` the last
output taken may come again (at least once), and nothing that was not taken is skipped.

Run the same map again with the same file and the batches recorded as done are read
from ``batches`` (to stay aligned) but neither computed nor yielded; an ordered map
yields the rest in order, ``ordered=False`` yields ``(index, output)`` with the original
indices. A finished map yields nothing. A file written for another method, or one that
records more batches than the input now has, is refused with an error naming the file.
With ``shard=True`` each rank keeps its own file (``path`` with ``.rank{r}-of-{n}``).
"""

from __future__ import annotations

import collections
import json
import os
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from dpmethods.streaming.map import Indexed, rank_and_world

__all__ = ["Progress", "Resumable", "checkpointed"]

_VERSION = 1
SAVE_EVERY_S = 2.0  # how often taken outputs are written while the map runs


class Progress:
    """The record of one map's taken batches, kept in ``path``.

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "map.json")
        >>> p = Progress(path, "encode")
        >>> p.taken(0); p.taken(1); p.taken(3); p.save()
        >>> sorted(Progress(path, "encode").done)
        [0, 1, 3]
    """

    def __init__(self, path: str | os.PathLike[str], method: str) -> None:
        self.path = Path(path)
        self.method = method
        self.done: set[int] = set()
        self.seen = 0  # batches the input had when the record was last written at its end
        self.finished = False
        if self.path.exists():
            self._load()
        self._saved_at = time.monotonic()

    def _load(self) -> None:
        try:
            record = json.loads(self.path.read_text())
            ranges, method = record["done"], record["method"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"map: checkpoint: {str(self.path)!r} is not a map checkpoint of dpmethods ({exc})"
            ) from None
        if method != self.method:
            raise ValueError(
                f"map: checkpoint: {str(self.path)!r} records a map of {method!r}, not of "
                f"{self.method!r}: pass another file, or delete it to start over"
            )
        self.done = {i for start, end in ranges for i in range(start, end)}
        self.seen, self.finished = int(record.get("seen", 0)), bool(record.get("finished", False))

    def taken(self, index: int) -> None:
        self.done.add(index)
        if time.monotonic() - self._saved_at >= SAVE_EVERY_S:
            self.save()

    def save(self) -> None:
        """Write the record atomically: a reader sees the old file or the new one."""
        ranges: list[list[int]] = []
        for i in sorted(self.done):
            if ranges and ranges[-1][1] == i:
                ranges[-1][1] = i + 1
            else:
                ranges.append([i, i + 1])
        record = {"version": _VERSION, "method": self.method, "done": ranges,
                  "seen": self.seen, "finished": self.finished}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.path)
        self._saved_at = time.monotonic()


def _rank_path(path: str | os.PathLike[str], shard: tuple[int, int] | None) -> Path:
    if shard is None:
        return Path(path)
    rank, world = shard
    return Path(f"{os.fspath(path)}.rank{rank}-of-{world}")


class Resumable(Iterator[Any]):
    """The outputs of ``run(pending batches)``, skipping and recording taken batches; also
    a context manager that closes it, as the map's own iterator is.

    An output counts as taken when the next one is asked for, or at the end. Closing it
    (``close()``, ``with``, an error, garbage collection) stops ``run`` and writes the record.

    Args:
        run: runs the map (unsharded) over the batches given, as
            :class:`~dpmethods.streaming.map.Indexed` ``(index, batch)`` pairs, yielding
            outputs in order or ``(index, output)`` pairs.
        batches: the map's input.
        path: the record's file.
        method: the map's method, recorded and checked.
        ordered: whether ``run`` yields outputs in order.
        shard: ``(rank, world_size)`` when this rank runs only batches
            ``i % world_size == rank``.

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "squares.json")
        >>> run = lambda pairs: (x * x for _, x in pairs)
        >>> it = Resumable(run, range(5), path=path, method="square", ordered=True)
        >>> next(it), next(it), next(it)
        (0, 1, 4)
        >>> it.close()  # 0 and 1 were taken; 4 was returned but not asked past
        >>> list(Resumable(run, range(5), path=path, method="square", ordered=True))
        [4, 9, 16]
        >>> list(Resumable(run, range(5), path=path, method="square", ordered=True))
        []
    """

    def __init__(
        self, run: Callable[[Iterable[Any]], Iterator[Any]], batches: Iterable[Any], *,
        path: str | os.PathLike[str], method: str, ordered: bool,
        shard: tuple[int, int] | None = None,
    ) -> None:
        self._progress = progress = Progress(_rank_path(path, shard), method)
        self._ordered = ordered
        self._original: collections.deque[int] = collections.deque()  # ordered: indices to come
        self._last: int | None = None  # the output returned last, taken when asked past
        # The batches to run never refer to self: dropping the iterator finalizes it.
        self._outputs = run(Indexed(_pending(batches, progress, shard, self._original if ordered else None)))
        # Not self: a dropped iterator writes its record too.
        self._finalizer = weakref.finalize(self, _stop, self._outputs, progress)

    def __next__(self) -> Any:
        if self._last is not None:  # asked past: taken
            self._progress.taken(self._last)
            self._last = None
        try:
            item = next(self._outputs)
        except StopIteration:
            self._progress.finished = True
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
        """Stop the map and write the record (idempotent)."""
        self._finalizer()

    def __enter__(self) -> Resumable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pending(
    batches: Iterable[Any], progress: Progress, shard: tuple[int, int] | None,
    original: collections.deque[int] | None,
) -> Iterator[tuple[int, Any]]:
    """The batches not taken yet (``original`` gets their indices), and a check of the
    input's length against the record at the end."""
    count = 0
    for i, batch in enumerate(batches):
        count = i + 1
        if (shard is not None and i % shard[1] != shard[0]) or i in progress.done:
            continue
        if original is not None:
            original.append(i)
        yield i, batch
    if count < progress.seen or (progress.done and max(progress.done) >= count):
        raise ValueError(
            f"map: checkpoint: {str(progress.path)!r} records {max(progress.seen, max(progress.done) + 1)} "
            f"batches, but the input now has {count}: it is another input's record"
        )
    progress.seen = count


def _stop(outputs: Iterator[Any], progress: Progress) -> None:
    close = getattr(outputs, "close", None)
    if close is not None and not progress.finished:
        close()
    progress.save()


def checkpointed(
    run_map: Callable[..., Iterator[Any]], method: str, batches: Iterable[Any],
    checkpoint: str | os.PathLike[str], *, ordered: bool, shard: bool, **options: Any,
) -> Resumable:
    """``run_map(method, pending, ordered=..., **options)`` (a ``DataParallel.map``) made
    resumable through the record in ``checkpoint``; sharding is done here, per rank."""
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(
            f"map: checkpoint: expected a file path (str or os.PathLike), got "
            f"{type(checkpoint).__name__} {checkpoint!r}"
        )
    rank = rank_and_world() if shard else None
    return Resumable(
        lambda pending: run_map(method, pending, ordered=ordered, shard=False, **options),
        batches, path=checkpoint, method=method, ordered=ordered, shard=rank,
    )
