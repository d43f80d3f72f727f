"""on_oom="split" on real models: a map's batch, or a call's share, that runs out of memory
runs in halves through the method's CallHooks as a call over devices runs, and equals one
device, on worker threads and worker processes; the hooks cross to worker processes; the
out-of-memory record is kept per replica per method."""

from __future__ import annotations

import functools
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import dpmethods
from dpmethods.extending import CallHooks
from dpmethods.testing import assert_close_to_reference
from tests.helpers import WORKERS
from tests.helpers.long_runs import Faulty, out_of_memory_above, rows_run
from tests.helpers.models import (
    random_sentences,
    tiny_gpt2,
    tiny_qwen2_vl,
    tiny_sentence_transformer,
)
from tests.helpers.oom_models import InBatch, OnlyMine, TwoMethods
from tests.helpers.terms import transformer_terms

pytestmark = pytest.mark.timeout(300)
LIMIT = 2  # rows that fit: 7 rows run as 2 + 2 + 2 + 1
# tiny_gpt2: 2 blocks of width 16 (MLP 64) over 8 tokens, a 48-token softmax, and the
# loss's mean over up to 7 x 8 tokens.
GPT2_TERMS = transformer_terms(width=16, ff=64, seq=8, layers=2) + 48 + 7 * 8
# tiny_qwen2_vl: a vision block of width 16 and a text block of width 32 over up to 16 tokens.
VL_TERMS = transformer_terms(width=32, ff=64, seq=16, layers=2) + 64


def _dp(model: torch.nn.Module, workers: str, **options: Any) -> Any:
    return dpmethods.DataParallel(model, device_ids=["cpu"] * 2, workers=workers, on_oom="split", **options)


def _limit_rows(module: torch.nn.Module, workdir: Path) -> None:
    module.register_forward_pre_hook(functools.partial(out_of_memory_above, str(workdir), LIMIT), with_kwargs=True)


def _ran_in_halves(workdir: Path) -> None:
    ran = rows_run(workdir)
    assert any(out for _, out in ran), "no run ran out of memory: the test split nothing"
    assert max(rows for rows, out in ran if not out) <= LIMIT


def _lm_batch(seed: int, rows: int = 7, width: int = 8) -> dict[str, torch.Tensor]:
    """Rows with left padding and labels left out at random: counted tokens differ by row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 48, (rows, width), generator=g)
    mask = torch.ones_like(ids)
    for row in range(rows):
        mask[row, : row % 4] = 0
    labels = ids.masked_fill(mask == 0, -100).masked_fill(torch.rand(rows, width, generator=g) < 0.4, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("workers", WORKERS)
def test_a_token_averaged_loss_in_halves_equals_one_device(tmp_path: Path, workers: str) -> None:
    torch.manual_seed(0)
    model = tiny_gpt2().eval()
    batches = [_lm_batch(1), _lm_batch(2)]
    with torch.no_grad():
        want = [model(**b) for b in batches]
    _limit_rows(model, tmp_path)
    dp = _dp(model, workers)
    with torch.no_grad():
        got = list(dp.map("forward", batches, on_oom="split"))
        got.append(dp(**batches[0]))  # a call: shares of 4 and 3 rows, each in halves
    dp.close()
    _ran_in_halves(tmp_path)
    for g, w in zip(got, [*want, want[0]]):
        assert_close_to_reference(g.loss, w.loss, terms=GPT2_TERMS)
        assert_close_to_reference(g.logits, w.logits, terms=GPT2_TERMS)


@pytest.mark.parametrize("workers", WORKERS)
def test_int8_embeddings_in_halves_are_calibrated_on_the_whole_batch(tmp_path: Path, workers: str) -> None:
    model = tiny_sentence_transformer(tmp_path)
    # Halves of 2 rows or more: calibrated on its own, each would be silently wrong.
    batches = [random_sentences(8), random_sentences(16)]
    want = [model.encode(b, precision="int8") for b in batches]
    _limit_rows(model[0].auto_model.embeddings, tmp_path)  # called as a module, with input_ids
    dp = _dp(model, workers)
    got = list(dp.map("encode", batches, on_oom="split", precision="int8"))
    got.append(dp.encode(batches[1], precision="int8"))  # shares of 8, each in halves
    dp.close()
    _ran_in_halves(tmp_path)
    for g, w in zip(got, [*want, want[1]]):
        assert g.dtype == w.dtype and g.tolist() == w.tolist()


@pytest.mark.parametrize("workers", WORKERS)
def test_generate_halves_give_each_item_its_index_in_the_whole_batch(tmp_path: Path, workers: str) -> None:
    torch.manual_seed(0)
    model = tiny_gpt2(eos_token_id=5, pad_token_id=0).eval()
    g = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(2, 48, (7, 4), generator=g)} for _ in range(2)]
    kwargs = dict(max_new_tokens=4, do_sample=False, prefix_allowed_tokens_fn=OnlyMine())
    with torch.no_grad():
        want = [model.generate(**b, **kwargs) for b in batches]
    _limit_rows(model, tmp_path)
    dp = _dp(model, workers)
    with torch.no_grad():
        got = list(dp.map("generate", batches, on_oom="split", **kwargs))
        got.append(dp.generate(**batches[0], **kwargs))  # share 2 starts at row 4, its halves at 4 and 6
    dp.close()
    _ran_in_halves(tmp_path)
    assert [o.tolist() for o in got] == [w.tolist() for w in [*want, want[0]]]


@pytest.mark.parametrize("workers", WORKERS)
def test_each_half_gets_the_patches_of_its_rows_images(tmp_path: Path, workers: str) -> None:
    pytest.importorskip("transformers")
    model, inputs = tiny_qwen2_vl()  # 7 rows with 0 to 2 images each: per_replica cuts the patches
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        want = model(**inputs)
        _limit_rows(model, tmp_path)
        dp = _dp(model, workers)
        got = [*dp.map("forward", [inputs], on_oom="split"), dp(**inputs)]
    dp.close()
    _ran_in_halves(tmp_path)
    for g in got:
        assert_close_to_reference(g.logits, want.logits, terms=VL_TERMS)
        assert len(g.image_outputs.pooler_output) == len(want.image_outputs.pooler_output) == 7
        assert_close_to_reference(list(g.image_outputs.pooler_output), list(want.image_outputs.pooler_output),
                                  terms=VL_TERMS)


@pytest.mark.parametrize("workers", WORKERS)
def test_a_module_that_couples_its_batch_is_warned_about_when_the_batch_is_split(tmp_path: Path, workers: str) -> None:
    dpmethods.vocab.warn_once.reset()
    dp = dpmethods.DataParallel(InBatch(tmp_path, limit=4), device_ids=["cpu"] * 2, workers=workers)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        list(dp.map("forward", [torch.randn(4, 6)] * 2, on_oom="split"))  # fits: one device's result
        assert not [w for w in caught if "couples the items of its batch" in str(w.message)]
        list(dp.map("forward", [torch.randn(7, 6)], on_oom="split"))
    dp.close()
    assert any(out for _, out in rows_run(tmp_path))
    assert [w for w in caught if "InBatch couples the items of its batch (in-batch scores)" in str(w.message)]


# --- the hooks cross to worker processes ----------------------------------------------


def _prepare(args: tuple[Any, ...], kwargs: dict[str, Any], call: Any) -> Any:
    return args, {**kwargs, "scale": kwargs.get("scale", 1) * 2}, _negate


def _negate(out: Any) -> Any:
    return -out


def _shift(args: tuple[Any, ...], kwargs: dict[str, Any], start: int, call: Any) -> Any:
    return (*args, start), kwargs


def test_chained_hooks_pickle_and_run_as_before() -> None:
    hooks = CallHooks(prepare=_prepare, per_replica=_shift).then(CallHooks(prepare=_prepare, per_replica=_shift))
    again = pickle.loads(pickle.dumps(hooks))
    assert again == hooks
    for h in (hooks, again):
        args, kwargs, finish = h.prepare((), {}, None)
        assert (args, kwargs, finish(3)) == ((), {"scale": 4}, 3)  # the finishes in reverse: -(-3)
        assert h.per_replica((), {}, 5, None) == ((5, 5), {})


@pytest.mark.parametrize("how", ["map", "call"])
def test_a_hook_that_cannot_be_pickled_is_named_before_any_batch_runs(tmp_path: Path, how: str) -> None:
    hooks = CallHooks(prepare=lambda args, kwargs, call: (args, kwargs, None))
    dp = _dp(Faulty(tmp_path), "processes", methods={"encode": {"hooks": hooks}})
    x = torch.randn(5, 6)
    message = (r"on_oom='split'.*the options of encode cannot be sent to a worker process: hooks\.prepare "
               r"\(function .*<lambda>\) cannot be pickled")
    with torch.no_grad(), pytest.raises(TypeError, match=message) as info:
        if how == "map":
            list(dp.map("encode", [x, x], on_oom="split"))
        else:
            dp.encode(x)
    dp.close()
    assert "batch 0 cannot be sent" not in str(info.value) and "its arguments" not in str(info.value)
    assert rows_run(tmp_path) == []


# --- the record --------------------------------------------------------------------------


@pytest.mark.parametrize("workers", WORKERS)
def test_the_record_is_kept_per_method(tmp_path: Path, workers: str) -> None:
    torch.manual_seed(0)
    model = TwoMethods(tmp_path, limit=LIMIT)
    ids = torch.randint(2, 48, (8, 5))
    with torch.no_grad():
        want = model.small(ids)
        (tmp_path / "small").unlink()
        dp = _dp(model, workers)
        dp.big(ids)  # shares of 4 rows: each runs out, then runs in halves
        got = [dp.small(ids), dp.small(ids)]
        got += list(dp.map("small", [ids], on_oom="split"))
    dp.close()
    assert any(out for _, out in rows_run(tmp_path, "big"))
    # small never ran out: its shares (4 + 4 rows, twice) and the map's batch run whole.
    assert sorted(rows for rows, _ in rows_run(tmp_path, "small")) == [4, 4, 4, 4, 8]
    for g in got:
        assert_close_to_reference(g, want, terms=GPT2_TERMS)


@pytest.mark.parametrize("mode", ["stack", "list"])
@pytest.mark.parametrize("workers", WORKERS)
def test_a_per_replica_gather_mode_refuses_to_join_halves(tmp_path: Path, workers: str, mode: str) -> None:
    # 'stack' and 'list' keep one entry per replica: a batch of 4 rows in halves of 2
    # would come back as [2, 2, ...] (or two entries) where one device gives [4, ...].
    torch.manual_seed(0)
    model = TwoMethods(tmp_path, limit=LIMIT)
    ids = torch.randint(2, 48, (4, 5))
    dp = _dp(model, workers, methods={"big": {"gather": mode}})
    with torch.no_grad():
        (fits,) = dp.map("big", [ids[:2]], on_oom="split")  # a batch that fits runs as without the option
        assert_close_to_reference(fits, model.lm(ids[:2]).logits, terms=GPT2_TERMS)
        with pytest.raises(ValueError, match=rf"on_oom='split': output is gathered with '{mode}', one entry per replica"):
            list(dp.map("big", [ids], on_oom="split"))
        with pytest.raises(ValueError, match=rf"on_oom='split': output is gathered with '{mode}'"):
            dp.big(torch.cat([ids, ids]))  # a call: shares of 4 rows, each in halves
    dp.close()
