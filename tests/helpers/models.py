"""Tiny real third-party models shared by several test files (random weights, no download),
and the probes the tests put on them."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dpmethods

_WORDS = "the a cat dog sat on mat runs fast slow big small red blue".split()


def _save_tiny_bert(path: Path, model_class: str) -> None:
    """A 2-layer BERT of width 32 (``transformers.<model_class>``, seeded) and its
    tokenizer over the tiny vocabulary, saved to ``path``."""
    transformers = pytest.importorskip("transformers")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *_WORDS]
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = transformers.BertTokenizer(str(path / "vocab.txt"))
    config = transformers.BertConfig(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    getattr(transformers, model_class)(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def tiny_sentence_transformer(path: Path) -> Any:
    """A SentenceTransformer (2-layer BERT, mean pooling) saved to and loaded from ``path``."""
    st = pytest.importorskip("sentence_transformers")
    _save_tiny_bert(path, "BertModel")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from sentence_transformers import models
    transformer = models.Transformer(str(path))
    pooling = models.Pooling(transformer.auto_model.config.hidden_size, "mean")
    return st.SentenceTransformer(modules=[transformer, pooling], device="cpu").eval()


def tiny_sparse_encoder(path: Path) -> Any:
    """A SparseEncoder (2-layer BERT masked-LM head, SPLADE max pooling over its tiny
    vocabulary) saved to and loaded from ``path``: ``encode`` returns sparse COO tensors."""
    pytest.importorskip("sentence_transformers")
    try:
        from sentence_transformers import SparseEncoder
        from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling
    except ImportError:
        pytest.skip("this sentence-transformers has no SparseEncoder modules")
    _save_tiny_bert(path, "BertForMaskedLM")
    return SparseEncoder(modules=[MLMTransformer(str(path)), SpladePooling("max")], device="cpu").eval()


def random_sentences(n: int) -> list[str]:
    """``n`` sentences of 1 to 5 words from the tiny model's vocabulary, seeded by ``n``."""
    g = torch.Generator().manual_seed(n)
    return [
        " ".join(_WORDS[int(i)] for i in torch.randint(0, len(_WORDS), (1 + k % 5,), generator=g))
        for k in range(n)
    ]


def batch_sizes_seen(module: nn.Module) -> list[int]:
    """Batch sizes seen by ``module``'s forward, one per call (replicas share the hooks).

    A forward given a dict of features (sentence-transformers') counts its input_ids.
    """
    seen: list[int] = []

    def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        first = args[0] if args else next(iter(kwargs.values()))
        if not isinstance(first, torch.Tensor):
            first = first["input_ids"]
        seen.append(int(first.shape[0]))

    module.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def shares(n: int, devices: int) -> list[int]:
    """The replicas' shares of ``n`` items on ``devices`` devices, sorted."""
    return sorted(dpmethods.parallel.chunk_sizes(n, devices))


def tiny_gpt2(**config: Any) -> Any:
    """A random GPT-2 (2 layers of width 16, 48 tokens; ``config`` overrides fields of
    ``GPT2Config``), as built here (no seed is set, no mode)."""
    import transformers

    base: dict[str, Any] = dict(
        vocab_size=48, n_positions=64, n_embd=16, n_layer=2, n_head=2,
        bos_token_id=1, eos_token_id=None, pad_token_id=None, initializer_range=1.0,
    )
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**base, **config}))


def _spread(model: Any) -> Any:
    """``model`` with every parameter drawn again from N(0, 0.3), in place."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def tiny_qwen3_next() -> Any:
    """A random Qwen3-Next (a linear-attention layer, whose cache keeps conv and recurrent
    states in dicts, then a full-attention one; 64 tokens, pad id 0), in eval mode."""
    import transformers

    if not hasattr(transformers, "Qwen3NextForCausalLM"):
        pytest.skip("this transformers has no Qwen3-Next")
    torch.manual_seed(0)
    config = transformers.Qwen3NextConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, linear_num_value_heads=2, linear_num_key_heads=1,
        linear_key_head_dim=8, linear_value_head_dim=8, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_experts=2, num_experts_per_tok=1,
        layer_types=["linear_attention", "full_attention"], max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=None)
    return _spread(transformers.Qwen3NextForCausalLM(config).eval())


def tiny_falcon_h1() -> Any:
    """A random FalconH1 (each layer a hybrid of a Mamba state and attention, its cache
    layers subclasses of DynamicLayer; 64 tokens, pad id 0), in eval mode."""
    import transformers

    if not hasattr(transformers, "FalconH1ForCausalLM"):
        pytest.skip("this transformers has no FalconH1")
    torch.manual_seed(0)
    config = transformers.FalconH1Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, mamba_d_ssm=16, mamba_n_heads=2, mamba_d_head=8,
        mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=4, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=None)
    return _spread(transformers.FalconH1ForCausalLM(config).eval())


def tiny_qwen2_vl() -> tuple[nn.Module, dict[str, Any]]:
    """A random Qwen2-VL and a batch of 7 rows with 0 to 2 images each, of different
    sizes: the patches of all images in one tensor, as its processor makes them."""
    import transformers

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
    # Images per row 2, 2, 1, 0, 1, 1, 0, of different sizes, so that on 3 or 4 replicas
    # no replica's first image has its first row's index; each stands in the text as
    # prod(t, h, w) / merge**2 image tokens between vision start and end.
    grids_per_row = [[(1, 4, 4), (1, 2, 2)], [(1, 2, 4), (1, 4, 2)], [(1, 2, 2)], [], [(1, 4, 4)], [(1, 2, 6)], []]
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


def tiny_vae() -> Any:
    """A random diffusers AutoencoderKL (blocks of 8 and 16 channels, 4 latent channels,
    16 x 16 images), in eval mode."""
    diffusers = pytest.importorskip("diffusers")
    return diffusers.AutoencoderKL(
        in_channels=3, out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16), latent_channels=4, norm_num_groups=4,
        layers_per_block=1, sample_size=16,
    ).eval()
