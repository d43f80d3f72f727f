"""The names of the gather modes, and the table of named modes that libraries add.

The built-in modes join tensors leaf by leaf (``"cat"``, ``"stack"``, ...). A named
mode, added with :func:`register_gather_mode`, joins a whole output and sees the call
it came from (the model, the call's arguments, each replica's share): what a
``generate`` result needs, whose fill token comes from the model's config and the
call's ``pad_token_id``. A named mode may also say which fields of an output pair
each item with the batch's other items (a contrastive model's ``logits_per_image``),
which item mode cannot cut into one output per item. Mode names are plain strings everywhere; :class:`Mode` names
the built-in ones once, and its members are those strings.
"""

from __future__ import annotations

import difflib
import enum
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from dpmethods.vocab.call_hooks import Call, check_arity
from dpmethods.vocab.loading import load_pending

__all__ = [
    "BUILTIN_MODES",
    "Mode",
    "check_mode_name",
    "known_modes",
    "mode_check",
    "mode_pairs",
    "named_mode",
    "register_gather_mode",
]


class Mode(str, enum.Enum):
    """The built-in gather modes; each member equals its string (``Mode.CAT == "cat"``).

    Example:
        >>> Mode.EXTEND == "extend", Mode("same") is Mode.SAME
        (True, True)
    """

    CAT = "cat"
    STACK = "stack"
    MEAN = "mean"
    SUM = "sum"
    PAD = "pad"
    LIST = "list"
    EXTEND = "extend"
    SAME = "same"

    def __str__(self) -> str:
        return self.value

    # Hashed as its string (Enum hashes the member's name), so sets and dicts of modes
    # and of strings mix: {Mode.LIST} & {"list"} is {"list"}.
    __hash__ = str.__hash__


BUILTIN_MODES: tuple[str, ...] = tuple(m.value for m in Mode)


GatherFn = Callable[[list[Any], Any, "Call | None"], Any]
CheckFn = Callable[["Call"], None]
PairsFn = Callable[[Any], Mapping[str, str]]


class _Named(NamedTuple):
    fn: GatherFn
    check: CheckFn | None
    pairs: PairsFn | None = None


_NAMED: dict[str, _Named] = {}  # the named modes, by name


def register_gather_mode(name: str, fn: GatherFn, *, check: CheckFn | None = None,
                         pairs: PairsFn | None = None) -> None:
    """Add a gather mode ``name``: ``fn(outputs, device, call)`` joins a whole output.

    ``outputs`` holds one output per replica, ``device`` is the output device, and
    ``call`` is a :class:`~dpmethods.extending.Call` (``None`` when :func:`dpmethods.parallel.gather` is called
    directly, outside a wrapper call). ``check(call)``, if given, runs before any replica
    does, with the call's shares still empty: it raises for a call whose outputs ``fn``
    could not join, so no work is wasted. ``pairs(output)``, if given, takes one batch's
    output (a map's batch, run whole on one replica) and returns its top-level keys whose
    values pair each item with the batch's other items (a contrastive model's
    ``logits_per_image``: each image's scores against every text of the batch), each
    with what to do instead (a str, or ``""``): a map in item mode refuses to cut them
    into one output per item, as an item's row would depend on the items batched with
    it. Registering a name again replaces all three.

    Example:
        >>> register_gather_mode("first", lambda outputs, device, call: outputs[0])
        >>> named_mode("first")(["a", "b"], "cpu", None)
        'a'
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_gather_mode: name: expected a non-empty str, got {name!r}")
    if name in BUILTIN_MODES:
        raise ValueError(
            f"register_gather_mode: name: expected a name other than the built-in modes "
            f"{list(BUILTIN_MODES)}, got {name!r}"
        )
    if not callable(fn):
        raise TypeError(
            f"register_gather_mode: fn: expected a callable fn(outputs, device, call), got "
            f"{type(fn).__name__} {fn!r}"
        )
    check_arity("register_gather_mode: fn", fn, "fn(outputs, device, call)")
    _check_optional("check", check, "check(call)")
    _check_optional("pairs", pairs, "pairs(output)")
    _NAMED[name] = _Named(fn, check, pairs)


def _check_optional(name: str, fn: Any, signature: str) -> None:
    """An optional callable argument of :func:`register_gather_mode`: None, or a callable
    that takes what ``signature`` says."""
    if fn is None:
        return
    if not callable(fn):
        raise TypeError(
            f"register_gather_mode: {name}: expected None or a callable {signature}, got "
            f"{type(fn).__name__} {fn!r}"
        )
    check_arity(f"register_gather_mode: {name}", fn, signature)


def mode_check(name: Any) -> CheckFn | None:
    """The ``check`` registered with the named mode ``name``, or None.

    Example:
        >>> mode_check("cat") is None
        True
    """
    named = _NAMED.get(name) if isinstance(name, str) else None
    return None if named is None else named.check


def mode_pairs(name: Any) -> PairsFn | None:
    """The ``pairs`` registered with the named mode ``name``, or None.

    Example:
        >>> register_gather_mode("scores", lambda outputs, device, call: outputs[0],
        ...                      pairs=lambda out: {"scores": ""})
        >>> mode_pairs("scores")({"scores": None}), mode_pairs("cat")
        ({'scores': ''}, None)
    """
    named = _NAMED.get(name) if isinstance(name, str) else None
    return None if named is None else named.pairs


def named_mode(name: str, where: str | None = None) -> GatherFn | None:
    """The function of the named mode ``name``, or None (a built-in or unknown name).

    With ``where`` (the option's name, for the message), an unknown name is refused
    with a ValueError that lists every mode and form, instead of returning None.

    Example:
        >>> named_mode("cat") is None
        True
        >>> named_mode("nope", "gather")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: gather: expected one of the built-in modes ['cat', 'stack', 'mean', 'sum', 'pad', 'list', 'extend', 'same'], a named mode ...
    """
    if name in BUILTIN_MODES:
        return None
    named = _NAMED.get(name)
    if named is None:
        load_pending()  # an integration imported since may provide it ("generate")
        named = _NAMED.get(name)
    if named is None and where is not None:
        raise ValueError(_unknown(where, name))
    return None if named is None else named.fn


def _unknown(where: str, name: str) -> str:
    named = sorted(_NAMED)
    close = difflib.get_close_matches(name, [*BUILTIN_MODES, *named], n=1)
    return (
        f"{where}: expected one of the built-in modes {list(BUILTIN_MODES)}, a named mode "
        f"(registered so far: {', '.join(map(repr, named)) or 'none'}; a library's named "
        "mode, such as transformers' 'generate', exists once the library is imported), a "
        "mapping of output keys, field names or tuple positions to built-in modes, a tuple "
        "of built-in modes (one per tuple position), or a callable fn(outputs, "
        f"output_device); got {name!r}" + (f": did you mean {close[0]!r}?" if close else "")
    )


def check_mode_name(where: str, name: str) -> None:
    """Refuse a mode name that is a typo of a built-in mode; accept any other.

    A name that is neither built in nor registered yet may be a library's, registered
    when the library is imported (after the method was decorated): it is resolved, with
    :func:`named_mode`, when the method is called.

    Example:
        >>> check_mode_name("gather", "generate")  # resolved when called
        >>> check_mode_name("gather", "extnd")
        Traceback (most recent call last):
        ...
        ValueError: gather: expected one of ['cat', 'stack', 'mean', 'sum', 'pad', 'list', 'extend', 'same'] or a named mode, got 'extnd': did you mean 'extend'?
    """
    if name in BUILTIN_MODES or name in _NAMED:
        return
    close = difflib.get_close_matches(name.lower(), BUILTIN_MODES, n=1, cutoff=_TYPO)
    if close:
        raise ValueError(
            f"{where}: expected one of {list(BUILTIN_MODES)} or a named mode, got {name!r}: "
            f"did you mean {close[0]!r}?"
        )


# How close (difflib's ratio) to a built-in mode a name must be to be taken for its typo:
# 'extnd', 'mena' and 'CAT' are; 'first' (0.67 to 'list') and 'generate' are not.
_TYPO = 0.75


def known_modes() -> list[str]:
    """The built-in modes, then the named modes registered so far.

    Example:
        >>> known_modes()[:3]
        ['cat', 'stack', 'mean']
    """
    return [*BUILTIN_MODES, *sorted(_NAMED)]
