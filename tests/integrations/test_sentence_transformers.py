"""sentence-transformers' ``encode`` through DataParallel, with no configuration and with a
split named, against the bare model on the full batch: every output kind and precision."""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import pytest
import torch

from dpmethods import DataParallel, parallel_methods
from dpmethods.testing import assert_close_to_reference
from dpmethods.vocab import warn_once as warn_once
from tests.helpers import SPLITS, WORKERS
from tests.helpers.models import (
    batch_sizes_seen,
    random_sentences,
    shares,
    tiny_sentence_transformer,
    tiny_sparse_encoder,
)
from tests.helpers.terms import transformer_terms

# The tiny BERT (2 blocks, width 32, up to 7 tokens), then the mean pooling.
SENTENCE_TERMS = transformer_terms(width=32, ff=37, seq=7, layers=2) + 7


@pytest.fixture(autouse=True)
def _fresh_warnings() -> None:
    warn_once.reset()


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
    seen = batch_sizes_seen(sentence_model[0])
    want = sentence_model.encode(sentences)
    seen.clear()
    got = DataParallel(sentence_model, device_ids=["cpu"] * devices).encode(sentences)
    assert sorted(seen) == shares(n, devices)
    assert isinstance(got, np.ndarray) and got.shape == want.shape
    assert_close_to_reference(got, want, terms=transformer_terms(width=32, ff=37, seq=7, layers=2) + 7)  # tiny BERT, mean pooling


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
    assert_close_to_reference(got, ref, terms=SENTENCE_TERMS)
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
            assert_close_to_reference(got, ref, terms=SENTENCE_TERMS + 32)  # normalized: a 32-wide norm


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



@pytest.mark.parametrize("workers", WORKERS)
def test_sparse_encoder_sparse_embeddings_are_joined(tmp_path: Any, workers: str) -> None:
    # SparseEncoder.encode returns one sparse COO tensor per batch: the replicas' are
    # concatenated by torch.cat (the coalesced gather takes strided tensors; it raised
    # "nbytes is not defined for sparse tensors").
    model = tiny_sparse_encoder(tmp_path)
    sentences = random_sentences(7)
    dp = DataParallel(model, device_ids=["cpu"] * 3, workers=workers, methods={"encode": {"split": "inputs"}})
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch's, unpickling a sparse tensor
            got, want = dp.encode(sentences), model.encode(sentences)
    finally:
        dp.close()
    assert got.layout == want.layout == torch.sparse_coo
    assert got.shape == want.shape
    # The MLM head's transform (width 32) before its decoder, then log(1 + relu) and a
    # max over the tokens (no sum).
    assert_close_to_reference(got.to_dense(), want.to_dense(), terms=SENTENCE_TERMS + 32 + 1)
