"""transformers' caches: split and joined per layer, and updated in place when passed in.

``DynamicCache`` and ``StaticCache`` come apart into their layers' per-item tensors
(keys and values ``[batch, heads, seq, head_dim]``, linear-attention states); an
``EncoderDecoderCache`` into its self- and cross-attention caches. The rules are
registered by name, so nothing of transformers is imported here.

On one device transformers updates the cache object it is given (``past_key_values``,
``cache`` in transformers 5) and returns that object; code that keeps its own cache
object across steps relies on it. Each replica updates its own copy, so after the
gather the joined cache's state is copied into the object passed in, which the output
then holds (:data:`CACHE_IN_PLACE`). Where that cannot be (no joined cache in the
output), a one-time warning names the pattern that works.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

from torch import Tensor

from dpmethods.extending import (
    Call,
    CallHooks,
    ItemState,
    register_item_state,
    register_type,
    warn_once,
)

__all__ = ["CACHE_IN_PLACE"]

_CACHE_MODULE = "transformers.cache_utils"


class _Template:
    """A context that compares by a key and carries an object to rebuild from.

    Replicas' contexts are compared with ``==``; the key says what must agree (layer
    classes and the names of their batch tensors), while the object differs per replica.
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


# A layer's batch tensor: an attribute's name, or (name, key) of an entry of a dict
# attribute (transformers 5's linear-attention layers keep their conv and recurrent
# states in dicts by state index).
_Name = str | tuple[str, Any]


def _batch_tensors(layer: Any) -> list[_Name]:
    # Per-layer state with a batch dim: keys and values [batch, heads, seq, head_dim],
    # linear-attention states [batch, ...]. 0-dim counters and unset (None) or empty
    # 1-dim placeholders stay in the template.
    names: list[_Name] = sorted(name for name, v in vars(layer).items() if _is_batch(v))
    for name, value in sorted(vars(layer).items()):
        if isinstance(value, dict):
            names += [(name, k) for k, v in value.items() if _is_batch(v)]
    return names


def _is_batch(value: Any) -> bool:
    return isinstance(value, Tensor) and value.dim() >= 2


def _get(layer: Any, name: _Name) -> Any:
    return getattr(layer, name) if isinstance(name, str) else getattr(layer, name[0])[name[1]]


def _flatten_cache(cache: Any) -> tuple[list[Any], Any]:
    layers = list(cache.layers)
    names = [_batch_tensors(layer) for layer in layers]
    children = [_get(layer, n) for layer, ns in zip(layers, names) for n in ns]
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
            elif isinstance(value, dict):  # its entries are set per cache (states, flags)
                setattr(layer, attr, dict(value))
        for name in names:
            if isinstance(name, str):
                setattr(layer, name, next(it))
            else:
                getattr(layer, name[0])[name[1]] = next(it)
        if names:
            first = _get(layer, names[0])
            if hasattr(layer, "device"):
                layer.device = first.device
            if hasattr(layer, "batch_size"):  # StaticLayer keeps the batch size it was built for
                layer.batch_size = first.shape[0]
        layers.append(layer)
    cache.layers = layers
    return cache


def _flatten_encoder_decoder(cache: Any) -> tuple[list[Any], Any]:
    return [cache.self_attention_cache, cache.cross_attention_cache], _Template((), cache)


def _unflatten_encoder_decoder(children: list[Any], context: _Template) -> Any:
    cache = copy.copy(context.obj)
    cache.self_attention_cache, cache.cross_attention_cache = children
    if hasattr(cache, "is_updated"):
        cache.is_updated = dict(cache.is_updated)
    return cache


for _name in ("DynamicCache", "StaticCache"):  # missing_ok: classes by transformers' version
    register_type(
        f"{_CACHE_MODULE}:{_name}", _flatten_cache, _unflatten_cache, per_item=True, missing_ok=True
    )
register_type(
    f"{_CACHE_MODULE}:EncoderDecoderCache", _flatten_encoder_decoder, _unflatten_encoder_decoder,
    per_item=True, missing_ok=True,
)

# Item maps: a cache is each item's own, a batch of its rows. Layers that hold every
# position in order have the item's positions cut out (and their counts of positions
# lessened by the batch's left padding before the item's own); a sliding window keeps
# the last of the item's own positions that its window holds alone; a linear-attention
# state has no positions (it counts the item's).


def _names(layer: Any) -> set[str]:
    return {c.__name__ for c in type(layer).__mro__}


def _holds_every_position(layer: Any) -> bool:
    """A dynamic or static attention layer (or a subclass: a hybrid linear-attention and
    attention layer, FalconH1's) that is not a sliding window."""
    names = _names(layer)
    return ("DynamicLayer" in names or "StaticLayer" in names) and not getattr(layer, "is_sliding", False)


def _window(t: Tensor, seen: int, own_end: int, keep: int, size: int | None = None) -> Tensor:
    """The ``keep`` positions before ``own_end`` of a layer that holds the last
    ``t.shape[2]`` of the ``seen`` positions, at the front of ``size`` positions (zeros
    after them); fewer where the layer no longer holds them."""
    first = seen - t.shape[2]  # the first position held
    start = max(own_end - keep, first)
    part = t[:, :, start - first: own_end - first]
    if size is None:
        return part
    out = t.new_zeros((*t.shape[:2], size, t.shape[3]))
    out[:, :, : part.shape[2]] = part
    return out


def _narrow_dynamic_window(layer: Any, start: int, drop: int) -> bool:
    """A dynamic sliding layer holds the last min(seen, window - 1) positions; alone the
    item has seen its own. False where the batch went on past the item's end and the
    window no longer holds all the positions the item's own holds."""
    seen = int(layer.cumulative_length)
    own = seen - start - drop
    keep = min(int(layer.keys.shape[2]), own)
    layer.keys, layer.values = (_window(t, seen, seen - drop, keep) for t in (layer.keys, layer.values))
    layer.cumulative_length = own
    return int(layer.keys.shape[2]) == keep


def _narrow_static_window(layer: Any, start: int, drop: int, longest: int | None) -> bool:
    """A static sliding layer: ``[batch, heads, size, dim]``, size min(window, the cache's
    length), positions in order from 0 until they fill it, then the last ones. The item's
    size is min(window, ``longest - start``), ``longest`` the batch cache's length, or the
    batch's size where that length is unknown (the window was smaller and no full layer
    says it; a static cache's size is not the item's own anyway: ``generate`` reuses a
    large enough one). False as for a dynamic one."""
    size, seen = int(layer.max_cache_len), int(layer.cumulative_length_int)
    held = min(seen, size)
    croppable = bool(layer.is_croppable)
    if croppable:  # the cache's length was within the window: it is the size
        longest = size
    own = seen - start - drop
    mine = size if longest is None else min(size, longest - start)
    keep = min(own, mine)
    keys, values = (_window(t[:, :, :held] if seen < size else t, seen, seen - drop, keep, mine)
                    for t in (layer.keys, layer.values))
    layer.keys, layer.values = keys, values
    layer.max_cache_len = mine
    layer._is_croppable = croppable or (longest is not None and longest - start <= size)
    layer.cumulative_length_int = own
    # The tensor count is read only while the layer is not full: then it is the int's.
    layer.cumulative_length = layer.cumulative_length.new_tensor(min(own, mine))
    return seen - drop - keep >= seen - held


def _narrow_static(layer: Any, start: int, drop: int) -> None:
    # Its keys were cut to the item's positions (_holds_every_position: from start; a cross-attention
    # layer's to the item's encoder positions), which it counts; those after the item's
    # end are not written alone (zeros).
    size = int(layer.keys.shape[2])
    own = min(int(layer.cumulative_length) - start - drop, size)
    if drop:
        layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
        layer.keys[:, :, own:] = 0
        layer.values[:, :, own:] = 0
    layer.max_cache_len = size
    layer.cumulative_length = layer.cumulative_length.new_tensor(own)


def _narrow_cache(cache: Any, start: int, drop: int) -> Any:
    """The cache of an item whose prompt had ``start`` positions of the batch's left
    padding before it, and whose batch went on ``drop`` steps after its end, as its
    ``generate`` alone leaves it."""
    layers = list(getattr(cache, "layers", ()))
    full = [layer for layer in layers if "StaticLayer" in _names(layer) and not getattr(layer, "is_sliding", False)]
    longest = int(full[0].max_cache_len) if full else None  # the batch cache's length
    whole = True
    for layer in layers:
        names = _names(layer)
        linear = getattr(layer, "cumulative_length_linear", None)
        if isinstance(linear, Tensor) and int(linear) > 0:  # a linear-attention state: it counts its positions
            layer.cumulative_length_linear = linear.new_tensor(int(linear) - start - drop)
            # The batch's steps after the item's end updated its state, which cannot be undone.
            whole &= not drop
        if not getattr(layer, "is_initialized", False) or not isinstance(getattr(layer, "keys", None), Tensor):
            continue
        if "DynamicSlidingWindowLayer" in names:
            whole &= _narrow_dynamic_window(layer, start, drop)
        elif "StaticSlidingWindowLayer" in names:
            whole &= _narrow_static_window(layer, start, drop, longest)
        elif "StaticLayer" in names:  # its keys were cut from start (_holds_every_position)
            _narrow_static(layer, start, drop)
        elif "DynamicLayer" in names and drop and layer.keys.dim() == 4:
            layer.keys, layer.values = layer.keys[:, :, : layer.keys.shape[2] - drop], layer.values[:, :, : layer.values.shape[2] - drop]
    if not whole:
        warn_once(
            "map: generate: an item whose rows ended at eos before its batch's last step has "
            "cache layers that are not its own cache alone: the batch's later steps moved a "
            "sliding window past the item's end, which dropped some of its last positions (the "
            "layer holds fewer), or updated a linear-attention state (its count of positions is "
            "the item's). Batch items that end alike, or generate the item alone, where its "
            "cache must be its own",
            stacklevel=2,
        )
    return cache


def _item_state(cls: Any, context: Any) -> ItemState | None:
    if not (isinstance(cls, type) and cls.__module__.startswith(_CACHE_MODULE)):
        return None
    if cls.__name__ == "EncoderDecoderCache":  # (self-attention cache, cross-attention cache)
        return ItemState(encoder=1)
    key, cache = getattr(context, "key", None), getattr(context, "obj", None)
    if not isinstance(key, tuple) or cache is None:
        return ItemState(narrow=_narrow_cache)
    positional = [_holds_every_position(layer) and name in ("keys", "values")
                  for layer, (_, names) in zip(cache.layers, key) for name in names]
    return ItemState(positional=positional, narrow=_narrow_cache)


register_item_state(_item_state)


# --- caches passed in: updated in place ------------------------------------------


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


# Per cache class name (and its subclasses): update(target, joined) copies the joined
# cache's state into the object the user passed in.
_IN_PLACE: dict[str, Callable[[Any, Any], None]] = {
    "DynamicCache": _update_layers,
    "StaticCache": _update_layers,
    "EncoderDecoderCache": _update_encoder_decoder,
}


def _class(name: str) -> type | None:
    cls = getattr(sys.modules.get(_CACHE_MODULE), name, None)
    return cls if isinstance(cls, type) else None


def _update(target: Any, joined: Any) -> bool:
    """Copy ``joined`` into ``target`` in place; False if their type has no such rule."""
    if type(joined) is not type(target):
        return False
    for name, update in _IN_PLACE.items():
        cls = _class(name)
        if cls is not None and isinstance(target, cls):
            update(target, joined)
            return True
    return False


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


def _finish(cache: Any, base: type) -> Callable[[Any], Any]:
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
            "return_dict_in_generate=True for generate).",
            stacklevel=5,
        )
        return out

    return finish


def _prepare(args: tuple[Any, ...], kwargs: dict[str, Any], call: Call) -> Any:
    base = _class("Cache")
    if base is None:
        return args, kwargs, None
    given = [v for v in (*args, *kwargs.values()) if isinstance(v, base)]
    if len(given) != 1:
        return args, kwargs, None
    return args, kwargs, _finish(given[0], base)


CACHE_IN_PLACE = CallHooks(prepare=_prepare)
"""The hooks that update a cache passed into ``forward`` or ``generate`` in place with
the joined cache, as one device updates it."""
