"""The per-call context of a wrapper: what its torch seams need beyond torch's arguments.

``DataParallel`` calls ``self.scatter(inputs, kwargs, device_ids)``,
``self.replicate(module, device_ids)``, ``self.parallel_apply(replicas, inputs, kwargs)``
and ``self.gather(outputs, output_device)`` with exactly torch's signatures, so a
subclass that overrides a seam as it would for ``torch.nn.DataParallel`` keeps
working. What a method call adds (the method's name and options, the replica-cache
key, the batch share of each replica) travels in a :class:`_Call` held by a
``ContextVar``: each thread sees only its own calls, and a call made from inside
another (re-entrant) stacks on top of it and is popped when it returns.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from dpmethods.gather_modes import named_mode
from dpmethods.options import MethodOptions

__all__: list[str] = []


@dataclass
class _Call:
    """One method call through a wrapper, as its seams see it."""

    owner: Any  # the wrapper; seams of another wrapper ignore this call
    name: str  # the method run on every replica ("forward" calls the replica itself)
    options: MethodOptions
    fn: Callable[..., Any] | None  # the bound method, for argument names
    key: Any = None  # the replica-cache fingerprint, when caching
    sizes: list[int] = field(default_factory=list)  # batch items per replica, set by scatter
    args: tuple[Any, ...] = ()  # the call's own arguments (hooks and named gather modes read
    kwargs: dict[str, Any] = field(default_factory=dict)  # them: generate's pad/eos ids)

    def __post_init__(self) -> None:
        # A mode named when the method was decorated may be a library's, registered once
        # the library is imported: resolved now, before any replica runs (unknown: refused).
        if isinstance(self.options.gather, str):
            named_mode(self.options.gather, "gather")

    def weights(self, n: int) -> list[float] | None:
        """Each replica's share of the batch, or None (equal) if unknown."""
        total = sum(self.sizes)
        if len(self.sizes) != n or not total:
            return None
        return [s / total for s in self.sizes]


_CURRENT: contextvars.ContextVar[_Call | None] = contextvars.ContextVar(
    "dpmethods_call", default=None
)


@contextlib.contextmanager
def _entered(call: _Call) -> Iterator[_Call]:
    token = _CURRENT.set(call)
    try:
        yield call
    finally:
        _CURRENT.reset(token)


def _current(owner: Any) -> _Call | None:
    """The call in progress in this thread through ``owner``, or None (a direct seam call)."""
    call = _CURRENT.get()
    return call if call is not None and call.owner is owner else None
