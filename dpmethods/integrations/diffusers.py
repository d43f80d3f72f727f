"""diffusers: the autoencoders' ``encode`` and ``decode``, and the latent distribution.

``encode`` and ``decode`` of the deterministic autoencoders (the ``AutoencoderKL`` family,
image and video, ``AutoencoderTiny``, ``AutoencoderDC``, ``VQModel``) are parallel
methods. Decoders that draw noise (``ConsistencyDecoderVAE``) are left out: their
replicas would share one generator. ``encode`` returns
``AutoencoderKLOutput(latent_dist=DiagonalGaussianDistribution(parameters))``; the
distribution is joined from its ``parameters`` (mean and log-variance stacked on dim 1),
so ``.sample(generator)``, ``.mode()`` and ``.kl()`` of the joined one equal one device's.
In item mode (``map`` with ``batch_size=``) each item's distribution keeps the batch dim,
as its ``encode`` alone gives it: the class cuts its parameters on dim 1, which a row
without the batch dim would cut across its height instead of its channels.
``VQModel.decode``'s ``commit_loss`` is the quantizer's mean over the batch: one value,
joined as the replicas' mean weighted by their shares; with ``force_not_quantize=True``
it is one value per row, joined by rows.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import torch

from dpmethods.extending import (
    Call,
    ItemState,
    MethodOptions,
    gather,
    register_gather_mode,
    register_item_state,
    register_method_finder,
    register_type,
)

__all__: list[str] = []

APPLIES_TO = "AutoencoderKL and its image and video variants, AutoencoderTiny, AutoencoderDC, VQModel"
METHODS = "encode, decode (latent_dist joined; VQModel's commit_loss a mean over the batch)"

_VAE = re.compile(r"AutoencoderKL\w*|AsymmetricAutoencoderKL|AutoencoderTiny|AutoencoderDC|VQModel\Z")
_GAUSSIAN = "diffusers.models.autoencoders.vae:DiagonalGaussianDistribution"


def _autoencoder_methods(cls: type) -> dict[str, MethodOptions]:
    if not any(
        k.__module__.startswith("diffusers.models.autoencoders") and _VAE.match(k.__name__)
        for k in cls.__mro__
    ):
        return {}
    vq = any(k.__name__ == "VQModel" for k in cls.__mro__)
    return {
        name: MethodOptions(gather=_VQ_DECODE) if vq and name == "decode" else MethodOptions()
        for name in ("encode", "decode")
        if inspect.isfunction(inspect.getattr_static(cls, name, None))
    }


_VQ_DECODE = "diffusers_vq_decode"


def _join_vq_decode(outputs: list[Any], device: Any, call: Call | None) -> Any:
    """``VQModel.decode``'s outputs: ``sample`` by rows; ``commit_loss`` (a field, or
    position 1 with ``return_dict=False``) the share-weighted mean where it is one value
    (the quantizer's mean over the batch), by rows where it is one per row."""
    first = outputs[0]
    loss = first[1] if isinstance(first, tuple) and len(first) > 1 else getattr(first, "commit_loss", None)
    one_value = isinstance(loss, torch.Tensor) and loss.dim() == 0
    mode: Any = {"commit_loss": "mean", 1: "mean"} if one_value else "cat"
    return gather(outputs, device, mode=mode, sizes=call.sizes if call is not None else None)


def _flatten_gaussian(dist: Any) -> tuple[list[Any], Any]:
    return [dist.parameters], (type(dist), bool(dist.deterministic))


def _unflatten_gaussian(children: list[Any], context: Any) -> Any:
    cls, deterministic = context
    return cls(children[0], deterministic=deterministic)


def _gaussian_item(cls: type, context: Any) -> ItemState | None:
    # Batch state: an item's distribution is rebuilt from its rows with the batch dim kept.
    if any(f"{k.__module__}:{k.__qualname__}" == _GAUSSIAN for k in getattr(cls, "__mro__", ())):
        return ItemState()
    return None


register_method_finder(_autoencoder_methods)
register_gather_mode(_VQ_DECODE, _join_vq_decode)
register_type(_GAUSSIAN, _flatten_gaussian, _unflatten_gaussian, per_item=True)
register_item_state(_gaussian_item)
