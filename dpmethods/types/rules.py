"""Rules for splitting and joining types that are not plain containers.

:func:`register_type` tells dpmethods how to take a class apart into children (tensors
or nested structures, split and joined like any other) and how to build it back. The
rules live in dpmethods only: torch's global pytree registry is not touched, because a
second registration of a class there raises, so a library should not register other
libraries' classes in it.

A class may be named as ``"module:Class"`` before its module is imported: its rule is
registered once the module is (checked when an unseen class is first walked). That is
how the integrations (:mod:`dpmethods.integrations`) give rules to a library's types
without importing the library. Rules for torch's own types (``PackedSequence``,
``torch.distributions``) are in :mod:`dpmethods.types.torch_rules`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from dpmethods.types import torch_rules
from dpmethods.types import tree as _tree
from dpmethods.types.named_classes import check_class_path, when_class_imported
from dpmethods.vocab.call_hooks import check_arity
from dpmethods.vocab.loading import when_imported

__all__ = ["register_type"]

Flatten = Callable[[Any], tuple[list[Any], Any]]
Unflatten = Callable[[list[Any], Any], Any]


def register_type(
    cls: type | str,
    flatten: Flatten,
    unflatten: Unflatten,
    *,
    per_item: bool = False,
    ragged: bool = False,
    exact: bool = False,
    missing_ok: bool = False,
) -> None:
    """Teach dpmethods to split and join objects of ``cls`` (and its subclasses).

    ``flatten(obj)`` returns ``(children, context)``: the children are split, moved and
    joined like any other part of an input or output (tensors are cut along the batch
    dim); ``unflatten(children, context)`` builds the object back. Replicas must agree on
    ``context`` (compared with ``==``). The signatures are those of
    ``torch.utils._pytree.register_pytree_node``; torch's global registry is not touched.
    Registering a class again replaces its rule.

    Args:
        cls: the class, or ``"module:Class"`` for a class whose module may not be
            imported yet (registered once it is).
        flatten: ``obj -> (children, context)``.
        unflatten: ``(children, context) -> obj``.
        per_item: the tensor children hold one row per batch item along the batch dim
            (a cache's keys and values), so gather never warns that they couple items
            of the batch, even when another of their dims equals a replica's share.
        ragged: the replicas' tensor children may differ in their other dims (sequences
            padded to each replica's longest): they are joined padded with zeros, which
            the rule's own lengths must mask.
        exact: the rule is for ``cls`` only, not its subclasses (whose constructors may
            take other arguments).
        missing_ok: with ``"module:Class"``, a class that its module (imported already)
            lacks is skipped instead of refused: for a class only some versions of a
            library have.

    Example:
        >>> import torch, dpmethods
        >>> from dpmethods.parallel import gather, scatter
        >>> class Box:
        ...     def __init__(self, t, tag):
        ...         self.t, self.tag = t, tag
        >>> dpmethods.register_type(Box, lambda b: ([b.t], b.tag), lambda c, tag: Box(c[0], tag))
        >>> parts = scatter(Box(torch.arange(4), "x"), ["cpu", "cpu"])
        >>> [p.t.tolist() for p in parts], parts[1].tag
        ([[0, 1], [2, 3]], 'x')
        >>> gather(parts, "cpu").t.tolist()
        [0, 1, 2, 3]
    """
    if not isinstance(cls, (type, str)):  # first: an instance is the likeliest slip
        raise TypeError(f"register_type: cls: expected a class, got {type(cls).__name__} {cls!r}"[:300])
    label = cls if isinstance(cls, str) else cls.__qualname__
    for name, fn, params in (
        ("flatten", flatten, "(obj)"),
        ("unflatten", unflatten, "(children, context)"),
    ):
        if not callable(fn):
            raise TypeError(
                f"register_type: {name}: expected a callable, got {type(fn).__name__} {fn!r}"
            )
        check_arity(f"register_type: {name} (of {label})", fn, name + params)
    flags = (("per_item", per_item), ("ragged", ragged), ("exact", exact), ("missing_ok", missing_ok))
    for name, flag in flags:
        if not isinstance(flag, bool):
            raise TypeError(
                f"register_type: {name}: expected True or False, got {type(flag).__name__} {flag!r}"
            )
    rule = _tree.TypeRule(flatten, unflatten, per_item, ragged, exact)
    if isinstance(cls, str):
        check_class_path("register_type", cls, missing_ok)
        when_class_imported(cls, functools.partial(_set_found, rule=rule))
        return
    _tree.set_rule(cls, rule)


def _set_found(cls: Any, rule: _tree.TypeRule) -> None:
    if isinstance(cls, type):  # None: a class its module lacks (missing_ok)
        _tree.set_rule(cls, rule)


torch_rules.install_packed_sequence()
torch_rules.mark_dynamic_quantization()
when_imported("torch.distributions", torch_rules.install_distributions)
