"""Rules for splitting and joining types that are not plain containers.

:func:`register_type` tells dpmethods how to take a class apart into children (tensors
or nested structures, split and joined like any other) and how to build it back. The
rules live in dpmethods only: torch's global pytree registry is not touched, because a
second registration of a class there raises, so a library should not register other
libraries' classes in it.

Rules for common library types are shipped here and installed only when their library
has already been imported by the user (``sys.modules`` is checked), so dpmethods has
no dependency on them:

- diffusers ``DiagonalGaussianDistribution``: joined from its ``parameters`` (mean and
  log-variance stacked on dim 1), so ``.sample(generator)``, ``.mode()`` and ``.kl()``
  of the joined distribution equal one device's.
- transformers ``DynamicCache``, ``StaticCache`` and ``EncoderDecoderCache`` (and their
  subclasses): one cache holding the whole batch, usable for the next step; split per
  replica when passed back in.

Both are ``per_item`` rules: their tensors hold one row per batch item, so a dim that
happens to equal a replica's share (as many attention heads as rows) is not reported as
batch-coupled.

Rules for torch's own types (``PackedSequence``, ``torch.distributions``) are in
:mod:`dpmethods.types.torch_rules`.
"""

from __future__ import annotations

import builtins
import copy
import inspect
import sys
from collections.abc import Callable
from typing import Any

from torch import Tensor

from dpmethods.types import torch_rules
from dpmethods.types import tree as _tree

__all__ = ["register_type"]


def register_type(
    cls: type,
    flatten: Callable[[Any], tuple[list[Any], Any]],
    unflatten: Callable[[list[Any], Any], Any],
    *,
    per_item: bool = False,
) -> None:
    """Teach dpmethods to split and join objects of ``cls`` (and its subclasses).

    ``flatten(obj)`` returns ``(children, context)``: the children are split, moved and
    joined like any other part of an input or output (tensors are cut along the batch
    dim); ``unflatten(children, context)`` builds the object back. Replicas must agree on
    ``context`` (compared with ``==``). The signatures are those of
    ``torch.utils._pytree.register_pytree_node``; torch's global registry is not touched.
    Registering a class again replaces its rule.

    Args:
        cls: the class.
        flatten: ``obj -> (children, context)``.
        unflatten: ``(children, context) -> obj``.
        per_item: the tensor children hold one row per batch item along the batch dim
            (a cache's keys and values), so gather never warns that they couple items
            of the batch, even when another of their dims equals a replica's share.

    Example:
        >>> import torch, dpmethods
        >>> class Box:
        ...     def __init__(self, t, tag):
        ...         self.t, self.tag = t, tag
        >>> dpmethods.register_type(Box, lambda b: ([b.t], b.tag), lambda c, tag: Box(c[0], tag))
        >>> parts = dpmethods.scatter(Box(torch.arange(4), "x"), ["cpu", "cpu"])
        >>> [p.t.tolist() for p in parts], parts[1].tag
        ([[0, 1], [2, 3]], 'x')
        >>> dpmethods.gather(parts, "cpu").t.tolist()
        [0, 1, 2, 3]
    """
    if not isinstance(cls, type):
        raise TypeError(f"register_type: cls: expected a class, got {type(cls).__name__} {cls!r}")
    for name, fn, params in (
        ("flatten", flatten, "(obj)"),
        ("unflatten", unflatten, "(children, context)"),
    ):
        if not callable(fn):
            raise TypeError(
                f"register_type: {name}: expected a callable, got {type(fn).__name__} {fn!r}"
            )
        _check_arity(cls, name, fn, params)
    if not isinstance(per_item, bool):
        raise TypeError(
            f"register_type: per_item: expected True or False, got {type(per_item).__name__} {per_item!r}"
        )
    _tree.set_rule(cls, _tree.TypeRule(flatten, unflatten, per_item))


def _check_arity(cls: type, name: str, fn: Callable[..., Any], params: str) -> None:
    # Checked here, once: called with the wrong number of arguments deep inside a
    # gather, the rule would raise a bare "<lambda>() takes 1 positional argument".
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: trust them
        return
    try:
        signature.bind(*([None] * params.count(",")), None)
    except TypeError:
        label = getattr(fn, "__name__", type(fn).__name__)
        raise TypeError(
            f"register_type: {name} (of {cls.__qualname__}): expected a function called as "
            f"{name}{params}, got {label}{signature}"
        ) from None


class _Template:
    """A context that compares by a key and carries an object to rebuild from.

    Replicas' specs are compared with ``==``; the key says what must agree (layer
    classes and sizes), while the template itself differs per replica.
    """

    __slots__ = ("key", "obj")

    def __init__(self, key: Any, obj: Any) -> None:
        self.key, self.obj = key, obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Template) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"{type(self.obj).__name__}{self.key!r}"


# --- diffusers --------------------------------------------------------------------


def _flatten_gaussian(dist: Any) -> tuple[list[Any], Any]:
    return [dist.parameters], bool(dist.deterministic)


def _gaussian_unflattener(cls: type) -> Callable[[list[Any], Any], Any]:
    def unflatten(children: list[Any], deterministic: Any) -> Any:
        return cls(children[0], deterministic=deterministic)

    return unflatten


def _install_diffusers() -> bool:
    module = sys.modules.get("diffusers.models.autoencoders.vae")
    cls = getattr(module, "DiagonalGaussianDistribution", None)
    if cls is None:
        return False
    _tree.set_rule(cls, _tree.TypeRule(_flatten_gaussian, _gaussian_unflattener(cls), per_item=True))
    return True


# --- transformers caches ----------------------------------------------------------


def _batch_tensors(layer: Any) -> list[str]:
    # Per-layer state with a batch dim: keys and values [batch, heads, seq, head_dim],
    # linear-attention states [batch, ...]. 0-dim counters and unset (None) or empty
    # 1-dim placeholders stay in the template.
    return sorted(
        name for name, v in vars(layer).items() if isinstance(v, Tensor) and v.dim() >= 2
    )


def _flatten_cache(cache: Any) -> tuple[list[Any], Any]:
    layers = list(cache.layers)
    names = [_batch_tensors(layer) for layer in layers]
    children = [getattr(layer, n) for layer, ns in zip(layers, names) for n in ns]
    key = tuple((type(layer).__name__, tuple(ns)) for layer, ns in zip(layers, names))
    return children, _Template(key, cache)


def _unflatten_cache(children: list[Any], context: _Template) -> Any:
    cache = copy.copy(context.obj)
    it = iter(children)
    layers = []
    for layer, (_, names) in zip(context.obj.layers, context.key):
        layer = copy.copy(layer)
        for attr, value in vars(layer).items():
            if isinstance(value, Tensor) and attr not in names:
                # Counters updated in place (a static layer's cumulative_length) must not
                # be shared by the caches of different replicas.
                setattr(layer, attr, value.clone())
        for name in names:
            setattr(layer, name, next(it))
        if names:
            first = getattr(layer, names[0])
            if hasattr(layer, "device"):
                layer.device = first.device
            if hasattr(layer, "batch_size"):  # StaticLayer keeps the batch size it was built for
                layer.batch_size = first.shape[0]
        layers.append(layer)
    cache.layers = layers
    return cache


def _flatten_encoder_decoder(cache: Any) -> tuple[list[Any], Any]:
    return [cache.self_attention_cache, cache.cross_attention_cache], _Template(
        (), cache
    )


def _unflatten_encoder_decoder(children: list[Any], context: _Template) -> Any:
    cache = copy.copy(context.obj)
    cache.self_attention_cache, cache.cross_attention_cache = children
    if hasattr(cache, "is_updated"):
        cache.is_updated = dict(cache.is_updated)
    return cache


def _install_transformers() -> bool:
    module = sys.modules.get("transformers.cache_utils")
    if module is None:
        return False
    rule = _tree.TypeRule(_flatten_cache, _unflatten_cache, per_item=True)
    for name in ("DynamicCache", "StaticCache"):
        cls = getattr(module, name, None)
        if cls is not None:
            _tree.set_rule(cls, rule)
    cls = getattr(module, "EncoderDecoderCache", None)
    if cls is not None:
        _tree.set_rule(cls, _tree.TypeRule(_flatten_encoder_decoder, _unflatten_encoder_decoder, per_item=True))
    return True


torch_rules.install_packed_sequence()

_PENDING: dict[str, Callable[[], bool]] = {
    "diffusers": _install_diffusers,
    "transformers": _install_transformers,
    "torch": torch_rules.install_distributions,
}


def _install_shipped(kind: type) -> None:
    """Install the rules of libraries imported by now (runs once per unseen class)."""
    if not _PENDING:
        return
    # A library's classes (and subclasses of them) can only show up once it is
    # imported, so checking the libraries of a class's bases when it is first seen is enough.
    # Builtin bases are skipped: torch.compile cannot read their __module__ while tracing.
    for root in {k.__module__.partition(".")[0] for k in kind.__mro__ if k not in _BUILTIN_TYPES}:
        install = _PENDING.get(root)
        if install is not None and install():
            del _PENDING[root]


_BUILTIN_TYPES = frozenset(v for v in vars(builtins).values() if isinstance(v, type))
_tree.on_miss.append(_install_shipped)
