"""Modules that couple their batch (in-batch-negatives losses) warn when run on a share.

Real losses from sentence-transformers and open_clip, and a class of a user's own marked
with the public API. The warning names the loss and the pattern that gives the
full-batch loss; that pattern is checked against one device.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from dpmethods import DataParallel, parallel_method
from dpmethods.extending import is_batch_coupled, mark_batch_coupled
from dpmethods.testing import assert_close_to_reference as close
from dpmethods.vocab import warn_once as warn_once
from tests.helpers.models import random_sentences, tiny_sentence_transformer
from tests.helpers.terms import transformer_terms


@pytest.fixture(autouse=True)
def _fresh_warnings() -> None:
    warn_once.reset()


def test_sentence_transformers_in_batch_negatives_loss_is_warned(tmp_path: Path) -> None:
    model = tiny_sentence_transformer(tmp_path)
    losses = pytest.importorskip("sentence_transformers.sentence_transformer.losses")
    loss = losses.MultipleNegativesRankingLoss(model)
    anchors, positives = random_sentences(8), random_sentences(9)[1:]
    features = [model.tokenize(anchors), model.tokenize(positives)]
    labels = torch.zeros(8)
    ref = loss(features, labels)
    dp = DataParallel(loss, device_ids=["cpu"] * 4, methods={"forward": {"gather": "mean"}})
    with pytest.warns(UserWarning, match=r"MultipleNegativesRankingLoss couples the items of its batch \(in-batch negatives\).*Gather the embeddings or features with dpmethods"):
        per_share = dp(features, labels)
    assert not torch.allclose(per_share, ref)  # what the warning is about
    # The documented pattern: embeddings gathered with dpmethods, the loss outside.
    with torch.no_grad():
        enc = DataParallel(model, device_ids=["cpu"] * 4)
        a = enc.encode(anchors, convert_to_tensor=True)
        p = enc.encode(positives, convert_to_tensor=True)
        scores = loss.similarity_fct(a, p) * loss.scale
        full = nn.functional.cross_entropy(scores, torch.arange(8))
        # 2 BERT blocks over up to 7 tokens, the mean pooling and the 32-wide cosine, then
        # the loss's log-sum-exp over 8 scores of up to loss.scale (the magnitude summed).
        terms = transformer_terms(width=32, ff=37, seq=7, layers=2) + 7 + 32 + 2 * 8
        close(full, ref.detach(), terms=terms, scale=loss.scale)


class _ClipTrainer(nn.Module):
    """A user's training module with open_clip's ClipLoss inside."""

    def __init__(self) -> None:
        super().__init__()
        open_clip_loss = pytest.importorskip("open_clip.loss")
        self.img, self.txt = nn.Linear(6, 4), nn.Linear(5, 4)
        self.loss = open_clip_loss.ClipLoss()

    @parallel_method(gather="mean")
    def training_step(self, images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
        return self.loss(self.img(images), self.txt(texts), torch.tensor(10.0))

    @parallel_method
    def features(self, images: torch.Tensor, texts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.img(images), self.txt(texts)


def test_open_clip_loss_inside_a_method_is_warned_and_the_pattern_matches() -> None:
    model = _ClipTrainer()
    images, texts = torch.randn(8, 6), torch.randn(8, 5)
    dp = DataParallel(model, device_ids=["cpu"] * 4)
    with pytest.warns(UserWarning, match=r"ClipLoss couples the items of its batch"):
        dp.training_step(images, texts)
    with warnings.catch_warnings():  # gathering the features, the loss outside: quiet
        warnings.simplefilter("error")
        img, txt = dp.features(images, texts)
        full = model.loss(img, txt, torch.tensor(10.0))
    # Linear(6, 4), the 4-wide products scaled by 10, the 8-way log-sum-exp and means.
    close(full, model.training_step(images, texts), terms=7 + 4 + 2 * 8, scale=10.0)
    # One device, and a map (each batch whole on one replica): the loss sees its batch.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_once.reset()
        DataParallel(model, device_ids=["cpu"]).training_step(images, texts)
        list(dp.map("training_step", [(images, texts)]))


def test_a_users_own_class_marked_through_the_public_api() -> None:
    class InBatch(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(a @ b.T, torch.arange(len(a)))

    class Derived(InBatch):  # inherits forward: marked through the base
        pass

    assert not is_batch_coupled(InBatch)
    mark_batch_coupled(InBatch, what="in-batch negatives")
    assert is_batch_coupled(InBatch) and is_batch_coupled(Derived)
    a, b = torch.randn(6, 3), torch.randn(6, 3)
    close(InBatch()(a, b), nn.functional.cross_entropy(a @ b.T, torch.arange(6)), terms=3 + 2 * 6)
    with pytest.warns(UserWarning, match=r"Derived couples the items of its batch \(in-batch negatives\)"):
        DataParallel(Derived(), device_ids=["cpu"] * 2, methods={"forward": {"gather": "mean"}})(a, b)
    with pytest.raises(TypeError, match=r"mark_batch_coupled: cls: expected an nn.Module subclass, got 3"):
        mark_batch_coupled(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"expected a class or 'module:Class', got 'nope'"):
        mark_batch_coupled("nope")


def test_open_clip_forward_gathers_logit_scale_and_bias_as_one_value() -> None:
    model_mod = pytest.importorskip("open_clip.model")
    torch.manual_seed(0)
    clip = model_mod.CLIP(
        embed_dim=16,
        vision_cfg=model_mod.CLIPVisionCfg(layers=1, width=32, head_width=16, patch_size=8, image_size=16),
        text_cfg=model_mod.CLIPTextCfg(context_length=8, vocab_size=50, width=32, heads=2, layers=1),
        init_logit_bias=-10.0,
    ).eval()
    images, texts = torch.randn(4, 3, 16, 16), torch.randint(0, 50, (4, 8))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        got = DataParallel(clip, device_ids=["cpu"] * 4)(images, texts)
        ref = clip(images, texts)
    assert len(got) == 4 and got[2].dim() == 0 and got[3].dim() == 0
    # The vision tower's 3 x 8 x 8 patch embedding, one block (the text tower's is alike),
    # the 32-wide projection; the scale and bias are the same parameter everywhere.
    close(got, ref, terms=192 + transformer_terms(width=32, ff=128, seq=8, layers=1) + 32)


def test_a_dim_equal_to_the_share_warns_only_where_the_shares_differ() -> None:
    # Equal shares: [2, 2] logits of 2 classes, [10, 10] of 10 classes (40 rows on 4):
    # they can't be told from [share, share] matrices, so nothing is said.
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 10))
    x = torch.randn(40, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        two = DataParallel(nn.Linear(4, 2), device_ids=["cpu"] * 2)(torch.randn(4, 4))
        ten = DataParallel(mlp, device_ids=["cpu"] * 4)(x)
    assert two.shape == (4, 2) and ten.shape == (40, 10)

    class Similarity(nn.Module):
        def forward(self, a: torch.Tensor) -> torch.Tensor:
            return a @ a.T

    # 7 rows on 2 devices: [4, 4] and [3, 3] follow the shares, a real similarity matrix.
    with pytest.warns(UserWarning, match=r"gather: output has each replica's share of the batch "
                      r"\(\[4, 3\]\) in more than one dim, like a similarity matrix"):
        pieces = DataParallel(Similarity(), device_ids=["cpu"] * 2)(torch.randn(7, 3))
    assert [tuple(p.shape) for p in pieces] == [(4, 4), (3, 3)]


def _dynamic_int8() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates torch.ao.quantization and its tensors
        return torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)


@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_a_dynamically_quantized_model_warns_on_shares_and_a_map_keeps_batches_whole(workers: str) -> None:
    # quantize_dynamic's Linear quantizes its input with one scale over the whole batch:
    # a replica's share gets its own scale, so the result is not the full batch's.
    model = _dynamic_int8()
    x = torch.randn(7, 8, generator=torch.Generator().manual_seed(1))
    x[0] *= 20  # one row sets the whole batch's scale
    dp = DataParallel(model, device_ids=["cpu"] * 2, workers=workers)
    try:
        with torch.no_grad():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                outs = list(dp.map("forward", [x, x[3:]]))
            assert [str(w.message) for w in caught] == []  # each batch ran whole; nothing of torch's
            assert [torch.equal(out, model(b)) for out, b in zip(outs, [x, x[3:]])] == [True, True]
            with pytest.warns(UserWarning, match=r"Linear couples the items of its batch \(dynamic quantization: "
                              r"one scale .*DataParallel\.map runs each batch whole on one replica"):
                split = dp(x)
            assert not torch.equal(split, model(x))  # what the warning is about
    finally:
        dp.close()
