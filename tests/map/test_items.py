"""``DataParallel.map`` over items: sorted by length in windows, cut by ``batch_size`` and
``max_tokens``, collated, and each item's output equal to the item run alone on one
device, in input order, on worker threads and on worker processes.

The wrappers are shared by the tests of this module (one per worker kind), so worker
processes start once; :class:`Tokens` records every batch it runs in a file, worker
processes too.
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import dpmethods
from dpmethods.extending import CallHooks
from dpmethods.testing import assert_close_to_reference
from dpmethods.vocab.call_hooks import is_per_item
from tests.helpers import WORKERS, workers_of
from tests.helpers.items_models import (
    FAIL,
    HANG,
    KILL,
    Tokens,
    batches_run,
    build_tokens,
    sharded_items,
    token_items,
)
from tests.helpers.long_runs import arm_hang, out_of_memory_above, release_hung, rows_run
from tests.helpers.models import (
    tiny_falcon_h1,
    tiny_gpt2,
    tiny_qwen3_next,
    tiny_sentence_transformer,
)
from tests.helpers.processes import spawn_gloo
from tests.helpers.terms import mlp_terms, transformer_terms

pytestmark = pytest.mark.timeout(240)
N = 23
# A row's features: the embedding (exact), a Linear(8, 4); its mean over up to 24 positions.
TERMS = mlp_terms(8) + 24


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("items")


@pytest.fixture(scope="module")
def wrappers(workdir: Path) -> Iterator[dict[str, Any]]:
    model = build_tokens(str(workdir))
    dps = {w: dpmethods.DataParallel(model, device_ids=["cpu"] * 2, workers=w) for w in WORKERS}
    yield dps
    for dp in dps.values():
        dp.close()


@pytest.fixture
def dp(wrappers: dict[str, Any], workdir: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    """The shared wrapper of the test's worker kind, its records and fault markers cleared."""
    for f in workdir.iterdir():
        f.unlink()
    arm_hang()
    wrapper = wrappers[workers_of(request)]
    wrapper.module.limit = None
    yield wrapper
    release_hung()  # a thread that timed out may go on (its replica is no longer used)
    wrapper.module.limit = None


def _generate_alone(model: Any, prompts: list[dict[str, torch.Tensor]], **kwargs: Any) -> list[Any]:
    """What ``model.generate`` gives each prompt alone, unpadded: the item map's reference."""
    return [model.generate(input_ids=p["input_ids"][None], attention_mask=torch.ones_like(p["input_ids"])[None], **kwargs)
            for p in prompts]


def _alone(model: Tokens, items: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    with torch.no_grad():
        return [model.alone(item["input_ids"]) for item in items]


def _pad(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    ids = torch.nn.utils.rnn.pad_sequence([b["input_ids"] for b in batch], batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(b["input_ids"]) for b in batch], batch_first=True)
    return {"input_ids": ids, "attention_mask": mask}


# --- outputs, one per item -----------------------------------------------------------


@pytest.mark.parametrize("workers", WORKERS)
def test_each_item_equals_the_item_alone_in_input_order(dp: Any, workers: str) -> None:
    items = token_items(N)
    with torch.no_grad():
        outs = list(dp.map("encode", items, batch_size=4, trim=True))
        pairs = list(dp.map("encode", items, max_tokens=40, ordered=False))
    ref = _alone(dp.module, items)
    assert [o["hidden"].shape[0] for o in outs] == [len(i["input_ids"]) for i in items]  # trimmed
    assert_close_to_reference(outs, ref, terms=TERMS)
    assert sorted(i for i, _ in pairs) == list(range(N))
    assert_close_to_reference([o["pooled"] for _, o in sorted(pairs, key=lambda p: p[0])],
                              [r["pooled"] for r in ref], terms=TERMS)
    # One window, sorted longest first, in batches of 4; and trim's probe: the first
    # batch's shortest item alone.
    lengths = sorted((len(i["input_ids"]) for i in items), reverse=True)
    planned = [(len(lengths[k:k + 4]), lengths[k]) for k in range(0, N, 4)] + [(1, lengths[3])]
    assert lengths[3] < lengths[0]
    assert sorted(batches_run(dp.module.workdir)[:len(planned)]) == sorted(planned)


@pytest.mark.parametrize("workers", WORKERS)
def test_max_tokens_caps_rows_times_the_longest_and_a_longer_item_runs_alone(dp: Any, workers: str) -> None:
    items = token_items(30, seed=1, longest=20)
    items.insert(7, {"input_ids": torch.arange(4, 4 + 36) % 36 + 4})  # over the budget of 32
    seen: list[tuple[int, int]] = []

    def collate(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        seen.append((len(batch), max(len(b["input_ids"]) for b in batch)))
        return _pad(batch)

    with torch.no_grad():
        outs = list(dp.map("encode", items, max_tokens=32, collate=collate))
        default = list(dp.map("encode", items, max_tokens=32, batch_size=3))
    assert sorted(seen) == sorted(seen) and (1, 36) in seen
    assert all(rows * longest <= 32 for rows, longest in seen if longest <= 32)
    assert max(rows for rows, _ in seen) > 3  # short items went in big batches
    runs = batches_run(dp.module.workdir)[len(seen):]  # the default collate pads to the longest only
    assert all(rows <= 3 and (rows * longest <= 32 or rows == 1) for rows, longest in runs)
    ref = _alone(dp.module, items)
    assert_close_to_reference([o["pooled"] for o in outs], [r["pooled"] for r in ref], terms=TERMS + 12)
    assert_close_to_reference([o["pooled"] for o in default], [r["pooled"] for r in ref], terms=TERMS + 12)


@pytest.mark.parametrize("workers", WORKERS)
def test_a_stream_is_sorted_a_window_at_a_time_and_read_a_bounded_way_ahead(dp: Any, workers: str) -> None:
    items = token_items(200, seed=2)
    index = {id(item["input_ids"]): i for i, item in enumerate(items)}
    pulled = [0]
    batches: list[list[int]] = []

    def stream() -> Iterator[dict[str, torch.Tensor]]:
        for item in items:
            pulled[0] += 1
            yield item

    def collate(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batches.append([index[id(b["input_ids"])] for b in batch])
        return _pad(batch)

    with torch.no_grad(), dp.map("encode", stream(), batch_size=4, window=6, collate=collate) as it:
        first = next(it)
        assert pulled[0] <= 60  # a few windows ahead, not the stream
        outs = [first, *it]
    assert all(len({i // 6 for i in b}) == 1 for b in batches)  # a batch never mixes windows
    lengths = [[len(items[i]["input_ids"]) for i in b] for b in batches]
    assert all(ls == sorted(ls, reverse=True) for ls in lengths)
    assert_close_to_reference([o["pooled"] for o in outs], [r["pooled"] for r in _alone(dp.module, items)],
                              terms=TERMS)


def test_a_stream_of_empty_items_under_max_tokens_alone_is_cut_into_windows() -> None:
    # An empty item takes a row: the window (64 x max_tokens) closes after 512 of them,
    # not at the end of the input.
    pulled = [0]

    def stream() -> Iterator[torch.Tensor]:
        for i in range(2000):
            pulled[0] += 1
            yield torch.full((3,), float(i))

    model = torch.nn.Linear(3, 2)
    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2)
    with torch.no_grad(), dp.map("forward", stream(), max_tokens=8, length=lambda x: 0, collate=torch.stack) as it:
        first = next(it)
        assert pulled[0] <= 2 * 512  # at most the next window read ahead, not the stream
        outs = [first, *it]
        want = model(torch.stack([torch.full((3,), float(i)) for i in range(2000)]))
    assert_close_to_reference(torch.stack(outs), want, terms=mlp_terms(3))


@pytest.mark.parametrize("workers", WORKERS)
def test_a_method_of_per_item_lists_gets_them_and_gives_one_output_per_item(dp: Any, workers: str) -> None:
    items = [(item["input_ids"], f"item {i}") for i, item in enumerate(token_items(N))]
    with torch.no_grad():
        outs = list(dp.map("tag", items, batch_size=5, length=lambda item: len(item[0])))
    assert [o["name"] for o in outs] == [f"item {i}" for i in range(N)]
    assert_close_to_reference([o["pooled"] for o in outs], [dp.module.alone(ids)["pooled"] for ids, _ in items],
                              terms=TERMS)
    assert sorted(rows for rows, _ in batches_run(dp.module.workdir)) == [3, 5, 5, 5, 5]


# --- real models ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def bert_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    transformers = pytest.importorskip("transformers")
    words = "the a cat dog sat on mat runs fast slow big small red blue".split()
    path = tmp_path_factory.mktemp("bert") / "vocab.txt"
    path.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    return transformers.BertTokenizer(str(path)), words


@pytest.mark.parametrize("workers", WORKERS)
def test_texts_through_a_tiny_bert_equal_each_text_alone(bert_tokenizer: Any, workers: str) -> None:
    import transformers

    tok, words = bert_tokenizer
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=len(words) + 5, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=37, max_position_embeddings=64)
    model = transformers.BertModel(config).eval()
    g = torch.Generator().manual_seed(3)
    texts = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (int(k),), generator=g))
             for k in torch.randint(1, 20, (17,), generator=g)]
    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2, workers=workers)
    try:
        with torch.no_grad():
            outs = list(dp.map("forward", texts, batch_size=4, length=len, trim=True,
                               collate=lambda batch: tok(batch, padding=True, return_tensors="pt")))
            pairs = list(dp.map("forward", texts, max_tokens=200, length=len, ordered=False,
                                collate=lambda batch: tok(batch, padding=True, return_tensors="pt")))
            ref = [model(**tok([t], return_tensors="pt")) for t in texts]
    finally:
        dp.close()
    terms = transformer_terms(width=32, ff=37, seq=22, layers=2)
    assert_close_to_reference([o.last_hidden_state for o in outs], [r.last_hidden_state[0] for r in ref], terms=terms)
    assert_close_to_reference([o.pooler_output for o in outs], [r.pooler_output[0] for r in ref], terms=terms + 32)
    assert sorted(i for i, _ in pairs) == list(range(len(texts)))
    assert_close_to_reference([o.pooler_output for _, o in sorted(pairs, key=lambda p: p[0])],
                              [r.pooler_output[0] for r in ref], terms=terms + 32)


@pytest.mark.parametrize("workers", WORKERS)
def test_generate_of_prompts_of_mixed_lengths_equals_each_prompt_alone(workers: str) -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tiny_gpt2().eval()
    g = torch.Generator().manual_seed(4)
    lengths = [1, 7, 3, 12, 5, 2, 9, 4, 6, 11]
    prompts = [{"input_ids": torch.randint(2, 48, (n,), generator=g)} for n in lengths]
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2, methods=["generate"], workers=workers)
    try:
        with torch.no_grad():
            outs = list(dp.map("generate", prompts, batch_size=4, **kwargs))
            ref = [r[0] for r in _generate_alone(model, prompts, **kwargs)]
    finally:
        dp.close()
    # Sorted longest first, in batches of 4: every batch pads some of its prompts.
    ordered = sorted(lengths, reverse=True)
    assert all(len(set(ordered[k:k + 4])) > 1 for k in range(0, len(lengths), 4))
    for out, want in zip(outs, ref):
        assert out.tolist() == want.tolist()


@pytest.mark.parametrize("workers", WORKERS)
def test_generate_with_num_return_sequences_gives_each_prompt_its_sequences(workers: str) -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tiny_gpt2().eval()
    g = torch.Generator().manual_seed(4)
    prompts = [{"input_ids": torch.randint(2, 48, (n,), generator=g)} for n in (1, 7, 3, 12, 5, 2, 9)]
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0, "num_beams": 2,
              "num_return_sequences": 2, "return_dict_in_generate": True, "output_scores": True}
    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2, methods=["generate"], workers=workers)
    try:
        with torch.no_grad():
            outs = list(dp.map("generate", prompts, batch_size=3, **kwargs))
            ids = list(dp.map("generate", prompts, batch_size=3, **{**kwargs, "return_dict_in_generate": False}))
            ref = _generate_alone(model, prompts, **kwargs)
    finally:
        dp.close()
    # Each prompt's 2 sequences (its rows of the batch's 6 or 2), without the batch's padding.
    assert [o.sequences.tolist() for o in outs] == [r.sequences.tolist() for r in ref]
    assert [o.tolist() for o in ids] == [r.sequences.tolist() for r in ref]
    assert_close_to_reference([o.sequences_scores for o in outs], [r.sequences_scores for r in ref],
                              terms=transformer_terms(width=16, ff=64, seq=16, layers=2))


@pytest.mark.parametrize("workers", WORKERS)
def test_generate_of_token_id_tensors_masks_the_batchs_padding(workers: str) -> None:
    """Prompts given as 1-D tensors: the default collate pads them with 0 and gives the batch
    an attention_mask, which generate would otherwise take from pad_token_id (GPT-2: unset,
    so the padding was attended to; BART: 1, so its 0s were)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    bart = transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=48, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)).eval()
    with torch.no_grad():
        for p in bart.parameters():
            p.normal_(0, 1.0)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 47, (n,), generator=g) for n in (1, 7, 3, 12, 5, 2)]
    for model in (tiny_gpt2().eval(), bart):
        dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2, methods=["generate"], workers=workers)
        try:
            with torch.no_grad():
                outs = list(dp.map("generate", prompts, batch_size=3, max_new_tokens=4, eos_token_id=None))
                ref = _generate_alone(model, [{"input_ids": p} for p in prompts], max_new_tokens=4, eos_token_id=None)
        finally:
            dp.close()
        assert [o.tolist() for o in outs] == [r[0].tolist() for r in ref]


def _right_padded(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return _pad(batch)


@pytest.mark.parametrize("workers", WORKERS)
def test_a_decoder_only_generate_refuses_padding_that_would_change_an_items_output(workers: str) -> None:
    """Prompts padded on the right (generation would go on after the padding), and
    max_length or min_length, which count the batch's left padding (an item would get
    another number of new tokens than alone), are refused before the batch runs; prompts
    of one length, which the batch does not pad, map as alone."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tiny_gpt2(pad_token_id=0).eval()
    g = torch.Generator().manual_seed(4)
    mixed = [{"input_ids": torch.randint(2, 48, (n,), generator=g)} for n in (1, 7, 3, 12, 5)]
    same = [{"input_ids": torch.randint(2, 48, (4,), generator=g)} for _ in range(4)]
    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2, methods=["generate"], workers=workers)
    try:
        with torch.no_grad():
            with pytest.raises(ValueError, match=r"map: collate: .* pads the prompts of items \[.*\] on the right"):
                list(dp.map("generate", mixed, batch_size=3, collate=_right_padded, max_new_tokens=3))
            # An encoder-decoder's decoder prompts of different lengths: right padded, the same.
            decoded = [{**p, "decoder_input_ids": torch.zeros(1 + i % 2, dtype=torch.long)} for i, p in enumerate(mixed)]
            t5 = dpmethods.DataParallel(_tiny_t5(), device_ids=["cpu"] * 2, methods=["generate"], workers=workers)
            try:
                with pytest.raises(ValueError, match=r"map: collate: the items .* have decoder_input_ids of lengths"):
                    list(t5.map("generate", decoded, batch_size=3, max_new_tokens=3))
            finally:
                t5.close()
            for name, value in (("max_length", 14), ("min_length", 10)):
                # min_length holds eos back: it counts where an eos id is set.
                limits = {name: value, "max_new_tokens": 12, "eos_token_id": 5} if name == "min_length" else {name: value}
                with pytest.raises(ValueError, match=f"map: {name}: got {value}, a limit of the whole sequence"):
                    list(dp.map("generate", mixed, batch_size=3, **limits))
                outs = list(dp.map("generate", same, batch_size=3, **limits))
                assert [o.tolist() for o in outs] == [r[0].tolist() for r in _generate_alone(model, same, **limits)]
            # Their new-token limits take precedence: nothing counts the padding.
            limits = {"max_length": 14, "max_new_tokens": 3, "min_length": 10, "min_new_tokens": 2}
            outs = list(dp.map("generate", mixed, batch_size=3, **limits))
            assert [o.tolist() for o in outs] == [r[0].tolist() for r in _generate_alone(model, mixed, **limits)]
    finally:
        dp.close()


def test_trim_does_not_change_a_sampling_generates_tokens() -> None:
    """Each batch's sampling is seeded from its index (processes: a generator each); trim's
    probes, run between batches, take indices of their own, so with the same seed trim=True
    gives the tokens trim=False gives."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tiny_gpt2(pad_token_id=0).eval()
    g = torch.Generator().manual_seed(4)
    prompts = [{"input_ids": torch.randint(2, 48, (n,), generator=g)} for n in (1, 7, 3, 12, 5, 2, 9)]
    kwargs = {"max_new_tokens": 6, "do_sample": True}
    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2, methods=["generate"], workers="processes")
    try:
        runs = []
        for trim in (False, True, False):
            torch.manual_seed(5)
            runs.append([o.tolist() for o in dp.map("generate", prompts, batch_size=3, trim=trim, **kwargs)])
    finally:
        dp.close()
    assert runs[0] == runs[2]  # reproducible
    assert runs[1] == runs[0]


def _tiny_t5() -> Any:
    import transformers

    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    model = transformers.T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # wide weights: beams part ways and scores differ clearly
            p.normal_(0, 1.0)
    return model


@pytest.mark.parametrize("workers", WORKERS)
def test_a_beam_searchs_scores_and_beam_indices_are_each_prompts_own(workers: str) -> None:
    pytest.importorskip("transformers")
    model = _tiny_t5()
    g = torch.Generator().manual_seed(4)
    prompts = [{"input_ids": torch.randint(3, 60, (n,), generator=g)} for n in (1, 7, 3, 12, 5, 2)]
    base = {"max_new_tokens": 5, "return_dict_in_generate": True, "output_scores": True}
    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2, methods=["generate"], workers=workers)
    try:
        for kwargs in ({**base, "num_beams": 2}, {**base, "num_beams": 3, "num_return_sequences": 2}):
            with torch.no_grad():
                outs = list(dp.map("generate", prompts, batch_size=3, **kwargs))
                ref = _generate_alone(model, prompts, **kwargs)
            k = kwargs.get("num_return_sequences", 1)
            rows = (lambda t: t) if k > 1 else (lambda t: t[0])  # one sequence: its row, without the batch dim
            for out, want in zip(outs, ref):
                assert out.sequences.tolist() == rows(want.sequences).tolist()
                # beam_indices index the prompt's own beams (0 to num_beams - 1), not the batch's
                assert out.beam_indices.tolist() == rows(want.beam_indices).tolist()
                assert len(out.scores) == len(want.scores)
                # each step's scores are the prompt's num_beams rows
                assert_close_to_reference(list(out.scores), list(want.scores), terms=transformer_terms(
                    width=16, ff=32, seq=12, layers=4) + 64)
                assert_close_to_reference(out.sequences_scores, rows(want.sequences_scores),
                                          terms=transformer_terms(width=16, ff=32, seq=12, layers=4) + 64)
    finally:
        dp.close()


def _cache_tensors(cache: Any) -> list[torch.Tensor]:
    if hasattr(cache, "self_attention_cache"):
        return _cache_tensors(cache.self_attention_cache) + _cache_tensors(cache.cross_attention_cache)
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


@pytest.mark.parametrize("workers", WORKERS)
def test_generates_cache_is_each_prompts_own_as_its_generate_alone_gives_it(workers: str) -> None:
    """Keys and values [1 (or num_beams), heads, the prompt's own positions, dim]: without the
    batch's left padding (GPT-2), the encoder's positions of the prompt alone (T5's cross attention)."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    prompts = [{"input_ids": torch.randint(3, 47, (n,), generator=g)} for n in (1, 7, 3, 12, 5)]
    for model in (tiny_gpt2(pad_token_id=0).eval(), _tiny_t5()):
        dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2, methods=["generate"], workers=workers)
        try:
            for kwargs in ({"max_new_tokens": 4}, {"max_new_tokens": 4, "num_beams": 2}):
                with torch.no_grad():
                    outs = list(dp.map("generate", prompts, batch_size=3, return_dict_in_generate=True, **kwargs))
                    ref = _generate_alone(model, prompts, return_dict_in_generate=True, **kwargs)
                for out, want in zip(outs, ref):
                    got, wanted = _cache_tensors(out.past_key_values), _cache_tensors(want.past_key_values)
                    assert [t.shape for t in got] == [t.shape for t in wanted]
                    assert_close_to_reference(got, wanted, terms=transformer_terms(width=16, ff=64, seq=16, layers=2))
        finally:
            dp.close()


@pytest.mark.parametrize("workers", WORKERS)
def test_a_beam_searchs_hidden_states_with_trim_are_each_prompts_own_beams_and_positions(workers: str) -> None:
    """With num_beams=b each item keeps its b rows with the batch dim, so trim cuts the dims
    after it (not one dim early: the beams); an encoder's outputs, one row per item, are the
    item's row also when num_return_sequences > 1."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    prompts = [{"input_ids": torch.randint(3, 47, (n,), generator=g)} for n in (1, 7, 3, 12, 5, 2)]
    base = {"max_new_tokens": 3, "return_dict_in_generate": True, "output_hidden_states": True, "num_beams": 3}
    cases = [(tiny_gpt2(pad_token_id=0).eval(), base, "hidden_states"),
             (_tiny_t5(), {**base, "num_return_sequences": 2}, "encoder_hidden_states")]
    for model, kwargs, field in cases:
        dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2, methods=["generate"], workers=workers)
        try:
            with torch.no_grad():
                outs = list(dp.map("generate", prompts, batch_size=3, trim=True, **kwargs))
                ref = _generate_alone(model, prompts, **kwargs)
        finally:
            dp.close()
        for out, want in zip(outs, ref):
            got, wanted = list(getattr(out, field)), list(getattr(want, field))
            if field == "hidden_states":  # per step, per layer: [beams, positions, width]
                got, wanted = [h for step in got for h in step], [h for step in wanted for h in step]
            else:  # per layer: the prompt's one row, [positions, width]
                wanted = [h[0] for h in wanted]
            assert [t.shape for t in got] == [t.shape for t in wanted]
            assert_close_to_reference(got, wanted, terms=transformer_terms(width=16, ff=64, seq=16, layers=4))


@pytest.mark.parametrize("workers", WORKERS)
def test_generates_attentions_with_trim_are_over_each_prompts_own_positions(workers: str) -> None:
    """A decoder-only generate's attentions of a later step attend to the positions so far,
    the batch's left padding first (a sliding window: its last ones, padding among them
    while the prompt is shorter than the window): with trim=True each item's are over its
    own, as alone."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    prompts = [{"input_ids": torch.randint(3, 47, (n,), generator=g)} for n in (1, 7, 3, 12, 5, 2)]
    kwargs = {"max_new_tokens": 3, "return_dict_in_generate": True, "output_attentions": True}
    for model in (tiny_gpt2(pad_token_id=0).eval(), _sliding_models()[0]):
        model.set_attn_implementation("eager")
        dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2, methods=["generate"], workers=workers)
        try:
            for extra in ({}, {"num_beams": 2}):
                with torch.no_grad():
                    outs = list(dp.map("generate", prompts, batch_size=3, trim=True, **kwargs, **extra))
                    ref = _generate_alone(model, prompts, **kwargs, **extra)
                rows = (lambda t: t) if extra else (lambda t: t[0])
                for out, want in zip(outs, ref):
                    got = [a for step in out.attentions for a in step]
                    wanted = [rows(a) for step in want.attentions for a in step]
                    assert [t.shape for t in got] == [t.shape for t in wanted]
                    assert_close_to_reference(got, wanted, terms=transformer_terms(width=16, ff=64, seq=16, layers=2))
        finally:
            dp.close()


def _an_eos_some_rows_reach(model: Any, prompts: list[dict[str, torch.Tensor]], decoder: bool) -> int:
    """A token that some prompts generate (greedy, alone) within 6 steps and others not:
    as eos, it ends rows at different steps."""
    seen = []
    for p in prompts:
        out = model.generate(input_ids=p["input_ids"][None], max_new_tokens=6, do_sample=False)[0]
        seen.append(set((out[len(p["input_ids"]):] if decoder else out[1:]).tolist()))
    counts = {t: sum(t in s for s in seen) for s in seen for t in s}
    return min(counts, key=lambda t: (abs(counts[t] - len(prompts) / 2), t))


def _layers(cache: Any) -> list[Any]:
    if hasattr(cache, "self_attention_cache"):
        return _layers(cache.self_attention_cache) + _layers(cache.cross_attention_cache)
    return list(cache.layers)


@pytest.mark.parametrize("workers", WORKERS)
def test_an_item_whose_rows_end_at_eos_early_ends_there_as_alone(workers: str) -> None:
    """With one beam, a row ends at its first eos; the batch goes on for its longest, filling
    the row after its end. Each item's sequences, per-step scores and logits, and cache
    (dynamic and static, GPT-2's and T5's self- and cross-attention) end where the item
    ends alone."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    prompts = [{"input_ids": torch.randint(3, 47, (n,), generator=g)} for n in (1, 7, 3, 12, 5, 2)]
    base = {"max_new_tokens": 6, "return_dict_in_generate": True, "output_scores": True, "output_logits": True}
    for model, decoder in ((tiny_gpt2(pad_token_id=0).eval(), True), (_tiny_t5(), False)):
        with torch.no_grad():
            eos = _an_eos_some_rows_reach(model, prompts, decoder)
        dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2, methods=["generate"], workers=workers)
        try:
            for kwargs in ({**base, "eos_token_id": eos}, {**base, "eos_token_id": [eos, 63], "cache_implementation": "static"}):
                dpmethods.vocab.warn_once.reset()
                with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    outs = list(dp.map("generate", prompts, batch_size=3, **kwargs))
                    ids = list(dp.map("generate", prompts, batch_size=3, **{**kwargs, "return_dict_in_generate": False}))
                    ref = _generate_alone(model, prompts, **kwargs)
                assert not [w for w in seen if "map: generate" in str(w.message)]
                assert len({len(r.scores) for r in ref}) > 1  # the rows ended at different steps
                assert [o.sequences.tolist() for o in outs] == [r.sequences[0].tolist() for r in ref]
                assert [o.tolist() for o in ids] == [r.sequences[0].tolist() for r in ref]
                for out, want in zip(outs, ref):
                    for field in ("scores", "logits"):
                        got, wanted = list(getattr(out, field)), [s[0] for s in getattr(want, field)]
                        assert len(got) == len(wanted)
                        assert_close_to_reference(got, wanted, terms=transformer_terms(width=16, ff=64, seq=16, layers=4))
                    for got_layer, want_layer in zip(_layers(out.past_key_values), _layers(want.past_key_values)):
                        (n, *kv), (m, *wkv) = _filled(got_layer), _filled(want_layer)
                        assert n == m
                        assert [t.shape for t in kv] == [t.shape for t in wkv]
                        assert_close_to_reference(kv, wkv, terms=transformer_terms(width=16, ff=64, seq=16, layers=4))
            # A beam search's own steps are not told by its sequences: a warning, once.
            dpmethods.vocab.warn_once.reset()
            with pytest.warns(UserWarning, match="with beam search, an item whose beams ended at eos before"):
                list(dp.map("generate", prompts, batch_size=3, **base, eos_token_id=eos, num_beams=2))
        finally:
            dp.close()


@pytest.mark.parametrize("workers", WORKERS)
def test_a_linear_attention_cache_is_each_prompts_own_state_as_alone(workers: str) -> None:
    """Qwen3-Next's linear-attention layer keeps its states in dicts: each item's cache holds
    its own row's states (not the batch's) and counts its own positions. FalconH1's hybrid
    layers (a Mamba state and attention, a DynamicLayer subclass) hold its own keys too."""
    pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(3)
    prompts = [{"input_ids": torch.randint(3, 60, (n,), generator=g)} for n in (1, 6, 2, 5)]
    kwargs = {"max_new_tokens": 3, "return_dict_in_generate": True}
    for model in (tiny_qwen3_next(), tiny_falcon_h1()):
        dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2, methods=["generate"], workers=workers)
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # transformers: its kernels fall back to torch
                outs = list(dp.map("generate", prompts, batch_size=2, **kwargs))
                ref = _generate_alone(model, prompts, **kwargs)
        finally:
            dp.close()
        for out, want in zip(outs, ref):
            assert out.sequences.tolist() == want.sequences[0].tolist()
            for got, wanted in zip(out.past_key_values.layers, want.past_key_values.layers):
                assert int(got.get_seq_length()) == int(wanted.get_seq_length())
                states = [(getattr(got, n, {}), getattr(wanted, n, {})) for n in ("conv_states", "recurrent_states")]
                mine = [t for d, _ in states for t in d.values() if t is not None]
                theirs = [t for _, d in states for t in d.values() if t is not None]
                if getattr(wanted, "keys", None) is not None:
                    mine, theirs = [*mine, got.keys, got.values], [*theirs, wanted.keys, wanted.values]
                assert [t.shape for t in mine] == [t.shape for t in theirs]
                assert_close_to_reference(mine, theirs, terms=transformer_terms(width=16, ff=32, seq=9, layers=2))


def _sliding_models() -> list[Any]:
    """Mistral (every layer a sliding window) and Gemma 2 (sliding and full layers), a window of 4."""
    import transformers

    shared = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64,
              "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": None, "sliding_window": 4}
    torch.manual_seed(0)
    models = [transformers.MistralForCausalLM(transformers.MistralConfig(**shared))]
    if hasattr(transformers, "Gemma2ForCausalLM"):
        models.append(transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**shared, head_dim=8)))
    return [m.eval() for m in models]


def _filled(layer: Any) -> tuple[int, torch.Tensor, torch.Tensor]:
    """A cache layer's count of positions seen and its keys and values; a static layer's
    without the positions not written yet (its size follows the cache generate reused)."""
    seen, keys, values = int(layer.get_seq_length()), layer.keys, layer.values
    if "Static" in type(layer).__name__:
        keys, values = keys[:, :, :seen], values[:, :, :seen]
    return seen, keys, values


@pytest.mark.parametrize("workers", WORKERS)
def test_a_sliding_window_cache_is_each_prompts_own_window_as_alone(workers: str) -> None:
    """A sliding window holds the last positions the batch saw: an item's keeps those of
    its own that its window holds alone, and counts its own positions (not the batch's
    left padding), dynamic and static."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "MistralForCausalLM"):
        pytest.skip("this transformers has no Mistral")
    g = torch.Generator().manual_seed(3)
    prompts = [{"input_ids": torch.randint(3, 60, (n,), generator=g)} for n in (1, 6, 2, 5)]
    for model in _sliding_models():
        dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2, methods=["generate"], workers=workers)
        try:
            for kwargs in ({"max_new_tokens": 5}, {"max_new_tokens": 5, "num_beams": 2},
                           {"max_new_tokens": 5, "cache_implementation": "static"}):
                with torch.no_grad():
                    outs = list(dp.map("generate", prompts, batch_size=2, return_dict_in_generate=True, **kwargs))
                    ref = _generate_alone(model, prompts, return_dict_in_generate=True, **kwargs)
                for out, want in zip(outs, ref):
                    assert out.sequences.tolist() == want.sequences[0].tolist()
                    for got, wanted in zip(out.past_key_values.layers, want.past_key_values.layers):
                        (n, *kv), (m, *wkv) = _filled(got), _filled(wanted)
                        assert n == m
                        assert [t.shape for t in kv] == [t.shape for t in wkv]
                        assert_close_to_reference(kv, wkv, terms=transformer_terms(width=16, ff=32, seq=12, layers=2))
        finally:
            dp.close()


@pytest.mark.parametrize("workers", WORKERS)
def test_an_encoder_decoders_prompts_are_padded_on_the_right_as_its_encoder_reads_them(workers: str) -> None:
    """BART's encoder adds learned positions: left padding would move a prompt's tokens."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BartConfig(
        vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)
    model = transformers.BartForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 1.0)
    g = torch.Generator().manual_seed(4)
    prompts = [{"input_ids": torch.randint(3, 60, (n,), generator=g)} for n in (1, 7, 3, 12, 5, 2, 9, 4)]
    kwargs = {"max_new_tokens": 5, "return_dict_in_generate": True, "output_scores": True}
    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2, methods=["generate"], workers=workers)
    try:
        with torch.no_grad():
            outs = list(dp.map("generate", prompts, batch_size=3, **kwargs))
            ref = _generate_alone(model, prompts, **kwargs)
    finally:
        dp.close()
    assert [o.sequences.tolist() for o in outs] == [r.sequences[0].tolist() for r in ref]
    for out, want in zip(outs, ref):  # left padded, the scores were up to 0.07 away
        assert_close_to_reference(list(out.scores), [s[0] for s in want.scores],
                                  terms=transformer_terms(width=16, ff=32, seq=12, layers=2) + 64)


@pytest.mark.parametrize("workers", WORKERS)
def test_generate_with_a_collate_without_attention_mask_needs_lengths_in_tokens(bert_tokenizer: Any,
                                                                                workers: str) -> None:
    pytest.importorskip("transformers")
    tok, _ = bert_tokenizer
    torch.manual_seed(0)
    model = tiny_gpt2().eval()
    texts = ["the cat", "a dog runs fast on the mat", "red", "big small red blue cat", "the a", "runs"]
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}

    def collate(batch: list[str]) -> Any:  # left-padded ids, no mask: generate infers it from pad_token_id
        return tok(batch, padding=True, padding_side="left", add_special_tokens=False, return_tensors="pt",
                   return_attention_mask=False, return_token_type_ids=False)

    def tokens(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2, methods=["generate"], workers=workers)
    try:
        with torch.no_grad():
            # Characters are not the prompt's positions: each row's padding is unknown.
            with pytest.raises(ValueError, match=r"map: length: the items \[1, 3, 0\] have lengths up to 26 "
                               r"\(length=\), but their batch's prompt is 7 positions wide"):
                list(dp.map("generate", texts, batch_size=3, length=len, collate=collate, **kwargs))
            outs = list(dp.map("generate", texts, batch_size=3, length=tokens, collate=collate, **kwargs))
            ref = [model.generate(**collate([t]), **kwargs)[0] for t in texts]
    finally:
        dp.close()
    assert [o.tolist() for o in outs] == [r.tolist() for r in ref]


@pytest.fixture(scope="module")
def encoders(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A tiny sentence-transformers model wrapped once per worker kind."""
    pytest.importorskip("sentence_transformers")
    model = tiny_sentence_transformer(tmp_path_factory.mktemp("tiny-st"))
    dps = {w: dpmethods.DataParallel(model, device_ids=["cpu"] * 2, workers=w) for w in WORKERS}
    yield dps
    for dp in dps.values():
        dp.close()


_WORDS = "the a cat dog sat on mat runs fast slow big small red blue".split()
TEXTS = [" ".join(_WORDS[(3 * k + j) % len(_WORDS)] for j in range(1 + k % 9)) for k in range(13)]
# The tiny BERT (2 blocks, width 32, up to 11 tokens), then the mean pooling.
ENCODE_TERMS = transformer_terms(width=32, ff=37, seq=11, layers=2) + 11


def _ours(record: list[Any]) -> list[str]:
    return [str(w.message) for w in record if str(w.message).startswith(("DataParallel", "map", "dpmethods"))]


@pytest.mark.parametrize("workers", WORKERS)
def test_sentence_transformers_encode_of_strings_with_the_default_collate(encoders: dict[str, Any],
                                                                          workers: str) -> None:
    dp = encoders[workers]
    with torch.no_grad():
        outs = list(dp.map("encode", TEXTS, batch_size=3))
    ref = [dp.module.encode([t])[0] for t in TEXTS]
    assert_close_to_reference(outs, ref, terms=ENCODE_TERMS)


@pytest.mark.parametrize("workers", WORKERS)
def test_encode_of_every_feature_with_trim_gives_each_text_its_own_positions(encoders: dict[str, Any],
                                                                           workers: str) -> None:
    """encode(output_value=None) gives each text's features (ids, mask, token embeddings)
    padded to its batch's longest: trim=True, with lengths in tokens, cuts each to its own."""
    dp = encoders[workers]
    model = dp.module

    def tokens(text: str) -> int:
        return len(model.tokenizer(text)["input_ids"])

    with torch.no_grad():
        outs = list(dp.map("encode", TEXTS, batch_size=3, output_value=None, trim=True, length=tokens))
    ref = [model.encode([t], output_value=None)[0] for t in TEXTS]
    for out, want in zip(outs, ref):
        assert set(out) == set(want)
        for key in ("input_ids", "attention_mask", "token_type_ids"):
            assert out[key].tolist() == want[key].tolist()
        assert_close_to_reference([out["token_embeddings"], out["sentence_embedding"]],
                                  [want["token_embeddings"], want["sentence_embedding"]], terms=ENCODE_TERMS)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", WORKERS)
def test_encode_of_every_feature_with_trim_and_on_oom_split_gives_each_text_its_own_positions(
        tmp_path: Path, workers: str) -> None:
    """A batch that runs out of memory runs in halves, and encode pads each half to its own
    longest text: trim=True still cuts each text's features to its own positions."""

    model = tiny_sentence_transformer(tmp_path)
    ref = [model.encode([t], output_value=None)[0] for t in TEXTS]
    # More than 2 texts run out of memory: each batch of 4 runs in halves.
    model[0].auto_model.embeddings.register_forward_pre_hook(
        functools.partial(out_of_memory_above, str(tmp_path), 2), with_kwargs=True)
    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2, workers=workers)
    try:
        with torch.no_grad():
            outs = list(dp.map("encode", TEXTS, batch_size=4, output_value=None, trim=True, on_oom="split",
                               length=lambda text: len(model.tokenizer(text)["input_ids"])))
    finally:
        dp.close()
    assert any(ran_out for _, ran_out in rows_run(tmp_path))
    for out, want in zip(outs, ref):
        for key in ("input_ids", "attention_mask", "token_type_ids"):
            assert out[key].tolist() == want[key].tolist()
        assert_close_to_reference([out["token_embeddings"], out["sentence_embedding"]],
                                  [want["token_embeddings"], want["sentence_embedding"]], terms=ENCODE_TERMS)


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("precision", ["int8", "uint8"])
def test_encode_calibrated_on_the_whole_batch_is_refused_before_any_batch_runs(
        encoders: dict[str, Any], workers: str, precision: str) -> None:
    # Each batch is dpmethods' choice: codes calibrated on it would depend on the items
    # sorted into it, and differ from model.encode(texts, precision=...) by 100+ levels.
    dp = encoders[workers]
    for kwargs in ({}, {"convert_to_tensor": True}):
        with pytest.raises(ValueError, match=re.escape(
                "map: SentenceTransformer.encode computes its results over the whole batch after the "
                "per-item work with these arguments (its CallHooks.prepare returns a finish), so in "
                "item mode each item's output would depend on the items batched with it. Map batches "
                "of your own (without batch_size= or max_tokens=), or leave out the argument that needs "
                "the whole batch and do that step yourself over all the outputs: encode with "
                "precision='float32' (the default), then sentence_transformers.quantize_embeddings("
                f"numpy.stack(outputs), precision={precision!r}) gives what model.encode(texts, "
                f"precision={precision!r}) gives")):
            list(dp.map("encode", TEXTS, batch_size=3, precision=precision, **kwargs))


@pytest.mark.parametrize("workers", WORKERS)
def test_encode_per_item_precisions_and_options_map_without_a_warning(encoders: dict[str, Any],
                                                                      workers: str) -> None:
    np = pytest.importorskip("numpy")
    st = pytest.importorskip("sentence_transformers")
    dp = encoders[workers]
    model = dp.module
    with warnings.catch_warnings(record=True) as record, torch.no_grad():
        warnings.simplefilter("always")
        floats = list(dp.map("encode", TEXTS, batch_size=3, precision="float32"))
        tensors = list(dp.map("encode", TEXTS, batch_size=3, convert_to_tensor=True, normalize_embeddings=True))
        binary = list(dp.map("encode", TEXTS, batch_size=3, precision="binary"))
    assert _ours(record) == []
    assert_close_to_reference(floats, [model.encode([t])[0] for t in TEXTS], terms=ENCODE_TERMS)
    normalized = [model.encode([t], convert_to_tensor=True, normalize_embeddings=True)[0] for t in TEXTS]
    assert all(isinstance(t, torch.Tensor) for t in tensors)
    assert_close_to_reference(tensors, normalized, terms=ENCODE_TERMS)
    # binary codes are each embedding's signs: per item (checked away from the threshold).
    want = model.encode(TEXTS)
    clear = np.abs(want) > 1e-4
    got_bits = np.unpackbits(np.stack(binary).view(np.uint8), axis=1).astype(bool)
    want_bits = np.unpackbits(model.encode(TEXTS, precision="binary").view(np.uint8), axis=1).astype(bool)
    assert (got_bits == want_bits)[clear].all()
    # What the refusal advises gives the codes calibrated on every text.
    codes = st.quantize_embeddings(np.stack(floats), precision="int8")
    assert np.abs(codes.astype(int) - model.encode(TEXTS, precision="int8").astype(int)).max() <= 1


class _Returns(Tokens):
    """``encode`` with transformers' ``return_dict``: the fields, or a (hidden, pooled) tuple."""

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,  # type: ignore[override]
               return_dict: bool = True) -> Any:
        out = super().encode(input_ids, attention_mask)
        return out if return_dict else (out["hidden"], out["pooled"])


def _as_tuple(out: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A finish that converts a format, each item's part alone: the fields as the tuple."""
    return out["hidden"], out["pooled"]


_as_tuple.per_item = True  # type: ignore[attr-defined]


def _undeclared(out: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The same finish, not declared per item."""
    return out["hidden"], out["pooled"]


def _fields_then(finish: Any) -> Any:
    """Hooks that have the replicas return their fields (which the gather joins by name)
    and ``finish`` give the tuple the caller asked for with return_dict=False."""

    def prepare(args: tuple[Any, ...], kwargs: dict[str, Any], call: Any) -> Any:
        wanted = kwargs.get("return_dict", True)
        return args, {**kwargs, "return_dict": True}, None if wanted else finish

    return prepare


def _tuple_prepare(args: tuple[Any, ...], kwargs: dict[str, Any], call: Any) -> Any:
    return _fields_then(_as_tuple)(args, kwargs, call)


def _undeclared_prepare(args: tuple[Any, ...], kwargs: dict[str, Any], call: Any) -> Any:
    return _fields_then(_undeclared)(args, kwargs, call)


def _hooked(workdir: Path, workers: str, prepare: Any) -> Any:
    torch.manual_seed(0)
    model = _Returns(str(workdir)).eval()
    return dpmethods.DataParallel(model, device_ids=["cpu"] * 2, workers=workers,
                                  methods={"encode": {"hooks": CallHooks(prepare=prepare)}})


@pytest.mark.parametrize("workers", WORKERS)
def test_a_finish_declared_per_item_maps_over_items_equal_to_one_device(tmp_path: Path, workers: str) -> None:
    items = token_items(N)
    dp = _hooked(tmp_path, workers, _tuple_prepare)
    try:
        with torch.no_grad():
            outs = list(dp.map("encode", items, batch_size=4, trim=True, return_dict=False))
            whole = dp.encode(**_pad(items[:3]), return_dict=False)  # a call: the hooks' finish
    finally:
        dp.close()
    model = dp.module
    with torch.no_grad():  # one device, each item alone
        ref = [model.encode(i["input_ids"][None], torch.ones_like(i["input_ids"])[None], return_dict=False)
               for i in items]
    ref = [(h[0], p[0]) for h, p in ref]
    assert all(isinstance(o, tuple) and len(o) == 2 for o in outs)
    assert_close_to_reference(outs, ref, terms=TERMS)
    assert isinstance(whole, tuple) and whole[1].shape == (3, 4)


def test_a_finish_not_declared_per_item_is_still_refused(tmp_path: Path) -> None:
    dp = _hooked(tmp_path, "threads", _undeclared_prepare)
    try:
        with pytest.raises(ValueError, match=re.escape(
                "map: _Returns.encode computes its results over the whole batch after the per-item work "
                "with these arguments (its CallHooks.prepare returns a finish), so in item mode each "
                "item's output would depend on the items batched with it. Map batches of your own "
                "(without batch_size= or max_tokens=), or leave out the argument that needs the whole "
                "batch and do that step yourself over all the outputs. A finish that works on each "
                "item's part of the output alone (a format, as out.float()) declares it with an "
                "attribute per_item = True (CallHooks)")):
            list(dp.map("encode", token_items(5), batch_size=2, return_dict=False))
    finally:
        dp.close()
    # Chained finishes are per item when each one is.
    declared, undeclared = (CallHooks(prepare=lambda a, k, call, f=f: (a, k, f)) for f in (_as_tuple, _undeclared))
    assert is_per_item(declared.then(declared).prepare((), {}, None)[2])  # type: ignore[misc]
    assert not is_per_item(declared.then(undeclared).prepare((), {}, None)[2])  # type: ignore[misc]


# --- compositions --------------------------------------------------------------------


@pytest.mark.parametrize("workers", WORKERS)
def test_progress_counts_items(dp: Any, workers: str, capsys: pytest.CaptureFixture[str]) -> None:
    with torch.no_grad():
        list(dp.map("encode", token_items(N), batch_size=4, progress="embedding"))
    err = capsys.readouterr().err
    assert f"{N}/{N}" in err and "item" in err and "embedding" in err


def test_a_resumed_item_maps_progress_bar_counts_every_item_from_what_was_done(
    dp: Any, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    items, ckpt = token_items(N), workdir / "items.json"
    with torch.no_grad():
        for i, _ in enumerate(dp.map("encode", items, batch_size=4, checkpoint=ckpt)):
            if i == 6:  # six taken
                break
        capsys.readouterr()
        list(dp.map("encode", items, batch_size=4, checkpoint=ckpt, progress=True))
    err = capsys.readouterr().err.replace(" ", "")
    assert f"6/{N}[" in err and f"{N}/{N}[" in err and "item/s" in err, err


@pytest.mark.parametrize("workers", WORKERS)
def test_errors_yield_puts_the_batch_error_in_place_of_each_of_its_items(dp: Any, workers: str) -> None:
    items = token_items(N)
    items[5] = {"input_ids": torch.tensor([4, FAIL, 5, 6, 7, 8, 9, 10])}
    with torch.no_grad():
        outs = list(dp.map("encode", items, batch_size=4, errors="yield"))
        with pytest.raises(ValueError, match="a poisoned item") as info:
            list(dp.map("encode", items, batch_size=4))
    failed = [i for i, o in enumerate(outs) if isinstance(o, Exception)]
    assert 5 in failed and len(failed) in (2, 3, 4)  # item 5's batch
    error = outs[5]
    assert all(outs[i] is error for i in failed)
    assert f"dpmethods: DataParallel.map: the batch held items {sorted(failed, key=lambda i: -len(items[i]['input_ids']))}" \
        in getattr(error, "__notes__", [])
    assert any(n.startswith("dpmethods: DataParallel.map: the batch held items") and "5" in n
               for n in getattr(info.value, "__notes__", []))
    fine = [i for i in range(N) if i not in failed]
    ref = _alone(dp.module, items)
    assert_close_to_reference([outs[i]["pooled"] for i in fine], [ref[i]["pooled"] for i in fine], terms=TERMS)


def _lengths_items(lengths: list[int], failing: int | None = None) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    items = [{"input_ids": torch.randint(4, 40, (n,), generator=g)} for n in lengths]
    if failing is not None:
        items[failing]["input_ids"][0] = FAIL
    return items


@pytest.mark.parametrize("workers", WORKERS)
def test_trim_with_errors_yield_when_the_probe_fails_as_its_batch_did(dp: Any, workers: str) -> None:
    # Item 3, the first padded batch's shortest, fails: its batch, and the probe (it alone).
    items = _lengths_items([6, 6, 6, 3, 6, 6, 6, 4], failing=3)
    with torch.no_grad():
        outs = list(dp.map("encode", items, batch_size=4, window=4, trim=True, errors="yield"))
    assert all(isinstance(o, ValueError) and "a poisoned item" in str(o) for o in outs[:4])
    assert [o["hidden"].shape[0] for o in outs[4:]] == [6, 6, 6, 4]  # trimmed, as each alone
    assert_close_to_reference(outs[4:], _alone(dp.module, items[4:]), terms=TERMS)


@pytest.mark.parametrize("workers", WORKERS)
def test_a_probe_that_fails_is_followed_by_another_while_the_map_reads(dp: Any, workers: str) -> None:
    items = _lengths_items([6, 6, 6, 3] + [6, 6, 6, 4] * 40, failing=3)  # 41 windows of 4, more than the map holds in flight
    with torch.no_grad():
        outs = list(dp.map("encode", items, batch_size=4, window=4, trim=True, errors="yield"))
    runs = batches_run(dp.module.workdir)
    assert [r for r in runs if r[0] == 1] == [(1, 3), (1, 4)]  # the failed probe, then one more
    assert runs.index((1, 4)) < len(runs) - 1  # sent after a later batch, not after the map
    assert all(isinstance(o, ValueError) for o in outs[:4])
    assert_close_to_reference(outs[4:], _alone(dp.module, items[4:]), terms=TERMS)


@pytest.mark.parametrize("workers", WORKERS)
def test_trim_of_one_batch_whose_probe_is_the_last_output(workdir: Path, workers: str) -> None:
    # One device runs the probe after its batch: the probe's output is the map's last, and
    # its evidence tells the batch that waits for it.
    model = build_tokens(str(workdir))
    dp = dpmethods.DataParallel(model, device_ids=["cpu"], workers=workers)
    items = _lengths_items([6, 2, 4])
    try:
        with torch.no_grad():
            outs = list(dp.map("encode", items, batch_size=4, trim=True))
            pairs = list(dp.map("encode", items, batch_size=4, trim=True, ordered=False))
    finally:
        dp.close()
    assert [o["hidden"].shape[0] for o in outs] == [6, 2, 4]
    assert_close_to_reference(outs, _alone(model, items), terms=TERMS)
    assert_close_to_reference([o for _, o in sorted(pairs, key=lambda p: p[0])], _alone(model, items), terms=TERMS)


class _Lonely(Tokens):
    """Tokens whose encode refuses a batch of one row: every probe of trim raises."""

    @dpmethods.parallel_method
    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        if input_ids.shape[0] == 1:
            raise ValueError("_Lonely: no batch of one row")
        return self._features(input_ids, attention_mask)


def test_trim_whose_every_probe_fails_gives_each_untold_item_an_error_caused_by_the_probes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    dp = dpmethods.DataParallel(_Lonely(tmp_path).eval(), device_ids=["cpu"] * 2)
    items = _lengths_items([6, 6, 6, 3, 6, 6, 6, 4])
    message = r"map: trim: output\['hidden'\]'s dim 1 cannot be told from a fixed size, since the probe that measures " \
              r"it \(item 7 alone\) raised"
    with torch.no_grad():
        outs = list(dp.map("encode", items, batch_size=4, window=4, trim=True, errors="yield"))
        with pytest.raises(RuntimeError, match=message) as info:
            list(dp.map("encode", items, batch_size=4, window=4, trim=True))
    dp.close()
    assert all(isinstance(o, RuntimeError) and re.match(message, str(o)) for o in outs)
    assert outs[0] is outs[1] and outs[4] is outs[5] and outs[0] is not outs[4]  # one per batch
    assert "dpmethods: DataParallel.map: the batch held items [4, 5, 6, 7]" in outs[4].__notes__
    for error in (outs[0], info.value):
        assert isinstance(error.__cause__, ValueError) and "no batch of one row" in str(error.__cause__)


@pytest.mark.parametrize("workers", WORKERS)
def test_on_oom_split_halves_a_batch_by_rows(dp: Any, workers: str) -> None:
    items = token_items(N)
    dp.module.limit = 3  # 3 rows or more run out of memory
    with torch.no_grad():
        outs = list(dp.map("encode", items, batch_size=5, on_oom="split", trim=True))
    runs = batches_run(dp.module.workdir)
    assert any(rows >= 3 for rows, _ in runs) and all(rows <= 5 for rows, _ in runs)
    assert_close_to_reference(outs, _alone(dp.module, items), terms=TERMS)


@pytest.mark.parametrize("workers", ["processes"])  # a thread does not die: nothing to retry
def test_retries_run_a_killed_workers_batch_again(dp: Any, workers: str) -> None:
    items = token_items(N)
    items[9] = {"input_ids": torch.tensor([4, 5, KILL, 6])}
    with torch.no_grad():
        outs = list(dp.map("encode", items, batch_size=4, retries=1))
    assert (dp.module.workdir and Path(dp.module.workdir, "kill").exists())  # the fault struck
    assert_close_to_reference([o["pooled"] for o in outs], [r["pooled"] for r in _alone(dp.module, items)],
                              terms=TERMS)


@pytest.mark.parametrize("workers", WORKERS)
def test_a_batch_past_the_timeout_is_an_error_for_each_of_its_items(dp: Any, workers: str) -> None:
    items = token_items(12)
    items[3] = {"input_ids": torch.tensor([4, HANG, 5])}
    with torch.no_grad():
        outs = list(dp.map("encode", items, batch_size=4, timeout=1.5, retries=0, errors="yield"))
    failed = [i for i, o in enumerate(outs) if isinstance(o, Exception)]
    assert 3 in failed and all(isinstance(outs[i], TimeoutError) for i in failed) and len(failed) <= 4
    fine = [i for i in range(12) if i not in failed]
    ref = _alone(dp.module, items)
    assert_close_to_reference([outs[i]["pooled"] for i in fine], [ref[i]["pooled"] for i in fine], terms=TERMS)


@pytest.mark.parametrize("workers", WORKERS)
def test_a_checkpointed_rerun_skips_the_items_taken_however_its_batches_are_cut(dp: Any, workers: str,
                                                                                tmp_path: Path) -> None:
    items = token_items(N)
    path = tmp_path / "run.json"
    with torch.no_grad():
        with dp.map("encode", items, batch_size=4, checkpoint=path) as first:
            taken = [next(first) for _ in range(6)]  # the sixth is not asked past: it comes again
        record = json.loads(path.read_text())
        assert record["done"] == [[0, 5]]  # items, not batches
        rest = list(dp.map("encode", items, max_tokens=30, ordered=False, checkpoint=path))
        again = list(dp.map("encode", items, max_tokens=30, checkpoint=path))
    assert sorted(i for i, _ in rest) == list(range(5, N)) and again == []
    ref = _alone(dp.module, items)
    assert_close_to_reference([o["pooled"] for o in taken], [r["pooled"] for r in ref[:6]], terms=TERMS)
    assert_close_to_reference([o["pooled"] for _, o in sorted(rest, key=lambda p: p[0])],
                              [r["pooled"] for r in ref[5:]], terms=TERMS)


@pytest.mark.parametrize("workers", ["threads"])  # refused before any batch runs, whatever the workers
def test_a_checkpointed_rerun_with_another_trim_or_collate_or_of_batches_is_refused(dp: Any, workers: str,
                                                                                    tmp_path: Path) -> None:
    items = token_items(N)
    path = tmp_path / "run.json"
    refusals = [  # each would mix the outputs taken with others of another shape
        (dict(batch_size=4), r"its items were trimmed \(trim=True\), this map's are not"),
        (dict(batch_size=4, trim=True, collate=_pad),
         r"its items were collated by the default collate, this map's by collate=tests\.map\.test_items\._pad"),
        ({}, r"its map read items \(batch_size= or max_tokens=\), this map reads batches"),
    ]
    with torch.no_grad():
        with dp.map("encode", items, batch_size=4, trim=True, checkpoint=path) as first:
            taken = [next(first) for _ in range(6)]
        record, ran = path.read_bytes(), len(batches_run(dp.module.workdir))
        for options, message in refusals:
            with pytest.raises(ValueError, match=rf"'{path}' records another map: {message}\. It is not"):
                list(dp.map("encode", items, checkpoint=path, **options))
            assert path.read_bytes() == record and len(batches_run(dp.module.workdir)) == ran
        rest = list(dp.map("encode", items, max_tokens=30, trim=True, checkpoint=path))  # the same map
    assert [o["hidden"].shape[0] for o in taken[:5] + rest] == [len(i["input_ids"]) for i in items]
    assert_close_to_reference(taken[:5] + rest, _alone(dp.module, items), terms=TERMS)


_GLOO = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is not available in this build",
)


@pytest.mark.distributed
@_GLOO
@pytest.mark.parametrize("workers", WORKERS)
def test_shard_takes_each_ranks_items_before_sorting(tmp_path: Path, workers: str) -> None:
    ranks = spawn_gloo(sharded_items, 2, tmp_path, workers, str(tmp_path), timeout_s=200)
    items = token_items(11)
    ref = _alone(build_tokens(str(tmp_path)), items)
    merged = []
    for rank, res in enumerate(ranks):
        mine = list(range(rank, 11, 2))
        assert_close_to_reference([o["pooled"] for o in res["ordered"]], [ref[i]["pooled"] for i in mine],
                                  terms=TERMS)
        assert sorted(i for i, _ in res["pairs"]) == mine
        merged += res["pairs"]
    assert sorted(i for i, _ in merged) == list(range(11))
    assert_close_to_reference([o["pooled"] for _, o in sorted(merged, key=lambda p: p[0])],
                              [r["pooled"] for r in ref], terms=TERMS)


# --- bad input -----------------------------------------------------------------------


@pytest.mark.parametrize("workers", WORKERS)
def test_bad_lengths_and_collates_name_the_argument_the_item_and_what_was_got(dp: Any, workers: str) -> None:
    items = token_items(6)
    cases: list[tuple[dict[str, Any], Any, type, str]] = [
        (dict(batch_size=2, length=lambda item: 2.5), items, TypeError,
         r"map: length: expected a non-negative int for item 0, got float 2.5"),
        (dict(batch_size=2, length=lambda item: -1 if item is items[3] else 1), items, ValueError,
         r"map: length: expected a non-negative int for item 3, got -1"),
        (dict(batch_size=2), [*items[:2], torch.ones(2, 3)], TypeError,
         r"map: length: item 2 is a tensor of shape \[2, 3\]; .* pass length=.*; images of one size: "
         r"length=lambda image: 1, collate=torch.stack$"),
        (dict(batch_size=2, length=lambda image: 1), [torch.ones(3, 4, 4)] * 3, TypeError,
         r"map: collate: item \d is a tensor of shape \[3, 4, 4\]; .* pass collate=.*; images of one size: "
         r"length=lambda image: 1, collate=torch.stack$"),
        (dict(batch_size=2, collate=lambda batch: {"ids": _pad(batch)["input_ids"]}), items, TypeError,
         r"map: collate: the batch of items \[\d, \d\] is a mapping with keys \['ids'\], which Tokens.encode cannot take"),
        (dict(batch_size=2, length=len), ["a", "bb"], TypeError,
         r"map: collate: item \d is str '\w+'; the default collate pads 1-D tensors .* pass collate="),
    ]
    for options, given, error, message in cases:
        with torch.no_grad(), pytest.raises(error, match=message):
            list(dp.map("encode", given, **options))
    assert batches_run(dp.module.workdir) == []  # each refused before it ran


def test_bad_options_are_refused_before_anything_runs() -> None:
    dp = dpmethods.DataParallel(Tokens("."), device_ids=["cpu"] * 2)
    items = token_items(4)
    cases: list[tuple[dict[str, Any], type, str]] = [
        (dict(max_tokens=0), ValueError, r"map: max_tokens: expected None or an int >= 1 .*, got int 0"),
        (dict(batch_size="4"), ValueError, r"map: batch_size: expected None or an int >= 1 .*, got str '4'"),
        (dict(batch_size=2, window="all"), ValueError, r"map: window: expected None or an int >= 1 .*, got str 'all'"),
        (dict(batch_size=2, trim=1), TypeError, r"map: trim: expected a bool, got int 1"),
        (dict(batch_size=2, collate="pad"), TypeError, r"map: collate: expected None or a callable, got str 'pad'"),
        (dict(length=len), TypeError, r"map: length: applies to items \(with batch_size= or max_tokens=\)"),
        (dict(window=8), TypeError, r"map: window: applies to items"),
    ]
    for options, error, message in cases:
        with pytest.raises(error, match=message):
            dp.map("encode", items, **options)
    with pytest.raises(TypeError, match=r"map: window: None sorts the whole input at once, so it needs a sized input"):
        dp.map("encode", iter(items), batch_size=2, window=None)


@pytest.mark.parametrize("workers", WORKERS)
def test_a_value_shared_by_the_batch_is_refused_naming_it(dp: Any, workers: str) -> None:
    with torch.no_grad(), pytest.raises(ValueError, match=re.escape(
            "map: output['loss'] of the output of a batch of 2 items is a tensor of shape [], gathered "
            "with 'mean', one value for the whole batch: it belongs to no item")) as info:
        list(dp.map("with_loss", token_items(4), batch_size=2))
    assert any("the batch held items" in n for n in getattr(info.value, "__notes__", []))


# --- contrastive models: scores of items against the batch's other items ---------------

# A CLIP tower (2 blocks of width 32, MLP 37, up to 8 tokens), its projection, the
# normalisation and the 16-wide products of the scores.
CLIP_TERMS = transformer_terms(width=32, ff=37, seq=8, layers=2) + 3 * 32


@pytest.fixture(scope="module")
def clips() -> Iterator[dict[str, Any]]:
    """A tiny CLIPModel (random weights) wrapped once per worker kind."""
    pytest.importorskip("transformers")
    from tests.helpers import contrastive_models

    model, _ = contrastive_models.clip()
    dps = {w: dpmethods.DataParallel(model, device_ids=["cpu"] * 2, workers=w) for w in WORKERS}
    yield dps
    for dp in dps.values():
        dp.close()


def _clip_items() -> list[dict[str, torch.Tensor]]:
    """Four text-image pairs: texts of mixed lengths, each ending with the eos id (2)."""
    g = torch.Generator().manual_seed(3)
    return [{"input_ids": torch.cat([torch.randint(3, 99, (n,), generator=g), torch.tensor([2])]),
             "pixel_values": torch.randn(3, 16, 16, generator=g)} for n in (3, 5, 2, 7)]


def _clip_collate(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    texts = [b["input_ids"] for b in batch]
    return {"input_ids": torch.nn.utils.rnn.pad_sequence(texts, batch_first=True, padding_value=1),
            "attention_mask": torch.nn.utils.rnn.pad_sequence([torch.ones_like(t) for t in texts], batch_first=True),
            "pixel_values": torch.stack([b["pixel_values"] for b in batch])}


@pytest.mark.parametrize("workers", WORKERS)
def test_a_contrastive_forwards_scores_against_the_batch_are_refused_naming_them(clips: dict[str, Any],
                                                                                 workers: str) -> None:
    # Each item's logits_per_image row would score it against whichever items were sorted
    # into its batch: silently batch-dependent.
    dp = clips[workers]
    with torch.no_grad(), pytest.raises(ValueError, match=re.escape(
            "map: output.logits_per_image of the output of a batch of 2 items is a tensor of shape "
            "[2, 2], which pairs each item with the batch's other items: an item's row would hold its "
            "scores against whichever items were batched with it, so the output cannot be cut into "
            "one per item. Map get_image_features and get_text_features instead (one embedding per "
            "item) and compute the scores over all the items from those embeddings, as the model's "
            "forward computes them from its image_embeds and text_embeds; or map batches of your own "
            "(no batch_size= or max_tokens=), where they pair the batch's items")):
        list(dp.map("forward", _clip_items(), batch_size=2, collate=_clip_collate))
    # With return_loss=True the batch's loss, first in the output, is what is refused.
    with torch.no_grad(), pytest.raises(ValueError, match=re.escape(
            "map: output.loss of the output of a batch of 2 items is a tensor of shape [], one value "
            "for the whole batch: it belongs to no item")):
        list(dp.map("forward", _clip_items(), batch_size=2, collate=_clip_collate, return_loss=True))


@pytest.mark.parametrize("workers", WORKERS)
def test_a_contrastive_models_features_map_over_items_and_give_the_whole_batchs_scores(
        clips: dict[str, Any], workers: str) -> None:
    dp = clips[workers]
    model = dp.module
    items = _clip_items()
    with warnings.catch_warnings(record=True) as record, torch.no_grad():
        warnings.simplefilter("always")
        texts = list(dp.map("get_text_features", [{"input_ids": x["input_ids"]} for x in items], batch_size=2))
        pictures = list(dp.map("get_image_features", [x["pixel_values"] for x in items], batch_size=2,
                               length=lambda x: 1, collate=torch.stack))
        want = model(**_clip_collate(items))
    assert _ours(record) == []
    t = torch.stack([o.pooler_output for o in texts])
    i = torch.stack([o.pooler_output for o in pictures])
    with torch.no_grad():
        alone = [model.get_text_features(input_ids=x["input_ids"][None]).pooler_output[0] for x in items]
    assert_close_to_reference(list(t), alone, terms=CLIP_TERMS)
    # The scores over all the items, from the per-item embeddings, as CLIP's forward computes them.
    t, i = t / t.norm(dim=-1, keepdim=True), i / i.norm(dim=-1, keepdim=True)
    scores = model.logit_scale.detach().exp() * t @ i.T
    scale = float(want.logits_per_text.abs().max())
    assert_close_to_reference(scores, want.logits_per_text, terms=CLIP_TERMS, scale=scale)
    assert_close_to_reference(scores.T, want.logits_per_image, terms=CLIP_TERMS, scale=scale)


@pytest.mark.parametrize("workers", WORKERS)
def test_groupvits_segmentation_logits_are_named_where_its_forward_is_refused(workers: str) -> None:
    # GroupViT's segmentation_logits [images, texts, h, w] score each image's pixels against
    # the batch's texts: a refusal of the forward names them, with what gives them right.
    pytest.importorskip("transformers")
    from tests.helpers import contrastive_models

    model, _ = contrastive_models.groupvit()
    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2, workers=workers)
    try:
        with torch.no_grad(), pytest.raises(ValueError) as info:
            list(dp.map("forward", _clip_items(), batch_size=2, collate=_clip_collate, output_segmentation=True))
    finally:
        dp.close()
    said = str(info.value)
    assert said.startswith("map: output.logits_per_image of the output of a batch of 2 items is a tensor of "
                           "shape [2, 2], which pairs each item with the batch's other items"), said
    assert said.endswith(
        "where they pair the batch's items. So do output.logits_per_text, output.segmentation_logits; for "
        "output.segmentation_logits, call forward on the images with the texts to segment them by, in one "
        "batch (DataParallel's forward computes segmentation_logits over the whole batch of a call, as one "
        "device does)"), said
