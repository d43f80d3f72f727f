"""One walk over nested inputs and outputs, shared by scatter and gather.

``flatten`` turns a structure into a hashable spec and a flat list of leaves;
``unflatten`` rebuilds the same types from a spec and new leaves. Specs are nested
tuples, so comparing the structures of N replicas is one C-level ``==``. Tensor
leaves are appended inline rather than through a recursive call, because the walk
runs per call on every replica and its cost matters as much as the copy.

Besides the built-in containers, dataclasses and namedtuples, a type is walked when it
has a rule: one given to :func:`dpmethods.register_type` (or shipped for a library in
:mod:`dpmethods.types.rules`), else one registered with ``torch.utils._pytree``. Those
lookups happen only for objects that are none of the common kinds, so the fast paths
for tensors, tuples, lists and dicts are unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import torch.utils._pytree as _pytree
from torch import Size, Tensor

from dpmethods.vocab.loading import load_pending

__all__ = [
    "DATACLASS", "DICT", "LEAF", "LEAVES", "LIST", "NAMEDTUPLE", "NODE", "NONE", "OTHER", "RULES",
    "TUPLE", "Node", "Spec", "TypeRule", "children_labels", "describe", "describe_mismatch",
    "flatten", "leaf_paths", "move", "per_item_leaves", "ragged_leaves", "rule_for", "set_rule",
    "unflatten",
]

# Leaf markers. Tensors, None and other values are told apart in the spec, so equal
# specs mean the replicas agree on which positions hold tensors.
LEAF, NONE, OTHER = "*", "-", "="
LEAVES = (LEAF, NONE, OTHER)
# The kinds of container a Node is (its first field).
TUPLE, LIST, NAMEDTUPLE, DICT, DATACLASS, NODE = range(6)
Spec = Any  # a leaf marker or a Node


class Node(NamedTuple):
    """One container in a spec: its kind, class, metadata (keys, fields, a rule and its
    context) and the specs of its children. Equal nodes mean equal structures."""

    kind: int
    cls: Any
    meta: Any
    children: tuple[Any, ...]


# tuple.__new__ in C, not the NamedTuple's Python-level __new__: the walk runs per call.
_make_node = functools.partial(tuple.__new__, Node)


class TypeRule(NamedTuple):
    """How to take a type apart: ``flatten(obj) -> (children, context)`` and
    ``unflatten(children, context) -> obj``, as in ``torch.utils._pytree``."""

    flatten: Callable[[Any], tuple[list[Any], Any]]
    unflatten: Callable[[list[Any], Any], Any]
    # The tensor children hold one row per batch item along the batch dim by
    # construction (a cache's keys and values), so they are never batch-coupled.
    per_item: bool = False
    # The replicas' children may differ in their other dims (sequences padded to each
    # replica's longest): joined padded with zeros, which the rule's lengths mask.
    ragged: bool = False
    # The rule is for this class only, not its subclasses (whose constructors may differ).
    exact: bool = False


# Rules given to dpmethods (register_type, shipped library rules), by class; a rule
# applies to subclasses too. Resolved lookups are cached per class.
RULES: dict[type, TypeRule] = {}
_resolved: dict[type, TypeRule | None] = {}


def set_rule(cls: type, rule: TypeRule | None) -> None:
    """Add (or with ``None`` remove) the rule of ``cls``; forget resolved lookups.

    Example:
        >>> class Pair(tuple): ...
        >>> set_rule(Pair, TypeRule(lambda p: (list(p), None), lambda c, _: Pair(c)))
        >>> rule_for(Pair) is RULES[Pair]
        True
        >>> set_rule(Pair, None)
    """
    if rule is None:
        RULES.pop(cls, None)
    else:
        RULES[cls] = rule
    _resolved.clear()


def rule_for(kind: type) -> TypeRule | None:
    """The rule that walks objects of type ``kind``, or None.

    Example:
        >>> rule_for(int) is None
        True
    """
    try:
        return _resolved[kind]
    except KeyError:
        pass
    load_pending()  # once per class: rules of libraries imported by now come first
    rule = next((RULES[k] for k in kind.__mro__ if k in RULES and (k is kind or not RULES[k].exact)), None)
    _resolved[kind] = rule
    return rule


def _pytree_rule(kind: type) -> TypeRule | None:
    # Read on every miss, not cached: libraries register their types at any time.
    node = _pytree.SUPPORTED_NODES.get(kind)
    return None if node is None else TypeRule(node.flatten_fn, node.unflatten_fn)


class _DictOf(NamedTuple):
    """A mapping type whose constructor takes more than the items (defaultdict)."""

    cls: type
    factory: Any

    @property
    def __name__(self) -> str:  # for messages, like a class
        return self.cls.__name__

    def __call__(self, items: dict[Any, Any]) -> Any:
        return self.cls(self.factory, items)


def _mapping(cls: Any, keys: tuple[Any, ...], values: list[Any]) -> Any:
    # Rebuilt from a dict of the items rather than from pairs: Counter(pairs) would
    # count the pairs, and mappingproxy takes only a mapping.
    try:
        return cls(dict(zip(keys, values)))
    except TypeError as exc:
        raise TypeError(
            f"cannot rebuild a {cls.__name__} from its items ({exc}); tell dpmethods how with "
            f"dpmethods.register_type({cls.__name__}, flatten, unflatten)"
        ) from exc


# One shared tuple per length, so comparing the specs of replicas is an identity check.
# A bounded dict rather than functools.lru_cache, which torch.compile warns about.
_ALL_LEAVES: dict[int, tuple[str, ...]] = {}


def _all_leaves(n: int) -> tuple[str, ...]:
    spec = _ALL_LEAVES.get(n)
    if spec is None:
        spec = (LEAF,) * n
        if len(_ALL_LEAVES) < 256:
            _ALL_LEAVES[n] = spec
    return spec


def _children(values: list[Any], leaves: list[Any]) -> tuple[Spec, ...]:
    # A container of tensors only (the common output) is handled without a Python-level
    # step per leaf; `map(isinstance, ...)` runs in C. The itertools.repeat is made here,
    # not kept in a global: torch.compile models one built while tracing, not one it finds.
    if all(map(isinstance, values, itertools.repeat(Tensor))):
        leaves.extend(values)
        return _all_leaves(len(values))
    append = leaves.append
    # `not append(v)` is always True: it appends and yields LEAF without a call frame.
    return tuple(
        [LEAF if isinstance(v, Tensor) and not append(v) else _flatten(v, leaves) for v in values]  # type: ignore[func-returns-value]
    )


def _node(rule: TypeRule, obj: Any, kind: type, leaves: list[Any]) -> Spec:
    out = rule.flatten(obj)
    # A wrong rule would otherwise fail far from its cause ("not enough values to
    # unpack") or, with a bare tensor as the children, split it silently into rows.
    # The right result passes with two type checks and a len.
    if type(out) is not tuple or len(out) != 2:
        out = _check_pair(out, kind)
    children, context = out
    if type(children) is not list and type(children) is not tuple:
        children = _check_children(children, kind)
    return _make_node((NODE, kind, (rule, context), _children(children, leaves)))


def _got(value: Any) -> str:
    """A short description of a value for error messages (no tensor data)."""
    if isinstance(value, Tensor):
        return f"a tensor of shape {list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of length {len(value)}"
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} with keys {list(value)[:8]}"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _check_pair(out: Any, kind: type) -> tuple[Any, Any]:
    if type(out) is list and len(out) == 2:
        return out[0], out[1]
    raise TypeError(
        f"the type rule of {kind.__qualname__}: flatten(obj) must return a pair "
        f"(children, context), got {_got(out)} (see dpmethods.register_type)"
    )


def _check_children(children: Any, kind: type) -> list[Any]:
    where = f"the type rule of {kind.__qualname__}: flatten(obj) returned"
    if isinstance(children, Tensor):
        # Iterating a tensor yields its rows: the object would be rebuilt from rows.
        raise TypeError(
            f"{where} {_got(children)} as its children, expected a list of children; "
            "to split the tensor along the batch, return ([tensor], context)"
        )
    if isinstance(children, (Mapping, str, bytes)):
        raise TypeError(
            f"{where} {_got(children)} as its children, expected a list of children"
            + ("; return (list(d.values()), keys)" if isinstance(children, Mapping) else "")
        )
    try:
        return list(children)
    except TypeError:
        raise TypeError(
            f"{where} {_got(children)} as its children, expected a list of children"
        ) from None


def _flatten(obj: Any, leaves: list[Any]) -> Spec:
    kind = type(obj)
    if kind is tuple:
        return _make_node((TUPLE, None, None, _children(list(obj), leaves)))
    if kind is list:
        return _make_node((LIST, None, None, _children(obj, leaves)))
    if kind is dict:
        return _make_node((DICT, dict, tuple(obj), _children(list(obj.values()), leaves)))
    if isinstance(obj, Tensor):
        leaves.append(obj)
        return LEAF
    if obj is None:
        leaves.append(obj)
        return NONE
    rule = rule_for(kind)  # before dataclasses: a registered rule wins
    if rule is not None:
        return _node(rule, obj, kind, leaves)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = dataclasses.fields(obj)
        names = tuple(f.name for f in fields)
        init = tuple(f.init for f in fields)
        values = [getattr(obj, name) for name in names]
        return _make_node((DATACLASS, kind, (names, init), _children(values, leaves)))
    if kind is Size:  # a shape is a value, not a container of batch items
        leaves.append(obj)
        return OTHER
    if isinstance(obj, tuple) and hasattr(kind, "_fields"):
        return _make_node((NAMEDTUPLE, kind, None, _children(list(obj), leaves)))
    if isinstance(obj, Mapping):
        cls: Any = _DictOf(kind, obj.default_factory) if isinstance(obj, defaultdict) else kind
        return _make_node((DICT, cls, tuple(obj.keys()), _children(list(obj.values()), leaves)))
    if isinstance(obj, (tuple, list)):
        return _make_node((TUPLE if isinstance(obj, tuple) else LIST, kind, None, _children(list(obj), leaves)))
    rule = _pytree_rule(kind)
    if rule is not None:
        return _node(rule, obj, kind, leaves)
    leaves.append(obj)
    return OTHER


def flatten(obj: Any) -> tuple[Spec, list[Any]]:
    """Split ``obj`` into ``(spec, leaves)``; ``unflatten(spec, leaves)`` rebuilds it.

    Example:
        >>> import torch
        >>> spec, leaves = flatten({"x": torch.ones(2), "n": 3})
        >>> len(leaves), unflatten(spec, leaves)["n"]
        (2, 3)
    """
    leaves: list[Any] = []
    return _flatten(obj, leaves), leaves


def _build(spec: Spec, it: Iterator[Any]) -> Any:
    if spec in LEAVES:
        return next(it)
    kind, cls, meta, children = spec
    if all(map(isinstance, children, itertools.repeat(str))):  # leaf markers only
        values = list(itertools.islice(it, len(children)))
    else:
        values = [next(it) if c in LEAVES else _build(c, it) for c in children]
    if kind == TUPLE:
        return tuple(values) if cls is None else cls(values)
    if kind == LIST:
        return values if cls is None else cls(values)
    if kind == DICT:
        return dict(zip(meta, values)) if cls is dict else _mapping(cls, meta, values)
    if kind == NODE:
        return meta[0].unflatten(values, meta[1])
    if kind == NAMEDTUPLE:
        return cls(*values)
    names, init = meta
    obj = cls(**{n: v for n, v, i in zip(names, values, init) if i})
    for n, v, i in zip(names, values, init):
        if not i:  # fields the constructor doesn't take are set as the original had them
            object.__setattr__(obj, n, v)
    return obj


def unflatten(spec: Spec, leaves: list[Any]) -> Any:
    """Rebuild the structure described by ``spec`` with ``leaves`` in order.

    Example:
        >>> spec, _ = flatten((1, [2, 3]))
        >>> unflatten(spec, ["a", "b", "c"])
        ('a', ['b', 'c'])
    """
    return _build(spec, iter(leaves))


def move(obj: Any, device: Any, non_blocking: bool = False) -> Any:
    """``obj`` with its tensor leaves on ``device``; ``obj`` itself when none has to move
    (or ``device`` is None).

    Example:
        >>> import torch
        >>> move({"x": torch.ones(1), "n": 3}, torch.device("cpu"))
        {'x': tensor([1.]), 'n': 3}
    """
    if device is None:
        return obj
    if isinstance(obj, Tensor):
        return obj if obj.device == device else obj.to(device, non_blocking=non_blocking)
    spec, leaves = flatten(obj)
    if not any(isinstance(t, Tensor) and t.device != device for t in leaves):
        return obj
    return unflatten(spec, [t.to(device, non_blocking=non_blocking) if isinstance(t, Tensor) else t for t in leaves])


def children_labels(spec: Spec) -> list[str]:
    """How each child of a container's spec is reached from it (``['k']``, ``.field``, ``[0]``).

    Example:
        >>> children_labels(flatten({"a": 1, "b": 2})[0])
        ["['a']", "['b']"]
    """
    kind, cls, meta, children = spec
    if kind == DICT:
        return [f"[{k!r}]" for k in meta]
    if kind == DATACLASS:
        return [f".{n}" for n in meta[0]]
    if kind == NAMEDTUPLE:
        return [f".{n}" for n in cls._fields]
    return [f"[{i}]" for i in range(len(children))]


def leaf_paths(spec: Spec, root: str = "output") -> list[str]:
    """The key path of every leaf, in leaf order (for error messages).

    Example:
        >>> leaf_paths(flatten({"a": (1, 2)})[0])
        ["output['a'][0]", "output['a'][1]"]
    """
    if spec in LEAVES:
        return [root]
    paths: list[str] = []
    for label, child in zip(children_labels(spec), spec.children):
        paths.extend(leaf_paths(child, root + label))
    return paths


def per_item_leaves(spec: Spec) -> set[int]:
    """Indices of the leaves under a node whose rule says its children are per item.

    Example:
        >>> per_item_leaves(flatten([1, 2])[0])
        set()
    """
    found: set[int] = set()
    _walk_flag(spec, 0, False, found, "per_item")
    return found


def ragged_leaves(spec: Spec) -> set[int]:
    """Indices of the leaves under a node whose rule joins its children padded.

    Example:
        >>> ragged_leaves(flatten([1, 2])[0])
        set()
    """
    found: set[int] = set()
    _walk_flag(spec, 0, False, found, "ragged")
    return found


def _walk_flag(node: Spec, start: int, inside: bool, found: set[int], flag: str) -> int:
    # Module level, not nested: a recursive closure is a reference cycle per call.
    if node in LEAVES:
        if inside:
            found.add(start)
        return start + 1
    kind, _, meta, children = node
    inside = inside or (kind == NODE and getattr(meta[0], flag))
    for child in children:
        start = _walk_flag(child, start, inside, found, flag)
    return start


def describe(spec: Spec) -> str:
    """What a spec is, in words, for messages.

    Example:
        >>> describe(flatten([1, 2, 3])[0]), describe(LEAF)
        ('list of length 3', 'a tensor')
    """
    if spec in LEAVES:
        return {LEAF: "a tensor", NONE: "None"}.get(spec, "a non-tensor value")
    kind, cls, meta, children = spec
    name = {TUPLE: "tuple", LIST: "list"}.get(kind) if cls is None else cls.__name__
    if kind == DICT:
        return f"{name} with keys {list(meta)}"
    if kind == DATACLASS:
        return f"{name} with fields {list(meta[0])}"
    if kind == NODE:
        return f"{name} of {len(children)} parts"
    return f"{name} of length {len(children)}"


def describe_mismatch(a: Spec, b: Spec, root: str = "output") -> str:
    """Where two specs first differ, as 'path: X in one, Y in the other'.

    Example:
        >>> describe_mismatch(flatten({"a": [1]})[0], flatten({"a": [1, 2]})[0])
        "output['a']: list of length 1 vs list of length 2"
    """
    if a in LEAVES or b in LEAVES or a[:3] != b[:3] or len(a.children) != len(b.children):
        return f"{root}: {describe(a)} vs {describe(b)}"
    for label, ca, cb in zip(children_labels(a), a.children, b.children):
        if ca != cb:
            return describe_mismatch(ca, cb, root + label)
    return f"{root}: structures differ"
