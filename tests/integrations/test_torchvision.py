"""torchvision detection models with no configuration: images and targets split per item.

Compared with the full batch on one device. The images pad to one canvas for any subset
of them (see docs/real_models.md), so every replica sees the pixels one device sees.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dpmethods import DataParallel, chunk_sizes
from dpmethods.testing import assert_close_to_reference
from tests.helpers import SPLITS, WORKERS
from tests.helpers.terms import FASTER_RCNN_TERMS, RETINANET_TERMS

detection = pytest.importorskip("torchvision.models.detection")


def _images(n: int) -> list[torch.Tensor]:
    return [torch.rand(3, 64, 66 + 4 * i) for i in range(n)]


def _targets(n: int) -> list[dict[str, torch.Tensor]]:
    """Two boxes per image, of sizes and places that differ: the images' losses differ."""
    return [
        {"boxes": torch.tensor([[5.0 + 3 * i, 5.0, 30.0 + 5 * i, 40.0], [10.0 + i, 20.0, 50.0, 60.0 - 2 * i]]),
         "labels": torch.tensor([1, 1 + i % 2])}
        for i in range(n)
    ]


def _faster_rcnn() -> nn.Module:
    return detection.fasterrcnn_mobilenet_v3_large_fpn(
        weights=None, weights_backbone=None, num_classes=3, min_size=64, max_size=96,
        rpn_pre_nms_top_n_test=200, rpn_post_nms_top_n_test=20,
        rpn_pre_nms_top_n_train=200, rpn_post_nms_top_n_train=10,
        rpn_batch_size_per_image=100_000, box_batch_size_per_image=100_000,
        box_score_thresh=0.0,
    )


def _retinanet() -> nn.Module:
    return detection.retinanet_resnet50_fpn(
        weights=None, weights_backbone=None, num_classes=3, min_size=64, max_size=96,
    )


@pytest.mark.parametrize(
    "make,batch,devices",
    [(_faster_rcnn, 5, 3), (_faster_rcnn, 4, 4), (_faster_rcnn, 7, 2), (_retinanet, 5, 3)],
    ids=["faster_rcnn-5-3", "faster_rcnn-4-4", "faster_rcnn-7-2", "retinanet-5-3"],
)
def test_detection_eval_with_no_configuration(make: object, batch: int, devices: int) -> None:
    torch.manual_seed(0)
    model = make().eval()  # type: ignore[operator]
    images = _images(batch)
    with torch.no_grad():
        ref = model(images)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing to warn about: the right options are built in
            got = DataParallel(model, device_ids=["cpu"] * devices)(images)
    assert isinstance(got, list) and len(got) == batch
    terms = RETINANET_TERMS if make is _retinanet else FASTER_RCNN_TERMS
    for g, r in zip(got, ref):
        assert g.keys() == r.keys()
        assert_close_to_reference(g, r, terms=terms)  # labels exactly


# The R-CNN heads' losses are means over the proposals sampled from all images (10 per
# image, and its 2 boxes), so with as many boxes in every image, weights by image give
# the full batch's. The RPN's are means over the anchors sampled, which vary with the
# boxes: weighted by image, they are the replicas' losses as documented, close to the
# full batch's but not equal.
ROI_LOSSES = ("loss_classifier", "loss_box_reg")


@pytest.mark.parametrize("batch,devices", [(5, 3), (7, 3)])
def test_detection_training_losses_with_no_configuration(batch: int, devices: int) -> None:
    # Uneven shares (2 + 2 + 1, 3 + 2 + 2): an unweighted mean of the replicas' losses
    # would differ.
    torch.manual_seed(0)
    model = _faster_rcnn().train()
    for m in model.modules():  # batch statistics would couple the items (see docs)
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()
    images, targets = _images(batch), _targets(batch)
    ref = model(images, targets)
    got = DataParallel(model, device_ids=["cpu"] * devices)(images, targets)
    assert got.keys() == ref.keys()
    # Means over the images' boxes and anchors (about 30 each).
    terms = FASTER_RCNN_TERMS + batch * 30
    # Every loss: each share's, as one device computes it, weighted by its images.
    shares, start = [], 0
    for size in chunk_sizes(batch, devices):
        shares.append((size, model(images[start:start + size], targets[start:start + size])))
        start += size
    weighted = {k: sum(size / batch * losses[k] for size, losses in shares) for k in ref}
    assert_close_to_reference(got, weighted, terms=terms)
    assert_close_to_reference({k: got[k] for k in ROI_LOSSES}, {k: ref[k] for k in ROI_LOSSES}, terms=terms)


@pytest.mark.parametrize("batch,devices", SPLITS)
def test_torchvision_detection_eval(batch: int, devices: int) -> None:
    model = _faster_rcnn().eval()
    images = _images(batch)
    dp = DataParallel(
        model,
        device_ids=["cpu"] * devices,
        methods={"forward": {"split": ("images", "targets"), "gather": "extend"}},
    )
    with torch.no_grad():
        ref = model(images)
        got = dp(images)
    assert isinstance(got, list) and len(got) == batch
    for g, r in zip(got, ref):
        assert g.keys() == r.keys()
        assert_close_to_reference(g, r, terms=FASTER_RCNN_TERMS)  # labels exactly


@pytest.mark.parametrize("batch,devices", SPLITS)
def test_torchvision_detection_training_with_targets(batch: int, devices: int) -> None:
    model = _faster_rcnn().train()
    for m in model.modules():  # batch statistics would couple the items (see docs)
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()
    images = _images(batch)
    targets = [  # two boxes per image, of sizes and places that differ: the images' losses differ
        {
            "boxes": torch.tensor([[5.0 + 3 * i, 5.0, 30.0 + 5 * i, 40.0], [10.0 + i, 20.0, 50.0, 60.0 - 2 * i]]),
            "labels": torch.tensor([1, 1 + i % 2]),
        }
        for i in range(batch)
    ]
    dp = DataParallel(
        model,
        device_ids=["cpu"] * devices,
        methods={"forward": {"split": ("images", "targets"), "gather": "mean"}},
    )
    ref = model(images, targets)
    ref_grad = torch.autograd.grad(sum(ref.values()), model.roi_heads.box_predictor.cls_score.weight)[0]
    got = dp(images, targets)
    assert got.keys() == ref.keys()
    # The losses: means over up to 8 images x about 30 boxes; the gradient sums over them.
    # The heads' losses are the full batch's; every loss is the shares' weighted by images.
    terms = FASTER_RCNN_TERMS + batch * 30
    sizes = [batch // devices + (i < batch % devices) for i in range(devices)]
    starts = [sum(sizes[:i]) for i in range(devices)]
    shares = [model(images[a:a + s], targets[a:a + s]) for a, s in zip(starts, sizes)]
    assert_close_to_reference(got, {k: sum(s / batch * share[k] for s, share in zip(sizes, shares)) for k in ref}, terms=terms)
    heads = ("loss_classifier", "loss_box_reg")
    assert_close_to_reference({k: got[k] for k in heads}, {k: ref[k] for k in heads}, terms=terms)
    grad = torch.autograd.grad(sum(got.values()), model.roi_heads.box_predictor.cls_score.weight)[0]
    assert_close_to_reference(grad, ref_grad, terms=2 * FASTER_RCNN_TERMS + batch * 30)


@pytest.mark.parametrize("workers", WORKERS)
def test_detection_calls_and_maps_on_threads_and_processes(workers: str) -> None:
    torch.manual_seed(0)
    model = _faster_rcnn().eval()
    images = _images(5)
    dp = DataParallel(model, device_ids=["cpu"] * 2, workers=workers)
    try:
        with torch.no_grad():
            ref = model(images)
            called = dp(images)  # 3 + 2 images
            mapped = [d for out in dp.map("forward", [(images[:3],), (images[3:],)]) for d in out]
        for got in (called, mapped):
            assert isinstance(got, list) and len(got) == len(ref)
            for g, r in zip(got, ref):
                assert g.keys() == r.keys()
                assert_close_to_reference(g, r, terms=FASTER_RCNN_TERMS)  # labels exactly
    finally:
        dp.close()
