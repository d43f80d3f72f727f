"""One walk over nested inputs and outputs, shared by scatter and gather.

``flatten`` turns a structure into a hashable spec and a flat list of leaves;
``unflatten`` rebuilds the same types from a spec and new leaves. Specs are nested
tuples, so comparing the structures of N replicas is one C-level ``==``. Tensor
leaves are appended inline rather than through a recursive call, because the walk
runs per call on every replica and its cost matters as much as the copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from torch import Tensor

__all__: list[str] = []

LEAF = "*"
_TUPLE, _LIST, _NAMEDTUPLE, _DICT, _DATACLASS = range(5)
Spec = Any


def _flatten(obj: Any, leaves: list[Any]) -> Spec:
    append = leaves.append
    kind = type(obj)
    if kind is tuple or kind is list:
        values = obj
    elif kind is dict:
        values = obj.values()
    elif isinstance(obj, Tensor) or obj is None:
        append(obj)
        return LEAF
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = dataclasses.fields(obj)
        names = tuple(f.name for f in fields)
        init = tuple(f.init for f in fields)
        values = [getattr(obj, name) for name in names]
        children = tuple(
            [LEAF if isinstance(v, Tensor) and not append(v) else _flatten(v, leaves) for v in values]  # type: ignore[func-returns-value]
        )
        return (_DATACLASS, kind, (names, init), children)
    elif isinstance(obj, tuple) and hasattr(kind, "_fields"):
        values = obj
    elif isinstance(obj, Mapping):
        values = obj.values()
    elif isinstance(obj, (tuple, list)):
        values = obj
    else:
        append(obj)
        return LEAF
    # `not append(v)` is always True: it appends and yields LEAF without a call frame.
    children = tuple(
        [LEAF if isinstance(v, Tensor) and not append(v) else _flatten(v, leaves) for v in values]  # type: ignore[func-returns-value]
    )
    if kind is tuple:
        return (_TUPLE, None, None, children)
    if kind is list:
        return (_LIST, None, None, children)
    if isinstance(obj, Mapping):
        return (_DICT, kind, tuple(obj.keys()), children)
    if isinstance(obj, tuple) and hasattr(kind, "_fields"):
        return (_NAMEDTUPLE, kind, None, children)
    return (_TUPLE if isinstance(obj, tuple) else _LIST, kind, None, children)


def flatten(obj: Any) -> tuple[Spec, list[Any]]:
    """Split ``obj`` into ``(spec, leaves)``; ``unflatten(spec, leaves)`` rebuilds it."""
    leaves: list[Any] = []
    return _flatten(obj, leaves), leaves


def _build(spec: Spec, it: Iterator[Any]) -> Any:
    if spec is LEAF:
        return next(it)
    kind, cls, meta, children = spec
    values = [next(it) if c is LEAF else _build(c, it) for c in children]
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
    if spec is LEAF:
        return [root]
    paths: list[str] = []
    for label, child in zip(_children_labels(spec), spec[3]):
        paths.extend(leaf_paths(child, root + label))
    return paths


def top_level_leaf_counts(spec: Spec) -> list[tuple[str, int]] | None:
    """``(key, number of leaves)`` per top-level key or field, or None if not keyed."""
    if spec is LEAF or spec[0] not in (_DICT, _DATACLASS, _NAMEDTUPLE):
        return None
    kind, cls, meta, children = spec
    keys = meta if kind == _DICT else meta[0] if kind == _DATACLASS else cls._fields
    return [(str(k), len(leaf_paths(c))) for k, c in zip(keys, children)]


def _describe(spec: Spec) -> str:
    if spec is LEAF:
        return "a leaf"
    kind, cls, meta, children = spec
    name = {_TUPLE: "tuple", _LIST: "list"}.get(kind) if cls is None else cls.__name__
    if kind == _DICT:
        return f"{name} with keys {list(meta)}"
    if kind == _DATACLASS:
        return f"{name} with fields {list(meta[0])}"
    return f"{name} of length {len(children)}"


def describe_mismatch(a: Spec, b: Spec, root: str = "output") -> str:
    """Where two specs first differ, as 'path: X in one, Y in the other'."""
    if a is LEAF or b is LEAF or a[:3] != b[:3] or len(a[3]) != len(b[3]):
        return f"{root}: {_describe(a)} vs {_describe(b)}"
    for label, ca, cb in zip(_children_labels(a), a[3], b[3]):
        if ca != cb:
            return describe_mismatch(ca, cb, root + label)
    return f"{root}: structures differ"
