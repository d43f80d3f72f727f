"""Out-of-memory splitting (``on_oom="split"``): a share that does not fit runs in halves
on the same replica. Calls on threads, a map's batches on threads, and both in a worker
process run their shares through this one module.

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
``prepare``, and its joined output finished.

The map of this module:

- :data:`ON_OOM`, :func:`check_on_oom`: the option's values, checked.
- :class:`Fit`: what fits in one replica's memory for one method (:meth:`Fit.kept`:
  the one kept in a table, across calls or batches).
- :func:`split_on_oom`: one share or batch of a method, halved by its scatter rules when
  it runs out of memory; the halving itself is :func:`_run_splitting`, over any piece.
- :class:`ShareRunner`: how each replica of a call runs its share (a wrapper's
  ``parallel_apply`` seam, ``dpmethods.wrapper.call``).
- :func:`batch_runner`: how a replica runs a map's whole batches
  (``dpmethods.streaming.threads``); a worker process calls :func:`split_on_oom`
  itself (``dpmethods.processes.worker``).
"""

from __future__ import annotations

import difflib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dpmethods.core.call import CallContext, adapt_shares, gather_outputs
from dpmethods.core.devices import as_device
from dpmethods.core.scatter import scatter_call
from dpmethods.types.coupled_modules import part_of_batch
from dpmethods.vocab.call_hooks import Call, check_prepared
from dpmethods.vocab.options import MethodOptions

__all__ = ["ON_OOM", "Fit", "ShareRunner", "batch_runner", "check_on_oom", "split_on_oom"]

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

    @staticmethod
    def kept(table: dict[Any, Fit], key: Any) -> Fit:
        """The :class:`Fit` kept in ``table`` under ``key`` (a new one the first time).

        Example:
            >>> table: dict = {}
            >>> Fit.kept(table, (0, "encode")) is Fit.kept(table, (0, "encode"))
            True
        """
        return table.setdefault(key, Fit())

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


def _run_splitting(
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
        >>> _run_splitting(run, [1, 2, 3, 4, 5], None, count=len, halve=halve, fit=Fit(), device="cpu")
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
        _run_splitting(run, part, m, count=count, halve=halve, fit=fit, device=device)
        for part, m in zip(parts, sizes)
    ]
    return join(outs)


def split_on_oom(
    module: Any, name: str, opts: MethodOptions, fn: Callable[..., Any], device: Any, fit: Fit,
    args: Any, kwargs: Any, n: int | None = None, *, names: Callable[..., Any] | None = None,
    prepared: bool = True,
) -> Any:
    """``fn(*args, **kwargs)`` on one replica, halved by the method's scatter rules when
    it runs out of memory, as a call over two devices runs.

    ``prepared``: the arguments are a replica's share of a call, adapted by the method's
    hooks already: a call of its own, whose halves get ``per_replica`` with their start
    in it, and whose halves' outputs the gather joins seeing it. False: a whole batch as
    its method takes it (a map's batch); split, it is first adapted by ``prepare``, and
    the joined output finished, as a call is. ``n`` is the share's items (None: counted
    by the scatter rules, only if needed); ``names`` the function whose signature names
    the arguments (default ``fn``).

    Example:
        >>> calls = []
        >>> def embed(x):
        ...     calls.append(len(x))
        ...     if len(x) > 2:
        ...         raise torch.OutOfMemoryError("too big")
        ...     return x * 2
        >>> split_on_oom(None, "embed", MethodOptions(), embed, "cpu", Fit(), (torch.arange(5),), {}).tolist()
        [0, 2, 4, 6, 8]
        >>> calls
        [5, 3, 2, 1, 2]
    """
    names = names if names is not None else fn
    hooks = opts.hooks
    whole = (tuple(args), dict(kwargs), prepared)
    memo: list[Any] = []  # the whole share's cut: counted first, it is cut once

    def cut(piece: tuple[Any, ...]) -> Any:
        """``(args, kwargs, finish, parts, sizes)``: the piece as its halves' call (prepared)."""
        if piece is whole and memo:
            return memo[0]
        a, k, ready = piece
        finish = None
        if not ready and hooks is not None and hooks.prepare is not None:
            a, k, finish = check_prepared(hooks.prepare(a, k, Call(module, name, a, k, (), opts)), hooks.prepare)
        parts = scatter_call(a, k, [device, device], opts.dim, opts.broadcast, names,
                             split=opts.split, scatter_dim=opts.scatter_dim)
        found = a, k, finish, list(zip(parts[0], parts[1])), list(parts.sizes)
        if piece is whole:
            memo.append(found)
        return found

    def halve(piece: tuple[Any, ...]) -> Any:
        a, k, finish, parts, sizes = cut(piece)
        if hooks is not None and hooks.per_replica is not None:
            parts = adapt_shares(hooks.per_replica, Call(module, name, a, k, sizes, opts), parts)

        def join(outs: list[Any]) -> Any:
            ctx = CallContext(None, name, opts, names, args=a, kwargs=k, sizes=sizes)
            out = gather_outputs(module, ctx, opts, outs, device, halves=True)
            return out if finish is None else finish(out)

        return [(pa, pk, True) for pa, pk in parts], sizes, join

    def run(piece: tuple[Any, ...]) -> Any:
        if piece is whole:
            return fn(*piece[0], **piece[1])
        with part_of_batch(True):  # a module that couples its batch warns, as on a share
            return fn(*piece[0], **piece[1])

    return _run_splitting(run, whole, n, count=lambda piece: sum(cut(piece)[4]), halve=halve, fit=fit, device=device)


@dataclass(frozen=True)
class ShareRunner:
    """How replica ``i`` of a call runs its share with ``on_oom="split"``:
    ``runner(i, fn, args, kwargs)`` is :func:`split_on_oom` on ``devices[i]``, the share
    a call of its own (its halves adapted by ``per_replica`` and joined by the gather),
    with the :class:`Fit` kept in ``fits`` under ``(i, name)``.

    Example:
        >>> fits: dict = {}
        >>> run = ShareRunner(None, "forward", MethodOptions(), ["cpu"], fits, [3], None)
        >>> run(0, lambda x: x + 1, (torch.zeros(3),), {}).tolist(), list(fits)
        ([1.0, 1.0, 1.0], [(0, 'forward')])
    """

    module: Any  # the wrapped module (hooks and named gather modes see it)
    name: str  # the method
    options: MethodOptions
    devices: Sequence[Any]  # replica i's device
    fits: dict[Any, Fit]  # kept across calls: (replica, method) -> what fits
    sizes: Sequence[int]  # replica i's share of the call, in items
    names: Callable[..., Any] | None  # the function whose signature names the arguments

    def __call__(self, i: int, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        n = self.sizes[i] if i < len(self.sizes) else 1
        return split_on_oom(self.module, self.name, self.options, fn, self.devices[i],
                            Fit.kept(self.fits, (i, self.name)), args, kwargs, n, names=self.names)


def batch_runner(
    module: Any, name: str, opts: MethodOptions, fn: Callable[..., Any], device: Any, *,
    names: Callable[..., Any] | None = None,
) -> Callable[..., Any]:
    """``fn`` as one replica runs a map's whole batches with ``on_oom="split"``: each
    batch is adapted by ``prepare`` only when it is split, and one :class:`Fit` is kept
    for the replica's batches of this map.

    Example:
        >>> run = batch_runner(None, "forward", MethodOptions(), lambda x: x * 2, "cpu")
        >>> run(torch.ones(2)).tolist()
        [2.0, 2.0]
    """
    fit = Fit()

    def run(*args: Any, **kwargs: Any) -> Any:
        return split_on_oom(module, name, opts, fn, device, fit, args, kwargs, names=names, prepared=False)

    return run
