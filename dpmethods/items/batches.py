"""Items into batches: read a window, sort it by length (longest first), cut it under
the caps.

``batch_size`` caps a batch's rows; ``max_tokens`` caps rows x the longest length in
the batch (its padded size), so short items go in big batches and long ones in small
ones; an item over the budget goes alone. A batch never mixes windows. Longest first:
the slowest batches start first, so the map's tail is short, and a batch that runs out
of memory does so at the start.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

from dpmethods.items.collate import measure
from dpmethods.items.options import ItemOptions

__all__ = ["Batch", "cut_window", "read_batches"]


class Batch(NamedTuple):
    """One batch's items, their input indices and lengths, longest first."""

    indices: list[int]
    items: list[Any]
    lengths: list[int]


def cut_window(window: list[tuple[int, int, Any]], batch_size: int | None, max_tokens: int | None) -> Iterator[Batch]:
    """``(length, index, item)`` triples sorted by length, longest first (ties in input
    order), cut into batches under both caps.

    Example:
        >>> [b.lengths for b in cut_window([(1, 0, "a"), (5, 1, "b"), (2, 2, "c"), (2, 3, "d")], None, 5)]
        [[5], [2, 2], [1]]
    """
    window = sorted(window, key=lambda t: -t[0])  # stable: equal lengths keep their order
    batch: list[tuple[int, int, Any]] = []
    for entry in window:
        rows = len(batch) + 1
        # Longest first: the batch's first item is its longest. An empty item still
        # takes a row.
        longest = max(batch[0][0] if batch else entry[0], 1)
        if batch and ((batch_size is not None and rows > batch_size)
                      or (max_tokens is not None and rows * longest > max_tokens)):
            yield Batch([i for _, i, _ in batch], [x for _, _, x in batch], [n for n, _, _ in batch])
            batch = []
        batch.append(entry)
    if batch:
        yield Batch([i for _, i, _ in batch], [x for _, _, x in batch], [n for n, _, _ in batch])


def read_batches(
    pairs: Iterable[tuple[int, Any]], options: ItemOptions, read: collections.deque[int],
) -> Iterator[Batch]:
    """The batches of ``(index, item)`` pairs, a window at a time; ``read`` gets each
    item's index as it is read, in input order.

    Example:
        >>> read = collections.deque()
        >>> [b.indices for b in read_batches(enumerate(["a", "bbb", "cc", "d"]), ItemOptions(batch_size=2, window=2), read)]
        [[1, 0], [2, 3]]
        >>> list(read)
        [0, 1, 2, 3]
    """
    per_window, tokens = options.window_items(), options.window_tokens()
    window: list[tuple[int, int, Any]] = []
    total = 0
    for index, item in pairs:
        n = measure(options.length, item, index)
        window.append((n, index, item))
        read.append(index)
        total += max(n, 1)  # an empty item takes a row (as in cut_window): zeros still close a window
        if (per_window is not None and len(window) >= per_window) or (tokens is not None and total >= tokens):
            yield from cut_window(window, options.batch_size, options.max_tokens)
            window, total = [], 0
    if window:
        yield from cut_window(window, options.batch_size, options.max_tokens)
