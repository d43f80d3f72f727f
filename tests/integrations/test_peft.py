"""peft models (LoRA adapters on a tiny GPT-2 and BERT, random weights) through
DataParallel, against one device: adapter_names split per row, generate with no
configuration, and forward's loss joined by the base model's plan."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from dpmethods import DataParallel
from dpmethods.testing import assert_close_to_reference
from dpmethods.vocab import warn_once as warn_once
from tests.helpers import SPLITS, WORKERS
from tests.helpers.terms import transformer_terms


@pytest.fixture(autouse=True)
def _fresh_warnings() -> None:
    warn_once.reset()


# A GPT-2 of 2 blocks, width 32 (MLP 128, LoRA rank 4), over 5 tokens; 64 logits.
TERMS = transformer_terms(width=32, ff=128 + 4, seq=5, layers=2)


# The tiny GPT-2 every test here adapts (the token ids differ per test).
_PEFT_GPT2 = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32)


def _two_adapters() -> Any:
    """The tiny GPT-2 (no eos: every row runs all its steps) with two LoRA adapters,
    "one" and "two", in eval mode."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = transformers.GPT2Config(**_PEFT_GPT2, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    lora = dict(r=4, target_modules=["c_attn"], init_lora_weights=False, fan_in_fan_out=True)
    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.GPT2LMHeadModel(config), peft.LoraConfig(**lora), adapter_name="one")
    model.add_adapter("two", peft.LoraConfig(**lora))
    return model.eval()


@pytest.mark.parametrize("batch,devices", SPLITS)
def test_peft_lora_adapter_names_per_row(batch: int, devices: int) -> None:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = transformers.GPT2Config(**_PEFT_GPT2, bos_token_id=0, eos_token_id=0)
    base = transformers.GPT2LMHeadModel(config)
    lora = dict(r=4, target_modules=["c_attn"], init_lora_weights=False, fan_in_fan_out=True)
    model = peft.get_peft_model(base, peft.LoraConfig(**lora), adapter_name="one")
    model.add_adapter("two", peft.LoraConfig(**lora))
    model.eval()
    ids = torch.randint(0, 64, (batch, 5))
    names = [("one", "two", "__base__")[i % 3] for i in range(batch)]  # peft's per-row adapters
    dp = DataParallel(model, device_ids=["cpu"] * devices, methods={"forward": {"split": "adapter_names"}})
    with torch.no_grad():
        got = dp(input_ids=ids, adapter_names=names, use_cache=False)
        ref = model(input_ids=ids, adapter_names=names, use_cache=False)
    assert_close_to_reference(got.logits, ref.logits, terms=TERMS)
    # forward splits them with no configuration, as generate does.
    plain = DataParallel(model, device_ids=["cpu"] * devices)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "every replica gets all of it"
        got = plain(input_ids=ids, adapter_names=names, use_cache=False)
    assert_close_to_reference(got.logits, ref.logits, terms=TERMS)
    # A gather= that is not transformers' keeps the split (the method's options, updated).
    other = DataParallel(model, device_ids=["cpu"] * devices, methods={"forward": {"gather": "cat"}})
    with torch.no_grad():
        assert_close_to_reference(other(input_ids=ids, adapter_names=names, use_cache=False).logits,
                                  ref.logits, terms=TERMS)


@pytest.mark.parametrize("batch,devices", SPLITS)
def test_peft_generate_is_parallel_with_no_configuration(batch: int, devices: int) -> None:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = transformers.GPT2Config(**_PEFT_GPT2, bos_token_id=0, eos_token_id=5, pad_token_id=0)
    lora = peft.LoraConfig(r=4, target_modules=["c_attn"], init_lora_weights=False, fan_in_fan_out=True)
    model = peft.get_peft_model(transformers.GPT2LMHeadModel(config), lora).eval()
    ids = torch.randint(6, 64, (batch, 5))
    calls: list[tuple[int, int]] = []  # (rows, tokens) of each embedding call
    hook = model.get_base_model().transformer.wte.register_forward_pre_hook(
        lambda m, args: calls.append(tuple(args[0].shape))
    )
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # no "not a parallel method" warning
            got = DataParallel(model, device_ids=["cpu"] * devices).generate(
                input_ids=ids, max_new_tokens=4, do_sample=False, num_beams=2
            )
            # The prompt steps (5 tokens); the replicas' later steps may come in between.
            first = sorted(rows for rows, tokens in calls if tokens == ids.shape[1])
            ref = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, num_beams=2)
    finally:
        hook.remove()
    assert torch.equal(got, ref)
    # Each replica's first step ran its own rows (2 beams each).
    assert first == sorted(2 * (batch // devices + (i < batch % devices)) for i in range(devices))


@pytest.mark.parametrize("batch,devices", SPLITS)
def test_peft_generate_splits_adapter_names_with_no_configuration(batch: int, devices: int) -> None:
    model = _two_adapters()
    ids = torch.randint(1, 64, (batch, 5))
    names = [("one", "two", "__base__")[i % 3] for i in range(batch)]  # one adapter per row
    kwargs = dict(input_ids=ids, adapter_names=names, max_new_tokens=4, do_sample=False)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "every replica gets all of it"
        got = DataParallel(model, device_ids=["cpu"] * devices).generate(**kwargs)
    with torch.no_grad():
        ref = model.generate(**kwargs)
        base = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, ref)
    assert not torch.equal(ref, base)  # the adapters change the tokens: the split matters


@pytest.mark.parametrize("workers", WORKERS)
def test_peft_adapter_names_per_row_on_threads_and_processes(workers: str) -> None:
    model = _two_adapters()
    ids = torch.randint(1, 64, (7, 5))
    names = [("one", "two", "__base__")[i % 3] for i in range(7)]  # one adapter per row
    kwargs = dict(max_new_tokens=4, do_sample=False)
    dp = DataParallel(model, device_ids=["cpu"] * 2, workers=workers)
    try:
        with torch.no_grad():
            ref = model.generate(input_ids=ids, adapter_names=names, **kwargs)
            assert not torch.equal(ref, model.generate(input_ids=ids, **kwargs))  # the adapters matter
            assert torch.equal(dp.generate(input_ids=ids, adapter_names=names, **kwargs), ref)  # 4 + 3 rows
            batches = [{"input_ids": ids[:4], "adapter_names": names[:4]}, {"input_ids": ids[4:], "adapter_names": names[4:]}]
            assert torch.equal(torch.cat(list(dp.map("generate", batches, **kwargs))), ref)
    finally:
        dp.close()


# --- forward: the loss joined by the base model's plan ------------------------------

# The GPT-2 above over 8 tokens; the loss adds a log-sum-exp over 64 logits and a mean
# over the counted tokens (at most 5 * 7), the gradients the tokens and rows they sum over.
LOSS_TERMS = transformer_terms(width=32, ff=128 + 4, seq=8, layers=2) + 64 + 5 * 7
GRAD_TERMS = 2 * LOSS_TERMS + 5 * 8


def _lora_causal_lm() -> tuple[Any, dict[str, Any]]:
    """A LoRA GPT-2 (``PeftModelForCausalLM``) and 5 rows whose labels count 7, 4, 6
    (the first replica's 3 rows) and 1, 0 tokens: -100 padding, unevenly per row."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = transformers.GPT2Config(**_PEFT_GPT2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    lora = peft.LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=["c_attn"], init_lora_weights=False,
                           fan_in_fan_out=True)
    model = peft.get_peft_model(transformers.GPT2LMHeadModel(config), lora)
    ids = torch.randint(1, 64, (5, 8))
    labels = ids.clone()
    for row, width in enumerate((8, 5, 7, 2, 1)):  # label tokens after the shift: width - 1
        labels[row, width:] = -100
    return model, dict(input_ids=ids, labels=labels)


def _lora_bert_classifier() -> tuple[Any, dict[str, Any]]:
    """A LoRA BERT classifier (``PeftModelForSequenceClassification``, 3 classes) and 5
    rows, one label ignored (-100)."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=32, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    lora = peft.LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["query", "value"], init_lora_weights=False)
    model = peft.get_peft_model(transformers.BertForSequenceClassification(config), lora)
    head = model.base_model.model.classifier.modules_to_save["default"]
    with torch.no_grad():
        head.weight.mul_(30.0)  # logits spread: the rows' losses differ, so do the replicas' means
    return model, dict(input_ids=torch.randint(1, 50, (5, 8)), labels=torch.tensor([0, 2, 1, -100, 2]))


@pytest.mark.parametrize("build", [_lora_causal_lm, _lora_bert_classifier], ids=["causal-lm", "classifier"])
@pytest.mark.parametrize("workers", WORKERS)
def test_peft_forward_loss_equals_the_full_batch_loss(workers: str, build: Any) -> None:
    # PeftModel.forward hands the call to its transformers model: its loss is joined by
    # that model's plan (3 + 2 rows), not stacked one per replica.
    model, kwargs = build()
    model.eval()
    want = model(**kwargs)
    with torch.no_grad():  # the replicas' own means, whose plain mean is not the full-batch loss
        means = [model(**{k: v[rows] for k, v in kwargs.items()}).loss for rows in (slice(0, 3), slice(3, 5))]
    assert abs(float(torch.stack(means).mean()) - want.loss.item()) > 0.02
    dp = DataParallel(model, device_ids=["cpu"] * 2, workers=workers)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # no "stacked into a vector" note
            if workers == "processes":
                with torch.no_grad():
                    got = dp(**kwargs)
            else:
                got = dp(**kwargs)
    finally:
        dp.close()
    assert list(got.keys()) == list(want.keys())  # the loss first, as on one device
    assert got.loss.dim() == 0
    assert_close_to_reference(got.loss, want.loss.detach(), terms=LOSS_TERMS)
    assert_close_to_reference(got.logits, want.logits.detach(), terms=LOSS_TERMS)
    if workers == "threads":
        # Gradients too: the LoRA weights' (the ones a peft model trains).
        lora = [p for n, p in model.named_parameters() if "lora_A" in n]
        want_grads = torch.autograd.grad(want.loss, lora)
        got_grads = torch.autograd.grad(got.loss, lora)
        assert_close_to_reference(got_grads, want_grads, terms=GRAD_TERMS)


# CLIP of tests/helpers/contrastive_models (2 blocks of width 32, MLP 37 + LoRA rank 4,
# over up to 17 tokens) and the projections; the logits' 16-wide products.
CLIP_TERMS = transformer_terms(width=32, ff=37 + 4, seq=17, layers=2) + 3 * 32 + 16


@pytest.mark.parametrize("workers", WORKERS)
def test_peft_clip_logits_and_loss_from_the_joined_embeddings(workers: str) -> None:
    # A LoRA CLIP's logits_per_* score every text against every image of the batch: they
    # and the contrastive loss are computed from the joined embeddings, as for CLIP itself.
    peft = pytest.importorskip("peft")
    from tests.helpers.contrastive_models import clip

    base, inputs = clip()
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(base, lora).eval()
    x = inputs(5)
    dp = DataParallel(model, device_ids=["cpu"] * 2, workers=workers)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # no "each replica's own" warning
            want = model(**x, return_loss=True)
            got = dp(**x, return_loss=True)  # 3 + 2 rows
            got_tuple = dp(**x, return_loss=True, return_dict=False)
    finally:
        dp.close()
    assert list(got.keys()) == list(want.keys())
    scale = float(want.logits_per_text.abs().max())  # the loss's log-sum-exp over the batch
    for i, key in enumerate(["loss", "logits_per_image", "logits_per_text", "text_embeds", "image_embeds"]):
        assert_close_to_reference(got[key], want[key], terms=CLIP_TERMS, scale=scale, msg=key)
        assert_close_to_reference(got_tuple[i], want[key], terms=CLIP_TERMS, scale=scale, msg=key)
