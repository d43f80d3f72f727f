"""Gather options given per top-level output key, field or tuple position, as one value per leaf."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from dpmethods.types import per_item
from dpmethods.types import tree as _tree
from dpmethods.vocab.options import GatherOption

__all__ = ["leaf_dims", "leaf_modes", "named_leaves", "option_for_leaf"]


def leaf_modes(spec: _tree.Spec, mode: GatherOption, n_leaves: int) -> list[str]:
    if isinstance(mode, str):
        return [mode] * n_leaves
    assert isinstance(mode, Mapping)
    return _per_key(spec, mode, "cat", "gather: a mapping of modes", "mode keys")


def _top_counts(spec: _tree.Spec) -> list[tuple[Any, int]] | None:
    """``(key, number of leaves)`` per top-level key, field or tuple position."""
    keys = per_item.top_keys(spec)
    if keys is None:
        return None
    return [(k, len(_tree.leaf_paths(c))) for k, c in zip(keys, spec.children)]


def named_leaves(spec: _tree.Spec, *options: Any) -> set[int]:
    """Leaves under a top-level key that a ``gather`` or ``gather_dim`` mapping names."""
    names = {k for o in options if isinstance(o, Mapping) for k in o}
    counts = _top_counts(spec) if names else None
    found: set[int] = set()
    start = 0
    for key, count in counts or ():
        if key in names:
            found.update(range(start, start + count))
        start += count
    return found


def option_for_leaf(spec: _tree.Spec, i: int, current: GatherOption, mode: str) -> str | None:
    """The ``gather=`` option that gives leaf ``i`` ``mode`` and every other leaf the mode
    ``current`` gives it; None when no option can (a mapping names only top-level keys,
    fields and positions, so a leaf nested under one, or sharing one, cannot have its own).

    Example:
        >>> spec = _tree.flatten({"y": 1, "loss": 2})[0]
        >>> option_for_leaf(spec, 1, "cat", "mean"), option_for_leaf(spec, 1, "pad", "mean")
        ("gather={'loss': 'mean'}", "gather={'y': 'pad', 'loss': 'mean'}")
        >>> print(option_for_leaf(_tree.flatten({"a": {"y": 1, "loss": 2}})[0], 1, "cat", "mean"))
        None
    """
    counts = _top_counts(spec)
    if counts is None:  # the output is the leaf
        return f"gather={mode!r}" if i == 0 else None
    start = 0
    for key, count in counts:
        if start <= i < start + count:
            if count != 1 or not isinstance(current, (str, Mapping)):
                return None
            others = {k: str(v) for k, v in current.items()} if isinstance(current, Mapping) else {
                k: str(current) for k, _ in counts if current != "cat"}
            return f"gather={ {**others, key: mode} !r}"
        start += count
    return None


def leaf_dims(spec: _tree.Spec, dims: Mapping[Any, int], dim: int) -> list[int]:
    return _per_key(spec, dims, dim, "gather_dim: a mapping of dims", "gather_dim keys")


def _per_key(spec: _tree.Spec, by_key: Mapping[Any, Any], default: Any, what: str, keys: str) -> list[Any]:
    counts = _top_counts(spec)
    key_kind = str if counts and isinstance(counts[0][0], str) else int
    if counts is None or (counts and not any(type(k) is key_kind for k in by_key)):
        raise ValueError(
            f"{what} {dict(by_key)} needs outputs with keys, fields or positions "
            f"(dict, dataclass, namedtuple, tuple), got {_tree.describe(spec)}"
        )
    # Names that are not in a keyed output are likely typos; positions past the end of a
    # tuple, and names given for a tuple (or positions for a dict), are not: one mapping
    # may serve outputs of several arities and forms (open_clip's 3- and 4-tuples, dicts).
    # A mapping that names positions too is such a mapping, and its names absent from a
    # dict are the other arity's (open_clip's dict has "logit_bias" only with a bias).
    named = {k for k, _ in counts}
    unknown = sorted(k for k in by_key if isinstance(k, str) and k not in named)
    several_forms = any(isinstance(k, int) for k in by_key)
    if unknown and not several_forms and counts and isinstance(counts[0][0], str):
        warnings.warn(
            f"gather: {keys} {unknown} are not in the output, whose keys are "
            f"{[k for k, _ in counts]}; those keys are ignored",
            UserWarning,
            stacklevel=4,
        )
    values: list[Any] = []
    for key, count in counts:
        values += [by_key.get(key, default)] * count
    return values


