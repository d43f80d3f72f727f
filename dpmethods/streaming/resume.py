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
from collections.abc import Callable, Generator, Iterable, Iterator
from pathlib import Path
from typing import Any

from dpmethods.streaming.map import Indexed, rank_and_world

__all__ = ["Progress", "checkpointed", "resumable"]

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


def resumable(
    run: Callable[[Iterable[Any]], Iterator[Any]], batches: Iterable[Any], *,
    path: str | os.PathLike[str], method: str, ordered: bool,
    shard: tuple[int, int] | None = None,
) -> Generator[Any, None, None]:
    """The outputs of ``run(pending batches)``, skipping and recording taken batches.

    Args:
        run: runs the map (unsharded) over the ``(index, batch)`` pairs given, yielding
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
        >>> it = resumable(run, range(5), path=path, method="square", ordered=True)
        >>> next(it), next(it), next(it)
        (0, 1, 4)
        >>> it.close()  # 0 and 1 were taken; 4 was returned but not asked past
        >>> list(resumable(run, range(5), path=path, method="square", ordered=True))
        [4, 9, 16]
        >>> list(resumable(run, range(5), path=path, method="square", ordered=True))
        []
    """
    progress = Progress(_rank_path(path, shard), method)
    original: collections.deque[int] = collections.deque()  # ordered: the indices to come

    def pending() -> Iterator[tuple[int, Any]]:
        count = 0
        for i, batch in enumerate(batches):
            count = i + 1
            if (shard is not None and i % shard[1] != shard[0]) or i in progress.done:
                continue
            if ordered:
                original.append(i)
            yield i, batch
        if count < progress.seen or (progress.done and max(progress.done) >= count):
            raise ValueError(
                f"map: checkpoint: {str(progress.path)!r} records {max(progress.seen, max(progress.done) + 1)} "
                f"batches, but the input now has {count}: it is another input's record"
            )
        progress.seen = count

    outputs = run(pending())
    finished = False
    try:
        for item in outputs:
            index = original.popleft() if ordered else item[0]
            yield item
            if not isinstance(item if ordered else item[1], BaseException):
                progress.taken(index)  # asked past; a failed batch (errors="yield") runs again
        finished = True
        progress.finished = True
    finally:
        close = getattr(outputs, "close", None)
        if close is not None and not finished:
            close()
        progress.save()


def checkpointed(
    run_map: Callable[..., Iterator[Any]], method: str, batches: Iterable[Any],
    checkpoint: str | os.PathLike[str], *, ordered: bool, shard: bool, **options: Any,
) -> Iterator[Any]:
    """``run_map(method, pending, ordered=..., **options)`` (a ``DataParallel.map``) made
    resumable through the record in ``checkpoint``; sharding is done here, per rank."""
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(
            f"map: checkpoint: expected a file path (str or os.PathLike), got "
            f"{type(checkpoint).__name__} {checkpoint!r}"
        )
    rank = rank_and_world() if shard else None
    return _Closing(resumable(
        lambda pending: run_map(method, (Indexed(i, b) for i, b in pending), ordered=ordered,
                                shard=False, **options),
        batches, path=checkpoint, method=method, ordered=ordered, shard=rank,
    ))


class _Closing(Iterator[Any]):
    """An iterator that is also a context manager, as the map's own iterator is."""

    def __init__(self, outputs: Generator[Any, None, None]) -> None:
        self._outputs = outputs

    def __next__(self) -> Any:
        return next(self._outputs)

    def close(self) -> None:
        """Stop the map and write the record."""
        self._outputs.close()

    def __enter__(self) -> _Closing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
