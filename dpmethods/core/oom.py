"""Out-of-memory splitting: a share that does not fit runs in halves on the same replica.

With ``on_oom="split"``, a replica whose method raises ``torch.OutOfMemoryError`` frees
the allocator's cached blocks and runs its share again in two halves, one after the
other, cut by the method's own scatter rules (``split=``, ``broadcast=``,
``scatter_dim=``, per-item lists) exactly as a two-device call would cut it, and joins
them by the method's gather rule; a half that does not fit is halved again. A share of
one item that does not fit raises. The replica remembers the largest share that ran
after an out-of-memory error and cuts larger shares up front, so later batches do not
fail first.

The halves run as a call of their own, without the method's ``CallHooks``: those
adapted the whole call once already.
"""

from __future__ import annotations

import difflib
import threading
from collections.abc import Callable
from typing import Any

import torch

from dpmethods.core.devices import as_device

__all__ = ["ON_OOM", "Fit", "check_on_oom", "run_splitting"]

ON_OOM = ("raise", "split")

Run = Callable[[tuple[Any, ...], dict[str, Any]], Any]


class Fit:
    """What one replica learned of its memory: the largest share that ran after it ran
    out (0: it never ran out, so nothing is cut up front)."""

    def __init__(self) -> None:
        self.largest = 0
        self._lock = threading.Lock()

    def cut_up_front(self, size: int) -> bool:
        """Whether a share of ``size`` items is larger than any that ran since an error."""
        return 0 < self.largest < size

    def ran(self, size: int) -> None:
        with self._lock:
            if self.largest:
                self.largest = max(self.largest, size)

    def ran_out(self, fitting: int) -> None:
        """A share ran out; ``fitting`` items (its half) are tried next."""
        fitting = max(1, fitting)
        with self._lock:
            self.largest = min(self.largest, fitting) if self.largest else fitting


def check_on_oom(value: Any) -> str:
    """``value`` if it is ``"raise"`` or ``"split"``; else a ``ValueError``.

    Example:
        >>> check_on_oom("split")
        'split'
        >>> check_on_oom("spilt")
        Traceback (most recent call last):
        ...
        ValueError: on_oom: expected one of ['raise', 'split'], got 'spilt': did you mean 'split'?
    """
    if value not in ON_OOM:
        close = difflib.get_close_matches(str(value), ON_OOM, n=1)
        hint = f": did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"on_oom: expected one of {list(ON_OOM)}, got {value!r}{hint}")
    return value  # type: ignore[no-any-return]


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.empty_cache()


def run_splitting(
    run: Run, args: tuple[Any, ...], kwargs: dict[str, Any], n: int | None, *,
    halve: Callable[[tuple[Any, ...], dict[str, Any]], Any],
    join: Callable[[list[Any], list[int], tuple[Any, ...], dict[str, Any]], Any],
    fit: Fit, device: Any,
) -> Any:
    """``run(args, kwargs)`` on a share of ``n`` items, or the share in halves when it
    runs out of memory.

    Args:
        run: runs the method on a share.
        n: the share's items, or None: the sizes of its halves, cut only when the count
            matters (after an out-of-memory error, or once one was seen).
        halve: ``(args, kwargs) -> (halves, sizes)``: the share cut in two, as
            ``[(args, kwargs), (args, kwargs)]`` and their sizes.
        join: ``(outputs, sizes, args, kwargs) -> output``: the halves' outputs joined
            as the share's (``args`` and ``kwargs`` are the share's).
        fit: the replica's record.
        device: the replica's device (its cached memory is freed before the halves run).

    Example:
        >>> def run(args, kwargs):
        ...     if len(args[0]) > 2:
        ...         raise torch.OutOfMemoryError("too big")
        ...     return list(args[0])
        >>> def halve(args, kwargs):
        ...     x = args[0]
        ...     h = (len(x) + 1) // 2
        ...     return [((x[:h],), {}), ((x[h:],), {})], [h, len(x) - h]
        >>> join = lambda outs, sizes, args, kwargs: outs[0] + outs[1]
        >>> run_splitting(run, ([1, 2, 3, 4, 5],), {}, 5, halve=halve, join=join, fit=Fit(), device="cpu")
        [1, 2, 3, 4, 5]
    """
    cut: list[Any] = []  # the share's halves, once cut (to count its items, or to run them)

    def halves() -> Any:
        if not cut:
            cut.append(halve(args, kwargs))
        return cut[0]

    def size() -> int:  # without n, counting costs a cut: only when it matters
        return n if n is not None else sum(halves()[1])

    if not (fit.largest and fit.cut_up_front(size())):
        try:
            out = run(args, kwargs)
            if fit.largest:
                fit.ran(size())
            return out
        except torch.OutOfMemoryError as exc:
            if size() <= 1:
                exc.add_note(f"dpmethods: on_oom='split': a share of {size()} item does not fit")
                raise
        # Out of the except block: the error and the frames' tensors it held are freed.
        _free(as_device(device))
        fit.ran_out((size() + 1) // 2)
    parts, sizes = halves()
    outs = [
        run_splitting(run, a, k, m, halve=halve, join=join, fit=fit, device=device)
        for (a, k), m in zip(parts, sizes)
    ]
    return join(outs, list(sizes), args, kwargs)
