"""Real third-party models (tiny configs, random weights, nothing downloaded) through
dpmethods.DataParallel on CPU devices, against the bare model on the full batch:
uneven (7 items on 3 replicas) and even (8 on 4) batches."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dpmethods import DataParallel
from dpmethods.testing import assert_close_to_reference
from dpmethods.vocab import warn_once as warn_once
from tests.helpers.models import random_sentences, tiny_sentence_transformer
from tests.helpers.terms import FASTER_RCNN_TERMS, transformer_terms

SPLITS = [pytest.param(7, 3, id="7-on-3"), pytest.param(8, 4, id="8-on-4")]
# The terms summed on the path to one output (see dpmethods.testing.assert_close_to_reference).
DETECTOR_TERMS = FASTER_RCNN_TERMS
# The tiny BERT (2 blocks, width 32, up to 7 tokens), then the mean pooling.
SENTENCE_TERMS = transformer_terms(width=32, ff=37, seq=7, layers=2) + 7
# The diffusers autoencoders: about 15 3x3 convs of up to 16 channels (144 terms each)
# and 6 GroupNorms over 2 channels x 16 x 16 (512 terms each).
AUTOENCODER_TERMS = 15 * 144 + 6 * 512
# CLIP: the 3x4x4 patch embedding and 2 blocks over 17 tokens (the text tower's 6 are
# fewer), the 32 -> 16 projection, the normalisation and the 16-wide products.
CLIP_TERMS = 48 + transformer_terms(width=32, ff=37, seq=17, layers=2) + 3 * 16


@pytest.fixture(autouse=True)
def _fresh_warnings() -> None:
    warn_once.reset()


def _close(got: Any, ref: Any, terms: int, **kwargs: Any) -> None:
    assert_close_to_reference(got, ref, terms=terms, **kwargs)


# --- torchvision detection: a list of images of different sizes, a list of targets --


def _detector() -> nn.Module:
    detection = pytest.importorskip("torchvision.models.detection")
    # Small images; every anchor and proposal sampled (huge per-image batch sizes) and a
    # fixed number of proposals per image, so the training losses are deterministic and,
    # with as many boxes in every image, each image weighs the same in the heads' losses,
    # as the "mean" gather assumes (the RPN's count the anchors each image samples).
    return detection.fasterrcnn_mobilenet_v3_large_fpn(
        weights=None,
        weights_backbone=None,
        num_classes=3,
        min_size=64,
        max_size=96,
        rpn_pre_nms_top_n_train=200,
        rpn_post_nms_top_n_train=10,
        rpn_pre_nms_top_n_test=200,
        rpn_post_nms_top_n_test=20,
        rpn_batch_size_per_image=100_000,
        box_batch_size_per_image=100_000,
        box_score_thresh=0.0,
    )


def _images(n: int) -> list[torch.Tensor]:
    # Different widths, one padded canvas (64 x 96) for any subset of them, so the
    # batched backbone sees the same pixels on one device and on a replica.
    return [torch.rand(3, 64, 66 + 4 * i) for i in range(n)]


@pytest.mark.parametrize("batch,devices", SPLITS)
def test_torchvision_detection_eval(batch: int, devices: int) -> None:
    model = _detector().eval()
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
        _close(g, r, DETECTOR_TERMS)  # labels exactly


@pytest.mark.parametrize("batch,devices", SPLITS)
def test_torchvision_detection_training_with_targets(batch: int, devices: int) -> None:
    model = _detector().train()
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
    terms = DETECTOR_TERMS + batch * 30
    sizes = [batch // devices + (i < batch % devices) for i in range(devices)]
    starts = [sum(sizes[:i]) for i in range(devices)]
    shares = [model(images[a:a + s], targets[a:a + s]) for a, s in zip(starts, sizes)]
    _close(got, {k: sum(s / batch * share[k] for s, share in zip(sizes, shares)) for k in ref}, terms)
    heads = ("loss_classifier", "loss_box_reg")
    _close({k: got[k] for k in heads}, {k: ref[k] for k in heads}, terms)
    grad = torch.autograd.grad(sum(got.values()), model.roi_heads.box_predictor.cls_score.weight)[0]
    _close(grad, ref_grad, 2 * DETECTOR_TERMS + batch * 30)


# --- sentence-transformers: encode(list of strings) -> numpy -------------------------

@pytest.fixture(scope="module")
def sentence_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tiny_sentence_transformer(tmp_path_factory.mktemp("tiny-bert"))


@pytest.mark.parametrize("batch,devices", SPLITS)
def test_sentence_transformers_encode_list_of_strings(sentence_model: Any, batch: int, devices: int) -> None:
    np = pytest.importorskip("numpy")
    import inspect

    # The argument is "sentences" in older versions, "inputs" in newer ones.
    name = list(inspect.signature(type(sentence_model).encode).parameters)[1]
    sentences = random_sentences(batch)
    seen: list[int] = []
    hook = sentence_model[0].register_forward_pre_hook(
        lambda m, args: seen.append(len(args[0]["input_ids"]))
    )
    try:
        ref = sentence_model.encode(sentences)
        seen.clear()
        dp = DataParallel(sentence_model, device_ids=["cpu"] * devices, methods={"encode": {"split": (name,)}})
        got = dp.encode(sentences)
    finally:
        hook.remove()
    assert isinstance(got, np.ndarray) and got.shape == ref.shape
    _close(got, ref, SENTENCE_TERMS)
    assert sorted(seen) == sorted([batch // devices + (i < batch % devices) for i in range(devices)])


@pytest.mark.parametrize("batch,devices", SPLITS)
def test_sentence_transformers_encode_outputs_and_precisions_with_no_configuration(
    sentence_model: Any, batch: int, devices: int
) -> None:
    pytest.importorskip("numpy")
    sentences = random_sentences(batch)
    dp = DataParallel(sentence_model, device_ids=["cpu"] * devices)  # the built-in rule only

    def same(got: Any, ref: Any) -> None:
        assert type(got) is type(ref)
        if isinstance(ref, list):
            assert len(got) == len(ref)
            for g, r in zip(got, ref):
                same(g, r)
        else:  # a tensor or an array; int8, uint8 and binary precisions exactly
            _close(got, ref, SENTENCE_TERMS + 32)  # normalized: a 32-wide norm

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # per-item lists: no ambiguity on equal shares
        for kwargs in (
            {"output_value": "token_embeddings"},  # a list of [tokens_i, dim] tensors
            {"convert_to_numpy": False},  # a list of [dim] tensors
            {"convert_to_tensor": True, "normalize_embeddings": True},
            {"precision": "binary"},
        ):
            same(dp.encode(sentences, **kwargs), sentence_model.encode(sentences, **kwargs))
    # int8/uint8 ranges are calibrated on the whole batch, as on one device, not per replica.
    for kwargs in (
        {"precision": "int8"},
        {"precision": "uint8", "convert_to_tensor": True},
        {"precision": "int8", "convert_to_numpy": False},
    ):
        same(dp.encode(sentences, **kwargs), sentence_model.encode(sentences, **kwargs))
    # One string is one input: one embedding back, not a batch of one, on one replica.
    with pytest.warns(UserWarning, match=r"a batch of 1 items on \d devices: only 1 replicas run"):
        same(dp.encode(sentences[0]), sentence_model.encode(sentences[0]))


# --- diffusers AutoencoderKL: encode(...).latent_dist is a DiagonalGaussianDistribution --


@pytest.mark.parametrize("batch,devices", SPLITS)
def test_diffusers_autoencoder_latent_dist(batch: int, devices: int) -> None:
    diffusers = pytest.importorskip("diffusers")
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16), latent_channels=4, norm_num_groups=4,
        layers_per_block=1, sample_size=16,
    ).eval()
    x = torch.randn(batch, 3, 16, 16)
    dp = DataParallel(vae, device_ids=["cpu"] * devices, methods=["encode"])
    with torch.no_grad():
        ref = vae.encode(x).latent_dist
        got = dp.encode(x).latent_dist
    assert type(got) is type(ref)
    terms = AUTOENCODER_TERMS
    _close(got.sample(torch.Generator().manual_seed(3)), ref.sample(torch.Generator().manual_seed(3)), terms)
    _close(got.mode(), ref.mode(), terms)
    _close(got.kl(), ref.kl(), terms + 4 * 4 * 4)  # a sum over the 4 x 4 x 4 latents
    _close(got.std, ref.std, terms)


@pytest.mark.parametrize("batch,devices", SPLITS)
def test_diffusers_tiny_and_vq_autoencoders_with_no_configuration(batch: int, devices: int) -> None:
    diffusers = pytest.importorskip("diffusers")
    import warnings

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
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # VQModel.decode's 0-dim commit_loss is stacked, with a warning
            latents = vae.encode(x).latents
            _close(dp.encode(x).latents, latents, AUTOENCODER_TERMS)
            _close(dp.decode(latents).sample, vae.decode(latents).sample, AUTOENCODER_TERMS)
        assert set(DataParallel(vae, device_ids=["cpu"] * 2)._dpm_methods) >= {"encode", "decode"}


# --- CLIP: logits_per_image has the texts on dim 1 --------------------------------


def _clip() -> nn.Module:
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
    clip = _clip()
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
        _close(got[key], ref[key], CLIP_TERMS, msg=key)


# Uneven shares: with equal ones a [share, share] output can't be told from [share, classes].
@pytest.mark.parametrize("batch,devices", [pytest.param(7, 3, id="7-on-3"), pytest.param(7, 2, id="7-on-2")])
def test_clip_contrastive_loss_split_per_replica_is_warned(batch: int, devices: int) -> None:
    clip = _clip()
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
    _close(loss, ref.loss, CLIP_TERMS + 2 * batch, scale=float(clip.logit_scale.detach().exp()))


def test_no_library_is_imported_by_dpmethods() -> None:
    # The shipped rules are installed only for libraries the user imported.
    code = (
        "import sys, torch, dpmethods; "
        "dpmethods.gather([{'a': torch.ones(1)}, {'a': torch.ones(1)}], 'cpu'); "
        "print(sorted(m for m in ('diffusers', 'transformers', 'sentence_transformers') if m in sys.modules))"
    )
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root)}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
