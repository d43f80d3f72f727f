"""Gather: modes, nested structures, and structure errors."""

from __future__ import annotations

import dataclasses
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from dpmethods import DataParallel
from dpmethods.parallel import gather
from dpmethods.testing import assert_close_to_reference
from dpmethods.vocab import warn_once as warn_once
from tests.helpers.long_runs import Faulty
from tests.helpers.terms import mlp_terms


class Out(NamedTuple):
    z: torch.Tensor
    extras: dict[str, Any]


@dataclasses.dataclass
class Result:
    logits: torch.Tensor
    hidden: tuple[torch.Tensor, ...]
    loss: torch.Tensor | None = None
    step: int = 0
    cached: int = dataclasses.field(default=7, init=False)


class Hybrid(OrderedDict):
    """An OrderedDict-plus-dataclass, the shape of Hugging Face's ModelOutput."""

    def __init_subclass__(cls) -> None:
        dataclasses.dataclass(cls)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is not None:
                self[f.name] = value


class HybridOut(Hybrid):
    logits: torch.Tensor | None = None
    aux: torch.Tensor | None = None


def _parts(full: torch.Tensor, sizes: list[int], dim: int = 0) -> list[torch.Tensor]:
    return list(full.split(sizes, dim))


def test_cat_rebuilds_nested_types() -> None:
    z = torch.randn(5, 3)
    h = torch.randn(5, 2)
    outs = [
        Out(zp, {"h": [hp], "tag": "same", "none": None, "n": i})
        for i, (zp, hp) in enumerate(zip(_parts(z, [3, 2]), _parts(h, [3, 2])))
    ]
    warn_once.reset()
    with pytest.warns(UserWarning, match=r"output\.extras\['n'\] \(int\) differs across replicas"):
        g = gather(outs, "cpu")
    assert isinstance(g, Out) and torch.equal(g.z, z) and torch.equal(g.extras["h"][0], h)
    assert g.extras["tag"] == "same"  # equal non-tensors come back once
    assert g.extras["none"] is None
    assert g.extras["n"] == [0, 1]  # differing ones as a list


def test_dataclass_with_non_init_field() -> None:
    logits = torch.randn(4, 6)
    outs = [Result(p, (p * 2,), None, step=3) for p in _parts(logits, [2, 2])]
    for o in outs:
        o.cached = 9
    g = gather(outs, "cpu")
    assert type(g) is Result and torch.equal(g.logits, logits) and torch.equal(g.hidden[0], logits * 2)
    assert g.loss is None and g.step == 3 and g.cached == 9


def test_ordereddict_dataclass_hybrid_keeps_type_and_keys() -> None:
    logits = torch.randn(3, 2)
    outs = [HybridOut(logits=p) for p in _parts(logits, [2, 1])]
    g = gather(outs, "cpu")
    assert type(g) is HybridOut
    assert list(g.keys()) == ["logits"] and torch.equal(g["logits"], logits) and g.aux is None


def test_model_output_from_transformers() -> None:
    outputs = pytest.importorskip("transformers.modeling_outputs", reason="transformers is not installed")
    logits = torch.randn(5, 4, 7)
    outs = [outputs.CausalLMOutputWithPast(logits=p) for p in _parts(logits, [3, 2])]
    g = gather(outs, "cpu")
    assert type(g) is outputs.CausalLMOutputWithPast
    assert torch.equal(g.logits, logits) and torch.equal(g[0], logits)


@pytest.mark.parametrize("sizes", [[2, 2], [3, 1, 1], [1, 4, 2]])
def test_mean_is_weighted_by_batch_share(sizes: list[int]) -> None:
    values = torch.randn(sum(sizes))
    losses = [p.mean() for p in _parts(values, sizes)]
    weights = [s / sum(sizes) for s in sizes]
    g = gather(losses, "cpu", mode="mean", weights=weights)
    # The shares' means weighted: a mean of the batch's values, in another order.
    assert_close_to_reference(g, values.mean(), terms=2 * len(values))
    assert_close_to_reference(gather([1.0, 4.0], "cpu", mode="mean", weights=[0.75, 0.25]), 1.75, terms=2)


def test_sum_stack_list_modes() -> None:
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    assert_close_to_reference(gather([a, b], "cpu", mode="sum"), a + b, terms=1)
    assert torch.equal(gather([a, b], "cpu", mode="stack"), torch.stack([a, b]))
    assert torch.equal(gather([a, b], "cpu", dim=1, mode="stack"), torch.stack([a, b], 1))
    listed = gather([a, b], "cpu", mode="list")
    assert isinstance(listed, list) and torch.equal(listed[1], b)
    assert gather([1, 2], "cpu", mode="sum") == 3


def test_pad_joins_ragged_sequences() -> None:
    a = torch.randint(1, 9, (2, 5))
    b = torch.randint(1, 9, (3, 3))
    g = gather([a, b], "cpu", mode="pad", pad_value=-1)
    assert g.shape == (5, 5)
    assert torch.equal(g[:2], a) and torch.equal(g[2:, :3], b)
    assert (g[2:, 3:] == -1).all()
    with pytest.raises(ValueError, match=r"'pad' needs the same number of dims.*\[\[2, 5\], \[3\]\]"):
        gather([a, torch.ones(3)], "cpu", mode="pad")


def test_mapping_of_modes_and_callable() -> None:
    y = torch.randn(4, 2)
    outs = [{"y": p, "loss": p.sum(), "tokens": p.argmax(1)} for p in _parts(y, [3, 1])]
    g = gather(outs, "cpu", mode={"loss": "sum", "tokens": "list"})
    assert torch.equal(g["y"], y)
    assert_close_to_reference(g["loss"], y.sum(), terms=y.numel())  # the parts' sums, summed
    assert isinstance(g["tokens"], list) and len(g["tokens"]) == 2
    assert gather(outs, "cpu", mode=lambda o, d: (len(o), str(d))) == (2, "cpu")
    with pytest.warns(UserWarning, match=r"mode keys \['los'\] are not in the output"):
        gather(outs, "cpu", mode={"los": "mean", "loss": "mean"})
    with pytest.raises(ValueError, match="a mapping of modes .* needs outputs with keys"):
        gather([y, y], "cpu", mode={"y": "cat"})


def test_zero_dim_under_cat_warns_and_stacks() -> None:
    with pytest.warns(UserWarning, match=r"output\['loss'\] is 0-dim on every replica.*gather=\{'loss': 'mean'\}"):
        g = gather([{"loss": torch.tensor(1.0)}, {"loss": torch.tensor(2.0)}], "cpu")
    assert torch.equal(g["loss"], torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_a_call_stacks_a_0_dim_loss_on_even_and_uneven_shares_alike(tmp_path: Path, workers: str) -> None:
    # As torch's DataParallel: one value per replica, with a warning whose fix is right.
    model = Faulty(tmp_path)
    dp = DataParallel(model, device_ids=["cpu"] * 3, workers=workers)
    fixed = DataParallel(model, device_ids=["cpu"] * 3, workers=workers, methods={"scored": {"gather": {"loss": "mean"}}})
    warning = (r"gather: output\['loss'\] is 0-dim on every replica, so it was stacked into a vector of 3 "
               r"values; use gather=\{'loss': 'mean'\} if it is a mean over the batch's items")
    g = torch.Generator().manual_seed(0)
    for rows in (6, 4):  # shares of 2 + 2 + 2, and of 2 + 1 + 1
        x = torch.randn(rows, 6, generator=g)
        with torch.no_grad():
            with pytest.warns(UserWarning, match=warning):
                out = dp.scored(x)
            assert out["loss"].shape == (3,)
            assert_close_to_reference(fixed.scored(x), model.scored(x), terms=mlp_terms(6, rows=rows * 3))
    dp.close()
    fixed.close()


@pytest.mark.parametrize(("outputs", "mode", "fix"), [
    ([torch.tensor(1.0)] * 2, "cat", "use gather='mean' if"),
    ([(torch.ones(2), torch.tensor(1.0))] * 2, "cat", "use gather={1: 'mean'} if"),
    ([{"y": torch.ones(2, 1), "loss": torch.tensor(1.0)}] * 2, "pad", "use gather={'y': 'pad', 'loss': 'mean'} if"),
    ([{"y": torch.ones(2), "loss": torch.tensor(1.0)}] * 2, {"y": "extend"},
     "use gather={'y': 'extend', 'loss': 'mean'} if"),
    ([{"a": {"y": torch.ones(2), "loss": torch.tensor(1.0)}}] * 2, "cat",
     "a gather mapping names only top-level keys, fields and positions: return it as one of its own"),
])
def test_a_0_dim_leaf_is_told_the_option_that_gives_it_alone_a_mode(outputs: list[Any], mode: Any, fix: str) -> None:
    # Never gather='mean' for a whole output that has other leaves: it would average them too.
    with pytest.warns(UserWarning) as seen:
        gather(outputs, "cpu", mode=mode)
    assert fix in str(seen[0].message), seen[0].message


class P(NamedTuple):
    x: Any


def test_structure_mismatch_names_the_key_path() -> None:
    t = torch.ones(1)
    with pytest.raises(ValueError, match=r"between replica 0 and replica 1: output\['m'\]: dict with keys \['a', 'b'\] vs dict with keys \['a'\]"):
        gather([{"m": {"a": t, "b": t}}, {"m": {"a": t}}], "cpu")
    with pytest.raises(ValueError, match=r"replica 0 and replica 2: output\[1\]\.x: a tensor vs None"):
        gather([(t, P(t)), (t, P(t)), (t, P(None))], "cpu")
    with pytest.raises(ValueError, match=r"output\[0\]: a non-tensor value vs a tensor"):
        gather([[3], [t]], "cpu")


def test_argument_errors() -> None:
    with pytest.raises(ValueError, match="outputs: expected at least one replica output, got none"):
        gather([], "cpu")
    with pytest.raises(ValueError, match=r"gather: mode: expected one of the built-in modes \['cat'.*got 'avg'$"):
        gather([torch.ones(1)], "cpu", mode="avg")
    with pytest.raises(ValueError, match=r"'mean' needs the same shape on every replica, got \[\[2\], \[1\]\]"):
        gather([torch.ones(2), torch.ones(1)], "cpu", mode="mean")
    with pytest.raises(ValueError, match="weights: expected 2 values .*got 3"):
        gather([torch.ones(1)] * 2, "cpu", mode="mean", weights=[1, 1, 1])


def test_gradients_flow_through_every_mode() -> None:
    x = torch.randn(6, 3, requires_grad=True)
    parts = _parts(x, [3, 3])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mode in ["cat", "stack", "pad", "mean", "sum"]:
            x.grad = None
            out = gather([p * 1.0 if mode != "stack" else p[:2] for p in parts], "cpu", mode=mode)
            out.sum().backward()
            assert x.grad is not None and x.grad.abs().sum() > 0, mode
