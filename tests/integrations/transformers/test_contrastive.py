"""transformers' contrastive models: logits_per_* and their loss over the whole batch.

Each family (CLIP, SigLIP and SigLIP 2, ALIGN, CLAP, Chinese-CLIP, AltCLIP, GroupViT,
OWL-ViT, OWLv2, BLIP, MetaCLIP 2, CLIPSeg, the vision-text dual encoder, TIPSv2, AIMv2,
BLIP-2's image-text contrast) from a tiny config with random weights, through
DataParallel with no configuration, against the bare model on the full batch: loss,
logits, embeddings and every parameter's gradient, on 7 items over 3 replicas and 8 over
4. Models whose logits or loss can't be computed again are warned about on equal shares
too.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from dpmethods import DataParallel
from dpmethods.testing import assert_close_to_reference
from dpmethods.vocab import warn_once as warn_once
from tests.helpers import SPLITS
from tests.helpers.terms import transformer_terms

pytest.importorskip("transformers")
import tests.helpers.contrastive_models as models

# A tower (2 blocks of width 32, MLP 37, up to 17 tokens), its projection, the
# normalisation and the 32-wide products of the logits; a gradient runs the path back and
# sums over the batch's rows.
TERMS = transformer_terms(width=32, ff=37, seq=17, layers=2) + 3 * 32
GRAD_TERMS = 2 * TERMS + 8


@pytest.fixture(autouse=True)
def _fresh_warnings() -> Iterator[None]:
    warn_once.reset()
    yield


def _ours(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if str(w.message).startswith(("DataParallel", "gather"))]


def _objective(name: str, out: Any) -> torch.Tensor:
    if name in models.NO_LOSS:  # a function of every logit, coupling the whole batch
        return out.logits_per_text.logsumexp(1).mean() + out.logits_per_text.logsumexp(0).mean()
    return out.loss


def _run(name: str, model: Any, x: dict[str, Any], devices: int | None) -> tuple[Any, dict[str, torch.Tensor]]:
    model.zero_grad()
    call = model if devices is None else DataParallel(model, device_ids=["cpu"] * devices)
    out = call(**x, return_loss=name not in models.NO_LOSS)
    _objective(name, out).backward()
    return out, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("n,devices", SPLITS)
@pytest.mark.parametrize("name", list(models.BUILDERS))
def test_logits_loss_and_gradients_equal_one_device(name: str, n: int, devices: int) -> None:
    model, inputs = models.BUILDERS[name]()
    x = inputs(n)
    want, want_grads = _run(name, model, x, None)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got, got_grads = _run(name, model, x, devices)
    assert _ours(record) == []
    assert list(got.keys()) == list(want.keys())
    fields = [k for k in want if k == "loss" or k.startswith("logits_per_") or k.endswith("_embeds")]
    assert len(fields) >= 4
    # The loss's log-sum-exp over the batch: the logits' magnitude is the scale.
    scale = float(want.logits_per_text.detach().abs().max())
    for key in fields:
        assert_close_to_reference(got[key], want[key], terms=TERMS, scale=scale, msg=f"{name} {key}: ")
    # Distinct CPU replicas (as on GPUs) broadcast every parameter under autograd, so one
    # that the loss does not use gets a zero gradient where one device leaves None.
    unused = got_grads.keys() - want_grads.keys()
    assert want_grads.keys() <= got_grads.keys() and all(not got_grads[k].any() for k in unused), unused
    _assert_grads_close({k: got_grads[k] for k in want_grads}, want_grads, scale, f"{name} grads: ")


def _assert_grads_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], scale: float,
                        msg: str) -> None:
    """Every gradient within the rounding bound of the loss's scale. A gradient whose
    values all lie below twenty times that bound's absolute part carries no signal in
    float32 (an attention key's bias: zero by the softmax's shift invariance, so what is
    computed is rounding): it must stay that small, on one device and on replicas alike."""
    floor = 4.0 * 2 * math.sqrt(GRAD_TERMS) * torch.finfo(torch.float32).eps / 2 * scale  # the helper's atol
    signal = {k for k, w in want.items() if float(w.abs().max()) > 20 * floor}
    for k in want.keys() - signal:
        assert float(got[k].abs().max()) <= 20 * floor, f"{msg}{k}: {float(got[k].abs().max()):.3g} > {20 * floor:.3g}"
    assert len(signal) > len(want) // 2, f"{msg}most gradients are below the rounding bound: {sorted(want.keys() - signal)}"
    assert_close_to_reference({k: got[k] for k in signal}, {k: want[k] for k in signal}, terms=GRAD_TERMS,
                              scale=scale, msg=msg)


@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_return_dict_false_gives_one_devices_tuple(name: str) -> None:
    model, inputs = models.BUILDERS[name]()
    x = inputs(8)
    with torch.no_grad():
        want = model(**x, return_loss=True, return_dict=False)
        got = DataParallel(model, device_ids=["cpu"] * 4)(**x, return_loss=True, return_dict=False)
    assert type(got) is tuple and len(got) == len(want)
    scale = float(want[2].abs().max())
    assert_close_to_reference(got[:5], want[:5], terms=TERMS, scale=scale)  # loss, logits, embeds


@pytest.mark.parametrize("n,devices", SPLITS)
def test_image_text_matching_logits_join_as_one_device(n: int, devices: int) -> None:
    # BLIP-2's matching head scores each (image, text) pair of a row: nothing couples the
    # batch, and logits_per_text is the [2, n] transpose of logits_per_image.
    model, inputs = models.blip2_retrieval()
    x = inputs(n)
    with torch.no_grad():
        want = model(**x, use_image_text_matching_head=True)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            got = DataParallel(model, device_ids=["cpu"] * devices)(**x, use_image_text_matching_head=True)
    assert _ours(record) == []
    assert got.logits_per_text.shape == (2, n)
    for key in ("logits_per_image", "logits_per_text"):
        assert_close_to_reference(got[key], want[key], terms=GRAD_TERMS, msg=key)


UNKNOWN = [
    pytest.param(models.xclip, True, "logits are not", id="xclip-text-per-video"),
    pytest.param(lambda: models.clip(models.SharperCLIP), False, "logits are not", id="other-scale"),
    pytest.param(lambda: models.clip(models.SmoothedCLIP), True, "loss is not computed", id="other-loss"),
]


@pytest.mark.parametrize("n,devices", SPLITS)
@pytest.mark.parametrize("build,loss,why", UNKNOWN)
def test_logits_that_cannot_be_computed_again_are_warned_whatever_the_shares(
    build: Any, loss: bool, why: str, n: int, devices: int
) -> None:
    model, inputs = build()
    x = inputs(n)
    with torch.no_grad(), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = DataParallel(model, device_ids=["cpu"] * devices)(**x, return_loss=loss)
    ours = [m for m in _ours(record) if m.startswith(f"DataParallel: {type(model).__name__}.forward returns")]
    assert len(ours) == 1, _ours(record)
    assert why in ours[0] and "each replica's own" in ours[0], ours[0]
    if loss:  # one loss per replica, not a mean passed off as the batch's
        assert got.loss.shape == (devices,)


@pytest.mark.parametrize("n,devices", SPLITS)
def test_groupvit_segmentation_logits_and_gradients_equal_one_device(n: int, devices: int) -> None:
    # GroupViT's segmentation_logits [images, texts, h, w] score each image's pixels against
    # every text of the batch: computed again from the replicas' group tokens and grouping
    # attentions, joined, and the joined text embeddings. They were each replica's own
    # ([n_r, n_r, h, w]: [3, 3] and [2, 2] pieces on 7-on-3), with a warning.
    model, inputs = models.groupvit()
    x = inputs(n)

    def run(call: Any) -> tuple[Any, dict[str, torch.Tensor]]:
        model.zero_grad()
        out = call(**x, return_loss=True, output_segmentation=True)
        (out.loss + out.segmentation_logits.mean() / square).backward()
        return out, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    square = float(model.logit_scale.detach().exp()) ** 2  # applied twice: |segmentation_logits| <= it
    want, want_grads = run(model)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got, got_grads = run(DataParallel(model, device_ids=["cpu"] * devices))
    assert _ours(record) == []
    assert got.segmentation_logits.shape == (n, n, 16, 16)
    # Each value: the tower, its projection, the 16-wide products with a text, then the sum
    # over the image's 2 groups of their grouping weights (at most 1 in all), times scale^2.
    assert_close_to_reference(got.segmentation_logits, want.segmentation_logits, terms=TERMS + 2, scale=square)
    scale = float(want.logits_per_text.detach().abs().max())
    for key in ("loss", "logits_per_image", "logits_per_text"):
        assert_close_to_reference(got[key], want[key], terms=TERMS, scale=scale, msg=key)
    unused = got_grads.keys() - want_grads.keys()
    assert all(not got_grads[k].any() for k in unused), unused
    _assert_grads_close({k: got_grads[k] for k in want_grads}, want_grads, scale, "grads: ")


def test_groupvit_segmentation_logits_in_bfloat16_equal_one_device() -> None:
    # The check computes them again in float32 from the replica's text embeddings; a bf16
    # model's group tokens were multiplied with those as they were (bf16 @ float32 fails).
    model, inputs = models.groupvit()
    model = model.to(torch.bfloat16)
    x = inputs(5)
    x["pixel_values"] = x["pixel_values"].to(torch.bfloat16)
    with torch.no_grad(), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        want = model(**x, output_segmentation=True)
        got = DataParallel(model, device_ids=["cpu"] * 2)(**x, output_segmentation=True)
    assert _ours(record) == []
    assert got.segmentation_logits.dtype == torch.bfloat16
    # The same bf16 arithmetic as one device (equal on this host): a rounding at most.
    assert_close_to_reference(got.segmentation_logits, want.segmentation_logits, terms=1)


def test_a_gather_given_for_forward_is_checked_on_equal_shares() -> None:
    model, inputs = models.clip()
    x = inputs(8)
    dp = DataParallel(model, device_ids=["cpu"] * 4, methods={"forward": {"gather": {"loss": "mean"}}})
    with torch.no_grad(), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        dp(**x, return_loss=True)
    assert [m for m in _ours(record) if "with the gather= given for it" in m], _ours(record)


def test_a_gather_given_for_forward_that_joins_right_is_not_warned() -> None:
    # Texts split, every image on every replica: each replica's logits_per_text are its
    # texts' rows against all images, and logits_per_image hold the texts in dim 1.
    model, _ = models.clip()
    x = {**models.texts(8), **models.images(5)}
    dp = DataParallel(model, device_ids=["cpu"] * 4, methods={"forward": {
        "broadcast": ("pixel_values",),
        "gather_dim": {"logits_per_image": 1},
        "gather": {"image_embeds": "mean", "vision_model_output": "mean"},
    }})
    with torch.no_grad(), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = dp(**x)
        want = model(**x)
    assert _ours(record) == []
    assert_close_to_reference(got.logits_per_image, want.logits_per_image, terms=TERMS)


@pytest.mark.timeout(280)
@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_threads_and_processes_give_one_devices_logits_and_loss(workers: str) -> None:
    model, inputs = models.clip()
    dp = DataParallel(model, device_ids=["cpu"] * 2, workers=workers)
    try:
        for n in (7, 8):  # uneven, then equal shares
            x = inputs(n)
            with torch.no_grad(), warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                want = model(**x, return_loss=True)
                got = dp(**x, return_loss=True)
                got_tuple = dp(**x, return_loss=True, return_dict=False)
            assert _ours(record) == []
            scale = float(want.logits_per_text.abs().max())
            for i, key in enumerate(["loss", "logits_per_image", "logits_per_text", "text_embeds", "image_embeds"]):
                assert_close_to_reference(got[key], want[key], terms=TERMS, scale=scale, msg=key)
                assert_close_to_reference(got_tuple[i], want[key], terms=TERMS, scale=scale, msg=key)
    finally:
        dp.close()


# CLIP: the 3x4x4 patch embedding and 2 blocks over 17 tokens (the text tower's 6 are
# fewer), the 32 -> 16 projection, the normalisation and the 16-wide products.
CLIP_TERMS = 48 + transformer_terms(width=32, ff=37, seq=17, layers=2) + 3 * 16


# --- CLIP: logits_per_image has the texts on dim 1 --------------------------------


def _clip_model() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    text = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_attention_heads=4,
                num_hidden_layers=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=2,
                pad_token_id=1)
    vision = dict(image_size=16, patch_size=4, hidden_size=32, intermediate_size=37,
                  num_attention_heads=4, num_hidden_layers=2)
    config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    return transformers.CLIPModel(config).eval()


@pytest.mark.parametrize("batch,devices", SPLITS)
def test_clip_logits_per_text_and_per_image_with_gather_dim(batch: int, devices: int) -> None:
    clip = _clip_model()
    ids, pixels = torch.randint(3, 99, (batch, 6)), torch.randn(5, 3, 16, 16)
    dp = DataParallel(clip, device_ids=["cpu"] * devices, methods={"forward": {
        "broadcast": ("pixel_values",),  # every replica scores its texts against all images
        "gather_dim": {"logits_per_image": 1},  # [images, texts]: the texts are on dim 1
        "gather": {"image_embeds": "mean", "vision_model_output": "mean"},  # same on every replica
    }})
    with torch.no_grad():
        ref = clip(input_ids=ids, pixel_values=pixels)
        got = dp(input_ids=ids, pixel_values=pixels)
    for key in ("logits_per_text", "logits_per_image", "text_embeds", "image_embeds"):
        assert_close_to_reference(got[key], ref[key], terms=CLIP_TERMS, msg=key)


# Uneven shares: with equal ones a [share, share] output can't be told from [share, classes].
@pytest.mark.parametrize("batch,devices", [pytest.param(7, 3, id="7-on-3"), pytest.param(7, 2, id="7-on-2")])
def test_clip_contrastive_loss_split_per_replica_is_warned(batch: int, devices: int) -> None:
    clip = _clip_model()
    ids, pixels = torch.randint(3, 99, (batch, 6)), torch.randn(batch, 3, 16, 16)
    dp = DataParallel(clip, device_ids=["cpu"] * devices, methods={"forward": {"gather": {"loss": "mean"}}})
    with torch.no_grad(), pytest.warns(UserWarning) as record:
        got = dp(input_ids=ids, pixel_values=pixels, return_loss=True)
    messages = [str(w.message) for w in record]
    assert any("gather: output.logits_per_image has each replica's share" in m for m in messages)
    assert any(
        "output.loss is reduced with 'mean' across replicas alongside the batch-coupled" in m
        and "NOT the full-batch loss" in m
        for m in messages
    )
    # The right pattern: gather the embeddings, compute the loss on the whole batch.
    with torch.no_grad():
        ref = clip(input_ids=ids, pixel_values=pixels, return_loss=True)
        logits = clip.logit_scale.exp() * got.text_embeds @ got.image_embeds.T
        labels = torch.arange(batch)
        loss = (nn.functional.cross_entropy(logits, labels) + nn.functional.cross_entropy(logits.T, labels)) / 2
    # The logits' log-sum-exp over the batch and the mean: the logits' scale is the magnitude.
    assert_close_to_reference(loss, ref.loss, terms=CLIP_TERMS + 2 * batch, scale=float(clip.logit_scale.detach().exp()))

