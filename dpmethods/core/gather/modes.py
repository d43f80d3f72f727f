"""The built-in gather modes: one row each, in one table.

A row says everything the gather does differently for its mode: how it joins a tensor
leaf, how it joins any other leaf, and which checks of the replicas' shares apply. A new
built-in mode is a member of :class:`dpmethods.vocab.gather_modes.Mode`, a row here, and a
test; :func:`join_tensor_leaf` and :func:`join_value_leaf` are the only dispatch.

Tensor joins return ``(result, None)`` when the leaf is done, or ``(None, pieces)`` for
pieces the walk concatenates along the join dim with the other leaves, in one coalesced
call. Value joins return :data:`UNJOINED` for what the mode has no rule for; such a leaf
comes back once if the replicas agree, else as a list, with a warning.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Size, Tensor

from dpmethods.core.gather.join import join_same, joinable, pad
from dpmethods.core.gather.values import all_equal, join_shapes, numpy_arrays, reduce
from dpmethods.types import tree as _tree
from dpmethods.types.per_item import Items, Whole, extend
from dpmethods.vocab.gather_modes import Mode
from dpmethods.vocab.warn_once import warn_once

__all__ = ["MODES", "UNJOINED", "ModeRow", "join_tensor_leaf", "join_value_leaf", "row"]

UNJOINED = object()  # a value join's "no rule of mine": the common fallback decides
_NUMBERS = (int, float, complex)

# (col, dim, ragged, path, plan) -> (result, None) or (None, pieces to concatenate)
TensorJoin = Callable[[Sequence[Tensor], int, bool, Callable[[], str], Any], "tuple[Any, Sequence[Tensor] | None]"]
# (column, dim, path, device, weights) -> the joined value, or UNJOINED
ValueJoin = Callable[[Sequence[Any], int, str, torch.device, Sequence[float]], Any]


class ModeRow(NamedTuple):
    """What one gather mode does."""

    tensors: TensorJoin
    values: ValueJoin
    couples: bool  # joins the batch items side by side: checked for batch-coupled outputs
    batch_dim: bool  # joins along the batch dim: checked for a batch held in another dim
    reduces: bool  # one value from all replicas: warned about next to a coupled output


def _whole_or_stacked(col: Sequence[Tensor], dim: int, path: Callable[[], str], plan: Any) -> Any:
    """One replica's leaf as it is, or 0-dim leaves stacked (with a warning); None else."""
    if plan.n == 1:
        # One replica ran (one device, or nothing to split): its output is the result,
        # as torch returns it; a 0-dim value stays 0-dim.
        return col[0].to(plan.device), None
    if col[0].dim() == 0:
        if plan.halves:
            raise ValueError(
                f"on_oom='split': {path()} is 0-dim: the share that ran out of memory returns "
                f"one value, and its {plan.n} parts' values cannot be concatenated into it; "
                + _own_mode(path, "the parts")
            )
        warnings.warn(
            f"gather: {path()} is 0-dim on every replica, so it was stacked into a vector "
            f"of {plan.n} values; " + _own_mode(path, "the replicas", "stack"),
            UserWarning,
            stacklevel=7,  # the caller of gather()
        )
        return None, [t.unsqueeze(dim) for t in col]
    return None


def _own_mode(path: Callable[[], str], parts: str, keep: str | None = None) -> str:
    """How a 0-dim leaf gets a mode of its own: the option that gives it one, if any."""
    option = getattr(path, "option", lambda mode: None)
    mean = option("mean")
    if mean is None:
        return (
            "a gather mapping names only top-level keys, fields and positions: return it as "
            "one of its own to give it a mode ('mean' for a mean over the batch's items)"
        )
    mean_text = (
        f"use {mean} if it is a mean over the batch's items ({parts}' values weighted by "
        f"their shares), {option('sum')} for a sum, or {option('same')} for a value they all share"
    )
    return mean_text + (f"; {option(keep)} keeps the vector without this warning" if keep else "")


def _cat(col: Sequence[Tensor], dim: int, ragged: bool, path: Callable[[], str], plan: Any) -> Any:
    # "extend" too: a tensor is a sequence of items.
    done = _whole_or_stacked(col, dim, path, plan)
    if done is not None:
        return done
    if ragged and not joinable(col, dim):
        return None, pad(col, dim, 0, path())  # the rule's lengths say what is padding
    return None, col


def _pad(col: Sequence[Tensor], dim: int, ragged: bool, path: Callable[[], str], plan: Any) -> Any:
    done = _whole_or_stacked(col, dim, path, plan)
    return done if done is not None else (None, pad(col, dim, plan.pad_value, path()))


def _stack(col: Sequence[Tensor], dim: int, ragged: bool, path: Callable[[], str], plan: Any) -> Any:
    return None, [t.unsqueeze(dim) for t in col]


def _reducing(mean: bool) -> TensorJoin:
    def join(col: Sequence[Tensor], dim: int, ragged: bool, path: Callable[[], str], plan: Any) -> Any:
        if any(t.shape != col[0].shape for t in col):
            name = "mean" if mean else "sum"
            raise ValueError(
                f"gather: {path()}: {name!r} needs the same shape on every replica, got "
                f"{[list(t.shape) for t in col]}; use 'cat' or 'pad' for batch outputs"
            )
        return reduce(col, plan.weights, plan.device, mean), None

    return join


def _list(col: Sequence[Tensor], dim: int, ragged: bool, path: Callable[[], str], plan: Any) -> Any:
    return [t.to(plan.device) for t in col], None


def _same(col: Sequence[Tensor], dim: int, ragged: bool, path: Callable[[], str], plan: Any) -> Any:
    return join_same(col, plan.device, path()), None


def _concat_values(column: Sequence[Any], dim: int, path: str, device: torch.device, weights: Sequence[float]) -> Any:
    if numpy_arrays(column):
        return sys.modules["numpy"].concatenate(column, axis=dim)
    return UNJOINED


def _stack_values(column: Sequence[Any], dim: int, path: str, device: torch.device, weights: Sequence[float]) -> Any:
    if numpy_arrays(column):
        return sys.modules["numpy"].stack(column, axis=dim)
    return UNJOINED


def _reducing_values(mean: bool) -> ValueJoin:
    def join(column: Sequence[Any], dim: int, path: str, device: torch.device, weights: Sequence[float]) -> Any:
        if all(isinstance(v, _NUMBERS) for v in column) or numpy_arrays(column):
            return reduce(column, weights, device, mean)
        return UNJOINED

    return join


def _list_values(column: Sequence[Any], dim: int, path: str, device: torch.device, weights: Sequence[float]) -> Any:
    return list(column)


def _same_values(column: Sequence[Any], dim: int, path: str, device: torch.device, weights: Sequence[float]) -> Any:
    if not all_equal(column):
        raise ValueError(
            f"gather: {path}: 'same' expects one value equal on every replica, got {list(column)!r}"
        )
    return column[0]


# Keyed by the modes' plain strings: torch.compile (2.11) cannot hash the Mode members.
MODES: dict[str, ModeRow] = {
    #                  tensors          values                   couples batch_dim reduces
    Mode.CAT.value: ModeRow(_cat, _concat_values, True, True, False),
    Mode.STACK.value: ModeRow(_stack, _stack_values, True, False, False),
    Mode.MEAN.value: ModeRow(_reducing(True), _reducing_values(True), False, False, True),
    Mode.SUM.value: ModeRow(_reducing(False), _reducing_values(False), False, False, True),
    Mode.PAD.value: ModeRow(_pad, _concat_values, True, True, False),
    Mode.LIST.value: ModeRow(_list, _list_values, False, False, False),
    Mode.EXTEND.value: ModeRow(_cat, _concat_values, True, False, False),
    Mode.SAME.value: ModeRow(_same, _same_values, False, False, False),
}


def row(mode: str) -> ModeRow:
    """The row of a built-in mode, given as a :class:`Mode` member or its string.

    Example:
        >>> row(Mode.MEAN).reduces, row("cat").reduces
        (True, False)
    """
    return MODES[mode.value if isinstance(mode, Mode) else mode]


def join_tensor_leaf(
    col: Sequence[Tensor], mode: str, dim: int, coupled: bool, ragged: bool,
    path: Callable[[], str], plan: Any,
) -> tuple[Any, Sequence[Tensor] | None]:
    """One tensor leaf by its mode: ``(result, None)``, or ``(None, pieces)`` to concatenate.

    Example:
        >>> from types import SimpleNamespace
        >>> plan = SimpleNamespace(n=2, device=torch.device("cpu"), weights=[0.5, 0.5], pad_value=0)
        >>> join_tensor_leaf([torch.tensor(1.0), torch.tensor(3.0)], "mean", 0, False, False,
        ...                  lambda: "loss", plan)
        (tensor(2.), None)
    """
    if coupled and not joinable(col, dim):
        # A coupled leaf that cat can't join comes back in pieces: it was warned about.
        return [t.to(plan.device) for t in col], None
    return row(mode).tensors(col, dim, ragged, path, plan)


def join_value_leaf(
    column: Sequence[Any], mode: str, dim: int, path: str, device: torch.device,
    weights: Sequence[float],
) -> Any:
    """One non-tensor leaf: per-item lists extended, then the mode's rule, then equal
    values once; anything else as a list of the replicas' values, with a warning.

    Example:
        >>> join_value_leaf([2, 4], "sum", 0, "count", torch.device("cpu"), [0.5, 0.5])
        6
        >>> join_value_leaf(["cfg", "cfg"], "cat", 0, "name", torch.device("cpu"), [0.5, 0.5])
        'cfg'
    """
    first = column[0]
    if isinstance(first, Items):
        return extend(column, device)
    if isinstance(first, Whole):
        return [_tree.move(w.value, device) for w in column]
    joined = row(mode).values(column, dim, path, device, weights)
    if joined is not UNJOINED:
        return joined
    if all_equal(column):
        return first
    if all(type(v) is Size for v in column):
        shape = join_shapes(column, dim)
        if shape is not None:
            return shape
    _warn_unjoined(column, path)
    return list(column)


def _warn_unjoined(column: Sequence[Any], path: str) -> None:
    kind = type(column[0]).__name__
    if isinstance(column[0], (*_NUMBERS, str, bytes, bool)):
        remedy = "pass gather='list' (or 'sum'/'mean' for numbers) for that output"
    else:
        remedy = (
            f"tell dpmethods how to split and join a {kind} with "
            f"dpmethods.register_type({kind}, flatten, unflatten), or pass gather='list' for "
            "that output"
        )
    warn_once(
        f"gather: {path} ({kind}) differs across replicas and dpmethods has no rule to join "
        f"it, so it is returned as a list of the {len(column)} replicas' values; {remedy} "
        "to silence this."
    )
