"""What the docs claim holds.

Detection: a detector pads each image to the largest of its batch, so a replica's results
equal the full batch's only for images that pad to the same size. The benchmark figures
the docs quote: tests/docs/test_figures.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dpmethods import DataParallel
from dpmethods.testing import assert_close_to_reference
from tests.helpers.terms import FASTER_RCNN_TERMS

_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("doc", ["docs/real_models.md", "README.md"])
def test_docs_say_detection_matches_only_for_images_that_pad_alike(doc: str) -> None:
    text = " ".join((_ROOT / doc).read_text().split())
    assert (
        "The results equal the full batch's only for images that pad to the same size" in text
    ), doc
    assert "boxes and scores depend on which images run together" in text, doc


def _run(widths: list[int]) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    detection = pytest.importorskip("torchvision.models.detection")
    torch.manual_seed(0)
    model = detection.fasterrcnn_mobilenet_v3_large_fpn(
        weights=None, weights_backbone=None, num_classes=3, min_size=64, max_size=160,
        rpn_pre_nms_top_n_test=200, rpn_post_nms_top_n_test=20, box_score_thresh=0.0,
    ).eval()
    images = [torch.rand(3, 64, w, generator=torch.Generator().manual_seed(w)) for w in widths]
    dp = DataParallel(model, device_ids=["cpu"] * 2,
                      methods={"forward": {"split": ("images", "targets"), "gather": "extend"}})
    with torch.no_grad():
        return model(images), dp(images)


def _same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
    """Whether two runs found the same detections, up to rounding. Both must give one dict
    of the same fields and dtypes per image (a mismatch there fails); another number of
    detections, or other labels, boxes or scores, is a difference."""
    assert len(a) == len(b)
    assert [{k: v.dtype for k, v in x.items()} for x in a] == [{k: v.dtype for k, v in x.items()} for x in b]
    if any(x[k].shape != y[k].shape for x, y in zip(a, b) for k in x):
        return False
    try:
        assert_close_to_reference(a, b, terms=FASTER_RCNN_TERMS)  # labels exactly
    except AssertionError:  # the structure matches: values differ
        return False
    return True


def test_detection_matches_the_full_batch_when_the_images_pad_alike() -> None:
    ref, got = _run([66, 70, 90, 94])  # every subset pads to 64 x 96
    assert _same(ref, got)


def test_detection_depends_on_the_batch_when_the_images_pad_differently() -> None:
    # Widths 66 and 70 pad to 96 on their replica, but to 160 beside 150 and 158 on one
    # device: the backbone sees other borders, so the boxes differ (as the docs say).
    ref, got = _run([66, 70, 150, 158])
    assert len(got) == len(ref) == 4
    assert not _same(ref[:2], got[:2])
