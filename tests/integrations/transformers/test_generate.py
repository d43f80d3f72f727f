"""``generate`` through DataParallel equals one device, token for token.

Tiny random transformers models (GPT-2, Llama, T5, Whisper). Random weights rarely
emit a given token, so each test picks eos ids from the model's own output without
eos: a set of tokens that ends the rows at different steps, checked by generating each
replica's share, so that the replicas stop at different steps and their outputs must be
padded as one device pads them. Greedy and beam search, ``pad_token_id`` 0 (where beam search fills with eos)
and non-zero, left-padded prompts, 7 items on 3 replicas and 8 on 4.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import multiprocessing
import warnings
from collections import Counter
from typing import Any

import pytest
import torch

import dpmethods
from dpmethods import DataParallel
from dpmethods.integrations.transformers import gather_generate
from dpmethods.parallel import chunk_sizes
from dpmethods.testing import assert_close_to_reference
from tests.helpers.models import tiny_gpt2
from tests.helpers.processes import Completer
from tests.helpers.terms import transformer_terms

transformers = pytest.importorskip("transformers")

NEW = 10


def _workers() -> set[int]:
    """The pids of the worker processes alive in this process."""
    return {p.pid for p in multiprocessing.active_children() if p.name.startswith("dpmethods-worker-")}  # type: ignore[misc]


def _gpt2() -> Any:
    return tiny_gpt2()


def _llama() -> Any:
    cfg = transformers.LlamaConfig(
        vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=None, pad_token_id=None, initializer_range=1.0,
    )
    return transformers.LlamaForCausalLM(cfg)


def _t5() -> Any:
    cfg = transformers.T5Config(
        vocab_size=48, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
        decoder_start_token_id=0, eos_token_id=None, pad_token_id=0, initializer_factor=8.0,
    )
    return transformers.T5ForConditionalGeneration(cfg)


def _whisper() -> Any:
    cfg = transformers.WhisperConfig(
        vocab_size=48, num_mel_bins=8, d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_source_positions=16, max_target_positions=32,
        decoder_start_token_id=1, bos_token_id=1, eos_token_id=None, pad_token_id=None,
        suppress_tokens=[], begin_suppress_tokens=[], init_std=1.0,
    )
    return transformers.WhisperForConditionalGeneration(cfg)


MODELS = {"gpt2": _gpt2, "llama": _llama, "t5": _t5, "whisper": _whisper}


def _inputs(name: str, n: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(n)
    if name == "whisper":
        return {"input_features": torch.randn(n, 8, 32, generator=g)}
    ids = torch.randint(4, 48, (n, 6), generator=g)
    mask = torch.ones_like(ids)
    if name != "t5":  # left-padded prompts of different lengths
        for row, width in ((0, 2), (2, 1), (n - 1, 3)):
            mask[row, :width] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask}


_EOS: dict[tuple[Any, ...], list[int]] = {}


def _eos_ids(model: Any, inputs: dict[str, Any], sizes: list[int], **search: Any) -> list[int]:
    """Tokens that end the rows at steps that differ between the replicas' shares, so that
    their outputs must be padded: drawn from the model's own output without eos, and
    checked by generating each share as its replica does (``search``: beams, returns).

    Kept per model, inputs, shares and search: tests that differ only in what the search
    does not read (the pad id) search once."""
    key = (_digest(model, inputs), tuple(sizes), tuple(sorted(search.items())))
    if key not in _EOS:
        _EOS[key] = _search_eos_ids(model, inputs, sizes, **search)
    return list(_EOS[key])


def _digest(model: Any, inputs: dict[str, Any]) -> str:
    """The model's class and weights and the inputs, as one digest."""
    h = hashlib.sha256(type(model).__qualname__.encode())
    for name, t in [*model.state_dict().items(), *sorted(inputs.items())]:
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _search_eos_ids(model: Any, inputs: dict[str, Any], sizes: list[int], **search: Any) -> list[int]:
    kwargs = dict(max_new_tokens=NEW, pad_token_id=2, do_sample=False, **search)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    with torch.no_grad():
        new = model.generate(**inputs, **kwargs, eos_token_id=None)[:, -NEW:]
        counts = Counter(t for t in new.flatten().tolist() if t not in (0, 2, 3))
        for k in range(1, 6):
            eos = [t for t, _ in counts.most_common(k)]
            widths = {
                model.generate(**{key: v[a : a + s] for key, v in inputs.items()}, **kwargs, eos_token_id=eos).shape[1]
                for a, s in zip(starts, sizes)
            }
            if len(widths) > 1:
                return eos
    pytest.fail(f"no eos ids make the replicas stop at different steps: {new.tolist()}")


@pytest.fixture(scope="module", params=sorted(MODELS))
def built(request: Any) -> tuple[str, Any]:
    torch.manual_seed(0)
    return request.param, MODELS[request.param]().eval()


@pytest.mark.parametrize("n,replicas", [(7, 3), (8, 4)])
@pytest.mark.parametrize("pad", [0, 2])
@pytest.mark.parametrize("beams", [1, 3])
def test_sequences_equal_one_device(built: tuple[str, Any], n: int, replicas: int, pad: int, beams: int) -> None:
    name, model = built
    inputs = _inputs(name, n)
    search = dict(num_beams=beams, num_return_sequences=2 if beams > 1 else 1)
    eos = _eos_ids(model, inputs, chunk_sizes(n, replicas), **search)
    kwargs: dict[str, Any] = dict(max_new_tokens=NEW, eos_token_id=eos, pad_token_id=pad, do_sample=False, **search)
    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * replicas)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = model.generate(**inputs, **kwargs)
        got = dp.generate(**inputs, **kwargs)
    assert got.shape == want.shape
    assert torch.equal(got, want), (got.tolist(), want.tolist())


# A step's scores: 2 blocks of width 16 (MLP 64) over up to 24 tokens, the head and
# a log-softmax over the 48 tokens, and a sum over the NEW steps (sequence scores). The
# big random weights give logits of tens: the bound scales with the reference's magnitude.
TERMS = transformer_terms(width=16, ff=64, seq=24, layers=2) + 48 + NEW


def _dict_call(name: str, n: int, replicas: int, beams: int, **extra: Any) -> tuple[Any, Any, Any, list[int]]:
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    inputs = _inputs(name, n)
    eos = _eos_ids(model, inputs, chunk_sizes(n, replicas))
    kwargs: dict[str, Any] = dict(
        max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0, num_beams=beams,
        num_return_sequences=2 if beams > 1 else 1, do_sample=False,
        return_dict_in_generate=True, output_scores=True, output_logits=True, **extra,
    )
    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * replicas)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*caches hold")
        want = model.generate(**inputs, **kwargs)
        got = dp.generate(**inputs, **kwargs)
    return model, want, got, eos


@pytest.mark.parametrize("name", ["gpt2", "t5"])
@pytest.mark.parametrize("n,replicas", [(7, 3), (8, 4)])
def test_greedy_dict_scores_and_transition_scores(name: str, n: int, replicas: int) -> None:
    model, want, got, eos = _dict_call(name, n, replicas, beams=1)
    assert type(got) is type(want)
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.scores) == len(want.scores) == len(got.logits)
    new = want.sequences[:, -len(want.scores):]
    # A row is live up to and including its first eos; after that one device scores the
    # pad it appends (a value no replica computes), and the gather fills a forced pad.
    is_eos = torch.isin(new, torch.tensor(eos))
    live = (is_eos.long().cumsum(1) - is_eos.long()) == 0
    assert not live.all()  # some rows finished early: the padded steps are exercised
    for field in ("scores", "logits"):
        ts_want = model.compute_transition_scores(want.sequences, getattr(want, field))
        ts_got = model.compute_transition_scores(got.sequences, getattr(got, field))
        assert_close_to_reference(ts_got[live], ts_want[live], terms=TERMS)
        for t, (g, w) in enumerate(zip(getattr(got, field), getattr(want, field))):
            assert_close_to_reference(g[live[:, t]], w[live[:, t]], terms=TERMS)
    # Filled steps of finished rows score the fill token 0 (log-prob 0), others -inf.
    ts = model.compute_transition_scores(got.sequences, got.scores, normalize_logits=True)
    assert torch.isfinite(ts[live]).all()


@pytest.mark.parametrize("name", ["gpt2", "t5", "whisper"])
@pytest.mark.parametrize("n,replicas", [(7, 3), (8, 4)])
def test_beam_dict_beam_indices_and_transition_scores(name: str, n: int, replicas: int) -> None:
    model, want, got, _ = _dict_call(name, n, replicas, beams=3)
    assert torch.equal(got.sequences, want.sequences)
    assert torch.equal(got.beam_indices, want.beam_indices)  # offset to the full batch
    assert_close_to_reference(got.sequences_scores, want.sequences_scores, terms=TERMS)
    assert len(got.scores) == len(want.scores)
    if name == "whisper":  # its scores are per returned sequence, not per beam row
        return
    ts_want = model.compute_transition_scores(want.sequences, want.scores, want.beam_indices)
    ts_got = model.compute_transition_scores(got.sequences, got.scores, got.beam_indices)
    assert_close_to_reference(ts_got, ts_want, terms=TERMS)


def test_attentions_and_hidden_states_padded_per_step() -> None:
    _, want, got, _ = _dict_call(
        "gpt2", 7, 3, beams=1, output_attentions=True, output_hidden_states=True
    )
    assert len(got.attentions) == len(want.attentions)
    for g_step, w_step in zip(got.attentions, want.attentions):
        assert [t.shape for t in g_step] == [t.shape for t in w_step]
    for g_step, w_step in zip(got.hidden_states, want.hidden_states):
        assert [t.shape for t in g_step] == [t.shape for t in w_step]
    for g, w in zip(got.hidden_states[0], want.hidden_states[0]):  # the prompt's step
        assert_close_to_reference(g, w, terms=TERMS)


def test_caches_of_different_lengths_come_back_per_replica_with_a_warning() -> None:
    torch.manual_seed(0)
    model = _gpt2().eval()
    inputs = _inputs("gpt2", 7)
    eos = _eos_ids(model, inputs, chunk_sizes(7, 3))
    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 3)
    dpmethods.vocab.warn_once.reset()
    with torch.no_grad(), pytest.warns(UserWarning, match=r"cache: the replicas stopped at different steps"):
        got = dp.generate(
            **inputs, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0,
            return_dict_in_generate=True,
        )
    assert isinstance(got.cache, list) and len(got.cache) == 3
    assert len({c.get_seq_length() for c in got.cache}) > 1


def test_gather_generate_plain_and_errors() -> None:
    a, b = torch.tensor([[4, 5, 6]]), torch.tensor([[7, 8]])
    assert dpmethods.gather_generate([a, b], "cpu", fill_token_id=9).tolist() == [
        [4, 5, 6], [7, 8, 9],
    ]
    with pytest.raises(ValueError, match="the fill token is unknown"):
        dpmethods.gather_generate([a, b], "cpu", fill_token_id=None)
    with pytest.raises(ValueError, match="mode: 'generate' needs the generate call"):
        dpmethods.gather([a, a], "cpu", mode="generate")
    ran: list[int] = []

    class Custom(torch.nn.Module):
        @dpmethods.parallel_method(gather="generate")
        def generate(self, x: torch.Tensor) -> torch.Tensor:
            ran.append(len(x))
            return x

    with pytest.raises(ValueError, match="Custom has no generation_config and was given none"):
        DataParallel(Custom(), device_ids=["cpu"] * 2).generate(torch.ones(3, 2))
    assert ran == []  # refused before any replica ran
    with pytest.raises(ValueError, match=r"gather\['x'\]: expected one of"):
        dpmethods.MethodOptions(gather={"x": "generate"})


@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_the_generate_gather_on_a_method_without_generate_says_what_it_needs(workers: str) -> None:
    # A user's method around lm.generate: the mode cannot know the generate call's fill
    # token, so it refuses the call before any replica runs, naming what it needs.
    torch.manual_seed(0)
    lm = _gpt2().eval()
    n, replicas = 7, 3
    inputs = _inputs("gpt2", n)
    kwargs: dict[str, Any] = dict(max_new_tokens=NEW, eos_token_id=_eos_ids(lm, inputs, chunk_sizes(n, replicas)),
                                  pad_token_id=2, do_sample=False)
    ran: list[int] = []
    hook = lm.register_forward_pre_hook(lambda m, a: ran.append(1))
    dp = DataParallel(Completer(lm), device_ids=["cpu"] * replicas, workers=workers)
    before = _workers()
    with torch.no_grad(), pytest.raises(ValueError) as info:
        dp.complete(**inputs, **kwargs)
    hook.remove()
    assert ran == [] and _workers() <= before  # before the work: no worker process was started
    text = str(info.value)
    assert text.startswith("gather='generate' pads the replicas' generate outputs"), text
    assert "(pad_token_id, eos_token_id, num_beams, num_return_sequences)" in text
    assert "got a call of Completer.complete, and Completer has no generate" in text
    assert "DataParallel(<your Completer>.lm, ...).generate(...)" in text
    assert "gather=functools.partial(dpmethods.integrations.transformers.gather_generate, fill_token_id=..." in text
    # Both fixes it gives return one device's sequences (rows that stop at different steps).
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = lm.generate(**inputs, **kwargs)
        whole = DataParallel(lm, device_ids=["cpu"] * replicas, workers=workers)
        by_model = whole.generate(**inputs, **kwargs)
        given = functools.partial(gather_generate, fill_token_id=2, num_beams=1, num_return_sequences=1)
        fixed = DataParallel(Completer(lm), device_ids=["cpu"] * replicas, workers=workers,
                             methods={"complete": {"gather": given}})
        by_fill = fixed.complete(**inputs, **kwargs)
    for wrapper in (dp, whole, fixed):
        wrapper.close()
    assert torch.equal(by_model, want) and torch.equal(by_fill, want)
    # A model's method other than generate: its arguments are not generate's.
    other = DataParallel(lm, device_ids=["cpu"] * replicas, methods={"forward": {"gather": "generate"}})
    with pytest.raises(ValueError, match=r"got a call of GPT2LMHeadModel\.forward, whose arguments are not generate's"):
        other(**inputs)


def test_caches_of_equal_lengths_are_joined() -> None:
    torch.manual_seed(0)
    model = _gpt2().eval()
    inputs = _inputs("gpt2", 7)
    kwargs: dict[str, Any] = dict(
        max_new_tokens=4, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True
    )
    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 3)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        want = model.generate(**inputs, **kwargs)
        got = dp.generate(**inputs, **kwargs)
    assert type(got.cache) is type(want.cache)
    assert got.cache.get_seq_length() == want.cache.get_seq_length()
    for g, w in zip(got.cache.layers, want.cache.layers):
        assert_close_to_reference(g.keys, w.keys, terms=TERMS)
        assert_close_to_reference(g.values, w.values, terms=TERMS)


@pytest.mark.parametrize("beams", [1, 2])
@pytest.mark.parametrize("n,replicas", [(7, 3), (8, 4)])
def test_prefix_allowed_tokens_fn_gets_each_items_index_in_the_whole_batch(n: int, replicas: int, beams: int) -> None:
    torch.manual_seed(0)
    model = _gpt2().eval()
    inputs = _inputs("gpt2", n)
    # Item i may only emit tokens 4 + 4i .. 4 + 4i + 3: a constraint per item, by index.
    allowed = [list(range(4 + 4 * i, 8 + 4 * i)) for i in range(n)]

    def only_mine(batch_id: int, ids: torch.Tensor) -> list[int]:
        return allowed[batch_id]

    kwargs = dict(max_new_tokens=4, num_beams=beams, do_sample=False, pad_token_id=0,
                  prefix_allowed_tokens_fn=only_mine)
    with torch.no_grad():
        want = model.generate(**inputs, **kwargs)
        got = DataParallel(model, device_ids=["cpu"] * replicas).generate(**inputs, **kwargs)
    assert torch.equal(got, want)
    new = got[:, inputs["input_ids"].shape[1]:]
    for i, row in enumerate(new.tolist()):
        assert set(row) <= set(allowed[i])


def test_a_cache_passed_to_generate_that_cannot_be_updated_in_place_is_warned_about() -> None:
    torch.manual_seed(0)
    model = _gpt2().eval()
    inputs = _inputs("gpt2", 7)
    dp = DataParallel(model, device_ids=["cpu"] * 3)
    dpmethods.vocab.warn_once.reset()
    # transformers 5 renamed generate's past_key_values to cache (the old name warns).
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = transformers.DynamicCache()
    with torch.no_grad(), pytest.warns(UserWarning, match=r"the DynamicCache passed in is not updated in place.*out\.past_key_values"):
        got = dp.generate(**inputs, max_new_tokens=3, pad_token_id=0, **{name: cache})
    with torch.no_grad():
        want = model.generate(**inputs, max_new_tokens=3, pad_token_id=0)
    assert torch.equal(got, want)
    # With the joined cache in the output (every replica ran max_new_tokens), it is.
    cache = transformers.DynamicCache()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        out = dp.generate(**inputs, max_new_tokens=3, pad_token_id=0, **{name: cache},
                          return_dict_in_generate=True)
    assert out.past_key_values is cache and cache.get_seq_length() == want.shape[1] - 1


@pytest.mark.parametrize("eos", [6, 31, 45])
def test_whisper_beam_rows_trimmed_of_their_eos_are_padded_as_one_device_pads_them(eos: int) -> None:
    # With one eos id (an int, here from the model's generation config) Whisper drops each
    # finished row's last eos and pads its rows with the pad id; a replica whose rows all
    # finish early returns fewer columns, which must be filled as one device fills them.
    torch.manual_seed(0)
    model = _whisper().eval()
    model.generation_config.eos_token_id = eos
    inputs = _inputs("whisper", 7)
    kwargs = dict(max_new_tokens=NEW, num_beams=3, pad_token_id=0)
    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 4)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = model.generate(**inputs, **kwargs)
        got = dp.generate(**inputs, **kwargs)
        widths = {int(model.generate(input_features=x, **kwargs).shape[-1])
                  for x in inputs["input_features"].split([2, 2, 2, 1])}
    assert len(widths) > 1  # the replicas returned different numbers of columns
    assert torch.equal(got, want), (got.tolist(), want.tolist())
