"""Caches passed into a parallel call are updated in place, as on one device.

On one device transformers updates the cache object it is given (``past_key_values``,
``cache`` in transformers 5) and returns that object; code that keeps its own cache
object across steps relies on it. Each replica updates its own copy, so after the
gather the joined cache's state is copied into the object passed in, which the output
then holds. Each cache type has an in-place rule (:data:`_IN_PLACE`, beside its split
and join rule in :mod:`dpmethods.types.rules`); where none applies, or the call returned
no joined cache (``generate`` without ``return_dict_in_generate``, replicas stopped at
different steps), a one-time warning names the pattern that works.

Example:
    >>> isinstance(in_place_types(), list)
    True
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

from torch import Tensor

from dpmethods.warn_once import warn_once

__all__ = ["in_place_types"]


def _class_in(module: str, name: str) -> type | None:
    cls = getattr(sys.modules.get(module), name, None)
    return cls if isinstance(cls, type) else None


# --- caches passed in: updated in place ------------------------------------------

# Per cache type (and its subclasses): update(target, joined) copies the joined cache's
# state into the object the user passed in.
_IN_PLACE: dict[type, Callable[[Any, Any], None]] = {}


def in_place_types() -> list[str]:
    """The cache types updated in place when passed into a parallel call.

    Example:
        >>> isinstance(in_place_types(), list)
        True
    """
    _install_in_place()
    return [cls.__name__ for cls in _IN_PLACE]


def _update_layer(target: Any, joined: Any) -> None:
    static = bool(getattr(target, "is_compileable", False))
    for name, value in vars(joined).items():
        old = vars(target).get(name)
        if (
            static
            and isinstance(old, Tensor)
            and isinstance(value, Tensor)
            and old is not value
            and (old.shape, old.dtype, old.device) == (value.shape, value.dtype, value.device)
        ):
            # A static layer's tensors keep their storage, as index_copy_ keeps it on one
            # device (compiled graphs and CUDA graphs hold their addresses).
            old.copy_(value)
        else:
            setattr(target, name, value)


def _update_layers(target: Any, joined: Any) -> None:
    mine, theirs = list(target.layers), list(joined.layers)
    if len(mine) == len(theirs) and all(type(a) is type(b) for a, b in zip(mine, theirs)):
        for a, b in zip(mine, theirs):
            _update_layer(a, b)
    else:  # an empty cache passed in: its layers are made by the first call
        target.layers = theirs
    for name, value in vars(joined).items():
        if name != "layers":
            setattr(target, name, value)


def _update_encoder_decoder(target: Any, joined: Any) -> None:
    for name in ("self_attention_cache", "cross_attention_cache"):
        inner, new = getattr(target, name), getattr(joined, name)
        if not _update(inner, new):
            setattr(target, name, new)
    for name, value in vars(joined).items():
        if name not in ("self_attention_cache", "cross_attention_cache"):
            setattr(target, name, copy.copy(value))


def _install_in_place() -> None:
    module = sys.modules.get("transformers.cache_utils")
    if module is None or _IN_PLACE:
        return
    for name, update in (
        ("DynamicCache", _update_layers), ("StaticCache", _update_layers),
        ("EncoderDecoderCache", _update_encoder_decoder),
    ):
        cls = getattr(module, name, None)
        if isinstance(cls, type):
            _IN_PLACE[cls] = update


def _update(target: Any, joined: Any) -> bool:
    """Copy ``joined`` into ``target`` in place; False if their type has no such rule."""
    if type(joined) is not type(target):
        return False
    _install_in_place()
    update = next((_IN_PLACE[k] for k in type(target).__mro__ if k in _IN_PLACE), None)
    if update is None:
        return False
    update(target, joined)
    return True


def _top_level(out: Any) -> list[tuple[Any, Any]]:
    if isinstance(out, Mapping):
        return list(out.items())
    if type(out) is tuple:
        return list(enumerate(out))
    return []


def _put(out: Any, key: Any, value: Any) -> Any:
    if isinstance(out, MutableMapping):
        out[key] = value  # a ModelOutput sets the field too
        return out
    items = list(out)
    items[key] = value
    return tuple(items)


def cache_around(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
    """``_around``: a cache object passed in is updated in place with the joined cache.

    On one device transformers updates the cache it is given and returns that object;
    code that keeps its cache object across steps relies on it. The replicas update
    copies, so the joined cache is copied into the object passed in, which the output
    then holds.
    """
    base = _class_in("transformers.cache_utils", "Cache")
    if base is None:
        return args, kwargs, None
    given = [v for v in (*args, *kwargs.values()) if isinstance(v, base)]
    if len(given) != 1:
        return args, kwargs, None
    cache = given[0]

    def finish(out: Any) -> Any:
        found = [(k, v) for k, v in _top_level(out) if isinstance(v, base)]
        if len(found) == 1 and _update(cache, found[0][1]):
            return _put(out, found[0][0], cache)
        if len(found) == 1 and found[0][1] is cache:
            return out
        warn_once(
            f"DataParallel: the {type(cache).__name__} passed in is not updated in place by a "
            "parallel call (on one device transformers updates it): each replica updates its "
            "own copy, and this cache type has no in-place rule or the call returned no "
            "joined cache. Use the cache the call returns for the next step: "
            "out.past_key_values (out.cache in transformers 5), with use_cache=True (and "
            "return_dict_in_generate=True for generate)."
        )
        return out

    return args, kwargs, finish
