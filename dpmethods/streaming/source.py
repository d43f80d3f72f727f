"""A map's source: its batches as ``(index, batch)`` pairs, this rank's only under ``shard=True``."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["Indexed", "count", "indexed", "rank_and_world"]


class Indexed:
    """Batches given as ``(index, batch)`` pairs: the map gives each batch that index
    (seeds, notes, ``ordered=False`` pairs) instead of its position, so a resumed map's
    batches keep their input indices.

    Example:
        >>> pairs = Indexed([(7, "a"), (9, "b")])
        >>> list(pairs)
        [(7, 'a'), (9, 'b')]
    """

    def __init__(self, pairs: Iterable[tuple[int, Any]]) -> None:
        self.pairs = pairs

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        return iter(self.pairs)


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size, for ``shard=True`` (torch.distributed must
    be initialized).

    Example:
        >>> try:
        ...     rank_and_world()
        ... except RuntimeError as exc:  # no process group in this process
        ...     print(str(exc).split(": ")[1])
        shard=True
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "DataParallel.map: shard=True: expected torch.distributed to be initialized "
            "(init_process_group, e.g. under torchrun), but it is not"
        )
    return dist.get_rank(), dist.get_world_size()


def indexed(batches: Iterable[Any], shard: bool) -> tuple[Iterator[tuple[int, Any]], int | None]:
    """``batches`` as ``(index, batch)`` pairs (this rank's with ``shard``), and how many
    there are (None: the input has no ``len()``).

    Example:
        >>> pairs, total = indexed("abc", shard=False)
        >>> list(pairs), total
        ([(0, 'a'), (1, 'b'), (2, 'c')], 3)
    """
    rank, world = rank_and_world() if shard else (0, 1)
    pairs = iter(batches) if isinstance(batches, Indexed) else enumerate(batches)
    return itertools.islice(pairs, rank, None, world), count(batches, rank, world)


def count(batches: Iterable[Any], rank: int = 0, world: int = 1) -> int | None:
    """How many of ``batches`` are rank ``rank``'s of ``world`` (all of them by default);
    None if the input has no ``len()``.

    Example:
        >>> count(range(5)), count(range(5), 1, 2), count(iter(range(5)))
        (5, 2, None)
    """
    try:
        return len(range(rank, len(batches), world))  # type: ignore[arg-type]
    except TypeError:  # no len(), e.g. a generator or a DataLoader of an IterableDataset
        return None
