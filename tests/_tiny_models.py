"""Tiny real third-party models shared by several test files (random weights, no download)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

_WORDS = "the a cat dog sat on mat runs fast slow big small red blue".split()


def tiny_sentence_transformer(path: Path) -> Any:
    """A SentenceTransformer (2-layer BERT, mean pooling) saved to and loaded from ``path``."""
    st = pytest.importorskip("sentence_transformers")
    transformers = pytest.importorskip("transformers")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *_WORDS]
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = transformers.BertTokenizer(str(path / "vocab.txt"))
    config = transformers.BertConfig(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from sentence_transformers import models
    transformer = models.Transformer(str(path))
    pooling = models.Pooling(transformer.auto_model.config.hidden_size, "mean")
    return st.SentenceTransformer(modules=[transformer, pooling], device="cpu").eval()


def random_sentences(n: int) -> list[str]:
    """``n`` sentences of 1 to 5 words from the tiny model's vocabulary, seeded by ``n``."""
    g = torch.Generator().manual_seed(n)
    return [
        " ".join(_WORDS[int(i)] for i in torch.randint(0, len(_WORDS), (1 + k % 5,), generator=g))
        for k in range(n)
    ]
