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
from tests.helpers import WORKERS
from tests.helpers.gather_data import Sparsify
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


_LAYOUTS = ["coo", "csr", "csc", "bsr", "bsc"]
# torch's own, on building any compressed tensor (one device's call gives it too)
_BETA = r"Sparse (CSR|CSC|BSR|BSC) tensor support is in beta state"


def _sparse_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """What a sparse tensor is made of, to compare exactly (index dtypes included)."""
    if t.layout == torch.sparse_coo:
        t = t.coalesce()
        return [t.indices(), t.values()]
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    return [t.ccol_indices(), t.row_indices(), t.values()]


def _assert_same_sparse(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert (got.layout, got.shape) == (want.layout, want.shape), what
    for a, b in zip(_sparse_parts(got), _sparse_parts(want), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), what


def _as(t: torch.Tensor, layout: str, dense_dim: int | None = None) -> torch.Tensor:
    return {
        "csr": t.to_sparse_csr, "csc": t.to_sparse_csc,
        "bsr": lambda dense_dim: t.to_sparse_bsr((1, 2), dense_dim),
        "bsc": lambda dense_dim: t.to_sparse_bsc((1, 2), dense_dim),
    }[layout](dense_dim)


@pytest.mark.parametrize("workers", WORKERS)
def test_sparse_outputs_are_joined_by_rows_as_one_device(workers: str) -> None:
    # torch.cat joins COO pieces but no compressed ones ("Sparse CSR tensors do not have
    # is_contiguous"): they are joined part by part. CSC's and BSC's rows are their plain
    # dim, so each column of the join holds that column's rows of every piece in turn.
    # Over processes they cross as their parts, without torch's warning that invariant
    # checks are implicitly off (warnings are errors here).
    model = Sparsify()
    x = torch.rand(5, 6, generator=torch.Generator().manual_seed(0))
    x[1], x[3] = 0, 1  # rows of 0 and of 6 nonzeros beside the random ones
    dp = DataParallel(model, device_ids=["cpu"] * 2, workers=workers)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            warnings.filterwarnings("ignore", _BETA, UserWarning)
            for rows in (5, 4):  # shares of 3 + 2 and 2 + 2
                for layout in _LAYOUTS:
                    got, want = dp.codes(x[:rows], layout), model.codes(x[:rows], layout)
                    _assert_same_sparse(got, want, f"{layout}, {rows} rows")
                    got, want = dp.codes(x[:rows], layout, alone=False), model.codes(x[:rows], layout, alone=False)
                    _assert_same_sparse(got["codes"], want["codes"], f"{layout} in a dict, {rows} rows")
                    assert torch.equal(got["norm"], want["norm"])
    finally:
        dp.close()


@pytest.mark.parametrize("layout", ["csr", "csc", "bsr", "bsc"])
def test_compressed_pieces_join_along_any_dim_as_the_whole(layout: str) -> None:
    # Along the compressed dim, the plain one, a batch dim and a dense dim, on uneven
    # pieces (1 x 2 blocks: columns in pairs), each part equal to the whole's.
    g = torch.Generator().manual_seed(1)
    x = torch.rand(5, 6, generator=g) * (torch.rand(5, 6, generator=g) > 0.5)
    pattern = torch.rand(3, 4, generator=g) > 0.5  # one nnz in every batch element
    cases = [
        (x, 0, [3, 2], None), (x, 1, [4, 2], None), (x, -2, [1, 2, 2], None),
        (torch.rand(4, 3, 4, generator=g) * pattern, 0, [1, 3], None),  # batched
        (torch.rand(4, 3, 4, generator=g) * pattern, 2, [2, 2], None),
        (torch.rand(5, 4, 3, generator=g) * (torch.rand(5, 4, 1, generator=g) > 0.5), 1, [2, 2], 1),  # dense dim
        (torch.rand(5, 4, 3, generator=g) * (torch.rand(5, 4, 1, generator=g) > 0.5), 2, [1, 2], 1),
    ]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", _BETA, UserWarning)
        for whole, dim, sizes, dense_dim in cases:
            got = gather([_as(p, layout, dense_dim) for p in whole.split(sizes, dim)], "cpu", dim=dim)
            _assert_same_sparse(got, _as(whole, layout, dense_dim), f"dim {dim} of {list(whole.shape)}")


def test_sparse_pieces_that_cannot_be_joined_exactly_are_errors() -> None:
    x = torch.rand(4, 4, 2, generator=torch.Generator().manual_seed(2))
    x[0, 0, 0] = 0  # along dim 2, replica 0's piece lacks an element the other has
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", _BETA, UserWarning)
        with pytest.raises(ValueError, match=r"output\['codes'\]: expected one layout on every replica "
                                             r"to join along dim 0, got \['torch.sparse_csr', 'torch.sparse_csc'\]"):
            gather([{"codes": x[:2, :, 0].to_sparse_csr()}, {"codes": x[2:, :, 0].to_sparse_csc()}], "cpu")
        with pytest.raises(ValueError, match=r"output: torch.sparse_csr pieces joined along dim 2, a dense dim, "
                                             r"need one sparsity pattern, but replica 1's differs"):
            gather([p.to_sparse_csr(dense_dim=1) for p in x.split([1, 1], 2)], "cpu", dim=2)
        batched = [torch.eye(3).expand(2, 3, 3).to_sparse_csr(), torch.ones(1, 3, 3).to_sparse_csr()]
        with pytest.raises(ValueError, match=r"output: a batched torch.sparse_csr tensor holds the same number of "
                                             r"elements in every batch element, but the replicas' pieces hold \[3, 9\]"):
            gather(batched, "cpu")
