"""transformers: its models' methods run data-parallel with no configuration.

When a class is looked up (transformers imported by then; nothing here imports it):

- ``generate`` of every ``GenerationMixin`` model gathers with ``"generate"``
  (:mod:`.generate`: sequences filled as one device fills them), each replica's
  ``prefix_allowed_tokens_fn`` gets its items' indices in the whole batch
  (:data:`~.fill.PREFIX_OFFSET`), and a cache passed in is updated in place
  (:mod:`.caches`);
- ``forward`` of every ``PreTrainedModel`` joins its ``loss`` as the full-batch loss
  (:mod:`.losses`), updates a cache passed in in place, and joins the rest with
  ``"cat"``; a contrastive model's ``logits_per_*`` and their loss are computed from the
  joined embeddings, as one device computes them (:mod:`.contrastive`);
- wav2vec 2.0's pretraining gives each replica its rows' ``sampled_negative_indices``,
  re-based to its share (:mod:`.negatives`);
- the Qwen2-VL family (patches of all images beside ``image_grid_thw``) gives each
  replica its rows' images, in ``forward`` and ``generate`` (:mod:`.vision`);
- every ``get_*_features`` method of a ``PreTrainedModel``;
- Encodec's ``encode`` joins ``audio_codes`` on dim 1, and ``decode`` splits them there;
  XLNet's ``forward`` joins and splits its ``mems`` on dim 1.

Example:
    >>> import torch, dpmethods
    >>> dpmethods.parallel_methods(torch.nn.Linear)
    {}
"""

from __future__ import annotations

import inspect
import re
import sys
import weakref

from dpmethods.extending import MethodOptions, register_method_finder, register_process_rule
from dpmethods.integrations.transformers.arguments import register_forward_delegate
from dpmethods.integrations.transformers.caches import CACHE_IN_PLACE
from dpmethods.integrations.transformers.contrastive import returns_pairs
from dpmethods.integrations.transformers.fill import PREFIX_OFFSET, OffsetPrefixFn
from dpmethods.integrations.transformers.generate import gather_generate
from dpmethods.integrations.transformers.losses import BY_FIELD, FORWARD_MODE, LOSS_COUNT, PAIRS
from dpmethods.integrations.transformers.negatives import NEGATIVE_SHARES, takes_negatives
from dpmethods.integrations.transformers.vision import (
    VISION_ARGUMENTS,
    VISION_SHARES,
    takes_vision_grids,
)

__all__ = [
    "APPLIES_TO", "FORWARD", "METHODS", "PAIRS", "PREFIX_OFFSET", "OffsetPrefixFn", "gather_generate",
    "register_forward_delegate",
]

APPLIES_TO = "GenerationMixin models; PreTrainedModel; EncodecModel"
METHODS = (
    "generate (gather='generate'); forward (loss joined as the full-batch loss; "
    "contrastive logits_per_* and loss from the joined embeddings); "
    "get_*_features; Encodec encode/decode (codes' batch in dim 1); XLNet forward's mems (batch in dim 1)"
)

_FEATURES = re.compile(r"get_\w+_features\Z")
_GENERATE = MethodOptions(gather="generate", hooks=CACHE_IN_PLACE.then(PREFIX_OFFSET))
FORWARD = MethodOptions(gather=FORWARD_MODE, hooks=CACHE_IN_PLACE.then(LOSS_COUNT))
"""A ``PreTrainedModel.forward``'s options: its loss joined as the full-batch loss, a cache
passed in updated in place (a wrapper that hands ``forward`` on, peft's, takes them too)."""
_PAIRS_FORWARD = FORWARD.with_updates(hooks=CACHE_IN_PLACE.then(LOSS_COUNT).then(PAIRS))
# Encodec's codes are [chunks, batch, quantizers, frames]: encode returns them with the
# batch in dim 1, and decode takes them so (its audio_scales and audio have it in dim 0).
_ENCODEC = {
    "encode": MethodOptions(gather_dim={"audio_codes": 1}),
    "decode": MethodOptions(scatter_dim={"audio_codes": 1}),
}
# Classes whose forward takes and returns states with the batch in dim 1: XLNet's mems,
# one [memory length, batch, d_model] tensor per layer, split and joined there.
_BATCH_DIM_1 = {
    ("transformers.models.xlnet.modeling_xlnet", "XLNetPreTrainedModel"): ("mems",),
}
# Weak by class, so a class defined in a function can be freed.
_FOUND: weakref.WeakKeyDictionary[type, dict[str, MethodOptions]] = weakref.WeakKeyDictionary()


def _class_in(module: str, name: str) -> type | None:
    cls = getattr(sys.modules.get(module), name, None)
    return cls if isinstance(cls, type) else None


def _defines(cls: type, name: str) -> bool:
    return inspect.isfunction(inspect.getattr_static(cls, name, None))


def _with_vision(opts: MethodOptions) -> MethodOptions:
    # All images' patches reach every replica, which keeps its rows' images.
    hooks = VISION_SHARES if opts.hooks is None else opts.hooks.then(VISION_SHARES)
    return opts.with_updates(broadcast=opts.broadcast + VISION_ARGUMENTS, hooks=hooks)


def _batch_dim_1(opts: MethodOptions, fields: tuple[str, ...]) -> MethodOptions:
    # The fields are named: a tuple output (return_dict=False) is made after the gather.
    hooks = BY_FIELD if opts.hooks is None else opts.hooks.then(BY_FIELD)
    dims = dict.fromkeys(fields, 1)
    return opts.with_updates(gather_dim=dims, scatter_dim=dims, hooks=hooks)


def _find(cls: type) -> dict[str, MethodOptions]:
    found: dict[str, MethodOptions] = {}
    mixin = _class_in("transformers.generation.utils", "GenerationMixin")
    if mixin is not None and issubclass(cls, mixin) and _defines(cls, "generate"):
        found["generate"] = _GENERATE
    pretrained = _class_in("transformers.modeling_utils", "PreTrainedModel")
    if pretrained is not None and issubclass(cls, pretrained):
        if _defines(cls, "forward"):
            found["forward"] = _PAIRS_FORWARD if returns_pairs(cls) else FORWARD
        for (module, name), fields in _BATCH_DIM_1.items():
            owner = _class_in(module, name)
            if owner is not None and issubclass(cls, owner) and "forward" in found:
                found["forward"] = _batch_dim_1(found["forward"], fields)
        if takes_negatives(cls) and "forward" in found:
            forward = found["forward"]
            hooks = NEGATIVE_SHARES if forward.hooks is None else forward.hooks.then(NEGATIVE_SHARES)
            found["forward"] = forward.with_updates(hooks=hooks)
        if takes_vision_grids(cls):
            found.update({n: _with_vision(o) for n, o in found.items() if n in ("forward", "generate")})
        for name in sorted({n for k in cls.__mro__ for n in vars(k) if _FEATURES.match(n)}):
            if _defines(cls, name):
                found[name] = MethodOptions()
    encodec = _class_in("transformers.models.encodec.modeling_encodec", "EncodecModel")
    if encodec is not None and issubclass(cls, encodec):
        found.update(_ENCODEC)
    return found


def _methods(cls: type) -> dict[str, MethodOptions]:
    """The method finder: the parallel methods transformers' class ``cls`` gets."""
    if "transformers" not in sys.modules:
        return {}
    found = _FOUND.get(cls)
    if found is None:
        found = _FOUND[cls] = _find(cls)
    return dict(found)


register_method_finder(_methods)


def _input_grads_hook(hook: object) -> bool:
    """The forward hook that makes the input embeddings' output require grad, which
    ``gradient_checkpointing_enable()`` (transformers 5 registers it on every text model)
    and peft's k-bit and checkpointing preparation register: a local function, which
    cannot be pickled, for training. A worker process runs inference: it goes without it,
    and without the model's handles to it."""
    return (getattr(hook, "__name__", None) in ("make_inputs_require_grads", "make_inputs_require_grad")
            and str(getattr(hook, "__module__", "")).split(".")[0] in ("transformers", "peft"))


register_process_rule(_input_grads_hook, attributes=("_require_grads_hooks", "_require_grads_hook"))
