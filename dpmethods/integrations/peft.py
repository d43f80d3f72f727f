"""peft: a ``PeftModel``'s (LoRA and other adapters) ``forward`` and ``generate`` run
data-parallel as its base transformers model's do.

A ``PeftModel`` wraps a transformers model and is no ``PreTrainedModel`` or
``GenerationMixin`` itself; its ``forward`` and ``generate`` pass through to the base
model's. ``generate`` gathers as transformers' does (the gather mode ``"generate"``), with
each replica's ``prefix_allowed_tokens_fn`` told where its rows start. ``forward`` takes
transformers' ``forward`` options: its ``loss`` is joined as the full-batch loss, by the
plan of the base model that computes it (a delegate tells the transformers integration
which model that is, and with what arguments), a contrastive base's (CLIP's)
``logits_per_*`` and loss are computed from the joined embeddings, the rest is joined
with ``"cat"``. Prompt learning
(prompt and prefix tuning) prepends virtual tokens, and -100 labels, before the base
model sees the call: its loss is not read from the labels given, and stays one per
replica, with a warning. ``adapter_names`` holds one adapter per row (peft's
mixed-batch inference): each replica gets its rows' names.

Example:
    >>> "adapter_names" in METHODS
    True
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping
from typing import Any

from dpmethods.extending import MethodOptions, register_method_finder
from dpmethods.integrations.transformers import (  # registers "generate" and the forward's mode too
    FORWARD,
    PAIRS,
    PREFIX_OFFSET,
    register_forward_delegate,
)

__all__ = ["APPLIES_TO", "METHODS"]

APPLIES_TO = "PeftModel (LoRA and other adapters)"
METHODS = (
    "generate (gather='generate'), forward (loss joined by the base model's plan); "
    "adapter_names split per row"
)

_PER_ROW = ("adapter_names",)
_GENERATE = MethodOptions(gather="generate", split=_PER_ROW, hooks=PREFIX_OFFSET)
# PAIRS acts where the base model returns logits_per_* (CLIP): return_dict=False made after.
_FORWARD = FORWARD.with_updates(split=_PER_ROW, hooks=FORWARD.hooks.then(PAIRS) if FORWARD.hooks else PAIRS)


def _peft_model() -> type | None:
    cls = getattr(sys.modules.get("peft.peft_model"), "PeftModel", None)
    return cls if isinstance(cls, type) else None


def _methods(cls: type) -> dict[str, MethodOptions]:
    peft_model = _peft_model()
    if peft_model is None or not issubclass(cls, peft_model):
        return {}
    candidates = {"generate": _GENERATE, "forward": _FORWARD}
    return {name: opts for name, opts in candidates.items()
            if inspect.isfunction(inspect.getattr_static(cls, name, None))}


def _base_call(
    model: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> tuple[Any, tuple[Any, ...], dict[str, Any]] | None:
    """The base model a ``PeftModel``'s ``forward`` hands this call to, with its
    arguments; None where peft changes them first (prompt learning) or it is no peft model."""
    peft_model = _peft_model()
    if peft_model is None or not isinstance(model, peft_model):
        return None
    module: Any = model  # (isinstance against a class found at runtime narrows to object)
    signature = inspect.signature(type(module).forward)
    passes_through = any(p.kind is p.VAR_POSITIONAL for p in signature.parameters.values())  # PeftModel's
    if not passes_through:
        try:
            prompt_learning = bool(module.active_peft_config.is_prompt_learning)
        except (AttributeError, KeyError):
            return None
        if prompt_learning:
            return None  # virtual tokens and their -100 labels are added: other labels
    # peft's own arguments (adapter_names, task_ids) never reach the base model.
    dropped = {*getattr(module, "special_peft_forward_args", ()), "task_ids"}
    if passes_through:
        return module.get_base_model(), args, {k: v for k, v in kwargs.items() if k not in dropped}
    # Its parameters are named by the PeftModelFor* class, in its own order: by name.
    try:
        given = signature.bind_partial(module, *args, **kwargs).arguments
    except TypeError:
        return None  # the call itself fails, as it does on one device
    given.pop(next(iter(signature.parameters)))  # self
    named = {**given, **(given.pop("kwargs", None) or {})}
    return module.get_base_model(), (), {k: v for k, v in named.items() if k not in dropped}


register_method_finder(_methods)
register_forward_delegate(_base_call)
