"""transformers models through DataParallel with no configuration, against one device.

Tiny configs with random weights (nothing downloaded), CPU replicas, compared with the
bare model on the full batch (fp32 1e-5, tokens exact): 7 items on 3 replicas and 8 on
4. ``generate`` has its own file (test_generate.py), the contrastive models too
(test_contrastive.py); peft's models are in tests/integrations/test_peft.py.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import dpmethods
from dpmethods import DataParallel, parallel_methods
from dpmethods.testing import assert_close_to_reference
from dpmethods.vocab import warn_once as warn_once
from dpmethods.wrapper.registry import resolve_methods
from tests.helpers import SPLITS, WORKERS
from tests.helpers.models import batch_sizes_seen, shares, tiny_qwen2_vl
from tests.helpers.terms import transformer_terms

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _fresh_warnings() -> None:
    warn_once.reset()


# The terms summed on the path to one output of this file's tiny models (see
# dpmethods.testing.assert_close_to_reference): at most 2 blocks of width 32 (MLP 128)
# over up to 16 tokens, a head over up to 99 classes, a loss's mean over up to 8 x 16
# tokens. A gradient runs the path back and sums over the tokens.
TERMS = transformer_terms(width=32, ff=128, seq=16, layers=2) + 99 + 8 * 16
GRAD_TERMS = 2 * TERMS + 8 * 16


# --- which methods are parallel ----------------------------------------------------------


def _clip() -> nn.Module:
    text = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_attention_heads=4,
                num_hidden_layers=2, max_position_embeddings=32)
    vision = dict(image_size=16, patch_size=8, hidden_size=32, intermediate_size=37,
                  num_attention_heads=4, num_hidden_layers=2)
    config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    torch.manual_seed(0)
    return transformers.CLIPModel(config).eval()


def test_transformers_rules_by_class() -> None:
    found = parallel_methods(transformers.GPT2LMHeadModel)
    assert found["generate"].gather == "generate"
    assert sorted(n for n in parallel_methods(transformers.CLIPModel) if n.startswith("get_")) == [
        "get_image_features", "get_text_features",
    ]
    assert "generate" not in parallel_methods(transformers.GPT2Model)  # no GenerationMixin
    assert parallel_methods(nn.Linear) == {}


@pytest.mark.parametrize("n,devices", SPLITS)
def test_clip_get_features_without_configuration(n: int, devices: int) -> None:
    model = _clip()
    ids = torch.randint(3, 99, (n, 7))
    pixels = torch.randn(n, 3, 16, 16)
    seen = batch_sizes_seen(model.vision_model)
    dp = DataParallel(model, device_ids=["cpu"] * devices)
    with torch.no_grad():
        want_t, want_i = model.get_text_features(input_ids=ids), model.get_image_features(pixels)
        seen.clear()
        got_t, got_i = dp.get_text_features(input_ids=ids), dp.get_image_features(pixels)
    assert sorted(seen) == shares(n, devices)  # every replica ran its share
    for got, want in ((got_t, want_t), (got_i, want_i)):
        if not isinstance(want, torch.Tensor):  # transformers 5 returns a ModelOutput
            got, want = got.pooler_output, want.pooler_output
        assert_close_to_reference(got, want, terms=TERMS)


def test_methods_list_takes_the_registered_options_and_a_dict_overrides_them() -> None:
    cfg = transformers.GPT2Config(vocab_size=16, n_positions=16, n_embd=8, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg)
    # What DataParallel(model, devices, methods=...) runs (its methods= is tested in
    # tests/wrapper/test_registry.py).
    assert resolve_methods(model)["generate"].gather == "generate"
    assert resolve_methods(model, ["generate"])["generate"].gather == "generate"
    given = resolve_methods(model, {"generate": {"gather": "pad", "pad_value": 5}})["generate"]
    assert (given.gather, given.pad_value) == ("pad", 5)


def test_decorations_and_registrations_win_over_builtins() -> None:

    class Decorated(transformers.GPT2LMHeadModel):
        @dpmethods.parallel_method(gather="list")
        def generate(self, *args: Any, **kwargs: Any) -> Any:
            return super().generate(*args, **kwargs)

    class Registered(transformers.GPT2LMHeadModel):
        pass

    dpmethods.register(Registered, "generate", gather="pad")
    assert dpmethods.get_options(Decorated, "generate").gather == "list"  # type: ignore[union-attr]
    assert dpmethods.get_options(Registered, "generate").gather == "pad"  # type: ignore[union-attr]

# --- transformers forward: losses joined as transformers joins them ----------------


def _loss_call(model: nn.Module, kwargs: dict[str, Any], devices: int) -> tuple[Any, Any, list[str]]:

    dpmethods.vocab.warn_once.reset()
    model.eval()
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        want = model(**kwargs)
        got = DataParallel(model, device_ids=["cpu"] * devices)(**kwargs)
    if isinstance(want, transformers.utils.ModelOutput):
        # out[0] and to_tuple() follow the keys' order: the loss first, as on one device.
        assert list(got.keys()) == list(want.keys())
    return got, want, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def _tokens(n: int, vocab: int = 50, width: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(5, vocab, (n, width), generator=g)
    labels = ids.masked_fill(torch.rand(n, width, generator=g) < 0.6, -100)  # uneven counts per row
    return ids, labels


@pytest.mark.parametrize("n,devices", SPLITS)
def test_gpt2_left_padded_loss_equals_the_full_batch_loss(n: int, devices: int) -> None:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    )
    ids, _ = _tokens(n)
    mask = torch.ones_like(ids)
    for row, width in ((0, 3), (1, 6), (n - 1, 1)):  # left padding, different per row
        mask[row, :width] = 0
    labels = ids.masked_fill(mask == 0, -100)
    got, want, warned = _loss_call(model, dict(input_ids=ids, attention_mask=mask, labels=labels), devices)
    assert warned == []
    assert got.loss.dim() == 0
    assert_close_to_reference(got.loss, want.loss, terms=TERMS)
    assert_close_to_reference(got.logits, want.logits, terms=TERMS)
    # Gradients too: each replica's loss is its share of the full-batch loss.
    model.train()
    model.config.embd_pdrop = model.config.resid_pdrop = model.config.attn_pdrop = 0.0
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    kwargs = dict(input_ids=ids, attention_mask=mask, labels=labels)
    model(**kwargs).loss.backward()
    want_grad = model.transformer.wte.weight.grad.clone()
    model.zero_grad()
    DataParallel(model, device_ids=["cpu"] * devices)(**kwargs).loss.backward()
    assert_close_to_reference(model.transformer.wte.weight.grad, want_grad, terms=GRAD_TERMS)


@pytest.mark.parametrize("n,devices", SPLITS)
def test_masked_lm_loss_with_ignored_labels_equals_the_full_batch_loss(n: int, devices: int) -> None:
    torch.manual_seed(0)
    config = transformers.ModernBertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
        sep_token_id=2, global_attn_every_n_layers=1,
    )
    ids, labels = _tokens(n)
    got, want, warned = _loss_call(transformers.ModernBertForMaskedLM(config), dict(input_ids=ids, labels=labels), devices)
    assert warned == []
    assert_close_to_reference(got.loss, want.loss, terms=TERMS)


def _moonshine() -> nn.Module:  # passes labels=None, shift_labels=labels: counted unshifted
    torch.manual_seed(0)
    config = transformers.MoonshineConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, encoder_num_hidden_layers=1,
        decoder_num_hidden_layers=1, encoder_num_attention_heads=2, decoder_num_attention_heads=2,
        encoder_num_key_value_heads=2, decoder_num_key_value_heads=2, max_position_embeddings=64,
        decoder_start_token_id=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return transformers.MoonshineForConditionalGeneration(config)


def _git() -> nn.Module:  # passes labels=None, shift_labels=labels[:, 1:]: counted shifted
    torch.manual_seed(0)
    vision = dict(image_size=16, patch_size=8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=32)
    config = transformers.GitConfig(vision_config=vision, vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                    num_attention_heads=2, intermediate_size=32, max_position_embeddings=64)
    return transformers.GitForCausalLM(config)


@pytest.mark.parametrize("name", ["moonshine", "git"])
@pytest.mark.parametrize("n,devices", SPLITS)
def test_a_causal_lm_loss_given_shift_labels_by_the_forward_counts_what_it_is_given(n: int, devices: int, name: str) -> None:
    # Moonshine's logits are aligned with its labels: it hands ForCausalLMLoss
    # shift_labels=labels, and the loss counts every label other than -100, the first
    # column's too (GIT hands it labels[:, 1:]). The first column counts in rows 0, 3
    # and 5 only: a count of labels[..., 1:] gives Moonshine's replicas wrong shares.
    g = torch.Generator().manual_seed(n)
    ids, _ = _tokens(n)
    labels = _uneven_labels(ids, devices)
    labels[:, 0] = -100
    labels[[0, 3, 5], 0] = ids[[0, 3, 5], 0]
    if name == "moonshine":
        model = _moonshine()
        kwargs: dict[str, Any] = dict(input_values=torch.randn(n, 1200, generator=g), labels=labels)
    else:
        model = _git()
        kwargs = dict(input_ids=ids, pixel_values=torch.randn(n, 3, 16, 16, generator=g), labels=labels)
    _far_from_uniform(model, kwargs)  # tokens' losses differ
    got, want, warned = _loss_call(model, kwargs, devices)
    assert warned == []
    assert got.loss.dim() == 0
    assert_close_to_reference(got.loss, want.loss, terms=TERMS, scale=float(want.logits.abs().max()))
    assert_close_to_reference(got.logits, want.logits, terms=TERMS)


def _wav2vec2(reduction: str) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        vocab_size=12, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2, ctc_loss_reduction=reduction,
    )
    return transformers.Wav2Vec2ForCTC(config)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("n,devices", SPLITS)
def test_ctc_loss_follows_the_configured_reduction(n: int, devices: int, reduction: str) -> None:
    g = torch.Generator().manual_seed(n)
    audio = torch.randn(n, 400, generator=g)
    labels = torch.randint(1, 12, (n, 6), generator=g)
    labels[torch.rand(n, 6, generator=g) < 0.3] = -100
    got, want, warned = _loss_call(_wav2vec2(reduction), dict(input_values=audio, labels=labels), devices)
    assert warned == []
    # The CTC recursion: a log-sum-exp of 3 per frame over 39 frames, then the batch's sum or mean.
    assert_close_to_reference(got.loss, want.loss, terms=TERMS + 3 * 39 + n)


def test_wav2vec2_loss_and_hidden_states_on_worker_processes() -> None:
    # Its positional convolution is under torch's weight_norm parametrization, a module
    # torch refuses to pickle: it is made again in each worker.
    g = torch.Generator().manual_seed(5)
    audio, labels = torch.randn(5, 400, generator=g), torch.randint(1, 12, (5, 6), generator=g)
    labels[torch.rand(5, 6, generator=g) < 0.3] = -100
    model = _wav2vec2("mean").eval()
    kwargs = dict(input_values=audio, labels=labels, output_hidden_states=True)
    dp = DataParallel(model, device_ids=["cpu"] * 2, workers="processes")
    try:
        with torch.no_grad():
            want, got = model(**kwargs), dp(**kwargs)  # 3 + 2 rows
    finally:
        dp.close()
    assert list(got.keys()) == list(want.keys())
    assert_close_to_reference(got.loss, want.loss, terms=TERMS + 3 * 39 + 5)  # as the CTC test's
    assert_close_to_reference((got.logits, got.hidden_states), (want.logits, want.hidden_states), terms=TERMS)


def _wav2vec2_pretraining(diversity_weight: float, n: int = 7) -> tuple[nn.Module, dict[str, Any]]:
    from transformers.models.wav2vec2.modeling_wav2vec2 import (
        _compute_mask_indices,
        _sample_negative_indices,
    )

    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2, codevector_dim=8, proj_codevector_dim=8,
        num_codevectors_per_group=4, num_codevector_groups=2, diversity_loss_weight=diversity_weight,
    )
    model = transformers.Wav2Vec2ForPreTraining(config).eval()
    frames = int(model._get_feat_extract_output_lengths(torch.tensor(400)))
    import numpy

    numpy.random.seed(n)  # transformers draws the mask and the negatives with numpy
    masked = _compute_mask_indices((n, frames), mask_prob=0.5, mask_length=2, min_masks=2)
    negatives = _sample_negative_indices((n, frames), num_negatives=config.num_negatives, mask_time_indices=masked)
    audio = torch.randn(n, 400, generator=torch.Generator().manual_seed(n))
    return model, dict(input_values=audio, mask_time_indices=torch.tensor(masked),
                       sampled_negative_indices=torch.tensor(negatives))


@pytest.mark.parametrize("workers", WORKERS)
def test_wav2vec2_pretraining_negatives_are_rebased_to_each_replica(workers: str) -> None:
    # sampled_negative_indices index the whole batch's frames flattened (row b's negatives
    # in [b * frames, (b + 1) * frames)): each replica gets its rows', counted from its
    # first frame. The contrastive loss is a sum over the masked frames, so with the
    # diversity term weighed 0 the replicas' losses add up to the full batch's.
    model, kwargs = _wav2vec2_pretraining(0.0)
    dp = DataParallel(model, device_ids=["cpu"] * 3, workers=workers)  # 3, 2, 2 rows
    try:
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            want, got = model(**kwargs), dp(**kwargs)
    finally:
        dp.close()
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    # The diversity term and the perplexity are over the whole batch's codevectors: they
    # stay per replica, with the gather's note; the loss and its contrastive term join.
    assert messages and all("output.codevector_perplexity" in m or "output.diversity_loss" in m for m in messages)
    assert got.loss.dim() == 0 and got.contrastive_loss.dim() == 0
    frames = kwargs["mask_time_indices"].sum()  # a sum of that many cross-entropies
    assert_close_to_reference(got.loss, want.loss, terms=TERMS + int(frames), scale=float(frames))
    assert_close_to_reference(got.contrastive_loss, want.contrastive_loss, terms=TERMS + int(frames),
                              scale=float(frames))
    assert_close_to_reference((got.projected_states, got.projected_quantized_states),
                              (want.projected_states, want.projected_quantized_states), terms=TERMS)


def test_wav2vec2_pretraining_diversity_term_keeps_per_replica_losses_with_a_warning() -> None:
    # The diversity term is over the perplexity of the whole batch's codevectors (an
    # entropy of their mean over the masked frames): no join of the replicas' gives it.
    model, kwargs = _wav2vec2_pretraining(0.1)
    got, want, warned = _loss_call(model, kwargs, 3)
    assert got.loss.shape == (3,)
    assert any("Wav2Vec2ForPreTraining.forward computes its loss in a way" in w for w in warned)
    assert not any("output.loss is 0-dim" in w for w in warned)  # no advice of a join that is wrong
    # Each replica's contrastive term is its rows' part: negatives re-based to its share.
    frames = int(kwargs["mask_time_indices"].sum())
    assert_close_to_reference(got.contrastive_loss.sum(), want.contrastive_loss, terms=TERMS + frames, scale=frames)


def test_wav2vec2_pretraining_negatives_from_other_rows_are_refused_before_any_replica_runs() -> None:
    model, kwargs = _wav2vec2_pretraining(0.0)
    negatives = kwargs["sampled_negative_indices"].clone()
    frames = negatives.shape[1]
    negatives[4, 0, 0] = 0  # row 4 (the second replica's) draws frame 0 of row 0
    seen = batch_sizes_seen(model.wav2vec2)
    with pytest.raises(ValueError, match=r"sampled_negative_indices .* row 4 .*rows 3 to 4.*"
                                         rf"\[{3 * frames}, {5 * frames}\)"):
        DataParallel(model, device_ids=["cpu"] * 3)(**{**kwargs, "sampled_negative_indices": negatives})
    assert seen == []


def _uneven_labels(ids: torch.Tensor, devices: int) -> torch.Tensor:
    """Labels with -100 spread unevenly over the replicas: the first replica's rows count
    few tokens, and the last replica's rows none at all (its mean would be NaN)."""
    n = ids.shape[0]
    g = torch.Generator().manual_seed(n + devices)
    keep = torch.rand(ids.shape, generator=g) < torch.linspace(0.9, 0.2, n)[:, None]
    labels = ids.masked_fill(~keep, -100)
    labels[0, 1:] = -100
    labels[n - dpmethods.chunk_sizes(n, devices)[-1]:] = -100
    assert int((labels != -100).sum()) > 0
    return labels


def _bert_mlm() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForMaskedLM(config)


def _t5() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=50, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0,
        dropout_rate=0.0,
    )
    return transformers.T5ForConditionalGeneration(config)


def _image_gpt() -> nn.Module:  # a causal LM whose forward shifts the labels itself
    torch.manual_seed(0)
    config = transformers.ImageGPTConfig(
        vocab_size=51, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return transformers.ImageGPTForCausalImageModeling(config)


def _distilbert_mlm() -> nn.Module:  # its CrossEntropyLoss is a child module, made in __init__
    torch.manual_seed(0)
    config = transformers.DistilBertConfig(
        vocab_size=50, dim=16, n_layers=1, n_heads=2, hidden_dim=32, max_position_embeddings=32,
        dropout=0.0, attention_dropout=0.0,
    )
    return transformers.DistilBertForMaskedLM(config)


def _gpt2_lm() -> nn.Module:  # hands **kwargs to self.loss_function
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    )


def _llama_tokens() -> nn.Module:  # calls self.loss_function without **kwargs
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**_LLAMA, num_labels=50, classifier_dropout=0.0)
    return transformers.LlamaForTokenClassification(config)


@pytest.mark.parametrize(
    "build", [_bert_mlm, _t5, _image_gpt, _distilbert_mlm, _llama_tokens],
    ids=["bert-mlm", "t5", "imagegpt", "distilbert-mlm", "llama-token-classification"],
)
@pytest.mark.parametrize("n,devices", SPLITS)
def test_a_token_averaged_cross_entropy_computed_by_the_model_equals_the_full_batch_loss(
    n: int, devices: int, build: Any
) -> None:
    # BertForMaskedLM and T5 call CrossEntropyLoss() on labels, ImageGPT on labels[..., 1:],
    # with no num_items_in_batch: the replicas' means are weighted by their counted labels.
    model = build()
    ids, _ = _tokens(n)
    labels = _uneven_labels(ids, devices)
    _far_from_uniform(model, dict(input_ids=ids, labels=labels))  # tokens' losses differ
    got, want, warned = _loss_call(model, dict(input_ids=ids, labels=labels), devices)
    assert warned == []
    assert got.loss.dim() == 0 and torch.isfinite(got.loss)  # the empty replica adds 0, not NaN
    assert_close_to_reference(got.loss, want.loss, terms=TERMS, scale=float(want.logits.abs().max()))
    assert_close_to_reference(got.logits, want.logits, terms=TERMS)
    # Gradients too (no dropout in these configs): the weighted join is differentiable,
    # the empty replica left out.
    model.train()
    kwargs = dict(input_ids=ids, labels=labels)
    model(**kwargs).loss.backward()
    weight = next(model.parameters())
    want_grad, weight.grad = weight.grad.clone(), None
    model.zero_grad()
    DataParallel(model, device_ids=["cpu"] * devices)(**kwargs).loss.backward()
    assert_close_to_reference(weight.grad, want_grad, terms=GRAD_TERMS)


@pytest.mark.parametrize(
    "build", [_bert_mlm, _t5, _llama_tokens, _gpt2_lm],
    ids=["bert-mlm", "t5", "llama-token-classification", "gpt2"],
)
def test_a_num_items_in_batch_given_joins_as_the_loss_that_uses_or_ignores_it(build: Any) -> None:
    # The Trainer passes num_items_in_batch to any forward that takes **kwargs. GPT-2 hands
    # it to transformers' loss_function (each replica's loss a share of the full loss); BERT
    # and T5 compute their own cross-entropy and Llama's token classification calls
    # loss_function without it: each replica's loss is a mean, and the means are weighted
    # by counted labels, not summed.
    model = build()
    ids, _ = _tokens(7)
    labels = _uneven_labels(ids, 3)
    shifted = isinstance(model, transformers.GPT2LMHeadModel)
    count = (labels[..., 1:] if shifted else labels).ne(-100).sum()  # the Trainer's count
    kwargs = dict(input_ids=ids, labels=labels, num_items_in_batch=count)
    _far_from_uniform(model, dict(input_ids=ids, labels=labels))  # tokens' losses differ
    got, want, warned = _loss_call(model, kwargs, 3)
    assert warned == []
    assert got.loss.dim() == 0
    assert_close_to_reference(got.loss, want.loss, terms=TERMS, scale=float(want.logits.abs().max()))


_BERT = dict(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
             intermediate_size=32, max_position_embeddings=32)
_LLAMA = dict(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)


def _far_from_uniform(model: nn.Module, kwargs: dict[str, Any], key: str = "logits") -> torch.Tensor:
    """Scale the model's output head (its last Linear) so that its logits spread by about
    3, and return them: a random head's logits are near uniform, every row's loss near
    ln(classes), and a wrong weighting of the replicas' losses would hardly show."""
    head = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    model.eval()
    with torch.no_grad():
        head.weight.mul_(3 / float(model(**kwargs)[key].std()))
        return model(**kwargs)[key]


def _ranked(logits: torch.Tensor) -> torch.Tensor:
    """Per row, the class ranked from the most likely (the first rows: a small loss) to the
    least likely (the last rows: a large loss): each replica's mean loss differs."""
    n, k = logits.shape
    order = logits.argsort(-1, descending=True)
    return order[torch.arange(n), torch.arange(n) * k // n]


def _classification_case(kind: str, n: int) -> tuple[nn.Module, dict[str, Any]]:
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(5, 50, (n, 6), generator=g)
    torch.manual_seed(0)
    if kind in ("single-label", "regression", "multi-label"):
        labels = {"single-label": 3, "regression": 1, "multi-label": 3}[kind]
        problem = "multi_label_classification" if kind == "multi-label" else None
        config = transformers.BertConfig(**_BERT, num_labels=labels, problem_type=problem)
        model: nn.Module = transformers.BertForSequenceClassification(config)
    elif kind == "llama":  # self.loss_function without **kwargs: a mean over counted rows
        config = transformers.LlamaConfig(**_LLAMA, num_labels=3, pad_token_id=0)
        model = transformers.LlamaForSequenceClassification(config)
    elif kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=50, n_positions=32, n_embd=16, n_layer=1,
                                         n_head=2, num_labels=3, pad_token_id=0)
        model = transformers.GPT2ForSequenceClassification(config)
    else:
        ids = torch.randint(5, 50, (n, 3, 6), generator=g)  # 3 choices: no share's size
        model = transformers.BertForMultipleChoice(transformers.BertConfig(**_BERT))
    logits = _far_from_uniform(model, dict(input_ids=ids))
    # Losses that grow down the batch: the replicas' means differ, so only the right
    # weights give the full-batch loss.
    if kind == "regression":
        return model, dict(input_ids=ids, labels=logits[:, 0] + torch.linspace(0, 4, n))
    if kind == "multi-label":  # the first third of the rows right, the others wrong
        wrong = (torch.arange(n) * 3 >= n)[:, None]
        return model, dict(input_ids=ids, labels=((logits > 0) ^ wrong).float())
    classes = _ranked(logits)
    # An ignored row in the last share: the replicas count 3, 2, 1 rows (7 on 3), or 2, 2,
    # 2, 1 (8 on 4), and their means are weighted by counted rows.
    classes[n - 1] = -100
    return model, dict(input_ids=ids, labels=classes)


@pytest.mark.parametrize("kind", ["single-label", "regression", "multi-label", "gpt2", "llama", "multiple-choice"])
@pytest.mark.parametrize("n,devices", SPLITS)
def test_classification_heads_losses_equal_the_full_batch_loss(n: int, devices: int, kind: str) -> None:
    # The heads bind one loss_fct to MSELoss, CrossEntropyLoss or BCEWithLogitsLoss by
    # problem type; each joins as the full batch's, with no configuration and no warning.
    model, kwargs = _classification_case(kind, n)
    got, want, warned = _loss_call(model, kwargs, devices)
    assert warned == []
    assert got.loss.dim() == 0
    # The loss: a log-sum-exp of the logits, less one of them: they are the magnitude.
    scale = float(want.logits.abs().max())
    assert_close_to_reference(got.loss, want.loss, terms=TERMS, scale=scale)
    assert_close_to_reference(got[0], want[0], terms=TERMS, scale=scale)  # the loss, as on one device
    assert_close_to_reference(got.logits, want.logits, terms=TERMS)


def _question_answering(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "bert":  # computes its loss itself (ignored_index)
        return transformers.BertForQuestionAnswering(transformers.BertConfig(**_BERT))
    config = transformers.LlamaConfig(  # transformers' ForQuestionAnsweringLoss
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
    )
    return transformers.LlamaForQuestionAnswering(config)


def _positions(n: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    starts = torch.randint(0, width, (n,), generator=g)
    ends = torch.randint(0, width, (n,), generator=g)
    return _outside(starts, ends, width)


def _outside(starts: torch.Tensor, ends: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows 1 and n - 1 answered outside the input: ignored by both losses, so the replicas
    count 2, 2, 1 rows (7 on 3), or 1, 2, 2, 1 (8 on 4)."""
    n = len(starts)
    starts[1] = ends[1] = width + 2
    starts[n - 1] = ends[n - 1] = width
    return starts, ends


@pytest.mark.parametrize("kind", ["bert", "llama"])
@pytest.mark.parametrize("return_dict", [True, False])
@pytest.mark.parametrize("n,devices", SPLITS)
def test_question_answering_loss_equals_the_full_batch_loss(
    n: int, devices: int, kind: str, return_dict: bool
) -> None:
    ids = torch.randint(5, 50, (n, 6), generator=torch.Generator().manual_seed(n))
    model = _question_answering(kind)
    logits = _far_from_uniform(model, dict(input_ids=ids), "start_logits")
    with torch.no_grad():
        end_logits = model(input_ids=ids).end_logits
    # Answers from the most likely positions (the first rows) to the least (the last):
    # the replicas' mean losses differ.
    starts, ends = _outside(_ranked(logits), _ranked(end_logits), 6)
    kwargs = dict(input_ids=ids, start_positions=starts, end_positions=ends, return_dict=return_dict)
    got, want, warned = _loss_call(model, kwargs, devices)
    assert warned == []
    assert got[0].dim() == 0
    scale = float(torch.cat([want[1], want[2]]).abs().max())  # the logits: the loss's magnitude
    assert_close_to_reference(got[0], want[0], terms=TERMS, scale=scale)  # the loss first, as on one device
    assert_close_to_reference(got[1], want[1], terms=TERMS)


def test_question_answering_positions_ignored_by_one_loss_only_are_said() -> None:
    # Row 0's start is outside the input and its end is not: the start loss averages over
    # other rows than the end loss, and no weight per replica gives the full-batch loss.
    ids = torch.randint(5, 50, (6, 6), generator=torch.Generator().manual_seed(0))
    starts, ends = _positions(6, 6)
    starts[0], ends[0] = 9, 2
    kwargs = dict(input_ids=ids, start_positions=starts, end_positions=ends)
    got, want, warned = _loss_call(_question_answering("bert"), kwargs, 3)
    assert got.loss.shape == (3,)
    assert [w for w in warned if "BertForQuestionAnswering.forward: some rows' start and end "
            "positions are not both inside the sequence" in w and "one value per replica" in w]
    assert not [w for w in warned if "gather='mean'" in w], warned  # not the full-batch loss
    assert_close_to_reference(got.start_logits, want.start_logits, terms=TERMS)


_VIT = dict(image_size=16, patch_size=4, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _uneven_pixels(n: int) -> torch.Tensor:
    """Images whose magnitude grows down the batch: the replicas' reconstruction losses differ."""
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 3, 16, 16, generator=g) * torch.linspace(0.2, 3.0, n)[:, None, None, None]


@pytest.mark.parametrize("norm_pix_loss,return_dict", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("workers", WORKERS)
def test_vit_mae_loss_is_the_mean_over_the_masked_patches_of_the_full_batch(
    workers: str, norm_pix_loss: bool, return_dict: bool
) -> None:
    # ViTMAE's loss is (loss * mask).sum() / mask.sum() over the mask its forward draws and
    # returns: each replica's mean is weighted by its part of that mask (found by its
    # field's name: a tuple asked for is made after the gather).
    torch.manual_seed(0)
    config = transformers.ViTMAEConfig(
        **_VIT, decoder_hidden_size=16, decoder_num_hidden_layers=1, decoder_num_attention_heads=2,
        decoder_intermediate_size=32, mask_ratio=0.5, norm_pix_loss=norm_pix_loss,
    )
    model = transformers.ViTMAEForPreTraining(config).eval()
    noise = torch.rand(7, 16, generator=torch.Generator().manual_seed(1))  # the masks, as on one device
    kwargs = dict(pixel_values=_uneven_pixels(7), noise=noise, return_dict=return_dict)
    dp = DataParallel(model, device_ids=["cpu"] * 3, workers=workers)  # 3, 2, 2 rows
    try:
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            want, got = model(**kwargs), dp(**kwargs)
    finally:
        dp.close()
    assert [str(w.message) for w in caught if issubclass(w.category, UserWarning)] == []
    assert type(got) is type(want)
    if return_dict:
        assert list(got.keys()) == list(want.keys())
    assert len(got) == len(want) and got[0].dim() == 0  # (loss, logits, mask, ids_restore)
    scale = float(want[1].abs().max()) ** 2  # a squared error of the logits
    assert_close_to_reference(got[0], want[0], terms=TERMS, scale=scale)
    assert_close_to_reference(tuple(got[1:]), tuple(want[1:]), terms=TERMS)


@pytest.mark.parametrize("name", ["ViT", "Swin"])
@pytest.mark.parametrize("n,devices", SPLITS)
def test_masked_image_modeling_loss_weighs_each_replica_by_its_masked_patches(n: int, devices: int, name: str) -> None:
    # ViT's and Swin's loss is a mean over the pixels of the patches bool_masked_pos masks:
    # the rows mask 1 to 10 patches, the last share none, so each replica's mean is weighted
    # by its rows' masked patches (the empty replica adds 0).
    torch.manual_seed(0)
    if name == "ViT":
        model = transformers.ViTForMaskedImageModeling(transformers.ViTConfig(**_VIT, encoder_stride=4))
    else:
        config = transformers.SwinConfig(image_size=16, patch_size=4, embed_dim=8, depths=[1], num_heads=[1],
                                          window_size=2, encoder_stride=4, hidden_dropout_prob=0.0,
                                          attention_probs_dropout_prob=0.0, drop_path_rate=0.0)
        model = transformers.SwinForMaskedImageModeling(config)
    g = torch.Generator().manual_seed(n)
    masked = torch.zeros(n, 16, dtype=torch.bool)
    for row in range(n):
        masked[row, torch.randperm(16, generator=g)[: 1 + row * 9 // n]] = True
    masked[n - dpmethods.chunk_sizes(n, devices)[-1]:] = False
    kwargs = dict(pixel_values=_uneven_pixels(n), bool_masked_pos=masked)
    got, want, warned = _loss_call(model, kwargs, devices)
    assert warned == []
    assert got.loss.dim() == 0
    assert_close_to_reference(got.loss, want.loss, terms=TERMS, scale=float(kwargs["pixel_values"].abs().max()))
    assert_close_to_reference(got.reconstruction, want.reconstruction, terms=TERMS)
    # Gradients too: the weighted join is differentiable.
    model(**kwargs).loss.backward()
    weight = next(model.parameters())
    want_grad, weight.grad = weight.grad.clone(), None
    model.zero_grad()
    DataParallel(model, device_ids=["cpu"] * devices)(**kwargs).loss.backward()
    assert_close_to_reference(weight.grad, want_grad, terms=GRAD_TERMS)


def _segmenter(name: str, labels: int = 3) -> nn.Module:
    torch.manual_seed(0)
    if name == "segformer":  # CrossEntropyLoss(ignore_index=config.semantic_loss_ignore_index) itself
        config = transformers.SegformerConfig(
            num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
            patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
            decoder_hidden_size=16, num_labels=labels,
        )
        return transformers.SegformerForSemanticSegmentation(config)
    # transformers' ForSemanticSegmentationLoss, with its auxiliary head's term.
    config = transformers.BeitConfig(
        image_size=32, patch_size=8, hidden_size=16, num_hidden_layers=4, num_attention_heads=2,
        intermediate_size=32, out_indices=[1, 2, 3, 4], num_labels=labels, use_auxiliary_head=True,
        pool_scales=[1, 2], auxiliary_channels=8, auxiliary_num_convs=1, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BeitForSemanticSegmentation(config)


def _pixel_labels(model: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """Each pixel's label: the most likely class in the first rows (a small loss), the
    least likely in the others (a large one), 255 (ignored) for a share of the pixels
    growing down the batch."""
    n = pixels.shape[0]
    logits = _far_from_uniform(model, dict(pixel_values=pixels))
    logits = nn.functional.interpolate(logits, size=pixels.shape[-2:], mode="bilinear", align_corners=False)
    labels = torch.where((torch.arange(n) >= n // 2)[:, None, None], logits.argmin(1), logits.argmax(1))
    g = torch.Generator().manual_seed(n)
    return labels.masked_fill(torch.rand(labels.shape, generator=g) < torch.linspace(0.0, 0.95, n)[:, None, None], 255)


@pytest.mark.parametrize("name", ["segformer", "beit"])
@pytest.mark.parametrize("n,devices", SPLITS)
def test_semantic_segmentation_loss_is_the_full_batch_mean_over_its_labelled_pixels(n: int, devices: int, name: str) -> None:
    # A cross-entropy over the pixels whose label is not the config's ignore index (255):
    # the replicas' means are weighted by their labelled pixels (BEiT's auxiliary head's
    # term likewise), with no warning.
    model = _segmenter(name)
    pixels = torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(n))
    kwargs = dict(pixel_values=pixels, labels=_pixel_labels(model, pixels))
    got, want, warned = _loss_call(model, kwargs, devices)
    assert warned == []
    assert got.loss.dim() == 0
    assert_close_to_reference(got.loss, want.loss, terms=TERMS + 32 * 32, scale=float(want.logits.abs().max()))
    assert_close_to_reference(got.logits, want.logits, terms=TERMS)
    # Segformer with one label computes a binary cross-entropy over every pixel instead.
    binary = _segmenter("segformer", labels=1)
    got, _, warned = _loss_call(binary, dict(pixel_values=pixels, labels=kwargs["labels"].clamp(max=1)), devices)
    assert got.loss.shape == (devices,)
    assert any("SegformerForSemanticSegmentation.forward computes its loss" in w for w in warned), warned


@pytest.mark.parametrize("n,devices", SPLITS)
def test_a_weighted_loss_with_return_dict_false_is_the_first_element(n: int, devices: int) -> None:
    model = _bert_mlm()
    ids, _ = _tokens(n)
    labels = _uneven_labels(ids, devices)
    _far_from_uniform(model, dict(input_ids=ids))  # tokens' losses differ
    got, want, warned = _loss_call(model, dict(input_ids=ids, labels=labels, return_dict=False), devices)
    assert type(got) is tuple and warned == []
    assert_close_to_reference(got[0], want[0], terms=TERMS, scale=float(want[1].abs().max()))
    assert_close_to_reference(got[1], want[1], terms=TERMS)


def _mean_loss_case(name: str, n: int) -> tuple[nn.Module, dict[str, Any]]:
    """A model whose forward computes a mean loss itself, on data where each replica's
    mean counts a different number of elements, and its arguments."""
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(5, 50, (n, 8), generator=g)
    mask = torch.ones_like(ids)
    for row, length in enumerate(torch.linspace(8, 2, n).long().tolist()):
        mask[row, length:] = 0  # fewer active tokens down the batch
    torch.manual_seed(0)
    if name in ("electra", "electra-unmasked", "funnel"):  # BCE over the tokens attention_mask == 1 selects
        flips = (torch.rand(n, 8, generator=g) < 0.3).long()
        if name == "funnel":
            config = transformers.FunnelConfig(vocab_size=50, block_sizes=[1, 1], d_model=16, n_head=2, d_head=8, d_inner=32)
            return transformers.FunnelForPreTraining(config), dict(input_ids=ids, attention_mask=mask, labels=flips)
        model = transformers.ElectraForPreTraining(transformers.ElectraConfig(**_BERT, embedding_size=16))
        if name == "electra-unmasked":  # a mean over every token: as many per row
            return model, dict(input_ids=ids, labels=flips)
        return model, dict(input_ids=ids, attention_mask=mask, labels=flips)
    if name == "deberta":  # problem_type None: a cross-entropy over the rows whose label is >= 0
        model = transformers.DebertaV2ForSequenceClassification(transformers.DebertaV2Config(**_BERT, num_labels=3))
        labels = torch.arange(n) % 3
        labels[1 : n // 2 + 1] = -1  # the first replicas count fewer rows
        return model, dict(input_ids=ids, attention_mask=mask, labels=labels)
    if name == "videomae":  # MSELoss() over the masked patches, as many in every row
        config = transformers.VideoMAEConfig(
            image_size=16, patch_size=4, num_frames=2, tubelet_size=2, hidden_size=16, num_hidden_layers=1,
            num_attention_heads=2, intermediate_size=32, decoder_hidden_size=16, decoder_num_hidden_layers=1,
            decoder_num_attention_heads=2, decoder_intermediate_size=32,
        )
        masked = torch.zeros(n, 16, dtype=torch.bool)
        for row in range(n):
            masked[row, torch.randperm(16, generator=g)[:6]] = True
        video = torch.randn(n, 2, 3, 16, 16, generator=g) * torch.linspace(0.2, 3.0, n)[:, None, None, None, None]
        return transformers.VideoMAEForPreTraining(config), dict(pixel_values=video, bool_masked_pos=masked)
    if name == "dpt":  # main + weight * auxiliary, one CrossEntropyLoss(ignore_index=255) on the same labels
        config = transformers.DPTConfig(
            image_size=32, patch_size=8, hidden_size=16, num_hidden_layers=4, num_attention_heads=2,
            intermediate_size=32, backbone_out_indices=[0, 1, 2, 3], neck_hidden_sizes=[8, 8, 8, 8],
            fusion_hidden_size=8, num_labels=3, use_auxiliary_head=True, reassemble_factors=[4, 2, 1, 0.5],
        )
        pixels = torch.randint(0, 3, (n, 32, 32), generator=g)
        pixels[torch.rand(n, 32, 32, generator=g) < torch.linspace(0.1, 0.9, n)[:, None, None]] = 255
        return transformers.DPTForSemanticSegmentation(config), dict(pixel_values=torch.randn(n, 3, 32, 32, generator=g),
                                                                     labels=pixels)
    # BLIP's captioning: its text decoder's label-smoothed cross-entropy over labels[:, 1:]
    config = transformers.BlipConfig(
        text_config=dict(_BERT, label_smoothing=0.1),
        vision_config=dict(image_size=16, patch_size=8, hidden_size=16, num_hidden_layers=1,
                           num_attention_heads=2, intermediate_size=32),
        projection_dim=16,
    )
    return transformers.BlipForConditionalGeneration(config), dict(
        pixel_values=torch.randn(n, 3, 16, 16, generator=g), input_ids=ids, attention_mask=mask,
        labels=ids.masked_fill(mask == 0, -100))


_MEAN_LOSSES = ["electra", "electra-unmasked", "funnel", "deberta", "videomae", "dpt", "blip"]


@pytest.mark.parametrize("name", _MEAN_LOSSES)
@pytest.mark.parametrize("n,devices", SPLITS)
def test_a_mean_loss_the_forward_computes_is_weighted_by_what_each_replica_counts(n: int, devices: int, name: str) -> None:
    # Read from the forward's source: a mean over what a comparison of an argument selects
    # (attention_mask == 1, labels >= 0) is weighted by each replica's part of it; a mean
    # over every element of batch-first tensors by rows; several terms of one plan, or a
    # child model's loss on the same labels, as that plan.
    model, kwargs = _mean_loss_case(name, n)
    got, want, warned = _loss_call(model, kwargs, devices)
    assert warned == []
    assert got.loss.dim() == 0
    assert_close_to_reference(got.loss, want.loss, terms=TERMS + 32 * 32)


@pytest.mark.parametrize("name", ["electra", "dpt"])
def test_a_mean_loss_the_forward_computes_has_one_device_gradients(name: str) -> None:
    model, kwargs = _mean_loss_case(name, 7)
    model.eval()  # no dropout: the same function on one device and on the replicas
    model(**kwargs).loss.backward()
    want = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    DataParallel(model, device_ids=["cpu"] * 3, workers="threads")(**kwargs).loss.backward()
    got = dict(model.named_parameters())
    # All at once: some gradients are rounding noise (1e-15) beside the others.
    assert_close_to_reference(torch.cat([got[k].grad.flatten() for k in want]),
                              torch.cat([g.flatten() for g in want.values()]), terms=GRAD_TERMS + 32 * 32)


@pytest.mark.parametrize("n,devices", SPLITS)
def test_a_loss_dpmethods_cannot_identify_keeps_per_replica_losses_with_a_warning(n: int, devices: int) -> None:
    # BertForPreTraining adds a masked-LM and a next-sentence loss: no one mean to weight.
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32,
    )
    ids, labels = _tokens(n)
    kwargs = dict(input_ids=ids, labels=labels, next_sentence_label=torch.arange(n) % 2)
    got, want, warned = _loss_call(transformers.BertForPreTraining(config), kwargs, devices)
    assert got.loss.shape == (devices,)  # one value per replica
    assert any(
        "BertForPreTraining.forward computes its loss in a way dpmethods can't join" in w
        and "{'loss': 'mean'}" in w
        for w in warned
    ), warned
    assert_close_to_reference(got.prediction_logits, want.prediction_logits, terms=TERMS)


@pytest.mark.parametrize("n,devices", SPLITS)
def test_a_cross_entropy_over_labels_a_mask_selects_keeps_per_replica_losses_with_a_warning(n: int, devices: int) -> None:
    # BROS's entity linking averages over labels.view(-1)[mask], the rows of its
    # bbox_first_token_mask: not the labels other than -100 (here all of them), which a
    # weight per replica would count.
    torch.manual_seed(0)
    config = transformers.BrosConfig(**_BERT, dim_bbox=8, dim_bbox_sinusoid_emb_2d=64, dim_bbox_sinusoid_emb_1d=8,
                                     dim_bbox_projection=8)
    model = transformers.BrosSpadeELForTokenClassification(config)
    g = torch.Generator().manual_seed(n)
    width = 8
    first = torch.rand(n, width, generator=g) < torch.linspace(0.9, 0.2, n)[:, None]  # uneven per row
    first[:, 0] = True
    labels = torch.full((n, width), width)  # "no link": the last column, never masked
    for row in range(n):
        for i in range(width):
            links = [j for j in range(width) if first[row, j] and j != i]
            if links and i % 3:
                labels[row, i] = links[(row + i) % len(links)]
    kwargs = dict(input_ids=torch.randint(5, 50, (n, width), generator=g), bbox=torch.rand(n, width, 8, generator=g),
                  attention_mask=torch.ones(n, width, dtype=torch.long), bbox_first_token_mask=first, labels=labels)
    got, want, warned = _loss_call(model, kwargs, devices)
    assert got.loss.shape == (devices,)  # one value per replica
    assert any("BrosSpadeELForTokenClassification.forward computes its loss in a way dpmethods can't join" in w
               for w in warned), warned
    assert_close_to_reference(got.logits, want.logits, terms=TERMS)


class _ActiveTokensLM(transformers.BertForMaskedLM):
    """A masked LM whose cross-entropy is over the labels ``attention_mask > 0`` selects,
    written as ELECTRA selects its active tokens: the -100 labels among them are not
    counted, so the active tokens are not what it averages over."""

    def forward(self, input_ids: Any = None, attention_mask: Any = None, labels: Any = None) -> Any:
        logits = self.cls(self.bert(input_ids, attention_mask=attention_mask).last_hidden_state)
        loss = None
        if labels is not None:
            loss_fct = nn.CrossEntropyLoss()
            active_loss = attention_mask.view(-1, logits.shape[1]) > 0
            active_labels = labels[active_loss]
            loss = loss_fct(logits[active_loss], active_labels)
        return transformers.modeling_outputs.MaskedLMOutput(loss=loss, logits=logits)


def test_a_cross_entropy_over_what_another_argument_selects_keeps_per_replica_losses_with_a_warning() -> None:
    torch.manual_seed(0)
    model = _ActiveTokensLM(transformers.BertConfig(**_BERT))
    ids, labels = _tokens(7)
    mask = torch.ones_like(ids)
    mask[:, 6:] = 0
    got, want, warned = _loss_call(model, dict(input_ids=ids, attention_mask=mask, labels=labels), 3)
    assert got.loss.shape == (3,)
    assert any("_ActiveTokensLM.forward computes its loss in a way dpmethods can't join" in w for w in warned), warned
    assert_close_to_reference(got.logits, want.logits, terms=TERMS)


def _mixtral(**options: Any) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2, num_experts_per_tok=1, **options,
    )
    return transformers.MixtralForCausalLM(config)


def _jetmoe(**options: Any) -> nn.Module:  # its coefficient is aux_loss_coef
    torch.manual_seed(0)
    config = transformers.JetMoeConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_key_value_heads=1, kv_channels=8,
        intermediate_size=32, num_local_experts=2, num_experts_per_tok=1, **options,
    )
    return transformers.JetMoeForCausalLM(config)


def _bamba(**options: Any) -> nn.Module:  # adds a z-loss, a mean over rows, when its coefficient is set
    torch.manual_seed(0)
    config = transformers.BambaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, mamba_n_heads=2, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8,
        mamba_expand=2, attn_layer_indices=[0], **options,
    )
    return transformers.BambaForCausalLM(config)


class _MixedLossLM(transformers.LlamaForCausalLM):
    """A causal LM that mixes its token-averaged loss with a z-loss over its rows when
    asked, written as VibeVoice mixes its diffusion loss: ``(1 - w) * loss + w * other``."""

    def forward(self, input_ids: Any = None, labels: Any = None, z_weight: float | None = None, **kwargs: Any) -> Any:
        logits = super().forward(input_ids=input_ids, **kwargs).logits
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
        if z_weight is not None and loss is not None:
            loss = (1 - z_weight) * loss + z_weight * logits.logsumexp(-1).pow(2).mean()
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


def _mixed(**options: Any) -> nn.Module:
    torch.manual_seed(0)
    return _MixedLossLM(transformers.LlamaConfig(**_LLAMA))


@pytest.mark.parametrize(
    "build,added,name",
    [
        (_mixtral, dict(output_router_logits=True), "MixtralForCausalLM"),
        (_jetmoe, dict(output_router_logits=True), "JetMoeForCausalLM"),
        (_bamba, dict(z_loss_coefficient=0.1), "BambaForCausalLM"),
        (_mixed, dict(z_weight=0.3), "_MixedLossLM"),
    ],
    ids=["mixtral-router", "jetmoe-router", "bamba-z-loss", "mixed"],
)
def test_a_term_added_to_the_loss_keeps_per_replica_losses_with_a_warning(build: Any, added: dict[str, Any], name: str) -> None:
    # A router's load-balancing loss over each replica's tokens, or a z-loss over its rows,
    # added to the token-averaged loss: neither a sum of shares nor a weighted mean.
    ids, labels = _tokens(7)
    passed = ("output_router_logits", "z_weight")  # arguments of the call, the others the config's
    options = {k: v for k, v in added.items() if k not in passed}
    kwargs = dict(input_ids=ids, labels=labels, **{k: v for k, v in added.items() if k in passed})
    got, want, warned = _loss_call(build(**options), kwargs, 3)
    assert got.loss.shape == (3,)
    assert any(f"{name}.forward computes its loss in a way dpmethods can't join" in w
               and "or it adds another term to it" in w for w in warned), warned
    assert_close_to_reference(got.logits, want.logits, terms=TERMS)
    # Without the added term: shares of the full-batch loss, with no warning.
    got, want, warned = _loss_call(build(), dict(input_ids=ids, labels=labels), 3)
    assert warned == []
    assert_close_to_reference(got.loss, want.loss, terms=TERMS)


def test_forward_without_labels_and_with_gather_given_is_unchanged() -> None:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    )
    ids, labels = _tokens(7)
    got, want, warned = _loss_call(model, dict(input_ids=ids), 3)
    assert warned == [] and got.loss is None
    assert_close_to_reference(got.logits, want.logits, terms=TERMS)
    # The user's gather wins, and then no num_items_in_batch is passed: row-weighted mean.
    dp = DataParallel(model, device_ids=["cpu"] * 3, methods={"forward": {"gather": {"loss": "mean"}}})
    with torch.no_grad():
        per_row = [model(input_ids=ids[a:b], labels=labels[a:b]).loss for a, b in ((0, 3), (3, 5), (5, 7))]
        mean = dp(input_ids=ids, labels=labels).loss
    assert_close_to_reference(mean, sum(loss * w for loss, w in zip(per_row, (3 / 7, 2 / 7, 2 / 7))), terms=TERMS)

# --- caches: joined, and updated in place when passed in --------------------------


@pytest.mark.parametrize("batch,devices", SPLITS)
def test_gpt2_cache_joined_and_used_for_the_next_step(batch: int, devices: int) -> None:
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=99,
                                     n_positions=64, bos_token_id=0, eos_token_id=0)
    gpt = transformers.GPT2LMHeadModel(config).eval()
    ids, nxt = torch.randint(0, 99, (batch, 5)), torch.randint(0, 99, (batch, 1))
    import inspect

    # transformers 5.x renamed past_key_values to cache.
    cache_arg = "cache" if "cache" in inspect.signature(gpt.forward).parameters else "past_key_values"
    dp = DataParallel(gpt, device_ids=["cpu"] * devices)
    with torch.no_grad():
        ref1 = gpt(ids, use_cache=True)
        ref_cache = ref1[cache_arg] if cache_arg in ref1 else ref1.past_key_values
        ref2 = gpt(nxt, use_cache=True, **{cache_arg: ref_cache})
        got1 = dp(ids, use_cache=True)
        cache = got1[cache_arg] if cache_arg in got1 else got1.past_key_values
        assert type(cache) is type(ref_cache) and cache.get_seq_length() == 5
        assert cache.layers[0].keys.shape[0] == batch
        got2 = dp(nxt, use_cache=True, **{cache_arg: cache})
    assert_close_to_reference(got1.logits, ref1.logits, terms=TERMS)
    assert_close_to_reference(got2.logits, ref2.logits, terms=TERMS)
    next_cache = got2[cache_arg] if cache_arg in got2 else got2.past_key_values
    assert next_cache.get_seq_length() == 6 and next_cache.layers[1].keys.shape[0] == batch


@pytest.mark.parametrize("return_dict", [True, False])
@pytest.mark.parametrize("workers", WORKERS)
def test_xlnet_mems_are_joined_and_split_along_their_batch_dim(workers: str, return_dict: bool) -> None:
    # XLNet's mems are one [memory length, batch, d_model] tensor per layer: returned with
    # the batch in dim 1 (with a tuple too, whose positions depend on which fields are
    # None), and taken back so on the next step.
    torch.manual_seed(0)
    config = transformers.XLNetConfig(vocab_size=50, d_model=16, n_layer=2, n_head=2, d_inner=32, mem_len=5)
    model = transformers.XLNetLMHeadModel(config).eval()
    ids, labels = _tokens(7)
    labels[1] = -100  # unequal -100 counts: each replica's mean weighted by its tokens
    mask = torch.ones_like(ids)
    mask[2, 5:] = 0
    first = dict(input_ids=ids, attention_mask=mask, labels=labels, return_dict=return_dict)
    dp = DataParallel(model, device_ids=["cpu"] * 3, workers=workers)  # 3, 2, 2 rows
    try:
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            want, got = model(**first), dp(**first)
            mems = got[2] if not return_dict else got.mems
            assert mems[0].shape == (5, 7, 16)  # the last mem_len positions of every row
            second = dict(input_ids=ids[:, :3], mems=mems, return_dict=return_dict)
            want_next = model(**{**second, "mems": want[2] if not return_dict else want.mems})
            got_next = dp(**second)
    finally:
        dp.close()
    assert [str(w.message) for w in caught if issubclass(w.category, UserWarning)] == []
    assert type(got) is type(want) and len(got) == len(want)
    assert got[0].dim() == 0  # the loss, first
    assert_close_to_reference(tuple(got), tuple(want), terms=TERMS)
    assert_close_to_reference(tuple(got_next), tuple(want_next), terms=TERMS)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
@pytest.mark.parametrize("batch,devices", SPLITS)
def test_a_cache_passed_in_is_updated_in_place_as_on_one_device(batch: int, devices: int, kind: str) -> None:

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=99, n_positions=64)
    gpt = transformers.GPT2LMHeadModel(config).eval()
    ids, nxt = torch.randint(0, 99, (batch, 5)), torch.randint(0, 99, (batch, 1))

    def new_cache() -> Any:
        if kind == "dynamic":
            return transformers.DynamicCache()
        return transformers.StaticCache(config=config, max_cache_len=8)

    def steps(model: Any) -> tuple[Any, Any, Any]:
        cache = new_cache()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # past_key_values renamed in 5.x
            first = model(ids, past_key_values=cache, use_cache=True)
            # Code that keeps its own cache object: the next step reuses it.
            second = model(nxt, past_key_values=cache, use_cache=True)
        return cache, first, second

    ref_cache, ref1, ref2 = steps(gpt)
    dp = DataParallel(gpt, device_ids=["cpu"] * devices)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        cache, got1, got2 = steps(dp)
    assert cache.get_seq_length() == ref_cache.get_seq_length() == 6
    assert got2.past_key_values is cache  # the object passed in, as on one device
    assert_close_to_reference(got1.logits, ref1.logits, terms=TERMS)
    assert_close_to_reference(got2.logits, ref2.logits, terms=TERMS)
    for g, w in zip(cache.layers, ref_cache.layers):
        assert_close_to_reference(g.keys, w.keys, terms=TERMS)


# --- Encodec: codes with the batch in dim 1 -----------------------------------------


@pytest.mark.parametrize("batch,devices", [pytest.param(6, 3, id="6-on-3"), pytest.param(7, 3, id="7-on-3")])
def test_encodec_codes_batch_in_dim_1(batch: int, devices: int) -> None:
    config = transformers.EncodecConfig(
        target_bandwidths=[1.5, 3.0], sampling_rate=400, hidden_size=16, num_filters=4,
        num_residual_layers=1, upsampling_ratios=[2, 2], codebook_size=32, num_lstm_layers=1,
    )
    model = transformers.EncodecModel(config).eval()
    audio = torch.randn(batch, 1, 64)
    cpus = ["cpu"] * devices
    with torch.no_grad():
        ref = model.encode(audio, bandwidth=3.0)
        # audio_codes is [chunks, batch, quantizers, frames]: joined on dim 1, with no
        # configuration.
        dp = DataParallel(model, device_ids=cpus)
        got = dp.encode(audio, bandwidth=3.0)
        assert torch.equal(got.audio_codes, ref.audio_codes)
        # decode takes the codes (batch in dim 1, split there) and returns audio [batch, 1, t].
        seen = []
        hook = model.decoder.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[0]))
        try:
            got_audio = dp.decode(ref.audio_codes, ref.audio_scales).audio_values
        finally:
            hook.remove()
        assert sorted(seen) == sorted(dpmethods.chunk_sizes(batch, devices))  # each replica its rows
        # The decoder: an LSTM over 16 frames (16 + 16 inputs, 2 biases a step) and about
        # 6 convs of kernel 7 over 16 channels.
        terms = 16 * (16 + 16 + 2) + 6 * 7 * 16
        assert_close_to_reference(got_audio, model.decode(ref.audio_codes, ref.audio_scales).audio_values, terms=terms)
        # The options spelled out, as before: the same.
        dec = DataParallel(model, device_ids=cpus, methods={"decode": {"dim": 1, "gather_dim": 0}})
        assert_close_to_reference(dec.decode(ref.audio_codes, ref.audio_scales).audio_values, got_audio, terms=terms)
        if batch % devices == 0:  # equal shares: joining the audio on dim 1 would succeed, wrongly
            plain = DataParallel(model, device_ids=cpus, methods={"decode": {"dim": 1}})
            with pytest.warns(UserWarning, match=r"audio_values is joined along dim 1.*its dim 0 has them"):
                plain.decode(ref.audio_codes, ref.audio_scales)

# --- hooks registered inside a replica: transformers' output capture ---------------


@pytest.mark.parametrize("batch,devices", SPLITS)
def test_llama_hidden_states_and_attentions_when_the_wrapper_runs_first(batch: int, devices: int) -> None:
    # transformers installs its output-capturing hooks on the first forward of a model
    # object; a replica is a new object, and its hooks went into the module's dicts.
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    config._attn_implementation = "eager"
    llama = transformers.LlamaModel(config).eval()
    ids = torch.randint(0, 64, (batch, 5))
    dp = DataParallel(llama, device_ids=["cpu"] * devices)
    with torch.no_grad():
        for _ in range(2):
            got = dp(input_ids=ids, output_attentions=True, output_hidden_states=True)
        ref = llama(input_ids=ids, output_attentions=True, output_hidden_states=True)
    assert len(got.attentions) == len(ref.attentions) == 2
    assert len(got.hidden_states) == len(ref.hidden_states) == 3
    for g, r in zip(got.attentions + got.hidden_states, ref.attentions + ref.hidden_states):
        assert_close_to_reference(g, r, terms=TERMS)
    assert_close_to_reference(got.last_hidden_state, ref.last_hidden_state, terms=TERMS)


# --- the Qwen2-VL family: patches of all images, split by row ------------------------


@pytest.mark.parametrize("devices", [3, 4])
def test_qwen2_vl_patches_of_all_images_split_by_row_with_no_configuration(devices: int) -> None:

    model, inputs = tiny_qwen2_vl()
    dp = DataParallel(model, device_ids=["cpu"] * devices)
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        want, got = model(**inputs), dp(**inputs)
        want_tokens, got_tokens = model.generate(**inputs, **kwargs), dp.generate(**inputs, **kwargs)
    assert_close_to_reference(got.logits, want.logits, terms=TERMS)
    assert type(got.image_outputs.pooler_output) is type(want.image_outputs.pooler_output)
    assert len(got.image_outputs.pooler_output) == len(want.image_outputs.pooler_output) == 7
    for g, w in zip(got.image_outputs.pooler_output, want.image_outputs.pooler_output):
        assert_close_to_reference(g, w, terms=TERMS)
    assert torch.equal(got_tokens, want_tokens)


@pytest.mark.parametrize("workers", WORKERS)
def test_llava_vision_towers_per_layer_hidden_states_join_as_one_device(workers: str) -> None:
    # image_outputs is the vision tower's output, one row per image: its hidden_states, a
    # tuple with one entry per layer, join entry by entry (each layer's rows in image
    # order), and its pooler_output, a list with one entry per image, is extended.
    torch.manual_seed(0)
    vision = transformers.CLIPVisionConfig(image_size=16, patch_size=8, hidden_size=16, num_hidden_layers=2,
                                           num_attention_heads=2, intermediate_size=32)
    config = transformers.LlavaConfig(vision_config=vision, text_config=transformers.LlamaConfig(**{**_LLAMA, "vocab_size": 60}),
                                      image_token_index=55, projector_hidden_act="gelu", vision_feature_layer=-1)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    g = torch.Generator().manual_seed(7)
    ids = torch.cat([torch.full((7, 4), 55), torch.randint(5, 50, (7, 6), generator=g)], 1)  # 4 image tokens a row
    kwargs = dict(input_ids=ids, pixel_values=torch.randn(7, 3, 16, 16, generator=g))
    dp = DataParallel(model, device_ids=["cpu"] * 3, workers=workers)  # 3, 2, 2 images
    try:
        with torch.no_grad():
            want, got = model(**kwargs), dp(**kwargs)
    finally:
        dp.close()
    assert type(got.image_outputs.hidden_states) is tuple
    assert len(got.image_outputs.hidden_states) == len(want.image_outputs.hidden_states)
    for g_layer, w_layer in zip(got.image_outputs.hidden_states, want.image_outputs.hidden_states):
        assert (g_layer is None) == (w_layer is None)
        if w_layer is not None:
            assert_close_to_reference(g_layer, w_layer, terms=TERMS)
    assert len(got.image_outputs.pooler_output) == len(want.image_outputs.pooler_output) == 7
    assert_close_to_reference(list(got.image_outputs.pooler_output), list(want.image_outputs.pooler_output), terms=TERMS)
    assert_close_to_reference(got.image_outputs.last_hidden_state, want.image_outputs.last_hidden_state, terms=TERMS)
    assert_close_to_reference(got.logits, want.logits, terms=TERMS)
