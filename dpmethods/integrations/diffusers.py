"""diffusers: the autoencoders' ``encode`` and ``decode``, and the latent distribution.

``encode`` and ``decode`` of the deterministic autoencoders (the ``AutoencoderKL`` family,
image and video, ``AutoencoderTiny``, ``AutoencoderDC``, ``VQModel``) are parallel
methods. Decoders that draw noise (``ConsistencyDecoderVAE``) are left out: their
replicas would share one generator. ``encode`` returns
``AutoencoderKLOutput(latent_dist=DiagonalGaussianDistribution(parameters))``; the
distribution is joined from its ``parameters`` (mean and log-variance stacked on dim 1),
so ``.sample(generator)``, ``.mode()`` and ``.kl()`` of the joined one equal one device's.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from dpmethods.extending import MethodOptions, register_method_finder, register_type

__all__: list[str] = []

APPLIES_TO = "AutoencoderKL and its image and video variants, AutoencoderTiny, AutoencoderDC, VQModel"
METHODS = "encode, decode (latent_dist joined)"

_VAE = re.compile(r"AutoencoderKL\w*|AsymmetricAutoencoderKL|AutoencoderTiny|AutoencoderDC|VQModel\Z")
_GAUSSIAN = "diffusers.models.autoencoders.vae:DiagonalGaussianDistribution"


def _autoencoder_methods(cls: type) -> dict[str, MethodOptions]:
    if not any(
        k.__module__.startswith("diffusers.models.autoencoders") and _VAE.match(k.__name__)
        for k in cls.__mro__
    ):
        return {}
    return {
        name: MethodOptions()
        for name in ("encode", "decode")
        if inspect.isfunction(inspect.getattr_static(cls, name, None))
    }


def _flatten_gaussian(dist: Any) -> tuple[list[Any], Any]:
    return [dist.parameters], (type(dist), bool(dist.deterministic))


def _unflatten_gaussian(children: list[Any], context: Any) -> Any:
    cls, deterministic = context
    return cls(children[0], deterministic=deterministic)


register_method_finder(_autoencoder_methods)
register_type(_GAUSSIAN, _flatten_gaussian, _unflatten_gaussian, per_item=True)
