"""open_clip models through DataParallel with no configuration, against one device."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from dpmethods import DataParallel
from dpmethods.testing import assert_close_to_reference
from tests.helpers import SPLITS, WORKERS
from tests.helpers.terms import transformer_terms

# The 3x8x8 patch embedding (vision), one block over up to 12 tokens, the projection.
TERMS = 192 + transformer_terms(width=32, ff=128, seq=12, layers=1) + 32


def _clip(**options: Any) -> Any:
    """A random open_clip CLIP (one block per tower, width 32, 16 x 16 images), in eval mode;
    ``options`` go to ``open_clip.CLIP`` (``init_logit_bias``: a SigLIP-style bias)."""
    open_clip = pytest.importorskip("open_clip")
    torch.manual_seed(0)
    return open_clip.CLIP(
        embed_dim=16,
        vision_cfg=open_clip.CLIPVisionCfg(layers=1, width=32, head_width=16, patch_size=8, image_size=16),
        text_cfg=open_clip.CLIPTextCfg(context_length=12, vocab_size=99, width=32, heads=2, layers=1),
        **options,
    ).eval()


@pytest.mark.parametrize("n,devices", SPLITS)
def test_open_clip_encode_image_and_text_without_configuration(n: int, devices: int) -> None:
    model = _clip()
    images, texts = torch.randn(n, 3, 16, 16), torch.randint(1, 99, (n, 12))
    dp = DataParallel(model, device_ids=["cpu"] * devices)
    with torch.no_grad():
        assert_close_to_reference(dp.encode_image(images), model.encode_image(images), terms=TERMS)
        assert_close_to_reference(dp.encode_text(texts), model.encode_text(texts), terms=TERMS)


@pytest.mark.parametrize("workers", WORKERS)
def test_open_clip_calls_and_maps_on_threads_and_processes(workers: str) -> None:
    model = _clip()
    images, texts = torch.randn(7, 3, 16, 16), torch.randint(1, 99, (7, 12))
    dp = DataParallel(model, device_ids=["cpu"] * 2, workers=workers)
    try:
        with torch.no_grad():
            assert_close_to_reference(dp.encode_image(images), model.encode_image(images), terms=TERMS)
            got = list(dp.map("encode_text", [texts[:4], texts[4:]]))
            assert_close_to_reference(torch.cat(got), model.encode_text(texts), terms=TERMS)
    finally:
        dp.close()


@pytest.mark.parametrize("workers", WORKERS)
def test_forward_returning_its_logit_bias_parameter_runs_on_threads_and_processes(workers: str) -> None:
    # forward returns the logit_bias parameter itself, which requires grad even under
    # no_grad; it has no graph, so a worker sends it as a plain tensor, as a replica
    # thread returns it (a worker process refused it as an output that requires grad).
    model = _clip(init_logit_bias=-10.0)
    images, texts = torch.randn(7, 3, 16, 16), torch.randint(1, 99, (7, 12))
    dp = DataParallel(model, device_ids=["cpu"] * 2, workers=workers)
    try:
        with torch.no_grad():
            want = model(images, texts)
            got = dp(images, texts)
            (mapped,) = dp.map("forward", [(images, texts)])
        for out in (got, mapped):
            assert len(out) == 4
            for g, w in zip(out[:2], want[:2]):
                assert_close_to_reference(g, w, terms=TERMS)
            assert torch.equal(out[2], want[2]) and torch.equal(out[3], want[3])
            assert out[3].shape == () and not out[3].requires_grad
    finally:
        dp.close()


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("bias", [None, -10.0], ids=["no-bias", "bias"])
def test_forward_output_dict_with_and_without_a_logit_bias_is_not_warned(bias: float | None, workers: str) -> None:
    # output_dict=True gives "logit_bias" only with a bias; the built-in gather names it for
    # both arities, so its absence is not a typo to warn about.
    model = _clip(init_logit_bias=bias)
    model.output_dict = True
    images, texts = torch.randn(7, 3, 16, 16), torch.randint(1, 99, (7, 12))
    dp = DataParallel(model, device_ids=["cpu"] * 3, workers=workers)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error")
            want, got = model(images, texts), dp(images, texts)
    finally:
        dp.close()
    assert list(got) == list(want) == ["image_features", "text_features", "logit_scale"] + (["logit_bias"] if bias else [])
    for key in ("image_features", "text_features"):
        assert_close_to_reference(got[key], want[key], terms=TERMS)
    for key in list(want)[2:]:
        assert got[key].shape == () and torch.equal(got[key], want[key])
