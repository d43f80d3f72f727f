"""open_clip: ``encode_image``/``encode_text``, and ``forward``'s one ``logit_scale``.

``encode_image`` and ``encode_text`` of every open_clip model are parallel methods.
``forward`` returns features beside one ``logit_scale`` (and ``logit_bias``).
The scale and bias are parameters, the same on every replica: they are gathered with
``"same"`` (one 0-dim value), not stacked into one value per replica. open_clip's
contrastive losses (``ClipLoss``, ``SigLipLoss`` and their subclasses) couple the
items of their batch: run on a replica's share they are warned about.
"""

from __future__ import annotations

import inspect
import sys

from dpmethods.extending import MethodOptions, mark_batch_coupled, register_method_finder

__all__: list[str] = []

APPLIES_TO = "open_clip models (CLIP, CustomTextCLIP, CoCa); ClipLoss, SigLipLoss"
METHODS = "encode_image, encode_text; forward (logit_scale and logit_bias gathered 'same')"

# Tuple outputs are (image_features, text_features, logit_scale[, logit_bias]); dict
# outputs (output_dict=True) name them. One mapping serves both.
_FORWARD = MethodOptions(
    gather={2: "same", 3: "same", "logit_scale": "same", "logit_bias": "same"}
)


_MODELS = (("open_clip.model", "CLIP"), ("open_clip.model", "CustomTextCLIP"), ("open_clip.coca_model", "CoCa"))


def _open_clip_methods(cls: type) -> dict[str, MethodOptions]:
    found: dict[str, MethodOptions] = {}
    if any(k.__module__.split(".")[0] == "open_clip" for k in cls.__mro__):
        for name in ("encode_image", "encode_text"):
            if inspect.isfunction(inspect.getattr_static(cls, name, None)):
                found[name] = MethodOptions()
    for module, name in _MODELS:
        model = getattr(sys.modules.get(module), name, None)
        if isinstance(model, type) and issubclass(cls, model):
            found["forward"] = _FORWARD
    return found


register_method_finder(_open_clip_methods)

for _name in ("ClipLoss", "SigLipLoss", "DistillClipLoss"):
    mark_batch_coupled(
        f"open_clip.loss:{_name}", what="a similarity matrix over the batch", missing_ok=True
    )
