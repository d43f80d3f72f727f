"""Built-in parallel methods of popular libraries, so their models need no configuration.

When a module's methods are resolved, each rule below whose library is already
imported (``sys.modules`` is checked; dpmethods imports none of them) adds the
methods it knows for the module's class:

- transformers: ``generate`` of every ``GenerationMixin`` model, with the gather mode
  ``"generate"`` (and ``prefix_allowed_tokens_fn`` given each item's index in the whole
  batch); ``forward`` of every ``PreTrainedModel``, its ``loss`` joined as transformers
  joins it (``num_items_in_batch``, the model's reduction; see
  :mod:`dpmethods.integrations.known_transformers`); a cache passed into either is updated in place
  (:mod:`dpmethods.integrations.known_caches`); the Qwen2-VL family's patches split by image; Encodec
  ``encode``/``decode`` with its codes' batch in dim 1; every ``get_*_features`` method
  of a ``PreTrainedModel`` (``get_text_features``, ``get_image_features``, ...);
- sentence-transformers: ``SentenceTransformer.encode`` (and ``encode_query``,
  ``encode_document``), with ``split`` on the sentences (numpy results are joined too),
  one string taken as one input, and ``int8``/``uint8`` precision calibrated on the
  whole batch, as on one device;
- peft: ``generate`` of a ``PeftModel`` (LoRA and other adapters), as transformers',
  with ``adapter_names`` (one per row) split with the rows;
- diffusers: ``encode`` and ``decode`` of ``AutoencoderKL`` and its image and video
  variants, ``AutoencoderTiny``, ``AutoencoderDC`` and ``VQModel``;
- timm: ``forward_features`` and ``forward_head`` of timm models;
- open_clip: ``encode_image`` and ``encode_text``.

They have the lowest precedence: a method decorated with ``@parallel_method`` or
registered with :func:`dpmethods.register` on the class (or a closer base) wins, and
``methods={"generate": {...}}`` overrides their options. ``python -m dpmethods info``
lists them.
"""

from __future__ import annotations

import inspect
import re
import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from dpmethods.integrations import known_caches as _caches
from dpmethods.integrations import known_transformers as _hf
from dpmethods.registry import MethodOptions, register_method_finder

__all__ = ["KnownMethods", "builtin_methods", "known_methods"]

_FEATURES = re.compile(r"get_\w+_features\Z")


@dataclass(frozen=True)
class KnownMethods:
    """One built-in rule: the methods a library's classes get without configuration.

    Args:
        library: the import name checked in ``sys.modules``.
        applies_to: the classes the rule covers, in words.
        methods: the method names (patterns in words), with their options in words.
        find: ``find(cls)`` returns ``{name: MethodOptions}`` for a class.

    Example:
        >>> sorted(r.library for r in known_methods())[:2]
        ['diffusers', 'open_clip']
    """

    library: str
    applies_to: str
    methods: str
    find: Callable[[type], dict[str, MethodOptions]]

    def active(self) -> bool:
        """Whether the library is imported, so the rule applies.

        Example:
            >>> KnownMethods("no_such_lib", "", "", lambda cls: {}).active()
            False
        """
        return self.library in sys.modules


def _class_in(module: str, name: str) -> type | None:
    cls = getattr(sys.modules.get(module), name, None)
    return cls if isinstance(cls, type) else None


def _defines(cls: type, name: str) -> bool:
    return inspect.isfunction(inspect.getattr_static(cls, name, None))


def _transformers(cls: type) -> dict[str, MethodOptions]:
    found: dict[str, MethodOptions] = {}
    mixin = _class_in("transformers.generation.utils", "GenerationMixin")
    if mixin is not None and issubclass(cls, mixin) and _defines(cls, "generate"):
        found["generate"] = MethodOptions(
            gather="generate", _around=_caches.cache_around, _per_replica=_offset_prefix_fn
        )
    pretrained = _class_in("transformers.modeling_utils", "PreTrainedModel")
    if pretrained is not None and issubclass(cls, pretrained):
        if _defines(cls, "forward"):
            # Losses joined as transformers joins them, caches passed in updated in place.
            found["forward"] = MethodOptions(
                gather=_hf.forward_gather, _around=_caches.cache_around,
                _per_replica=_hf.loss_per_replica,
            )
        if _hf.takes_vision_grids(cls):
            # Qwen2-VL family: all images' patches in one tensor, cut per replica's rows.
            for name, opts in list(found.items()):
                if name in ("forward", "generate"):
                    steps = (opts._per_replica, _hf.vision_per_replica)
                    found[name] = replace(
                        opts, broadcast=opts.broadcast + _hf.VISION_ARGUMENTS,
                        _per_replica=_hf.chain_per_replica(*(s for s in steps if s is not None)),
                    )
        for name in sorted({n for k in cls.__mro__ for n in vars(k) if _FEATURES.match(n)}):
            if _defines(cls, name):
                found[name] = MethodOptions()
    found.update(_encodec(cls))
    return found


def _encodec(cls: type) -> dict[str, MethodOptions]:
    # Encodec's codes are [chunks, batch, quantizers, frames]: encode returns them with
    # the batch in dim 1, and decode takes them so (its audio_scales and the audio it
    # returns have the batch in dim 0).
    encodec = _class_in("transformers.models.encodec.modeling_encodec", "EncodecModel")
    if encodec is None or not issubclass(cls, encodec):
        return {}
    return {
        "encode": MethodOptions(gather_dim={"audio_codes": 1}),
        "decode": MethodOptions(scatter_dim={"audio_codes": 1}),
    }


class _OffsetPrefixFn:
    """``prefix_allowed_tokens_fn`` for a replica whose first item is item ``start``.

    transformers calls it with the item's index in the batch that ``generate`` got,
    the replica's chunk: without the offset, items of every replica but the first
    would get the constraints of other items.
    """

    def __init__(self, fn: Callable[[int, Any], Any], start: int) -> None:
        self.fn, self.start = fn, start

    def __call__(self, batch_id: int, input_ids: Any) -> Any:
        return self.fn(batch_id + self.start, input_ids)


def _offset_prefix_fn(args: tuple[Any, ...], kwargs: dict[str, Any], start: int) -> tuple[Any, Any]:
    fn = kwargs.get("prefix_allowed_tokens_fn")
    if fn is None or start == 0:
        return args, kwargs
    return args, {**kwargs, "prefix_allowed_tokens_fn": _OffsetPrefixFn(fn, start)}


def _sentence_transformers(cls: type) -> dict[str, MethodOptions]:
    st = getattr(sys.modules.get("sentence_transformers"), "SentenceTransformer", None)
    if not (isinstance(st, type) and issubclass(cls, st)):
        return {}
    found = {}
    for name in ("encode", "encode_query", "encode_document"):
        if not _defines(cls, name):
            continue
        # The sentences are the first argument: `sentences` in 2.x-5.x, `inputs` in 6.x.
        first = next(iter(list(inspect.signature(getattr(cls, name)).parameters)[1:]), None)
        if first is not None:
            # Results are per item: a list (token embeddings, tensors) is extended, never zipped.
            found[name] = MethodOptions(split=(first,), gather="extend", _around=_st_around(first))
    return found


_CALIBRATED = ("int8", "uint8")  # precisions whose ranges come from the whole batch


def _st_around(first: str) -> Any:
    """sentence-transformers' ``encode`` conventions that a plain split would break.

    - One string is one input, and the result is one embedding, not a batch of one.
    - ``precision="int8"``/``"uint8"`` calibrates the quantization ranges on all the
      embeddings of the call: each replica would calibrate on its share. The replicas
      compute float32 embeddings; they are quantized once, on the gathered batch, then
      converted as ``encode`` converts them.
    """

    def around(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
        one = False
        if args and isinstance(args[0], str):
            args, one = ([args[0]], *args[1:]), True
        elif isinstance(kwargs.get(first), str):
            kwargs, one = {**kwargs, first: [kwargs[first]]}, True
        precision = kwargs.get("precision")
        if precision not in _CALIBRATED:
            return args, kwargs, (lambda out: out[0]) if one else None
        convert_tensor = bool(kwargs.get("convert_to_tensor", False))
        convert_numpy = bool(kwargs.get("convert_to_numpy", True))
        kwargs = {**kwargs, "precision": "float32"}

        def finish(out: Any) -> Any:
            import torch

            quantize = sys.modules["sentence_transformers"].quantize_embeddings
            if len(out):
                out = quantize(out, precision=precision)
            if convert_tensor:
                out = torch.as_tensor(out)
            elif not convert_numpy and not isinstance(out, list):
                out = list(torch.from_numpy(out))
            return out[0] if one else out

        return args, kwargs, finish

    return around


# diffusers' deterministic autoencoders: the AutoencoderKL family (image and video), the
# tiny, VQ and deep-compression ones. Decoders that draw noise (ConsistencyDecoderVAE)
# are left out: their replicas would share one generator.
_DIFFUSERS_VAE = re.compile(r"AutoencoderKL\w*|AsymmetricAutoencoderKL|AutoencoderTiny|AutoencoderDC|VQModel\Z")


def _diffusers(cls: type) -> dict[str, MethodOptions]:
    if not any(
        k.__module__.startswith("diffusers.models.autoencoders") and _DIFFUSERS_VAE.match(k.__name__)
        for k in cls.__mro__
    ):
        return {}
    return {name: MethodOptions() for name in ("encode", "decode") if _defines(cls, name)}


def _peft(cls: type) -> dict[str, MethodOptions]:
    # A PeftModel wraps a transformers model and is not a GenerationMixin itself; its
    # generate passes through to the base model's, so it gathers the same way.
    peft_model = _class_in("peft.peft_model", "PeftModel")
    if peft_model is None or not issubclass(cls, peft_model) or not _defines(cls, "generate"):
        return {}
    # adapter_names holds one adapter per row (peft's mixed-batch inference): each replica
    # gets its rows' names.
    return {
        "generate": MethodOptions(
            gather="generate", split=("adapter_names",), _per_replica=_offset_prefix_fn
        )
    }


def _by_module(prefix: str, names: tuple[str, ...]) -> Callable[[type], dict[str, MethodOptions]]:
    def find(cls: type) -> dict[str, MethodOptions]:
        # timm and open_clip models share no base class: their classes are theirs by module.
        owners = (k for k in cls.__mro__ if k.__module__.split(".")[0] == prefix)
        if next(owners, None) is None:
            return {}
        return {name: MethodOptions() for name in names if _defines(cls, name)}

    return find


_RULES = (
    KnownMethods(
        "transformers", "GenerationMixin models; PreTrainedModel; EncodecModel",
        "generate (gather='generate'); forward (loss joined by num_items_in_batch); "
        "get_*_features; Encodec encode/decode (codes' batch in dim 1)", _transformers,
    ),
    KnownMethods(
        "peft", "PeftModel (LoRA and other adapters)",
        "generate (gather='generate', adapter_names split per row)", _peft,
    ),
)

# Weak by class, so a wrapped class can be freed (a module class defined in a function).
_CACHE: weakref.WeakKeyDictionary[type, dict[tuple[str, ...], dict[str, MethodOptions]]] = (
    weakref.WeakKeyDictionary()
)


def known_methods() -> tuple[KnownMethods, ...]:
    """Every built-in rule, active or not.

    Example:
        >>> [r.library for r in known_methods()][0]
        'transformers'
    """
    return _RULES


def _active() -> Iterator[KnownMethods]:
    return (rule for rule in _RULES if rule.library in sys.modules)


def builtin_methods(cls: type) -> dict[str, MethodOptions]:
    """The built-in parallel methods of ``cls`` from the libraries imported now.

    Args:
        cls: a module class.

    Example:
        >>> import torch
        >>> builtin_methods(torch.nn.Linear)
        {}
    """
    active = tuple(rule.library for rule in _active())
    if not active:
        return {}
    per_class = _CACHE.setdefault(cls, {})
    found = per_class.get(active)  # a library imported later makes a new key
    if found is None:
        found = {}
        for rule in _active():
            found.update(rule.find(cls))
        per_class[active] = found
    return found


def registrations() -> list[dict[str, Any]]:
    """The rules as ``python -m dpmethods info`` reports them, installed or not.

    Example:
        >>> registrations()[0]["library"]
        'transformers'
    """
    import importlib.util

    rows = []
    for rule in _RULES:
        try:
            installed = importlib.util.find_spec(rule.library) is not None
        except (ImportError, ValueError):
            installed = False
        rows.append({
            "library": rule.library, "installed": installed, "imported": rule.active(),
            "applies_to": rule.applies_to, "methods": rule.methods,
        })
    return rows


register_method_finder(builtin_methods)
