"""Scatter's words for its arguments: their names in messages, and the warnings and
hints about lists that look like batches of items."""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from typing import Any

from torch import Tensor

from dpmethods.core.signature import argument_names, signature_of
from dpmethods.types import tree as _tree
from dpmethods.vocab.warn_once import warn_once

__all__ = ["Arguments", "first_split", "list_arguments", "mismatch_hint", "warn_ragged_lists"]


class Arguments:
    """One call's arguments bound to the names of ``fn``'s signature."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any], fn: Callable[..., Any] | None) -> None:
        self.args, self.kwargs, self.fn = args, kwargs, fn
        self.params = signature_of(fn)

    def names(self) -> list[str]:
        """One name per argument: positional ones through the signature, then keywords."""
        return [*argument_names(self.params, len(self.args)), *self.kwargs]

    def values(self) -> list[Any]:
        return [*self.args, *self.kwargs.values()]

    def selected(self, names: Sequence[str]) -> list[tuple[bool, Any]]:
        """Per positional then keyword argument: (named by ``names``, value). The name of
        ``*args`` or ``**kwargs`` covers every argument that lands in it."""
        wanted, params = set(names), self.params
        named = len(params.positional)
        entries = [
            (n in wanted or (i >= named and params.star in wanted), a)
            for i, (n, a) in enumerate(zip(argument_names(params, len(self.args)), self.args))
        ]
        entries += [
            (k in wanted or (k not in params.names and params.double_star in wanted), v)
            for k, v in self.kwargs.items()
        ]
        return entries

    def leaf_names(self, spec: _tree.Spec) -> list[str]:
        """The name of each leaf of ``(args, kwargs)``'s spec, for messages."""
        positional = argument_names(self.params, len(self.args))
        return [_rename(p, positional) for p in _tree.leaf_paths(spec.children[0], "args")] + [
            _kw(p) for p in _tree.leaf_paths(spec.children[1], "kwargs")
        ]


def mismatch_hint(lists: list[str]) -> str:
    # Never broadcast for a list: every replica would run all of its entries (all the
    # targets beside its share of the images), which gives a wrong answer silently.
    if lists:
        names = ", ".join(map(repr, lists))
        return (
            f"{names} {'is a list' if len(lists) == 1 else 'are lists'} whose tensors were "
            f"split as batches: if each entry belongs to one batch item (an image, a target "
            f"dict), pass split=({names},) so each replica gets its items' entries."
        )
    return "Pass broadcast=(name, ...) for arguments that every replica needs whole."


def list_arguments(names: list[str], values: list[Any]) -> list[str]:
    """The arguments that are lists or tuples holding tensors (the ones split= is for)."""
    return [
        name
        for name, value in zip(names, values)
        if isinstance(value, (list, tuple))
        and any(isinstance(t, Tensor) for t in _tree.flatten(value)[1])
    ]


def warn_ragged_lists(names: list[str], values: list[Any], whole: Container[str], dim: int) -> None:
    """Warn once when a list of tensors of different shapes is split entry by entry.

    Entries of different shapes are seldom one batch each: they are the items (images
    of several sizes for a detection model), and splitting each one along ``dim`` gives
    every replica a piece of every item.
    """
    for name, value in zip(names, values):
        if name in whole or type(value) not in (list, tuple) or len(value) < 2:
            continue
        shapes = [tuple(t.shape) for t in value if isinstance(t, Tensor)]
        if len(shapes) == len(value) and len(set(shapes)) > 1:
            shown = ", ".join(str(list(s)) for s in shapes[:3])
            warn_once(
                f"scatter: argument {name!r} is a list of {len(shapes)} tensors of different "
                f"shapes ({shown}{', ...' if len(shapes) > 3 else ''}), and each one is split "
                f"along dim {dim} as a batch of its own, so every replica gets a piece of "
                f"every entry. If each entry is one batch item (an image), pass "
                f"split=({name!r},) to give each replica whole entries.",
                stacklevel=5,
            )


def first_split(leaves: list[Any], whole: Container[int], names: Callable[[], list[str]]) -> str:
    i = next(
        i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.dim() and i not in whole
    )
    return names()[i]


def _rename(path: str, positional: list[str]) -> str:
    # "args[1]['ids']" -> "argument 'batch' at batch['ids']", named through the signature.
    head, _, rest = path[len("args[") :].partition("]")
    index = int(head)
    name = positional[index]
    return f"argument {name!r}" + (f" at {name}{rest}" if rest else "")


def _kw(path: str) -> str:
    # "kwargs['mask'][0]" -> "argument 'mask' at mask[0]"
    head, _, rest = path[len("kwargs['") :].partition("']")
    return f"argument {head!r}" + (f" at {head}{rest}" if rest else "")
