"""Real third-party models (tiny configs, random weights, nothing downloaded) through
dpmethods.DataParallel on CPU devices, against the bare model on the full batch:
uneven (7 items on 3 replicas) and even (8 on 4) batches."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from _tiny_models import random_sentences, tiny_sentence_transformer
from torch import nn

import dpmethods
from dpmethods import DataParallel, warn_once

SPLITS = [pytest.param(7, 3, id="7-on-3"), pytest.param(8, 4, id="8-on-4")]
ATOL = 1e-5


@pytest.fixture(autouse=True)
def _fresh_warnings() -> None:
    warn_once.reset()


def _close(got: Any, ref: Any) -> None:
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


# --- torchvision detection: a list of images of different sizes, a list of targets --


def _detector() -> nn.Module:
    detection = pytest.importorskip("torchvision.models.detection")
    # Small images; every anchor and proposal sampled (huge per-image batch sizes) and a
    # fixed number of proposals per image, so the training losses are deterministic and
    # each image weighs the same in them, as the "mean" gather assumes.
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
        for key in r:
            _close(g[key], r[key])


@pytest.mark.parametrize("batch,devices", SPLITS)
def test_torchvision_detection_training_with_targets(batch: int, devices: int) -> None:
    model = _detector().train()
    for m in model.modules():  # batch statistics would couple the items (see docs)
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()
    images = _images(batch)
    targets = [
        {
            "boxes": torch.tensor([[5.0, 5.0, 30.0, 40.0], [10.0 + i, 20.0, 50.0, 60.0]]),
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
    for key in ref:
        _close(got[key], ref[key])
    grad = torch.autograd.grad(sum(got.values()), model.roi_heads.box_predictor.cls_score.weight)[0]
    _close(grad, ref_grad)


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
    np.testing.assert_allclose(got, ref, atol=ATOL, rtol=0)
    assert sorted(seen) == sorted([batch // devices + (i < batch % devices) for i in range(devices)])


@pytest.mark.parametrize("batch,devices", SPLITS)
def test_sentence_transformers_encode_outputs_and_precisions_with_no_configuration(
    sentence_model: Any, batch: int, devices: int
) -> None:
    np = pytest.importorskip("numpy")
    sentences = random_sentences(batch)
    dp = DataParallel(sentence_model, device_ids=["cpu"] * devices)  # the built-in rule only

    def same(got: Any, ref: Any) -> None:
        assert type(got) is type(ref)
        if isinstance(ref, list):
            assert len(got) == len(ref)
            for g, r in zip(got, ref):
                same(g, r)
        elif isinstance(ref, torch.Tensor):
            assert got.dtype == ref.dtype and got.shape == ref.shape
            torch.testing.assert_close(got.double(), ref.double(), atol=ATOL, rtol=0)
        else:
            assert got.dtype == ref.dtype and got.shape == ref.shape
            np.testing.assert_allclose(got.astype(float), ref.astype(float), atol=ATOL, rtol=0)

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
    # One string is one input: one embedding back, not a batch of one.
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
    _close(got.sample(torch.Generator().manual_seed(3)), ref.sample(torch.Generator().manual_seed(3)))
    _close(got.mode(), ref.mode())
    _close(got.kl(), ref.kl())
    _close(got.std, ref.std)


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
            _close(dp.encode(x).latents, latents)
            _close(dp.decode(latents).sample, vae.decode(latents).sample)
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
        _close(got[key], ref[key])


@pytest.mark.parametrize("batch,devices", SPLITS)
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
    _close(loss, ref.loss)


# --- GPT-2: the forward cache is joined and used for one more step -----------------


@pytest.mark.parametrize("batch,devices", SPLITS)
def test_gpt2_cache_joined_and_used_for_the_next_step(batch: int, devices: int) -> None:
    transformers = pytest.importorskip("transformers")
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
    _close(got1.logits, ref1.logits)
    _close(got2.logits, ref2.logits)
    next_cache = got2[cache_arg] if cache_arg in got2 else got2.past_key_values
    assert next_cache.get_seq_length() == 6 and next_cache.layers[1].keys.shape[0] == batch


@pytest.mark.parametrize("kind", ["dynamic", "static"])
@pytest.mark.parametrize("batch,devices", SPLITS)
def test_a_cache_passed_in_is_updated_in_place_as_on_one_device(batch: int, devices: int, kind: str) -> None:
    transformers = pytest.importorskip("transformers")
    import warnings

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
    _close(got1.logits, ref1.logits)
    _close(got2.logits, ref2.logits)
    for g, w in zip(cache.layers, ref_cache.layers):
        _close(g.keys, w.keys)


# --- Encodec: codes with the batch in dim 1 -----------------------------------------


@pytest.mark.parametrize("batch,devices", [pytest.param(6, 3, id="6-on-3"), pytest.param(7, 3, id="7-on-3")])
def test_encodec_codes_batch_in_dim_1(batch: int, devices: int) -> None:
    transformers = pytest.importorskip("transformers")
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
        _close(got_audio, model.decode(ref.audio_codes, ref.audio_scales).audio_values)
        # The options spelled out, as before: the same.
        dec = DataParallel(model, device_ids=cpus, methods={"decode": {"dim": 1, "gather_dim": 0}})
        _close(dec.decode(ref.audio_codes, ref.audio_scales).audio_values, got_audio)
        if batch % devices == 0:  # equal shares: joining the audio on dim 1 would succeed, wrongly
            plain = DataParallel(model, device_ids=cpus, methods={"decode": {"dim": 1}})
            with pytest.warns(UserWarning, match=r"audio_values is joined along dim 1.*its dim 0 has them"):
                plain.decode(ref.audio_codes, ref.audio_scales)


# --- hooks registered inside a replica: transformers' output capture, peft adapters --


@pytest.mark.parametrize("batch,devices", SPLITS)
def test_llama_hidden_states_and_attentions_when_the_wrapper_runs_first(batch: int, devices: int) -> None:
    # transformers installs its output-capturing hooks on the first forward of a model
    # object; a replica is a new object, and its hooks went into the module's dicts.
    transformers = pytest.importorskip("transformers")
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
        _close(g, r)
    _close(got.last_hidden_state, ref.last_hidden_state)


@pytest.mark.parametrize("batch,devices", SPLITS)
def test_peft_lora_adapter_names_per_row(batch: int, devices: int) -> None:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
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
    _close(got.logits, ref.logits)
    # Without split= every replica would get all the names: said, not silently done.
    plain = DataParallel(model, device_ids=["cpu"] * devices)
    with pytest.warns(UserWarning, match=r"argument 'adapter_names' is a list of .*split=\('adapter_names',\)"):
        with pytest.raises(ValueError, match="adapter_names"):
            with torch.no_grad():
                plain(input_ids=ids, adapter_names=names, use_cache=False)


@pytest.mark.parametrize("batch,devices", SPLITS)
def test_peft_generate_is_parallel_with_no_configuration(batch: int, devices: int) -> None:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32,
                                     bos_token_id=0, eos_token_id=5, pad_token_id=0)
    lora = peft.LoraConfig(r=4, target_modules=["c_attn"], init_lora_weights=False, fan_in_fan_out=True)
    model = peft.get_peft_model(transformers.GPT2LMHeadModel(config), lora).eval()
    ids = torch.randint(6, 64, (batch, 5))
    calls: list[int] = []
    hook = model.get_base_model().transformer.wte.register_forward_pre_hook(
        lambda m, args: calls.append(args[0].shape[0])
    )
    import warnings

    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # no "not a parallel method" warning
            got = DataParallel(model, device_ids=["cpu"] * devices).generate(
                input_ids=ids, max_new_tokens=4, do_sample=False, num_beams=2
            )
            first = sorted(calls[:devices])
            ref = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, num_beams=2)
    finally:
        hook.remove()
    assert torch.equal(got, ref)
    # Each replica's first step ran its own rows (2 beams each).
    assert first == sorted(2 * (batch // devices + (i < batch % devices)) for i in range(devices))


@pytest.mark.parametrize("batch,devices", SPLITS)
def test_peft_generate_splits_adapter_names_with_no_configuration(batch: int, devices: int) -> None:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32,
                                     bos_token_id=0, eos_token_id=None, pad_token_id=0)
    lora = dict(r=4, target_modules=["c_attn"], init_lora_weights=False, fan_in_fan_out=True)
    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.GPT2LMHeadModel(config), peft.LoraConfig(**lora), adapter_name="one")
    model.add_adapter("two", peft.LoraConfig(**lora))
    model.eval()
    ids = torch.randint(1, 64, (batch, 5))
    names = [("one", "two", "__base__")[i % 3] for i in range(batch)]  # one adapter per row
    kwargs = dict(input_ids=ids, adapter_names=names, max_new_tokens=4, do_sample=False)
    import warnings

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "every replica gets all of it"
        got = DataParallel(model, device_ids=["cpu"] * devices).generate(**kwargs)
    with torch.no_grad():
        ref = model.generate(**kwargs)
        base = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, ref)
    assert not torch.equal(ref, base)  # the adapters change the tokens: the split matters


def test_no_library_is_imported_by_dpmethods() -> None:
    # The shipped rules are installed only for libraries the user imported.
    code = (
        "import sys, torch, dpmethods; "
        "dpmethods.gather([{'a': torch.ones(1)}, {'a': torch.ones(1)}], 'cpu'); "
        "print(sorted(m for m in ('diffusers', 'transformers', 'sentence_transformers') if m in sys.modules))"
    )
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root)}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _tiny_qwen2_vl() -> tuple[nn.Module, dict[str, Any]]:
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen2VLForConditionalGeneration"):
        pytest.skip("this transformers has no Qwen2-VL")
    config = transformers.Qwen2VLConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=2,
                           spatial_merge_size=2, temporal_patch_size=1, in_channels=3),
        image_token_id=60, video_token_id=61, vision_start_token_id=62, vision_end_token_id=63,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(config).eval()
    # Images per row 1, 0, 2, 1, 1, 0, 1, of different sizes; each stands in the text as
    # prod(t, h, w) / merge**2 image tokens between vision start and end.
    grids_per_row = [[(1, 4, 4)], [], [(1, 2, 4), (1, 4, 2)], [(1, 2, 2)], [(1, 4, 4)], [], [(1, 2, 6)]]
    g = torch.Generator().manual_seed(0)
    rows, grids = [], []
    for row in grids_per_row:
        tokens = torch.randint(1, 50, (3,), generator=g).tolist()
        for t, h, w in row:
            tokens += [62] + [60] * (t * h * w // 4) + [63]
            grids.append((t, h, w))
        rows.append(tokens + torch.randint(1, 50, (2,), generator=g).tolist())
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):  # left padding
        ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r), 1
    grid = torch.tensor(grids)
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 2, generator=g)  # all images' patches
    return model, dict(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid,
                       mm_token_type_ids=(ids == 60).int())


@pytest.mark.parametrize("devices", [3, 4])
def test_qwen2_vl_patches_of_all_images_split_by_row_with_no_configuration(devices: int) -> None:
    import warnings

    model, inputs = _tiny_qwen2_vl()
    dp = DataParallel(model, device_ids=["cpu"] * devices)
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        want, got = model(**inputs), dp(**inputs)
        want_tokens, got_tokens = model.generate(**inputs, **kwargs), dp.generate(**inputs, **kwargs)
    _close(got.logits, want.logits)
    assert len(got.image_outputs.pooler_output) == len(want.image_outputs.pooler_output) == 6
    for g, w in zip(got.image_outputs.pooler_output, want.image_outputs.pooler_output):
        _close(g, w)
    assert torch.equal(got_tokens, want_tokens)
