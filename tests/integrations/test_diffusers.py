"""diffusers' autoencoders (AutoencoderKL, AutoencoderTiny, VQModel) through DataParallel,
against the bare model on the full batch: encode, decode and the latent distribution."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from dpmethods import DataParallel, parallel_methods
from dpmethods.testing import assert_close_to_reference
from tests.helpers import SPLITS, WORKERS
from tests.helpers.models import batch_sizes_seen, shares, tiny_vae

# The diffusers autoencoders: about 15 3x3 convs of up to 16 channels (144 terms each)
# and 6 GroupNorms over 2 channels x 16 x 16 (512 terms each).
AUTOENCODER_TERMS = 15 * 144 + 6 * 512


@pytest.mark.parametrize("n,devices", SPLITS)
def test_diffusers_autoencoder_encode_decode_without_configuration(n: int, devices: int) -> None:
    torch.manual_seed(0)
    vae = tiny_vae()
    x = torch.randn(n, 3, 16, 16)
    seen = batch_sizes_seen(vae.encoder)
    dp = DataParallel(vae, device_ids=["cpu"] * devices)
    with torch.no_grad():
        want = vae.encode(x).latent_dist
        seen.clear()
        got = dp.encode(x).latent_dist
        assert sorted(seen) == shares(n, devices)
        # About 15 3x3 convs of up to 16 channels, 6 GroupNorms over 2 x 16 x 16 values.
        terms = 15 * 144 + 6 * 512
        assert_close_to_reference(got.mode(), want.mode(), terms=terms)
        z = want.mode()
        assert_close_to_reference(dp.decode(z).sample, vae.decode(z).sample, terms=terms)


@pytest.mark.parametrize("batch,devices", SPLITS)
def test_diffusers_autoencoder_latent_dist(batch: int, devices: int) -> None:
    vae = tiny_vae()
    x = torch.randn(batch, 3, 16, 16)
    dp = DataParallel(vae, device_ids=["cpu"] * devices, methods=["encode"])
    with torch.no_grad():
        ref = vae.encode(x).latent_dist
        got = dp.encode(x).latent_dist
    assert type(got) is type(ref)
    terms = AUTOENCODER_TERMS
    assert_close_to_reference(got.sample(torch.Generator().manual_seed(3)), ref.sample(torch.Generator().manual_seed(3)), terms=terms)
    assert_close_to_reference(got.mode(), ref.mode(), terms=terms)
    assert_close_to_reference(got.kl(), ref.kl(), terms=terms + 4 * 4 * 4)  # a sum over the 4 x 4 x 4 latents
    assert_close_to_reference(got.std, ref.std, terms=terms)


@pytest.mark.parametrize("batch,devices", SPLITS)
def test_diffusers_tiny_and_vq_autoencoders_with_no_configuration(batch: int, devices: int) -> None:
    diffusers = pytest.importorskip("diffusers")

    tiny = diffusers.AutoencoderTiny(
        encoder_block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8), latent_channels=4,
    ).eval()
    vq = diffusers.VQModel(
        block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4,
        num_vq_embeddings=16, vq_embed_dim=4,
    ).eval()
    x = torch.randn(batch, 3, 32, 32)
    for vae in (tiny, vq):
        dp = DataParallel(vae, device_ids=["cpu"] * devices)  # built-in encode and decode
        with torch.no_grad():
            latents = vae.encode(x).latents
            assert_close_to_reference(dp.encode(x).latents, latents, terms=AUTOENCODER_TERMS)
            assert_close_to_reference(dp.decode(latents).sample, vae.decode(latents).sample, terms=AUTOENCODER_TERMS)
        assert set(parallel_methods(vae)) >= {"encode", "decode"}


@pytest.mark.parametrize("workers", WORKERS)
def test_diffusers_calls_and_maps_on_threads_and_processes(workers: str) -> None:
    torch.manual_seed(0)
    vae = tiny_vae()
    x = torch.randn(7, 3, 16, 16)
    dp = DataParallel(vae, device_ids=["cpu"] * 2, workers=workers)
    try:
        with torch.no_grad():
            want = vae.encode(x).latent_dist
            got = dp.encode(x).latent_dist  # 4 + 3 rows, one distribution again
            assert type(got) is type(want)
            assert_close_to_reference(got.mode(), want.mode(), terms=AUTOENCODER_TERMS)
            assert_close_to_reference(got.std, want.std, terms=AUTOENCODER_TERMS)
            z = want.mode()
            decoded = [out.sample for out in dp.map("decode", [z[:4], z[4:]])]
            assert_close_to_reference(torch.cat(decoded), vae.decode(z).sample, terms=AUTOENCODER_TERMS)
    finally:
        dp.close()


@pytest.mark.parametrize("workers", WORKERS)
def test_vq_decode_commit_loss_is_the_batch_mean_or_per_row_as_one_device(workers: str) -> None:
    # The quantizer's commit loss is one mean over the batch: on 3 + 2 rows, the replicas'
    # values weighted by their shares; with force_not_quantize=True, one value per row.
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    vq = diffusers.VQModel(
        block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4,
        num_vq_embeddings=16, vq_embed_dim=4,
    ).eval()
    z = torch.randn(5, 4, 16, 16)
    dp = DataParallel(vq, device_ids=["cpu"] * 2, workers=workers)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning: nothing is left per replica
            for kwargs in ({}, {"return_dict": False}, {"force_not_quantize": True}):
                want, got = _fields(vq.decode(z, **kwargs)), _fields(dp.decode(z, **kwargs))
                assert got["commit_loss"].shape == want["commit_loss"].shape
                assert_close_to_reference(got["commit_loss"], want["commit_loss"], terms=4 * 16 * 16 * 5)
                assert_close_to_reference(got["sample"], want["sample"], terms=AUTOENCODER_TERMS)
    finally:
        dp.close()


def _fields(out: Any) -> Any:
    """A decoder output, or its ``return_dict=False`` tuple, by field name."""
    return dict(zip(("sample", "commit_loss"), out)) if isinstance(out, tuple) else out


@pytest.mark.parametrize("workers", WORKERS)
def test_an_items_latent_dist_in_item_mode_is_its_encode_alone(workers: str) -> None:
    # The distribution cuts its parameters on dim 1 (mean and log-variance channels): an
    # item's rows without the batch dim would be cut across their height instead.
    torch.manual_seed(0)
    vae = tiny_vae()
    images = list(torch.randn(5, 3, 16, 16))
    dp = DataParallel(vae, device_ids=["cpu"] * 2, workers=workers)
    try:
        with torch.no_grad():
            got = [out.latent_dist for out in dp.map("encode", images, batch_size=3, length=_one, collate=torch.stack)]
            for dist, image in zip(got, images, strict=True):
                want = vae.encode(image[None]).latent_dist
                assert type(dist) is type(want)
                assert_close_to_reference(dist.mode(), want.mode(), terms=AUTOENCODER_TERMS)
                assert_close_to_reference(dist.std, want.std, terms=AUTOENCODER_TERMS)
                assert_close_to_reference(dist.kl(), want.kl(), terms=AUTOENCODER_TERMS + 4 * 8 * 8)
    finally:
        dp.close()


def _one(image: torch.Tensor) -> int:
    return 1


def _unet(flip_sin_to_cos: bool) -> Any:
    """A tiny UNet2DModel whose weights do not depend on ``flip_sin_to_cos``, which changes
    its timestep embedding (its output) and no parameter's shape."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    return diffusers.UNet2DModel(
        sample_size=8, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=4, flip_sin_to_cos=flip_sin_to_cos,
    ).eval()


@pytest.mark.parametrize("workers", WORKERS)
def test_a_map_resumed_with_another_config_is_refused_and_with_the_same_resumes(tmp_path: Any, workers: str) -> None:
    """A diffusers model's ``config`` (a FrozenDict it keeps privately) is part of the map a
    checkpoint records: resumed on a model with the same weights and another config, the
    map would mix the outputs of both."""
    g = torch.Generator().manual_seed(2)
    batches = [{"sample": torch.randn(2, 3, 8, 8, generator=g), "timestep": torch.tensor([3, 700])} for _ in range(4)]
    ckpt = tmp_path / "map.json"

    def start(flip: bool) -> tuple[Any, Any, Any]:
        model = _unet(flip)
        dp = DataParallel(model, device_ids=["cpu"] * 2, workers=workers)
        with torch.no_grad():
            return model, dp, dp.map("forward", batches, checkpoint=ckpt)

    model, dp, it = start(True)
    with torch.no_grad():
        next(it), next(it)
    it.close()
    dp.close()
    record = ckpt.read_text()
    other = _unet(False)
    with torch.no_grad():
        assert not torch.equal(other(**batches[0]).sample, model(**batches[0]).sample)
    with pytest.raises(ValueError, match=r"records another map: its model's settings differ: config \(another value\)"):
        start(False)
    assert ckpt.read_text() == record
    model, dp, it = start(True)
    with torch.no_grad():
        rest = list(it)
        alone = [model(**b).sample for b in batches[1:]]
    dp.close()
    assert len(rest) == 3  # the first output was taken; the second was asked for, not taken
    # About 12 3x3 convs of up to 32 input channels (288 terms each: the up blocks take the
    # skips too) and 8 GroupNorms over 4 channels x 8 x 8, summed in another order in a
    # worker process with other intra-op threads.
    assert_close_to_reference([o.sample for o in rest], alone, terms=12 * 288 + 8 * 256)
