"""timm models through DataParallel with no configuration, against one device."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dpmethods import DataParallel, parallel_methods
from dpmethods.testing import assert_close_to_reference
from tests.helpers import SPLITS, WORKERS
from tests.helpers.models import batch_sizes_seen, shares
from tests.helpers.terms import transformer_terms

# The 3x8x8 patch embedding, 2 blocks of width 192 over 17 tokens; the head: 192.
FEATURE_TERMS = 192 + transformer_terms(width=192, ff=768, seq=17, layers=2)
HEAD_TERMS = 192 + 1


def _vit() -> Any:
    """A random timm ViT (2 blocks of width 192, 32 x 32 images, 5 classes), in eval mode."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2, num_classes=5,
    ).eval()


@pytest.mark.parametrize("n,devices", SPLITS)
def test_timm_forward_features_and_head_without_configuration(n: int, devices: int) -> None:
    model = _vit()
    assert set(parallel_methods(type(model))) >= {"forward_features", "forward_head", "forward_intermediates"}
    x = torch.randn(n, 3, 32, 32)
    seen = batch_sizes_seen(model.patch_embed)
    dp = DataParallel(model, device_ids=["cpu"] * devices)
    with torch.no_grad():
        want = model.forward_features(x)
        seen.clear()
        got = dp.forward_features(x)
        assert sorted(seen) == shares(n, devices)
        assert_close_to_reference(got, want, terms=FEATURE_TERMS)
        assert_close_to_reference(dp.forward_head(want), model.forward_head(want), terms=HEAD_TERMS)
        # timm's feature extraction: the final features and each block's, joined by rows.
        for kwargs in ({"indices": 2}, {"indices": [0], "intermediates_only": True, "return_prefix_tokens": True}):
            seen.clear()
            got_maps = dp.forward_intermediates(x, **kwargs)
            assert sorted(seen) == shares(n, devices)
            assert_close_to_reference(got_maps, model.forward_intermediates(x, **kwargs), terms=FEATURE_TERMS)


@pytest.mark.parametrize("workers", WORKERS)
def test_timm_calls_and_maps_on_threads_and_processes(workers: str) -> None:
    model = _vit()
    x = torch.randn(7, 3, 32, 32)
    dp = DataParallel(model, device_ids=["cpu"] * 2, workers=workers)
    try:
        with torch.no_grad():
            want = model.forward_features(x)
            assert_close_to_reference(dp.forward_features(x), want, terms=FEATURE_TERMS)  # 4 + 3 rows
            got = list(dp.map("forward_head", [want[:4], want[4:]]))
            assert_close_to_reference(torch.cat(got), model.forward_head(want), terms=HEAD_TERMS)
    finally:
        dp.close()
