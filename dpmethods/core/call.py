"""One method call, as the stages see it: its context, and what the scatter and gather
seams do for a method.

``DataParallel`` calls ``self.scatter(inputs, kwargs, device_ids)``,
``self.replicate(module, device_ids)``, ``self.parallel_apply(replicas, inputs, kwargs)``
and ``self.gather(outputs, output_device)`` with exactly torch's signatures, so a
subclass that overrides a seam as it would for ``torch.nn.DataParallel`` keeps
working. What a method call adds (the method's name and options, the replica-cache
key, the batch share of each replica) travels in a :class:`CallContext` held by a
``ContextVar``: each thread sees only its own calls, and a call made from inside
another (re-entrant) stacks on top of it and is popped when it returns.

:func:`scatter_shares` and :func:`gather_outputs` are what the scatter and gather seams
do for a method; :func:`adapt_shares` gives each share its ``per_replica`` hook.
Out-of-memory splitting, which runs a share as a call of its own, is in
:mod:`dpmethods.core.oom`.
The flow of a call through a wrapper's seams is the wrapper's own
(:mod:`dpmethods.wrapper.call`). The public :class:`~dpmethods.extending.Call` that hooks
and named gather modes see is built once the shares are known, once per call (and, with
its empty shares, for ``prepare``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from dpmethods.core.devices import DeviceLike
from dpmethods.core.gather import join_outputs
from dpmethods.core.scatter import scatter_call
from dpmethods.vocab.call_hooks import Call, check_per_replica
from dpmethods.vocab.gather_modes import BUILTIN_MODES, named_mode
from dpmethods.vocab.options import MethodOptions

__all__ = ["CallContext", "adapt_shares", "current", "entered", "gather_outputs", "scatter_shares"]


@dataclass
class CallContext:
    """One method call through a wrapper, as its seams see it."""

    owner: Any  # the wrapper; seams of another wrapper ignore this call
    name: str  # the method run on every replica ("forward" calls the replica itself)
    options: MethodOptions
    fn: Callable[..., Any] | None  # the bound method, for argument names
    key: Any = None  # the replica-cache fingerprint, when caching
    sizes: list[int] = field(default_factory=list)  # batch items per replica, set by scatter
    args: tuple[Any, ...] = ()  # the call's own arguments (hooks and named gather modes read
    kwargs: dict[str, Any] = field(default_factory=dict)  # them: generate's pad/eos ids)
    public: Call | None = None  # what hooks and named modes see, built once the shares are

    def __post_init__(self) -> None:
        # A mode named when the method was decorated may be a library's, registered once
        # the library is imported: resolved now, before any replica runs (unknown: refused).
        if isinstance(self.options.gather, str):
            named_mode(self.options.gather, "gather")

    def seen(self, module: Any) -> Call:
        """The public :class:`Call`, with the shares as the scatter set them."""
        if self.public is None or list(self.public.sizes) != self.sizes:
            self.public = Call(module, self.name, self.args, self.kwargs, list(self.sizes), self.options)
        return self.public

    def weights(self, n: int) -> list[float] | None:
        """Each replica's share of the batch, or None (equal) if unknown."""
        total = sum(self.sizes)
        if len(self.sizes) != n or not total:
            return None
        return [s / total for s in self.sizes]


_CURRENT: contextvars.ContextVar[CallContext | None] = contextvars.ContextVar(
    "dpmethods_call", default=None
)


@contextlib.contextmanager
def entered(call: CallContext) -> Iterator[CallContext]:
    token = _CURRENT.set(call)
    try:
        yield call
    finally:
        _CURRENT.reset(token)


def current(owner: Any) -> CallContext | None:
    """The call in progress in this thread through ``owner``, or None (a direct seam call)."""
    call = _CURRENT.get()
    return call if call is not None and call.owner is owner else None


def scatter_shares(
    module: Any, ctx: CallContext | None, opts: MethodOptions, inputs: tuple[Any, ...],
    kwargs: dict[str, Any] | None, device_ids: Sequence[DeviceLike],
) -> tuple[tuple[Any, ...], tuple[dict[str, Any], ...]]:
    """Each device's share of a call's arguments by the method's options, adapted by its
    ``per_replica`` hook; records the shares in ``ctx``.

    Example:
        >>> import torch
        >>> ins, kws = scatter_shares(None, None, MethodOptions(), (torch.ones(3, 2),), {}, ["cpu"] * 2)
        >>> [x[0].shape[0] for x in ins]
        [2, 1]
    """
    result = scatter_call(
        tuple(inputs), dict(kwargs or {}), device_ids, opts.dim, opts.broadcast,
        ctx.fn if ctx is not None else None, split=opts.split, scatter_dim=opts.scatter_dim,
    )
    if ctx is not None:
        ctx.sizes = result.sizes
    adapt = opts.hooks.per_replica if opts.hooks is not None else None
    if adapt is not None and ctx is not None and len(result.sizes) > 1:
        pairs = adapt_shares(adapt, ctx.seen(module), list(zip(result[0], result[1])))
        return tuple(a for a, _ in pairs), tuple(k for _, k in pairs)
    return result[0], result[1]


def gather_outputs(
    module: Any, ctx: CallContext | None, opts: MethodOptions, outputs: Sequence[Any],
    output_device: DeviceLike, *, halves: bool = False,
) -> Any:
    """The replicas' outputs joined by the method's ``gather`` option (a named mode sees
    the call); ``halves``: they are the parts of one share that ran out of memory.

    Example:
        >>> import torch
        >>> gather_outputs(None, None, MethodOptions(), [torch.ones(2), torch.zeros(1)], "cpu")
        tensor([1., 1., 0.])
    """
    call = None
    if ctx is not None and isinstance(opts.gather, str) and opts.gather not in BUILTIN_MODES:
        call = ctx.seen(module)  # a library's named mode sees the call
    sizes = ctx.sizes if ctx is not None else None
    return join_outputs(
        outputs, output_device, opts.dim, mode=opts.gather, pad_value=opts.pad_value,
        weights=ctx.weights(len(outputs)) if ctx is not None else None, gather_dim=opts.gather_dim,
        sizes=sizes if sizes is not None and len(sizes) == len(outputs) else None, call=call,
        halves=halves,
    )


def adapt_shares(adapt: Any, call: Call, parts: list[Any]) -> list[Any]:
    """Each share ``(args, kwargs)`` of ``call`` adapted by its ``per_replica`` hook
    ``adapt``, with the share's start in the call.

    Example:
        >>> call = Call(None, "f", (), {}, [2, 1], MethodOptions())
        >>> adapt_shares(lambda a, k, start, call: (a, {"start": start}), call, [((1,), {}), ((2,), {})])
        [((1,), {'start': 0}), ((2,), {'start': 2})]
    """
    starts = accumulate(call.sizes[:-1], initial=0)
    return [check_per_replica(adapt(a, k, s, call), adapt) for (a, k), s in zip(parts, starts)]

