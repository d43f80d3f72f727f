"""``dpmethods.ray.Predictor``: methods in Ray Data pipelines equal one device.

The pipelines run on a local Ray cluster (``ray.init(num_cpus=2)``, started once for the
module), which examples/ray_batch_inference.py joins as a second driver; the cheap error
cases call a Predictor directly on a dict of numpy arrays, as Ray would, and need no Ray.
The factories live in tests/helpers/ray_models.py, which Ray's workers import by name
(the repository root is on their PYTHONPATH).
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import functools
import inspect
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.items_models import batches_run, build_tokens
from tests.helpers.models import random_sentences, tiny_sentence_transformer
from tests.helpers.ray_models import FEATURES, HIDDEN, encoder, gpt2, per_row
from tests.helpers.terms import mlp_terms, transformer_terms

np = pytest.importorskip("numpy")

from dpmethods.ray import Predictor, devices_for  # noqa: E402
from dpmethods.testing import assert_close_to_reference  # noqa: E402

# Ray Data's DataContext reads its own deprecated fields when the cluster's context is
# made (ray's code, warned on every run whatever the caller does): not ours to fix.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:`use_push_based_shuffle` is deprecated:DeprecationWarning",
    r"ignore:`use_polars` is deprecated:DeprecationWarning",
    r"ignore:`use_arrow_tensor_v2` is deprecated:DeprecationWarning",
)

_ROOT = Path(__file__).resolve().parents[2]
NORM_TERMS = FEATURES + 1 + 1 + HIDDEN  # Linear(FEATURES, HIDDEN), a scale, a HIDDEN-wide norm
N = 10  # rows: batches of 4 give 4 + 4 + 2, split over 2 replicas as 2 + 2, 2 + 2, 1 + 1


def _linear_tolerance(model: Any, x: torch.Tensor) -> float:
    # A row of Linear(x) sums FEATURES products and the bias in fp32: its rounding error
    # depends on the order of the sum (which BLAS picks by batch size), bounded by
    # (FEATURES + 1) * eps * the sum of the terms' magnitudes.
    with torch.no_grad():
        scale = (x.abs() @ model.lin.weight.abs().T + model.lin.bias.abs()).max()
    return float((FEATURES + 1) * torch.finfo(torch.float32).eps * scale)


def _rows(n: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(n)
    return {"id": np.arange(n), "pixels": torch.randn(n, FEATURES, generator=g).numpy()}


# --- without Ray: a Predictor called on a batch as Ray calls it ---------------------


def test_a_batch_gives_one_row_per_input_row_and_keeps_columns() -> None:
    batch = _rows(N)
    predict = Predictor(encoder, "encode", columns={"x": "pixels"}, keep=["id"],
                        device_ids=["cpu"] * 2, scale=2.0)
    out = predict(batch)
    model = encoder()
    x = torch.from_numpy(batch["pixels"])
    want = model.encode(x, scale=2.0)
    assert sorted(out) == ["id", "mean", "norm"]
    assert out["id"] is batch["id"]
    tol = 2 * _linear_tolerance(model, x)
    np.testing.assert_allclose(out["mean"], want["mean"].detach().numpy(), rtol=0, atol=tol)
    assert_close_to_reference(out["norm"], want["norm"].numpy(), terms=NORM_TERMS)


def test_tuple_outputs_are_numbered_and_strings_become_lists() -> None:
    class Tagger(torch.nn.Module):
        def forward(self, x: torch.Tensor, words: list[str]) -> tuple[torch.Tensor, list[str]]:
            return x * 2, [w.upper() for w in words]

    predict = Predictor(Tagger, output="tag", device_ids=["cpu"])
    out = predict({"x": np.arange(3.0), "words": np.array(["a", "b", "c"], dtype=object)})
    assert sorted(out) == ["tag_0", "tag_1"]
    assert out["tag_0"].tolist() == [0.0, 2.0, 4.0] and out["tag_1"] == ["A", "B", "C"]


class _Labeler(torch.nn.Module):
    """Pairs each row of a tensor column with the row's entry of a string column."""

    def forward(self, x: torch.Tensor, words: list[str]) -> list[str]:
        return [f"{w}={float(v.sum()):g}" for w, v in zip(words, x)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("batch_format", ["numpy", "pandas"])
def test_a_string_column_is_split_by_row_over_the_devices(batch_format: str) -> None:
    # Each replica gets its rows of the string column with its rows of the tensor, as
    # on one device; not the whole column beside its share of the tensor rows.
    words = np.array([f"w{i}" for i in range(5)], dtype=object)
    batch: Any = {"x": np.arange(10.0).reshape(5, 2), "words": words}
    if batch_format == "pandas":
        batch = pytest.importorskip("pandas").DataFrame({"x": list(batch["x"]), "words": words})
    want = ["w0=1", "w1=5", "w2=9", "w3=13", "w4=17"]
    assert list(Predictor(_Labeler, device_ids=["cpu"])(batch)["forward"]) == want
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning that the column goes whole to each replica
        assert list(Predictor(_Labeler, device_ids=["cpu"] * 2)(batch)["forward"]) == want


@dataclasses.dataclass
class _Posterior:
    mu: torch.Tensor
    hidden: tuple[torch.Tensor, torch.Tensor]
    logvar: torch.Tensor | None = None
    items: list[dict[str, torch.Tensor]] | None = None


def test_dataclass_fields_nested_tuples_and_per_row_lists_become_columns() -> None:
    class Vae(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> _Posterior:
            h = x.to(torch.bfloat16)
            return _Posterior(mu=x + 1, hidden=(h, x * 3), items=[{"row": r} for r in x])

    x = torch.randn(5, 3)
    out = Predictor(Vae, device_ids=["cpu"] * 2)({"x": x.numpy()})
    assert sorted(out) == ["hidden_0", "hidden_1", "items", "mu"]  # logvar is None: left out
    np.testing.assert_array_equal(out["mu"], (x + 1).numpy())
    assert out["hidden_0"].dtype == np.float32  # bfloat16, widened exactly
    np.testing.assert_array_equal(out["hidden_0"], x.to(torch.bfloat16).float().numpy())
    assert isinstance(out["items"], list) and len(out["items"]) == 5
    np.testing.assert_array_equal(out["items"][4]["row"], x[4].numpy())


class _Clashing(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        return {"h_0": x + 1, "h": (x * 10, x * 20)}  # "h_0", and h's item 0 named "h_0"


@pytest.mark.timeout(60)
def test_two_parts_of_the_output_named_alike_are_refused() -> None:
    with pytest.raises(ValueError, match=r"output: two parts of the output give the column 'h_0', which can "
                       r"hold one of them; rename a field of the output"):
        Predictor(_Clashing, device_ids=["cpu"])({"x": np.arange(3.0)})


class _Sometimes(torch.nn.Module):
    """A field that some rows have (None in the others)."""

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        return {"a": x, "big": x * 2 if float(x.sum()) >= 1 else None}


@pytest.mark.timeout(60)
def test_items_a_field_that_only_some_rows_have_is_a_column_with_none_in_the_others() -> None:
    # Each row runs alone (batch_size=1); the first row's field is None: the column is
    # still every row's, not left out.
    out = Predictor(_Sometimes, device_ids=["cpu"], batch_size=1, length=lambda row: 1)(
        {"x": np.arange(3.0).reshape(3, 1)})
    assert sorted(out) == ["a", "big"]
    assert out["big"][0] is None and [b.tolist() for b in out["big"][1:]] == [[2.0], [4.0]]
    assert out["a"].tolist() == [[0.0], [1.0], [2.0]]


def test_a_model_output_is_one_column_per_field() -> None:
    pytest.importorskip("transformers")
    ids = torch.randint(4, 48, (5, 6), generator=torch.Generator().manual_seed(2))
    out = Predictor(gpt2, columns=["input_ids"], device_ids=["cpu"] * 2, use_cache=False)(
        {"input_ids": ids.numpy()})
    with torch.no_grad():
        want = gpt2()(input_ids=ids, use_cache=False).logits
    assert list(out) == ["logits"]
    # fp32, as transformers/test_generate.py: the big random weights give logits of tens, whose
    # last bits differ with the batch size (BLAS blocking); 1e-5 relative to their scale.
    scale = float(want.abs().max())
    np.testing.assert_allclose(out["logits"], want.numpy(), rtol=1e-5, atol=1e-5 * max(1.0, scale))


def test_a_missing_column_is_named_with_the_columns_that_exist() -> None:
    predict = Predictor(encoder, "encode", columns={"x": "pixel"}, device_ids=["cpu"])
    with pytest.raises(ValueError, match=(
        r"columns: 'pixel' is not a column of the batch; its columns are \['id', 'pixels'\] "
        r"\(did you mean 'pixels'\?\)"
    )):
        predict(_rows(3))
    with pytest.raises(ValueError, match=r"keep: 'ids' is not a column of the batch; .*\(did you mean 'id'\?\)"):
        Predictor(encoder, "encode", columns={"x": "pixels"}, keep=["ids"])(_rows(3))


def test_an_output_without_one_row_per_input_row_is_named() -> None:
    class Summary(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"rows": x, "total": x.sum()}

    predict = Predictor(Summary, device_ids=["cpu"])
    with pytest.raises(ValueError, match=(
        r"output 'total' is a \(\) Tensor with no rows; expected one row per input row "
        r"\(4 rows\)"
    )):
        predict({"x": np.ones((4, 2))})

    class Doubled(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, x])

    with pytest.raises(ValueError, match=r"output 'forward' is a \(8, 2\) Tensor with 8 rows; "
                                         r"expected one row per input row \(4 rows\)"):
        Predictor(Doubled, device_ids=["cpu"])({"x": np.ones((4, 2))})


def test_an_output_that_is_not_a_column_is_named() -> None:
    class Cache:  # a state for the next step, as a transformers cache
        pass

    class Step(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, Any]:
            return {"logits": x, "cache": Cache()}

    with pytest.raises(ValueError, match=(
        r"output 'cache' is a Cache with no rows; expected one row per input row \(3 rows\)\. "
        r".*use_cache=False leaves a cache out"
    )):
        Predictor(Step, device_ids=["cpu"])({"x": np.ones((3, 4))})


def test_arguments_are_checked_when_the_predictor_is_built() -> None:
    with pytest.raises(AttributeError, match=r"method: Encoder has no method 'encod' \(did you mean 'encode'\?\)"):
        Predictor(encoder, "encod")
    with pytest.raises(TypeError, match=r"keep: expected a list of column names, got 'id'; pass keep=\['id'\]"):
        Predictor(encoder, "encode", keep="id")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="factory: expected it to return a torch.nn.Module, got int"):
        Predictor(lambda: 3)  # type: ignore[arg-type, return-value]
    with pytest.raises(TypeError, match=r"method_kwargs: \['x'\] are also arguments given by columns="):
        Predictor(encoder, "encode", columns=["x"], x=1)
    with pytest.raises(ValueError, match=r"keep: \['mean'\] are also output columns of 'encode'"):
        Predictor(encoder, "encode", columns={"x": "pixels"}, keep=["mean"])(
            {**_rows(2), "mean": np.zeros(2)})


# Rows whose first feature sets each per-row output; sorted by it, item mode's batches
# differ from the input's order.
_PER_ROW = {"id": np.arange(7), "x": np.array([[1, 0], [6, 0], [3, 0], [2, 0], [5, 0], [4, 0], [7, 0]], dtype=np.float32)}


def _by_first(row: dict[str, Any]) -> int:
    return int(row["x"][0])


def _assert_same_columns(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Equal columns, of the same kinds: arrays (dtype, shape), or lists of equal entries."""
    assert sorted(got) == sorted(want)
    for name, column in want.items():
        assert type(got[name]) is type(column), name
        if isinstance(column, np.ndarray):
            assert got[name].dtype == column.dtype and got[name].shape == column.shape, name
            np.testing.assert_array_equal(got[name], column)
            continue
        assert len(got[name]) == len(column), name
        for g, w in zip(got[name], column):
            assert type(g) is type(w), name
            if isinstance(w, np.ndarray):
                np.testing.assert_array_equal(g, w)
            else:
                assert g == w, name


@pytest.mark.timeout(60)
@pytest.mark.parametrize("items", [dict(batch_size=2, length=_by_first), dict(max_tokens=6, length=_by_first)])
def test_items_per_row_lists_tuples_dicts_and_ragged_tensors_equal_one_device(items: dict[str, Any]) -> None:
    # A per-row list is one column on one device, whatever its entries are: in item mode
    # too, not a tuple's positions and a dict's keys as columns of their own.
    want = Predictor(per_row, columns=["x"], keep=["id"], device_ids=["cpu"])(_PER_ROW)
    assert sorted(want) == ["id", "pair", "ramp", "tag", "tokens", "y"]
    assert want["pair"][1] == (6, "w6") and want["tag"][1] == {"n": 6, "half": 3.0}
    got = Predictor(per_row, columns=["x"], keep=["id"], device_ids=["cpu"] * 2, **items)(_PER_ROW)
    _assert_same_columns(got, want)


@pytest.mark.timeout(60)
def test_items_an_empty_batch_gives_the_output_columns_with_no_rows() -> None:
    empty = {"id": np.arange(0), "x": _PER_ROW["x"][:0]}
    want = Predictor(per_row, columns=["x"], keep=["id"], device_ids=["cpu"])(empty)
    assert sorted(want) == ["id", "pair", "ramp", "tag", "tokens", "y"] and want["y"].shape == (0, 2)
    predict = Predictor(per_row, columns=["x"], keep=["id"], device_ids=["cpu"] * 2, batch_size=2,
                        length=_by_first)
    _assert_same_columns(predict(empty), want)  # before any batch: the method's, on the empty columns
    predict(_PER_ROW)
    _assert_same_columns(predict(empty), want)  # after one: that batch's columns, with no rows
    for batch in (_PER_ROW, empty):  # a kept column named as an output column is refused, with rows or not
        with pytest.raises(ValueError, match=r"keep: \['y'\] are also output columns of 'forward'; keep other "
                           r"columns, or pass output= to name the output differently"):
            Predictor(per_row, columns=["x"], keep=["y"], device_ids=["cpu"], batch_size=2, length=_by_first)(
                {**batch, "y": batch["id"]})


def _ragged(lengths: list[int], seed: int = 5) -> Any:
    """A column of token ids of these lengths, as Ray gives a variable-shaped one: an
    object array of arrays."""
    g = torch.Generator().manual_seed(seed)
    column = np.empty(len(lengths), dtype=object)
    for i, n in enumerate(lengths):
        column[i] = torch.randint(4, 40, (n,), generator=g).numpy()
    return column


@pytest.mark.parametrize("items", [dict(max_tokens=12), dict(batch_size=2, length=lambda row: len(row["input_ids"]))])
def test_items_rows_are_sorted_batched_and_returned_in_their_order(tmp_path: Path, items: dict[str, Any]) -> None:
    lengths = [3, 9, 1, 5, 7, 2, 12, 4]
    column = _ragged(lengths)
    predict = Predictor(functools.partial(build_tokens, str(tmp_path)), "encode", columns=["input_ids"],
                        keep=["id"], device_ids=["cpu"] * 2, **items)
    out = predict({"id": np.arange(len(lengths)), "input_ids": column})
    model = build_tokens(str(tmp_path))
    with torch.no_grad():
        want = [model.alone(torch.from_numpy(ids))["pooled"].numpy() for ids in column]
    assert sorted(out) == ["hidden", "id", "pooled"] and out["id"].tolist() == list(range(len(lengths)))
    assert_close_to_reference(out["pooled"], np.stack(want), terms=mlp_terms(8) + 12)
    runs = batches_run(tmp_path)
    assert len(runs) > 1  # sub-batches, not the Ray batch whole
    if "max_tokens" in items:
        assert all(rows * longest <= 12 or rows == 1 for rows, longest in runs)


@pytest.mark.timeout(60)
def test_items_options_are_checked_when_the_predictor_is_built(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"map: max_tokens: expected None or an int >= 1 .*, got int 0"):
        Predictor(functools.partial(build_tokens, str(tmp_path)), "encode", max_tokens=0, device_ids=["cpu"])
    # Without batch_size= or max_tokens= each batch is one call: length= and collate=
    # would be ignored.
    for name in ("length", "collate"):
        with pytest.raises(TypeError, match=rf"{name}: applies to item mode \(with batch_size= or max_tokens=\), "
                           rf"but neither was given, so each batch runs as one call; got {name}=<built-in function len>"):
            Predictor(encoder, "encode", **{name: len})


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(keep=None), r"keep: expected a list of column names, got None"),
    (dict(device_ids="cpu"), r"device_ids: expected a list of devices, got str 'cpu'"),
    (dict(device_ids=0), r"device_ids: expected a list of devices, got int 0"),
])
def test_bad_arguments_are_named_with_what_was_expected(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(TypeError, match=message):
        Predictor(encoder, "encode", **kwargs)


def test_devices_are_the_gpus_ray_gave_the_actor() -> None:
    assert devices_for(None, 0) == ["cpu"]  # outside Ray, without GPUs
    assert devices_for(None, 2) == [0, 1]  # outside Ray: every visible GPU
    assert devices_for([], 4) == ["cpu"]  # an actor given no GPU
    assert devices_for([3, 5], 2) == [0, 1]  # CUDA_VISIBLE_DEVICES=3,5: torch's 0 and 1
    assert devices_for(["3", "5"], 8) == [3, 5]  # Ray left CUDA_VISIBLE_DEVICES alone


def test_pandas_batches_come_back_as_dataframes() -> None:
    pd = pytest.importorskip("pandas")
    batch = _rows(5)
    frame = pd.DataFrame({"id": batch["id"], "pixels": list(batch["pixels"])})
    out = Predictor(encoder, "encode", columns={"x": "pixels"}, keep=["id"], device_ids=["cpu"])(frame)
    assert isinstance(out, pd.DataFrame) and list(out.columns) == ["id", "mean", "norm"]
    want = Predictor(encoder, "encode", columns={"x": "pixels"}, device_ids=["cpu"])(batch)
    np.testing.assert_array_equal(np.stack(list(out["mean"])), want["mean"])
    assert out["id"].tolist() == list(range(5))


# --- on a local Ray cluster ------------------------------------------------------------


@pytest.fixture(scope="module")
def ray() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    # The cluster's processes inherit this PYTHONPATH: the workers of every job on it,
    # this module's and the example's, import this checkout's dpmethods and tests.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", _pythonpath())
        ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        yield ray
    finally:
        ray.shutdown()


def _pythonpath() -> str:
    return os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))


def _run(ray: Any, items: list[dict[str, Any]], batch_format: str = "numpy", **kwargs: Any) -> list[dict[str, Any]]:
    ds = ray.data.from_items(items).map_batches(
        Predictor, fn_constructor_kwargs=kwargs, batch_size=4, batch_format=batch_format,
        compute=ray.data.ActorPoolStrategy(size=1),
    )
    return sorted(ds.take_all(), key=lambda row: row["id"])


_PASSENGERS = ("when", "price", "name")  # kept columns of types no model input has


def _passengers(i: int) -> dict[str, Any]:
    """Row ``i``'s kept values: a timestamp to the microsecond, a decimal and a string, each
    different per row."""
    return {"when": datetime.datetime(2024, 1, 1 + i, 12, 0, i, 1000 * i + 7),
            "price": decimal.Decimal(f"{i}.{i:02d}"), "name": f"row-{i}"}


def _assert_passengers_kept(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        want = _passengers(row["id"])
        got = {k: row[k] for k in _PASSENGERS}
        assert got == want and all(type(got[k]) is type(want[k]) for k in _PASSENGERS), (got, want)


@pytest.mark.timeout(240)
# Two replicas on numpy batches are the other pipelines' (generate, sentence-transformers).
@pytest.mark.parametrize("devices,batch_format", [(None, "numpy"), (["cpu"] * 2, "pandas")])
def test_a_decorated_method_in_a_pipeline_equals_one_device(ray: Any, devices: Any, batch_format: str) -> None:
    batch = _rows(N)
    items = [{"id": int(i), "pixels": p, **_passengers(int(i))} for i, p in zip(batch["id"], batch["pixels"])]
    rows = _run(ray, items, batch_format, factory=encoder, method="encode",
                columns={"x": "pixels"}, keep=["id", *_PASSENGERS], device_ids=devices)
    _assert_passengers_kept(rows)
    model = encoder()
    x = torch.from_numpy(batch["pixels"])
    with torch.no_grad():
        want = model.encode(x)
    tol = _linear_tolerance(model, x)
    assert [r["id"] for r in rows] == list(range(N))
    assert all(sorted(r) == sorted(["id", "mean", "norm", *_PASSENGERS]) for r in rows)
    np.testing.assert_allclose(np.stack([r["mean"] for r in rows]), want["mean"].numpy(), rtol=0, atol=tol)
    norms = np.array([r["norm"] for r in rows], dtype=np.float32)  # rows may hold them as float64: exact
    assert_close_to_reference(norms, want["norm"].numpy(), terms=NORM_TERMS)
    assert np.stack([r["mean"] for r in rows]).shape == (N, HIDDEN)


@pytest.mark.timeout(240)
def test_transformers_generate_in_a_pipeline_equals_one_device(ray: Any) -> None:
    pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 48, (N, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = mask[5, :1] = 0  # left-padded prompts
    ids = ids.masked_fill(mask == 0, 0)
    kwargs = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    items = [{"id": i, "input_ids": ids[i].numpy(), "attention_mask": mask[i].numpy()} for i in range(N)]
    rows = _run(ray, items, factory=gpt2, method="generate", output="tokens",
                keep=["id"], device_ids=["cpu"] * 2, **kwargs)
    with torch.no_grad():
        want = gpt2().generate(input_ids=ids, attention_mask=mask, **kwargs)
    assert np.array_equal(np.stack([r["tokens"] for r in rows]), want.numpy())


@pytest.mark.timeout(240)
def test_sentence_transformers_encode_of_a_text_column_equals_one_device(
    ray: Any, tmp_path: Path
) -> None:
    pytest.importorskip("sentence_transformers")
    model = tiny_sentence_transformer(tmp_path)
    sentences = random_sentences(N)
    first = list(inspect.signature(type(model).encode).parameters)[1]
    items = [{"id": i, "text": s} for i, s in enumerate(sentences)]
    rows = _run(ray, items, factory=functools.partial(tiny_sentence_transformer, tmp_path),
                method="encode", columns={first: "text"}, keep=["id"], output="embedding",
                device_ids=["cpu"] * 2)
    want = model.encode(sentences)
    # The tiny BERT (2 blocks, width 32, up to 7 tokens) and the mean pooling, summed in
    # another order for another batch size.
    terms = transformer_terms(width=32, ff=37, seq=7, layers=2) + 7
    assert_close_to_reference(np.stack([r["embedding"] for r in rows]), want, terms=terms)


@pytest.mark.timeout(240)
def test_generate_with_max_tokens_in_a_pipeline_equals_each_prompt_alone(ray: Any) -> None:
    pytest.importorskip("transformers")
    lengths = [2, 9, 4, 1, 7, 3, 6, 5, 8, 2]
    column = _ragged(lengths, seed=6)
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    items = [{"id": i, "input_ids": column[i], **_passengers(i)} for i in range(N)]
    rows = _run(ray, items, factory=gpt2, method="generate", columns=["input_ids"], output="tokens",
                keep=["id", *_PASSENGERS], device_ids=["cpu"] * 2, max_tokens=16, **kwargs)
    _assert_passengers_kept(rows)  # each row's, though its prompt ran in a batch sorted by length
    model = gpt2()
    with torch.no_grad():
        for row, ids in zip(rows, column):
            prompt = torch.from_numpy(ids)[None]
            want = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), **kwargs)[0]
            assert row["tokens"].tolist() == want.tolist()


@pytest.mark.timeout(240)
def test_the_example_on_a_running_cluster_equals_one_device(ray: Any) -> None:
    """examples/ray_batch_inference.py run as a script against a running cluster
    (``--address``, as under ``ray job submit``): this module's, whose Ray Data helper
    actors it shares instead of starting a cluster of its own."""
    example = _ROOT / "examples" / "ray_batch_inference.py"
    proc = subprocess.run(
        [sys.executable, str(example), "--address", ray.get_runtime_context().gcs_address,
         "--rows", "96", "--batch-size", "16", "--replicas", "2"],
        capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONPATH": _pythonpath()},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "rows: 96, columns: ['embedding', 'id', 'norm']" in proc.stdout, proc.stdout
    assert "equal to one device (within fp32 rounding): True" in proc.stdout, proc.stdout


@pytest.mark.timeout(240)
def test_a_missing_column_in_a_pipeline_reaches_the_driver(ray: Any) -> None:
    # The module's last pipeline: after the error, Ray Data keeps the failed actor's CPU
    # for tens of seconds, which a later pipeline on this cluster would wait for.
    items = [{"id": i, "pixels": np.zeros(FEATURES, dtype=np.float32)} for i in range(4)]
    with pytest.raises(Exception, match=r"columns: 'x' is not a column of the batch; its columns are \['id', 'pixels'\]"):
        _run(ray, items, factory=encoder, method="encode", columns=["x"])
