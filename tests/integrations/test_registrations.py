"""Built-in registrations: popular libraries' methods run data-parallel with no configuration.

Real models from tiny configs (random weights, nothing downloaded), CPU replicas,
compared with the bare model on the full batch: 7 items on 3 replicas and 8 on 4.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from dpmethods import DataParallel, parallel_methods
from dpmethods.integrations import INTEGRATIONS
from dpmethods.testing import assert_close_to_reference
from tests.helpers.models import (
    batch_sizes_seen,
    random_sentences,
    shares,
    tiny_sentence_transformer,
)
from tests.helpers.terms import transformer_terms

SPLITS = [pytest.param(7, 3, id="7-on-3"), pytest.param(8, 4, id="8-on-4")]


def _close(got: Any, want: Any, terms: int) -> None:
    # terms: the sums on the path to one output (see assert_close_to_reference).
    assert_close_to_reference(got, want, terms=terms)


# --- sentence-transformers -------------------------------------------------------

@pytest.fixture(scope="module")
def sentence_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tiny_sentence_transformer(tmp_path_factory.mktemp("tiny-bert"))


@pytest.mark.parametrize("n,devices", SPLITS)
def test_sentence_transformers_encode_without_configuration(
    sentence_model: Any, n: int, devices: int
) -> None:
    np = pytest.importorskip("numpy")
    first = list(inspect.signature(type(sentence_model).encode).parameters)[1]
    assert parallel_methods(type(sentence_model))["encode"].split == (first,)
    sentences = random_sentences(n)
    seen = batch_sizes_seen(sentence_model[0])
    want = sentence_model.encode(sentences)
    seen.clear()
    got = DataParallel(sentence_model, device_ids=["cpu"] * devices).encode(sentences)
    assert sorted(seen) == shares(n, devices)
    assert isinstance(got, np.ndarray) and got.shape == want.shape
    _close(got, want, transformer_terms(width=32, ff=37, seq=7, layers=2) + 7)  # tiny BERT, mean pooling


# --- diffusers, timm, open_clip ---------------------------------------------------


@pytest.mark.parametrize("n,devices", SPLITS)
def test_diffusers_autoencoder_encode_decode_without_configuration(n: int, devices: int) -> None:
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16), latent_channels=4, norm_num_groups=4,
        layers_per_block=1, sample_size=16,
    ).eval()
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
        _close(got.mode(), want.mode(), terms)
        z = want.mode()
        _close(dp.decode(z).sample, vae.decode(z).sample, terms)


@pytest.mark.parametrize("n,devices", SPLITS)
def test_timm_forward_features_and_head_without_configuration(n: int, devices: int) -> None:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
        num_classes=5,
    ).eval()
    assert set(parallel_methods(type(model))) >= {"forward_features", "forward_head"}
    x = torch.randn(n, 3, 32, 32)
    seen = batch_sizes_seen(model.patch_embed)
    dp = DataParallel(model, device_ids=["cpu"] * devices)
    with torch.no_grad():
        want = model.forward_features(x)
        seen.clear()
        got = dp.forward_features(x)
        assert sorted(seen) == shares(n, devices)
        # The 3x8x8 patch embedding, 2 blocks of width 192 over 17 tokens; the head: 192.
        _close(got, want, 192 + transformer_terms(width=192, ff=768, seq=17, layers=2))
        _close(dp.forward_head(want), model.forward_head(want), 192 + 1)


@pytest.mark.parametrize("n,devices", SPLITS)
def test_open_clip_encode_image_and_text_without_configuration(n: int, devices: int) -> None:
    open_clip = pytest.importorskip("open_clip")
    torch.manual_seed(0)
    model = open_clip.CLIP(
        embed_dim=16,
        vision_cfg=open_clip.CLIPVisionCfg(layers=1, width=32, head_width=16, patch_size=8, image_size=16),
        text_cfg=open_clip.CLIPTextCfg(context_length=12, vocab_size=99, width=32, heads=2, layers=1),
    ).eval()
    images, texts = torch.randn(n, 3, 16, 16), torch.randint(1, 99, (n, 12))
    dp = DataParallel(model, device_ids=["cpu"] * devices)
    with torch.no_grad():
        # The 3x8x8 patch embedding (vision), one block over up to 12 tokens, the projection.
        terms = 192 + transformer_terms(width=32, ff=128, seq=12, layers=1) + 32
        _close(dp.encode_image(images), model.encode_image(images), terms)
        _close(dp.encode_text(texts), model.encode_text(texts), terms)


# --- the CLI ---------------------------------------------------------------------


def test_info_lists_the_registrations() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "dpmethods", "info"], capture_output=True, text=True, check=True,
        timeout=120, cwd=Path(__file__).resolve().parents[2],  # this checkout's dpmethods
    ).stdout
    for library in INTEGRATIONS:
        assert library in out
    assert "generate (gather='generate')" in out
