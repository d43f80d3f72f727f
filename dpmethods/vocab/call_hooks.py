"""Per-method call hooks: adapt a call's arguments, one replica's, and the gathered output.

Some methods need more than splitting and joining. sentence-transformers' ``encode``
takes one string as one input and calibrates ``int8`` codes on the whole batch;
transformers' ``prefix_allowed_tokens_fn`` numbers the rows of the batch it is called
on, so each replica must be told where its rows start. :class:`CallHooks`, given as
the ``hooks`` option of a method, says how, with the same API for a user's own
library as for the built-in integrations.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Union

__all__ = [
    "Call", "CallHooks", "Finish", "PerReplica", "Prepare", "check_arity", "check_per_replica",
    "check_prepared", "is_per_item",
]


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
            after the per-item work. A map in item mode (``batch_size=``,
            ``max_tokens=``) runs ``prepare`` on its first batch and refuses a method that
            returns a finish, as each item's output would depend on the items batched
            with it; a finish's ``advice`` attribute (a str), if it has one, is added to
            that error: how to get the result instead. A finish that works on each item's
            part of the output alone (a format: ``out.float()``, the fields as the tuple the
            caller asked for) declares so with a ``per_item`` attribute that is ``True``, and
            item mode maps the method: each batch runs as it is, as on one device (the
            hooks, finish included, adapt it only where it is split), and its output is
            cut into items. Chained finishes are per item when each one is.
        per_replica: ``per_replica(args, kwargs, start, call) -> (args, kwargs)``, run for
            each replica's share after the scatter; ``start`` is the index of the
            replica's first item in the whole batch.

    Example:
        >>> hooks = CallHooks(prepare=lambda a, k, call: ((a[0].lower(),), k, str.upper))
        >>> args, kwargs, finish = hooks.prepare(("Hi",), {}, None)
        >>> args, finish("done")
        (('hi',), 'DONE')

        A finish that converts each item's part alone, declared so for item mode:

        >>> def as_float(out):
        ...     return out.float()
        >>> as_float.per_item = True  # or a class attribute of a callable finish
        >>> hooks = CallHooks(prepare=lambda a, k, call: (a, k, as_float))
    """

    prepare: Prepare | None = None
    per_replica: PerReplica | None = None

    def __post_init__(self) -> None:
        for name, params in (("prepare", "(args, kwargs, call)"), ("per_replica", "(args, kwargs, start, call)")):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(
                    f"CallHooks: {name}: expected a callable or None, got "
                    f"{type(value).__name__} {value!r}"
                )
            if value is not None:
                check_arity(f"CallHooks: {name}", value, name + params)

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
    return _Chained(first, second)


def _chain_per_replica(first: PerReplica | None, second: PerReplica | None) -> PerReplica | None:
    if first is None or second is None:
        return first or second
    return _ChainedPerReplica(first, second)


class _Steps:
    """Two steps run in turn. A class, not a closure: hooks cross to worker processes
    (``on_oom="split"`` runs them there), so they must pickle by reference."""

    def __init__(self, first: Any, second: Any) -> None:
        self.first, self.second = first, second

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and (self.first, self.second) == (other.first, other.second)  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self), self.first, self.second))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.first!r}, {self.second!r})"


class _Chained(_Steps):
    """``prepare`` of :meth:`CallHooks.then`: ``first``'s, then ``second``'s; their
    finishes run in reverse."""

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any], call: Call) -> Any:
        args, kwargs, finish_a = check_prepared(self.first(args, kwargs, call), self.first)
        args, kwargs, finish_b = check_prepared(self.second(args, kwargs, call), self.second)
        if finish_a is None or finish_b is None:
            return args, kwargs, finish_a or finish_b
        return args, kwargs, _Finishes(finish_b, finish_a)


class _Finishes(_Steps):
    """``first``'s finish, then ``second``'s."""

    def __call__(self, out: Any) -> Any:
        return self.second(self.first(out))

    @property
    def advice(self) -> str | None:
        """The finishes' ``advice``, where they have one."""
        given = [a for f in (self.first, self.second) if isinstance(a := getattr(f, "advice", None), str) and a]
        return "; ".join(given) or None

    @property
    def per_item(self) -> bool:
        """Whether both finishes work on each item's part alone (see :class:`CallHooks`)."""
        return is_per_item(self.first) and is_per_item(self.second)


class _ChainedPerReplica(_Steps):
    """``per_replica`` of :meth:`CallHooks.then`: ``first``'s, then ``second``'s."""

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any], start: int, call: Call) -> Any:
        args, kwargs = check_per_replica(self.first(args, kwargs, start, call), self.first)
        return check_per_replica(self.second(args, kwargs, start, call), self.second)


def is_per_item(finish: Any) -> bool:
    """Whether ``finish`` declares that it works on each item's part of the output alone:
    its ``per_item`` attribute is ``True`` (see :class:`CallHooks`).

    Example:
        >>> class Round:
        ...     per_item = True
        ...     def __call__(self, out):
        ...         return out.round()
        >>> is_per_item(Round()), is_per_item(str.upper)
        (True, False)
    """
    return getattr(finish, "per_item", False) is True


def _label(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _describe(value: Any) -> str:
    if isinstance(value, tuple):
        return f"a tuple of length {len(value)}"
    return f"{type(value).__name__} {value!r}"[:200]


def check_prepared(result: Any, fn: Any) -> tuple[tuple[Any, ...], dict[str, Any], Finish | None]:
    """``prepare``'s result, checked: ``(args, kwargs, finish)``, or a TypeError naming the hook.

    Example:
        >>> check_prepared(((1,), {}, None), print)
        ((1,), {}, None)
        >>> check_prepared(None, print)
        Traceback (most recent call last):
        ...
        TypeError: CallHooks.prepare (print) must return (args, kwargs, finish): a tuple of positional arguments, a dict of keyword arguments and a function applied to the gathered output or None; got NoneType None
    """
    if not (
        isinstance(result, tuple) and len(result) == 3 and isinstance(result[0], (tuple, list))
        and isinstance(result[1], Mapping) and (result[2] is None or callable(result[2]))
    ):
        raise TypeError(
            f"CallHooks.prepare ({_label(fn)}) must return (args, kwargs, finish): a tuple of "
            "positional arguments, a dict of keyword arguments and a function applied to the "
            f"gathered output or None; got {_describe(result)}"
        )
    return tuple(result[0]), dict(result[1]), result[2]


def check_per_replica(result: Any, fn: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``per_replica``'s result, checked: ``(args, kwargs)``, or a TypeError naming the hook.

    Example:
        >>> check_per_replica(((1,), {"a": 2}), print)
        ((1,), {'a': 2})
    """
    if not (
        isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], (tuple, list))
        and isinstance(result[1], Mapping)
    ):
        raise TypeError(
            f"CallHooks.per_replica ({_label(fn)}) must return (args, kwargs): the replica's "
            "tuple of positional arguments and dict of keyword arguments; got "
            f"{_describe(result)}"
        )
    return tuple(result[0]), dict(result[1])


def check_arity(where: str, fn: Callable[..., Any], call: str) -> None:
    """Refuse a function that can't be called as ``call`` (``"fn(outputs, device, call)"``).

    Checked when the extension API is given the function: called with the wrong number of
    arguments later, deep inside a call, it would raise a bare "<lambda>() takes 2
    positional arguments but 3 were given". Callables without a signature are trusted.

    Example:
        >>> check_arity("register_gather_mode: fn", lambda outputs, device: 0, "fn(outputs, device, call)")
        Traceback (most recent call last):
        ...
        TypeError: register_gather_mode: fn: expected a function called as fn(outputs, device, call), got <lambda>(outputs, device)
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: trust them
        return
    try:
        signature.bind(*([None] * (call.count(",") + 1)))
    except TypeError:
        label = getattr(fn, "__name__", type(fn).__name__)
        raise TypeError(f"{where}: expected a function called as {call}, got {label}{signature}") from None
