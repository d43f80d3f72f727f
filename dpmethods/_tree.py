"""One walk over nested inputs and outputs, shared by scatter and gather.

``flatten`` turns a structure into a hashable spec and a flat list of leaves;
``unflatten`` rebuilds the same types from a spec and new leaves. Specs are nested
tuples, so comparing the structures of N replicas is one C-level ``==``. Tensor
leaves are appended inline rather than through a recursive call, because the walk
runs per call on every replica and its cost matters as much as the copy.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Iterator, Mapping
from typing import Any

from torch import Tensor

__all__: list[str] = []

# Leaf markers. Tensors, None and other values are told apart in the spec, so equal
# specs mean the replicas agree on which positions hold tensors.
LEAF, NONE, OTHER = "*", "-", "="
_LEAVES = (LEAF, NONE, OTHER)
_LEAF_SET = frozenset(_LEAVES)
_TUPLE, _LIST, _NAMEDTUPLE, _DICT, _DATACLASS = range(5)
_TENSORS = itertools.repeat(Tensor)
Spec = Any


@functools.lru_cache(maxsize=256)
def _all_leaves(n: int) -> tuple[str, ...]:
    # One shared tuple per length, so comparing the specs of replicas is an identity check.
    return (LEAF,) * n


def _children(values: list[Any], leaves: list[Any]) -> tuple[Spec, ...]:
    # A container of tensors only (the common output) is handled without a Python-level
    # step per leaf; `map(isinstance, ...)` runs in C.
    if all(map(isinstance, values, _TENSORS)):
        leaves.extend(values)
        return _all_leaves(len(values))
    append = leaves.append
    # `not append(v)` is always True: it appends and yields LEAF without a call frame.
    return tuple(
        [LEAF if isinstance(v, Tensor) and not append(v) else _flatten(v, leaves) for v in values]  # type: ignore[func-returns-value]
    )


def _flatten(obj: Any, leaves: list[Any]) -> Spec:
    kind = type(obj)
    if kind is tuple:
        return (_TUPLE, None, None, _children(list(obj), leaves))
    if kind is list:
        return (_LIST, None, None, _children(obj, leaves))
    if kind is dict:
        return (_DICT, dict, tuple(obj), _children(list(obj.values()), leaves))
    if isinstance(obj, Tensor):
        leaves.append(obj)
        return LEAF
    if obj is None:
        leaves.append(obj)
        return NONE
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = dataclasses.fields(obj)
        names = tuple(f.name for f in fields)
        init = tuple(f.init for f in fields)
        values = [getattr(obj, name) for name in names]
        return (_DATACLASS, kind, (names, init), _children(values, leaves))
    if isinstance(obj, tuple) and hasattr(kind, "_fields"):
        return (_NAMEDTUPLE, kind, None, _children(list(obj), leaves))
    if isinstance(obj, Mapping):
        return (_DICT, kind, tuple(obj.keys()), _children(list(obj.values()), leaves))
    if isinstance(obj, (tuple, list)):
        return (_TUPLE if isinstance(obj, tuple) else _LIST, kind, None, _children(list(obj), leaves))
    leaves.append(obj)
    return OTHER


def flatten(obj: Any) -> tuple[Spec, list[Any]]:
    """Split ``obj`` into ``(spec, leaves)``; ``unflatten(spec, leaves)`` rebuilds it."""
    leaves: list[Any] = []
    return _flatten(obj, leaves), leaves


def _build(spec: Spec, it: Iterator[Any]) -> Any:
    if spec in _LEAVES:
        return next(it)
    kind, cls, meta, children = spec
    if set(children) <= _LEAF_SET:
        values = list(itertools.islice(it, len(children)))
    else:
        values = [next(it) if c in _LEAVES else _build(c, it) for c in children]
    if kind == _TUPLE:
        return tuple(values) if cls is None else cls(values)
    if kind == _LIST:
        return values if cls is None else cls(values)
    if kind == _DICT:
        return dict(zip(meta, values)) if cls is dict else cls(zip(meta, values))
    if kind == _NAMEDTUPLE:
        return cls(*values)
    names, init = meta
    obj = cls(**{n: v for n, v, i in zip(names, values, init) if i})
    for n, v, i in zip(names, values, init):
        if not i:  # fields the constructor doesn't take are set as the original had them
            object.__setattr__(obj, n, v)
    return obj


def unflatten(spec: Spec, leaves: list[Any]) -> Any:
    """Rebuild the structure described by ``spec`` with ``leaves`` in order."""
    return _build(spec, iter(leaves))


def _children_labels(spec: Spec) -> list[str]:
    kind, cls, meta, children = spec
    if kind == _DICT:
        return [f"[{k!r}]" for k in meta]
    if kind == _DATACLASS:
        return [f".{n}" for n in meta[0]]
    if kind == _NAMEDTUPLE:
        return [f".{n}" for n in cls._fields]
    return [f"[{i}]" for i in range(len(children))]


def leaf_paths(spec: Spec, root: str = "output") -> list[str]:
    """The key path of every leaf, in leaf order (for error messages)."""
    if spec in _LEAVES:
        return [root]
    paths: list[str] = []
    for label, child in zip(_children_labels(spec), spec[3]):
        paths.extend(leaf_paths(child, root + label))
    return paths


def top_level_leaf_counts(spec: Spec) -> list[tuple[str, int]] | None:
    """``(key, number of leaves)`` per top-level key or field, or None if not keyed."""
    if spec in _LEAVES or spec[0] not in (_DICT, _DATACLASS, _NAMEDTUPLE):
        return None
    kind, cls, meta, children = spec
    keys = meta if kind == _DICT else meta[0] if kind == _DATACLASS else cls._fields
    return [(str(k), len(leaf_paths(c))) for k, c in zip(keys, children)]


def _describe(spec: Spec) -> str:
    if spec in _LEAVES:
        return {LEAF: "a tensor", NONE: "None"}.get(spec, "a non-tensor value")
    kind, cls, meta, children = spec
    name = {_TUPLE: "tuple", _LIST: "list"}.get(kind) if cls is None else cls.__name__
    if kind == _DICT:
        return f"{name} with keys {list(meta)}"
    if kind == _DATACLASS:
        return f"{name} with fields {list(meta[0])}"
    return f"{name} of length {len(children)}"


def describe_mismatch(a: Spec, b: Spec, root: str = "output") -> str:
    """Where two specs first differ, as 'path: X in one, Y in the other'."""
    if a in _LEAVES or b in _LEAVES or a[:3] != b[:3] or len(a[3]) != len(b[3]):
        return f"{root}: {_describe(a)} vs {_describe(b)}"
    for label, ca, cb in zip(_children_labels(a), a[3], b[3]):
        if ca != cb:
            return describe_mismatch(ca, cb, root + label)
    return f"{root}: structures differ"
