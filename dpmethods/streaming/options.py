"""A map's options (``DataParallel.map``'s keywords), checked once, as one frozen value."""

from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any

from dpmethods.core.oom import check_on_oom
from dpmethods.processes.pool import check_workers

__all__ = ["MapOptions"]

_ERRORS = ("raise", "yield")


@dataclasses.dataclass(frozen=True)
class MapOptions:
    """How a map runs (see ``DataParallel.map``); checked when made, each error naming
    the argument, what it expected and what it got.

    Example:
        >>> MapOptions(prefetch=4).prefetch
        4
        >>> MapOptions(errors="yeild")
        Traceback (most recent call last):
        ...
        ValueError: map: errors: expected one of ['raise', 'yield'], got 'yeild': did you mean 'yield'?
    """

    ordered: bool = True  # outputs in input order; else (index, output) as they finish
    progress: bool | str = False  # a tqdm bar; a str is its description
    prefetch: int | None = None  # batches in flight per replica; None: the backend's (Backend.prefetch)
    shard: bool = False  # under torch.distributed: batch i on rank i % world_size only
    workers: str | None = None  # "threads" or "processes"; None: the wrapper's
    retries: int = 0  # runs again of a batch whose worker process died running it
    timeout: float | None = None  # seconds a batch may run
    errors: str = "raise"  # or "yield": a failed batch's exception in its place
    on_oom: str = "raise"  # or "split": a batch out of memory runs in halves
    checkpoint: str | os.PathLike[str] | None = None  # the record of a resumable map

    def __post_init__(self) -> None:
        _check(self)


def _check(o: MapOptions) -> None:
    if o.errors not in _ERRORS:
        close = difflib.get_close_matches(str(o.errors), _ERRORS, n=1)
        raise ValueError(f"map: errors: expected one of {list(_ERRORS)}, got {o.errors!r}"
                         + (f": did you mean {close[0]!r}?" if close else ""))
    for name, value in (("ordered", o.ordered), ("shard", o.shard)):
        if not isinstance(value, bool):
            raise TypeError(f"map: {name}: expected a bool, got {type(value).__name__} {value!r}")
    if not isinstance(o.progress, (bool, str)):
        raise TypeError(
            f"map: progress: expected a bool or a str (the bar's description), got "
            f"{type(o.progress).__name__} {o.progress!r}"
        )
    counts: tuple[tuple[str, Any, int, str], ...] = (
        ("prefetch", o.prefetch, 1, "batches in flight per replica, or None"),
        ("retries", o.retries, 0, "runs again after a worker died"))
    for name, count, least, what in counts:
        if name == "prefetch" and count is None:
            continue
        if isinstance(count, bool) or not isinstance(count, int) or count < least:
            raise ValueError(f"map: {name}: expected an int >= {least} ({what}), got "
                             f"{type(count).__name__} {count!r}")
    timeout: Any = o.timeout
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not 0 < timeout < float("inf")):
        raise ValueError(f"map: timeout: expected None or a number of seconds > 0, got "
                         f"{type(timeout).__name__} {timeout!r}")
    check_on_oom(o.on_oom)
    if o.workers is not None:
        check_workers(o.workers)
    if o.checkpoint is not None and not isinstance(o.checkpoint, (str, os.PathLike)):
        raise TypeError(
            f"map: checkpoint: expected a file path (str or os.PathLike), got "
            f"{type(o.checkpoint).__name__} {o.checkpoint!r}"
        )
