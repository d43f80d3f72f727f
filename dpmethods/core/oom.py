"""Out-of-memory splitting: a share that does not fit runs in halves on the same replica.

With ``on_oom="split"``, a replica whose method raises ``torch.OutOfMemoryError`` frees
the allocator's cached blocks and runs its share again in two halves, one after the
other, cut by the method's own scatter rules (``split=``, ``broadcast=``,
``scatter_dim=``, per-item lists) exactly as a two-device call would cut it, and joins
them by the method's gather rule; a half that does not fit is halved again. A share of
one item that does not fit raises. The replica remembers, per method (a :class:`Fit`
each), the largest share that ran after an out-of-memory error and cuts larger shares
up front, so later batches do not fail first.

The halves run as a call over two devices runs: a share of a call, which the method's
``CallHooks`` adapted already, is a call of its own, whose halves get ``per_replica``
(with their start in it) and are joined by the gather, which sees that call; a whole
batch run as it is (a map's batch, a call without devices) is first adapted by
``prepare``, and its joined output finished (see :func:`dpmethods.core.call.split_on_oom`).
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

class Fit:
    """What fits in one replica's memory, for one method: the largest share that ran
    after it ran out (0: it never ran out, so nothing is cut up front).

    Example:
        >>> fit = Fit(); fit.ran_out(4); fit.cut_up_front(5), fit.cut_up_front(4)
        (True, False)
    """

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
    run: Callable[[Any], Any], piece: Any, n: int | None, *,
    count: Callable[[Any], int],
    halve: Callable[[Any], tuple[list[Any], list[int], Callable[[list[Any]], Any]]],
    fit: Fit, device: Any,
) -> Any:
    """``run(piece)`` on a share of ``n`` items, or the share in halves when it runs out
    of memory.

    Args:
        run: runs the method on a piece (a share, or a part of one).
        piece: the share, as ``run`` and ``halve`` take it.
        n: its items, or None: ``count(piece)``, asked only when the count matters (after
            an out-of-memory error, or once one was seen).
        count: ``piece -> items``.
        halve: ``piece -> (parts, sizes, join)``: the piece cut in two, their sizes, and
            ``join(outputs)``, the parts' outputs joined as the piece's.
        fit: what fits in the replica's memory, learned so far (updated here).
        device: the replica's device (its cached memory is freed before the halves run).

    Example:
        >>> def run(x):
        ...     if len(x) > 2:
        ...         raise torch.OutOfMemoryError("too big")
        ...     return list(x)
        >>> def halve(x):
        ...     h = (len(x) + 1) // 2
        ...     return [x[:h], x[h:]], [h, len(x) - h], lambda outs: outs[0] + outs[1]
        >>> run_splitting(run, [1, 2, 3, 4, 5], None, count=len, halve=halve, fit=Fit(), device="cpu")
        [1, 2, 3, 4, 5]
    """
    counted: list[int] = [] if n is None else [n]

    def size() -> int:  # without n, counting may cost a cut: only when it matters
        if not counted:
            counted.append(count(piece))
        return counted[0]

    if not (fit.largest and fit.cut_up_front(size())):
        try:
            out = run(piece)
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
    parts, sizes, join = halve(piece)
    outs = [
        run_splitting(run, part, m, count=count, halve=halve, fit=fit, device=device)
        for part, m in zip(parts, sizes)
    ]
    return join(outs)
