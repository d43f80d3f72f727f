"""Built-in registrations: popular libraries' methods run data-parallel with no configuration.

Real models from tiny configs (random weights, nothing downloaded), CPU replicas,
compared with the bare model on the full batch: 7 items on 3 replicas and 8 on 4.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _tiny_models import random_sentences, tiny_sentence_transformer
from torch import nn

import dpmethods
from dpmethods import DataParallel, parallel_methods
from dpmethods.integrations import INTEGRATIONS

SPLITS = [pytest.param(7, 3, id="7-on-3"), pytest.param(8, 4, id="8-on-4")]


def _close(got: Any, want: Any) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _counting(module: nn.Module) -> list[int]:
    """Batch sizes seen by ``module``'s forward, one per call (replicas share the hooks)."""
    seen: list[int] = []

    def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        first = args[0] if args else next(iter(kwargs.values()))
        if not isinstance(first, torch.Tensor):  # sentence-transformers' features dict
            first = first["input_ids"]
        seen.append(int(first.shape[0]))

    module.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def _shares(n: int, devices: int) -> list[int]:
    return sorted(dpmethods.chunk_sizes(n, devices))


# --- transformers ----------------------------------------------------------------


def _clip() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    text = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_attention_heads=4,
                num_hidden_layers=2, max_position_embeddings=32)
    vision = dict(image_size=16, patch_size=8, hidden_size=32, intermediate_size=37,
                  num_attention_heads=4, num_hidden_layers=2)
    config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    torch.manual_seed(0)
    return transformers.CLIPModel(config).eval()


def test_transformers_rules_by_class() -> None:
    transformers = pytest.importorskip("transformers")
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
    seen = _counting(model.vision_model)
    dp = DataParallel(model, device_ids=["cpu"] * devices)
    with torch.no_grad():
        want_t, want_i = model.get_text_features(input_ids=ids), model.get_image_features(pixels)
        seen.clear()
        got_t, got_i = dp.get_text_features(input_ids=ids), dp.get_image_features(pixels)
    assert sorted(seen) == _shares(n, devices)  # every replica ran its share
    for got, want in ((got_t, want_t), (got_i, want_i)):
        if not isinstance(want, torch.Tensor):  # transformers 5 returns a ModelOutput
            got, want = got.pooler_output, want.pooler_output
        _close(got, want)


def test_methods_list_takes_the_registered_options_and_a_dict_overrides_them() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=16, n_positions=16, n_embd=8, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg)
    devices = ["cpu", "cpu"]
    assert DataParallel(model, devices)._dpm_methods["generate"].gather == "generate"
    listed = DataParallel(model, devices, methods=["generate"])._dpm_methods["generate"]
    assert listed.gather == "generate"
    given = DataParallel(model, devices, methods={"generate": {"gather": "pad", "pad_value": 5}})
    assert (given._dpm_methods["generate"].gather, given._dpm_methods["generate"].pad_value) == (
        "pad", 5,
    )


def test_decorations_and_registrations_win_over_builtins() -> None:
    transformers = pytest.importorskip("transformers")

    class Decorated(transformers.GPT2LMHeadModel):
        @dpmethods.parallel_method(gather="list")
        def generate(self, *args: Any, **kwargs: Any) -> Any:
            return super().generate(*args, **kwargs)

    class Registered(transformers.GPT2LMHeadModel):
        pass

    dpmethods.register(Registered, "generate", gather="pad")
    assert dpmethods.get_options(Decorated, "generate").gather == "list"  # type: ignore[union-attr]
    assert dpmethods.get_options(Registered, "generate").gather == "pad"  # type: ignore[union-attr]


# --- sentence-transformers -------------------------------------------------------

@pytest.fixture(scope="module")
def sentence_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tiny_sentence_transformer(tmp_path_factory.mktemp("tiny-bert"))


@pytest.mark.parametrize("n,devices", SPLITS)
def test_sentence_transformers_encode_without_configuration(
    sentence_model: Any, n: int, devices: int
) -> None:
    np = pytest.importorskip("numpy")
    first = list(inspect.signature(type(sentence_model).encode).parameters)[1]
    assert parallel_methods(type(sentence_model))["encode"].split == (first,)
    sentences = random_sentences(n)
    seen = _counting(sentence_model[0])
    want = sentence_model.encode(sentences)
    seen.clear()
    got = DataParallel(sentence_model, device_ids=["cpu"] * devices).encode(sentences)
    assert sorted(seen) == _shares(n, devices)
    assert isinstance(got, np.ndarray) and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# --- diffusers, timm, open_clip ---------------------------------------------------


@pytest.mark.parametrize("n,devices", SPLITS)
def test_diffusers_autoencoder_encode_decode_without_configuration(n: int, devices: int) -> None:
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16), latent_channels=4, norm_num_groups=4,
        layers_per_block=1, sample_size=16,
    ).eval()
    x = torch.randn(n, 3, 16, 16)
    seen = _counting(vae.encoder)
    dp = DataParallel(vae, device_ids=["cpu"] * devices)
    with torch.no_grad():
        want = vae.encode(x).latent_dist
        seen.clear()
        got = dp.encode(x).latent_dist
        assert sorted(seen) == _shares(n, devices)
        _close(got.mode(), want.mode())
        z = want.mode()
        _close(dp.decode(z).sample, vae.decode(z).sample)


@pytest.mark.parametrize("n,devices", SPLITS)
def test_timm_forward_features_and_head_without_configuration(n: int, devices: int) -> None:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
        num_classes=5,
    ).eval()
    assert set(parallel_methods(type(model))) >= {"forward_features", "forward_head"}
    x = torch.randn(n, 3, 32, 32)
    seen = _counting(model.patch_embed)
    dp = DataParallel(model, device_ids=["cpu"] * devices)
    with torch.no_grad():
        want = model.forward_features(x)
        seen.clear()
        got = dp.forward_features(x)
        assert sorted(seen) == _shares(n, devices)
        _close(got, want)
        _close(dp.forward_head(want), model.forward_head(want))


@pytest.mark.parametrize("n,devices", SPLITS)
def test_open_clip_encode_image_and_text_without_configuration(n: int, devices: int) -> None:
    open_clip = pytest.importorskip("open_clip")
    torch.manual_seed(0)
    model = open_clip.CLIP(
        embed_dim=16,
        vision_cfg=open_clip.CLIPVisionCfg(layers=1, width=32, head_width=16, patch_size=8, image_size=16),
        text_cfg=open_clip.CLIPTextCfg(context_length=12, vocab_size=99, width=32, heads=2, layers=1),
    ).eval()
    images, texts = torch.randn(n, 3, 16, 16), torch.randint(1, 99, (n, 12))
    dp = DataParallel(model, device_ids=["cpu"] * devices)
    with torch.no_grad():
        _close(dp.encode_image(images), model.encode_image(images))
        _close(dp.encode_text(texts), model.encode_text(texts))


# --- the CLI ---------------------------------------------------------------------


def test_info_lists_the_registrations() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "dpmethods", "info"], capture_output=True, text=True, check=True,
        timeout=120, cwd=Path(__file__).resolve().parents[1],  # this checkout's dpmethods
    ).stdout
    for library in INTEGRATIONS:
        assert library in out
    assert "generate (gather='generate')" in out


# --- transformers forward: losses joined as transformers joins them ----------------


def _loss_call(model: nn.Module, kwargs: dict[str, Any], devices: int) -> tuple[Any, Any, list[str]]:
    import warnings

    dpmethods.warn_once.reset()
    model.eval()
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        want = model(**kwargs)
        got = DataParallel(model, device_ids=["cpu"] * devices)(**kwargs)
    return got, want, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def _tokens(n: int, vocab: int = 50, width: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(5, vocab, (n, width), generator=g)
    labels = ids.masked_fill(torch.rand(n, width, generator=g) < 0.6, -100)  # uneven counts per row
    return ids, labels


@pytest.mark.parametrize("n,devices", SPLITS)
def test_gpt2_left_padded_loss_equals_the_full_batch_loss(n: int, devices: int) -> None:
    transformers = pytest.importorskip("transformers")
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
    _close(got.loss, want.loss)
    _close(got.logits, want.logits)
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
    _close(model.transformer.wte.weight.grad, want_grad)


@pytest.mark.parametrize("n,devices", SPLITS)
def test_masked_lm_loss_with_ignored_labels_equals_the_full_batch_loss(n: int, devices: int) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.ModernBertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
        sep_token_id=2, global_attn_every_n_layers=1,
    )
    ids, labels = _tokens(n)
    got, want, warned = _loss_call(transformers.ModernBertForMaskedLM(config), dict(input_ids=ids, labels=labels), devices)
    assert warned == []
    _close(got.loss, want.loss)


def _wav2vec2(reduction: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
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
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-5 * float(want.loss.abs()))


@pytest.mark.parametrize("n,devices", SPLITS)
def test_a_loss_without_num_items_in_batch_keeps_per_replica_losses_with_a_warning(n: int, devices: int) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=50, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0
    )
    ids, _ = _tokens(n)
    labels = _tokens(n + 1, width=5)[1][:n]
    got, want, warned = _loss_call(
        transformers.T5ForConditionalGeneration(config), dict(input_ids=ids, labels=labels), devices
    )
    assert got.loss.shape == (devices,)  # as before: one value per replica
    assert any(
        "T5ForConditionalGeneration.forward computes its loss without num_items_in_batch" in w
        and "{'loss': 'mean'}" in w
        for w in warned
    ), warned
    _close(got.logits, want.logits)


def test_forward_without_labels_and_with_gather_given_is_unchanged() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    )
    ids, labels = _tokens(7)
    got, want, warned = _loss_call(model, dict(input_ids=ids), 3)
    assert warned == [] and got.loss is None
    _close(got.logits, want.logits)
    # The user's gather wins, and then no num_items_in_batch is passed: row-weighted mean.
    dp = DataParallel(model, device_ids=["cpu"] * 3, methods={"forward": {"gather": {"loss": "mean"}}})
    with torch.no_grad():
        per_row = [model(input_ids=ids[a:b], labels=labels[a:b]).loss for a, b in ((0, 3), (3, 5), (5, 7))]
        mean = dp(input_ids=ids, labels=labels).loss
    _close(mean, sum(loss * w for loss, w in zip(per_row, (3 / 7, 2 / 7, 2 / 7))))
