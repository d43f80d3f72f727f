"""Per-method call hooks: adapt a call's arguments, one replica's, and the gathered output.

Some methods need more than splitting and joining. sentence-transformers' ``encode``
takes one string as one input and calibrates ``int8`` codes on the whole batch;
transformers' ``prefix_allowed_tokens_fn`` numbers the rows of the batch it is called
on, so each replica must be told where its rows start. :class:`CallHooks`, given as
the ``hooks`` option of a method, says how, with the same API for a user's own
library as for the built-in integrations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Union

__all__ = ["Call", "CallHooks", "Finish", "PerReplica", "Prepare"]


class Call(NamedTuple):
    """One call of a parallel method, as hooks and named gather modes see it.

    Attributes:
        module: the wrapped module (the model whose method runs).
        method: the method's name.
        args: the call's positional arguments (as ``prepare`` returned them).
        kwargs: the call's keyword arguments (as ``prepare`` returned them).
        sizes: the batch items each replica got, in replica order (empty before the
            scatter, so in ``prepare``).
        options: the method's :class:`~dpmethods.MethodOptions`.
    """

    module: Any
    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    sizes: Sequence[int]
    options: Any


Finish = Callable[[Any], Any]
Prepare = Callable[
    [tuple[Any, ...], dict[str, Any], Call],
    tuple[tuple[Any, ...], dict[str, Any], Union[Finish, None]],  # noqa: UP007 (3.10 runtime)
]
PerReplica = Callable[
    [tuple[Any, ...], dict[str, Any], int, Call], tuple[tuple[Any, ...], dict[str, Any]]
]


@dataclass(frozen=True)
class CallHooks:
    """How a parallel method's calls are adapted around scatter and gather.

    Args:
        prepare: ``prepare(args, kwargs, call) -> (args, kwargs, finish)``, run once per
            call before the scatter (``call`` is a :class:`Call`, with the model): the
            arguments as the replicas should see them, and a function applied to the
            gathered output (or ``None``), for results computed over the whole batch
            after the per-item work.
        per_replica: ``per_replica(args, kwargs, start, call) -> (args, kwargs)``, run for
            each replica's share after the scatter; ``start`` is the index of the
            replica's first item in the whole batch.

    Example:
        >>> hooks = CallHooks(prepare=lambda a, k, call: ((a[0].lower(),), k, str.upper))
        >>> args, kwargs, finish = hooks.prepare(("Hi",), {}, None)
        >>> args, finish("done")
        (('hi',), 'DONE')
    """

    prepare: Prepare | None = None
    per_replica: PerReplica | None = None

    def __post_init__(self) -> None:
        for name in ("prepare", "per_replica"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(
                    f"CallHooks: {name}: expected a callable or None, got "
                    f"{type(value).__name__} {value!r}"
                )

    def then(self, other: CallHooks | None) -> CallHooks:
        """These hooks, then ``other``'s: prepares run in order and their finishes in
        reverse; per-replica steps run in order.

        Example:
            >>> a = CallHooks(per_replica=lambda a, k, s, call: (a + (s,), k))
            >>> a.then(a).per_replica((), {}, 3, None)
            ((3, 3), {})
        """
        if other is None:
            return self
        return CallHooks(
            prepare=_chain_prepare(self.prepare, other.prepare),
            per_replica=_chain_per_replica(self.per_replica, other.per_replica),
        )


def _chain_prepare(first: Prepare | None, second: Prepare | None) -> Prepare | None:
    if first is None or second is None:
        return first or second

    def prepare(args: tuple[Any, ...], kwargs: dict[str, Any], call: Call) -> Any:
        args, kwargs, finish_a = first(args, kwargs, call)
        args, kwargs, finish_b = second(args, kwargs, call)
        if finish_a is None or finish_b is None:
            return args, kwargs, finish_a or finish_b
        return args, kwargs, lambda out: finish_a(finish_b(out))

    return prepare


def _chain_per_replica(first: PerReplica | None, second: PerReplica | None) -> PerReplica | None:
    if first is None or second is None:
        return first or second

    def per_replica(args: tuple[Any, ...], kwargs: dict[str, Any], start: int, call: Call) -> Any:
        args, kwargs = first(args, kwargs, start, call)
        return second(args, kwargs, start, call)

    return per_replica
