"""peft: ``generate`` of a ``PeftModel`` (LoRA and other adapters) runs data-parallel.

A ``PeftModel`` wraps a transformers model and is no ``GenerationMixin`` itself; its
``generate`` passes through to the base model's, so it gathers as transformers'
``generate`` does (the gather mode ``"generate"``), with each replica's
``prefix_allowed_tokens_fn`` told where its rows start. ``adapter_names`` holds one
adapter per row (peft's mixed-batch inference): each replica gets its rows' names.

Example:
    >>> "adapter_names" in METHODS
    True
"""

from __future__ import annotations

import inspect
import sys

from dpmethods.extending import MethodOptions, register_method_finder
from dpmethods.integrations.transformers import PREFIX_OFFSET  # registers "generate" too

__all__ = ["APPLIES_TO", "METHODS"]

APPLIES_TO = "PeftModel (LoRA and other adapters)"
METHODS = "generate (gather='generate', adapter_names split per row)"

_GENERATE = MethodOptions(gather="generate", split=("adapter_names",), hooks=PREFIX_OFFSET)


def _methods(cls: type) -> dict[str, MethodOptions]:
    peft_model = getattr(sys.modules.get("peft.peft_model"), "PeftModel", None)
    if not (isinstance(peft_model, type) and issubclass(cls, peft_model)):
        return {}
    if not inspect.isfunction(inspect.getattr_static(cls, "generate", None)):
        return {}
    return {"generate": _GENERATE}


register_method_finder(_methods)
