"""split= (per-item sequence arguments), gather "extend" (per-item list outputs),
gather_dim, batch-coupled warnings, and mappings/shapes in inputs and outputs, on CPU
devices against the bare module on the full batch."""

from __future__ import annotations

import contextlib
import types
import warnings
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import dpmethods
from dpmethods import DataParallel, MethodOptions, parallel_method
from dpmethods.core.gather import gather
from dpmethods.testing import assert_close_to_reference as close
from dpmethods.vocab import warn_once as warn_once
from tests.helpers import SPLITS
from tests.helpers.terms import mlp_terms


@pytest.fixture(autouse=True)
def _fresh_warnings() -> None:
    warn_once.reset()


@contextlib.contextmanager
def _no_warnings() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


class PerItem(nn.Module):
    """A model that takes a list of variable-size items (and optional targets)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    @parallel_method(split=("images", "targets"))
    def score(
        self, images: list[torch.Tensor], scale: torch.Tensor, targets: list[dict[str, Any]] | None = None
    ) -> list[dict[str, Any]]:
        out = []
        for i, img in enumerate(images):
            y = self.lin(img.mean(dim=(1, 2))) * scale[i]
            item: dict[str, Any] = {"y": y, "n": img.shape[1]}
            if targets is not None:
                item["loss"] = (y - targets[i]["t"]).pow(2).sum()
            out.append(item)
        return out

    @parallel_method(split="words")
    def lengths(self, words: list[str]) -> torch.Tensor:
        return torch.tensor([float(len(w)) for w in words]) + self.lin.bias[0] * 0

    @parallel_method(split="words", gather="extend")
    def upper(self, words: tuple[str, ...]) -> list[str]:
        return [w.upper() for w in words]


def _images(n: int) -> list[torch.Tensor]:
    return [torch.randn(3, 2 + i % 3, 4 + i % 2) for i in range(n)]


# PerItem.score: a mean over up to 4 x 5 pixels, Linear(3, 2), a scale, then the squared
# error summed over 2 values.
ITEM_TERMS = 2 * (20 + 4 + 1) + 2


def _assert_items_equal(got: list[dict[str, Any]], ref: list[dict[str, Any]]) -> None:
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert g.keys() == r.keys()
        for k in r:
            if isinstance(r[k], torch.Tensor):
                close(g[k], r[k], terms=ITEM_TERMS)
            else:
                assert g[k] == r[k]


@pytest.mark.parametrize("batch,devices", SPLITS)
def test_split_lists_line_up_with_tensor_chunks(batch: int, devices: int) -> None:
    model = PerItem()
    images, scale = _images(batch), torch.randn(batch)
    targets = [{"t": torch.randn(2)} for _ in range(batch)]
    dp = DataParallel(model, device_ids=["cpu"] * devices, methods={"score": {"gather": "extend"}})
    got = dp.score(images, scale, targets=targets)
    _assert_items_equal(got, model.score(images, scale, targets=targets))


def test_split_uneven_shares_extend_automatically_with_cat() -> None:
    model = PerItem()
    images, scale = _images(7), torch.randn(7)
    dp = DataParallel(model, device_ids=["cpu"] * 3)  # gather stays "cat"
    with _no_warnings():
        got = dp.score(images, scale)
    _assert_items_equal(got, model.score(images, scale))


def test_equal_shares_per_item_list_warns_naming_the_path_and_extend() -> None:
    model = PerItem()
    images, scale = _images(8), torch.randn(8)
    dp = DataParallel(model, device_ids=["cpu"] * 4)
    warn_once.reset()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        dp.score(images, scale)
    said = [str(w.message) for w in seen]
    assert any("gather: output is a list with one entry per batch item" in m and "'extend'" in m
               for m in said), said
    # Joined entry by entry, as the per-replica list it looks like, each entry's item
    # count differs across the replicas: said too, for each entry, and nothing else.
    rest = [m for m in said if "gather: output is a list with one entry per batch item" not in m]
    assert rest and all("['n'] (int) differs across replicas" in m for m in rest), rest
    # With "extend" it is right and quiet.
    dp = DataParallel(model, device_ids=["cpu"] * 4, methods={"score": {"gather": "extend"}})
    with _no_warnings():
        got = dp.score(images, scale)
    _assert_items_equal(got, model.score(images, scale))


def test_list_of_batch_tensors_with_equal_shares_is_joined_entry_by_entry_quietly() -> None:
    outs = [[torch.randn(2, 3), torch.randn(2, 5)] for _ in range(4)]
    with _no_warnings():
        got = gather(outs, "cpu", sizes=[2, 2, 2, 2])
    assert [t.shape for t in got] == [torch.Size([8, 3]), torch.Size([8, 5])]
    close(got[1], torch.cat([o[1] for o in outs]), terms=0)  # a copy


@pytest.mark.parametrize("batch,devices", SPLITS)
def test_split_strings_batch_size_from_the_sequence(batch: int, devices: int) -> None:
    model = PerItem()
    words = tuple(f"w{'x' * i}" for i in range(batch))
    dp = DataParallel(model, device_ids=["cpu"] * devices)
    close(dp.lengths(list(words)), model.lengths(list(words)), terms=0)  # lengths + 0 * bias
    assert dp.upper(words) == model.upper(words)


def test_split_size_disagreeing_with_tensors_names_both() -> None:
    dp = DataParallel(PerItem(), device_ids=["cpu"] * 3)
    with pytest.raises(ValueError, match=r"split: argument 'images' has 5 items, but the tensors split along dim 0 have a batch of 4 \(argument 'scale' has 4\)"):
        dp.score(_images(5), torch.randn(4))
    with pytest.raises(ValueError, match=r"argument 'images' has 3 items and argument 'targets' has 2"):
        dp.score(_images(3), torch.randn(3), targets=[{"t": torch.zeros(2)}] * 2)


def test_split_argument_that_is_not_a_sequence_is_a_type_error() -> None:
    dp = DataParallel(PerItem(), device_ids=["cpu"] * 3)
    with pytest.raises(TypeError, match=r"split: argument 'words': expected a list, tuple or other sequence with one entry per batch item, got str 'abc'"):
        dp.lengths("abc")


def test_split_unknown_argument_name_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"split: \['imgs'\] are not arguments of PerItem.score"):
        DataParallel(PerItem(), device_ids=["cpu"] * 2, methods={"score": {"split": ("imgs",)}})


def test_nothing_split_on_several_devices_warns_once_naming_method_and_lists() -> None:
    class Enc(nn.Module):
        @parallel_method
        def encode(self, sentences: list[str], normalize: bool = False) -> list[int]:
            return [len(s) for s in sentences]

    dp = DataParallel(Enc(), device_ids=["cpu"] * 2)
    with pytest.warns(UserWarning, match=r"scatter: .*Enc.encode: nothing in this call was split.*\['sentences'\].*split=\('sentences',\)"):
        assert dp.encode(["a", "bb"]) == [1, 2]
    with _no_warnings():
        dp.encode(["a", "bb"])  # once
    dp = DataParallel(Enc(), device_ids=["cpu"] * 2, methods={"encode": {"split": "sentences"}})
    assert dp.encode(["a", "bb", "ccc"]) == [1, 2, 3]


class _PerRowScale(nn.Module):
    """Takes one scale per row as a Python list and, like most models, never checks its length."""

    @parallel_method
    def scaled(self, x: torch.Tensor, scales: list[float], shape: tuple[int, int] = (2, 2)) -> torch.Tensor:
        return x * torch.tensor(scales[: x.shape[0]]).unsqueeze(1)


@pytest.mark.parametrize("batch,devices", SPLITS)
def test_unsplit_list_as_long_as_the_batch_warns_naming_split_and_broadcast(batch: int, devices: int) -> None:
    model = _PerRowScale()
    x, scales = torch.randn(batch, 3), [float(i + 1) for i in range(batch)]
    dp = DataParallel(model, device_ids=["cpu"] * devices)
    with pytest.warns(
        UserWarning,
        match=rf"scatter: .*_PerRowScale.scaled: argument 'scales' is a list of {batch} items, as many as "
        r"the batch, and every replica gets all of it\. .*split=\('scales',\).*broadcast=\('scales',\)",
    ):
        wrong = dp.scaled(x, scales)
    assert not torch.allclose(wrong, model.scaled(x, scales))  # what the warning is about
    split = DataParallel(model, device_ids=["cpu"] * devices, methods={"scaled": {"split": "scales"}})
    with _no_warnings():
        close(split.scaled(x, scales), model.scaled(x, scales), terms=1)
        # Named in broadcast: every replica needs it whole, said so, no warning.
        whole = DataParallel(model, device_ids=["cpu"] * devices, methods={"scaled": {"broadcast": "scales"}})
        whole.scaled(x, [1.0] * batch)
        # A tuple of ints as long as the batch is a shape, not a batch.
        dp.scaled(x, [1.0] * (batch + 1), shape=(batch,) * batch)


def test_split_moves_tensors_inside_items_and_keeps_gradients() -> None:
    model = PerItem()
    images = [t.requires_grad_() for t in _images(5)]
    scale = torch.randn(5)
    dp = DataParallel(model, device_ids=["cpu"] * 2)
    out = dp.score(images, scale, targets=[{"t": torch.zeros(2)} for _ in range(5)])
    sum(o["loss"] for o in out).backward()
    grads = [i.grad.clone() for i in images]
    for i in images:
        i.grad = None
    ref = model.score(images, scale, targets=[{"t": torch.zeros(2)} for _ in range(5)])
    sum(o["loss"] for o in ref).backward()
    for g, i in zip(grads, images):
        close(g, i.grad, terms=2 * ITEM_TERMS)  # the forward's path, back


# --- options -----------------------------------------------------------------------


def test_options_validate_split_and_gather_dim() -> None:
    assert MethodOptions(split="images").split == ("images",)
    assert MethodOptions().with_updates(split=["a", "b"], gather_dim={"x": 1}).gather_dim == {"x": 1}
    with pytest.raises(TypeError, match=r"split: expected argument names \(str\), got int 1"):
        MethodOptions(split=(1,))
    with pytest.raises(TypeError, match=r"split: expected an argument name or a tuple of names \(str\), got int 5"):
        MethodOptions(split=5)
    with pytest.raises(TypeError, match=r"gather_dim: expected an int, a mapping of output keys to ints, or None, got str 'x'"):
        MethodOptions(gather_dim="x")
    with pytest.raises(TypeError, match=r"gather_dim\['a'\]: expected an int, got float 1.0"):
        MethodOptions(gather_dim={"a": 1.0})
    with pytest.raises(ValueError, match=r"split: expected names not also in broadcast, got \['a'\]"):
        MethodOptions(split="a", broadcast="a")
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['splits'\]"):
        MethodOptions().with_updates(splits=("a",))
    assert "extend" in dpmethods.vocab.gather_modes.BUILTIN_MODES

    class M(nn.Module):
        @parallel_method(split="xs", gather_dim=1)
        def f(self, xs: list[int]) -> list[int]:
            return xs

    assert dpmethods.get_options(M, "f") == MethodOptions(split=("xs",), gather_dim=1)
    dpmethods.register(M, "forward", split=("x",))
    assert dpmethods.get_options(M, "forward").split == ("x",)


# --- gather_dim --------------------------------------------------------------------


@pytest.mark.parametrize("batch,devices", SPLITS)
def test_gather_dim_per_output_key(batch: int, devices: int) -> None:
    class Sim(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        @parallel_method(broadcast="keys", gather_dim={"by_key": 1})
        def f(self, queries: torch.Tensor, keys: torch.Tensor) -> dict[str, torch.Tensor]:
            q = self.proj(queries)
            return {"by_query": q @ keys.T, "by_key": keys @ q.T, "q": q}

    model = Sim()
    q, k = torch.randn(batch, 4), torch.randn(5, 4)
    got = DataParallel(model, device_ids=["cpu"] * devices).f(q, k)
    ref = model.f(q, k)
    close(got, ref, terms=mlp_terms(4) + 4)  # Linear(4, 4), then a product with 4-wide keys


def test_gather_dim_int_differs_from_scatter_dim() -> None:
    class T(nn.Module):
        @parallel_method(gather_dim=1)
        def f(self, x: torch.Tensor) -> torch.Tensor:
            return x.T * 2  # batch moves to dim 1 (like audio codes)

    x = torch.randn(7, 3)
    close(DataParallel(T(), device_ids=["cpu"] * 3).f(x), x.T * 2, terms=1)


class _LayersFirst(nn.Module):
    """Returns stacked per-layer states [layers, batch, features]: the batch is in dim 1."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    @parallel_method
    def states(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h1 = self.lin(x)
        return {"stacked": torch.stack([x, h1, self.lin(h1)]), "last": h1}


def test_output_with_its_batch_in_another_dim_warns_naming_that_dim() -> None:
    model, x = _LayersFirst(), torch.randn(8, 3)
    dp = DataParallel(model, device_ids=["cpu"] * 4)
    with pytest.warns(
        UserWarning,
        match=r"gather: output\['stacked'\] is joined along dim 0, where its sizes \(\[3, 3, 3, 3\]\) are "
        r"not the replicas' shares of the batch \(\[2, 2, 2, 2\]\), but its dim 1 has them.*gather_dim=1",
    ):
        wrong = dp.states(x)
    assert wrong["stacked"].shape == (12, 2, 3)  # what the warning is about: batches side by side
    fixed = DataParallel(model, device_ids=["cpu"] * 4, methods={"states": {"gather_dim": {"stacked": 1}}})
    with _no_warnings():
        got = fixed.states(x)
        # An int gather_dim is the caller's word for every output: trusted too.
        DataParallel(model, device_ids=["cpu"] * 4, methods={"states": {"gather_dim": 0}}).states(x)
    close(got, model.states(x), terms=mlp_terms(3, 3))  # two Linear(3, 3)


def test_output_batch_in_dim_0_under_a_scatter_dim_of_1_warns() -> None:
    class Decoder(nn.Module):  # codes [1, batch, t] in, audio [batch, 1, t] out, as Encodec
        @parallel_method(dim=1)
        def decode(self, codes: torch.Tensor) -> torch.Tensor:
            return codes.transpose(0, 1) * 2

    codes = torch.randn(1, 6, 5)
    with pytest.warns(UserWarning, match=r"gather: output is joined along dim 1.*its dim 0 has them.*gather_dim=0"):
        DataParallel(Decoder(), device_ids=["cpu"] * 3).decode(codes)
    dp = DataParallel(Decoder(), device_ids=["cpu"] * 3, methods={"decode": {"dim": 1, "gather_dim": 0}})
    with _no_warnings():
        close(dp.decode(codes), Decoder().decode(codes), terms=1)


def test_gather_dim_mapping_needs_keyed_outputs() -> None:
    with pytest.raises(ValueError, match=r"gather_dim: a mapping of dims \{'a': 1\} needs outputs with keys"):
        gather([(torch.ones(1, 2),), (torch.ones(1, 2),)], "cpu", gather_dim={"a": 1})


# --- batch-coupled outputs ---------------------------------------------------------


class Contrastive(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(4, 8)

    @parallel_method(gather={"loss": "mean"})
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        za, zb = self.a(x), self.b(y)
        sim = za @ zb.T
        loss = nn.functional.cross_entropy(sim, torch.arange(len(x)))
        return {"sim": sim, "loss": loss, "za": za, "zb": zb}


@pytest.mark.parametrize("batch,devices", [pytest.param(7, 3, id="7-on-3"), pytest.param(7, 2, id="7-on-2")])
def test_batch_coupled_output_and_its_loss_are_warned(batch: int, devices: int) -> None:
    model = Contrastive()
    x, y = torch.randn(batch, 4), torch.randn(batch, 4)
    dp = DataParallel(model, device_ids=["cpu"] * devices)
    with pytest.warns(UserWarning) as record:
        out = dp(x, y)
    messages = [str(w.message) for w in record]
    assert any("gather: output['sim'] has each replica's share of the batch" in m for m in messages)
    assert any(
        "output['loss'] is reduced with 'mean' across replicas alongside the batch-coupled "
        "output['sim']" in m and "NOT the full-batch loss" in m
        for m in messages
    )
    # The right pattern: the features are exact; the loss is computed outside.
    ref = model(x, y)
    close(out["za"], ref["za"], terms=mlp_terms(4))
    sim = out["za"] @ out["zb"].T
    loss = nn.functional.cross_entropy(sim, torch.arange(batch))
    # Linear(4, 8), the 8-term products, then a log-sum-exp over and a mean of the rows.
    close(loss, ref["loss"], terms=mlp_terms(4) + 8 + 2 * batch)
    assert not torch.allclose(out["loss"], ref["loss"], atol=1e-5)


class PerItemTensors(nn.Module):
    """Per-item lists of tensors: each item's products with every item of its batch
    (``[n_r]`` entries of ``[n_r, 3]``), or ``m`` scaled copies of it (``[m, 3]``); and a
    list of ``n`` batch outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))

    @parallel_method
    def paired(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x[i] * x * self.scale for i in range(len(x))]

    @parallel_method
    def copies(self, x: torch.Tensor, m: int) -> list[torch.Tensor]:
        return [x[i].expand(m, -1) * torch.arange(1.0, m + 1)[:, None] * self.scale for i in range(len(x))]

    @parallel_method
    def layers(self, x: torch.Tensor, n: int) -> list[torch.Tensor]:
        return [x * (j + 1.0) * self.scale for j in range(n)]


def test_per_item_list_whose_entries_hold_the_share_is_warned_as_coupled() -> None:
    # 3 + 2 rows: each replica's list is extended, each entry its item against the 3 or 2
    # items of its own share, where one device gives 5 entries of 5 rows. It was silent.
    model, x = PerItemTensors(), torch.randn(5, 3)
    dp = DataParallel(model, ["cpu"] * 2)
    with pytest.warns(UserWarning, match=r"gather: output is a list with one entry per batch item, and every entry "
                                         r"holds its replica's share of the batch \(\[3, 2\]\) along dim 0"):
        got = dp.paired(x)
    assert [len(t) for t in got] == [3, 3, 3, 2, 2] and [len(t) for t in model.paired(x)] == [5] * 5
    # Entries that hold one replica's share by chance (2 or 3 rows each) are per item: quiet.
    for m in (2, 3):
        with _no_warnings():
            got = dp.copies(x, m)
        close(got, model.copies(x, m), terms=0)  # the same elementwise products: exact
    # A list of 2 or 3 batch outputs (one per layer, say) is joined entry by entry, quietly.
    for n in (2, 3):
        with _no_warnings():
            close(dp.layers(x, n), model.layers(x, n), terms=0)


# --- per-item outputs straight through gather --------------------------------------


def test_extend_concatenates_lists_in_replica_order_and_moves_tensors() -> None:
    outs = [[{"b": torch.ones(1, 4)}, {"b": torch.ones(2, 4)}], [{"b": torch.zeros(3, 4)}]]
    got = gather(outs, "cpu", mode="extend")
    assert [g["b"].shape[0] for g in got] == [1, 2, 3]
    keyed = [{"feats": [torch.ones(2)], "y": torch.ones(1)}, {"feats": [torch.ones(5), torch.ones(1)], "y": torch.zeros(2)}]
    got = gather(keyed, "cpu", mode={"feats": "extend"})
    assert [t.numel() for t in got["feats"]] == [2, 5, 1]
    assert got["y"].tolist() == [1.0, 0.0, 0.0]


def test_per_item_lists_are_never_zipped_silently() -> None:
    outs = [[torch.randn(5), torch.randn(6)], [torch.randn(7), torch.randn(8)]]
    with pytest.warns(UserWarning, match=r"'extend'"):
        gather(outs, "cpu", sizes=[2, 2])


def test_numpy_outputs_are_concatenated() -> None:
    np = pytest.importorskip("numpy")
    got = gather([np.ones((2, 3)), np.zeros((1, 3))], "cpu", sizes=[2, 1])
    assert got.shape == (3, 3)


def test_differing_object_outputs_are_a_list_with_a_warning_naming_register_type() -> None:
    class Thing:
        def __init__(self, n: int) -> None:
            self.n = n

    outs = [{"t": Thing(1), "y": torch.ones(1)}, {"t": Thing(2), "y": torch.ones(1)}]
    with pytest.warns(UserWarning, match=r"output\['t'\] \(Thing\) differs across replicas.*dpmethods.register_type\(Thing, flatten, unflatten\)"):
        got = gather(outs, "cpu")
    assert [t.n for t in got["t"]] == [1, 2]


# --- mappings and shapes ------------------------------


def test_counter_mappingproxy_inputs_and_defaultdict_outputs() -> None:
    class M(nn.Module):
        @parallel_method
        def f(self, x: torch.Tensor, weights: Any, table: Any) -> Any:
            out: defaultdict[str, Any] = defaultdict(list)
            out["y"] = x * weights["a"] + table["t"]
            return out

    x = torch.randn(7, 2)
    counts = Counter({"a": 3, "b": 1})
    table = types.MappingProxyType({"t": torch.randn(7, 2)})
    got = DataParallel(M(), device_ids=["cpu"] * 3).f(x, counts, table)
    assert type(got) is defaultdict and got.default_factory is list
    close(got["y"], x * 3 + table["t"], terms=2)
    assert got["missing"] == []

    parts = dpmethods.scatter((counts, OrderedDict(z=torch.arange(4))), ["cpu"] * 2)
    assert parts[1][0] == counts and type(parts[1][0]) is Counter
    assert type(parts[1][1]) is OrderedDict and parts[1][1]["z"].tolist() == [2, 3]


def test_torch_size_in_outputs() -> None:
    class M(nn.Module):
        @parallel_method
        def f(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Size, torch.Size]:
            return x + 1, x.shape, x.shape[1:]

    x = torch.randn(7, 3)
    y, shape, tail = DataParallel(M(), device_ids=["cpu"] * 3).f(x)
    assert type(shape) is torch.Size and shape == x.shape
    assert type(tail) is torch.Size and tail == torch.Size([3])
    close(y, x + 1, terms=1)


def test_fixed_arity_tuple_as_long_as_the_share_is_not_taken_for_per_item() -> None:
    class M(nn.Module):
        @parallel_method
        def f(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x.sum(), x * 2

    x = torch.randn(8, 3)
    dp = DataParallel(M(), device_ids=["cpu"] * 4)
    with _no_warnings():
        with pytest.raises(UserWarning, match="0-dim on every replica"):
            dp.f(x)  # the only warning is the existing one about a 0-dim output
    out = gather([(torch.ones(2, 3), torch.ones(2, 5)) for _ in range(4)], "cpu", sizes=[2] * 4)
    assert [t.shape[0] for t in out] == [8, 8]


class _TwoClasses(nn.Module):
    """A 2-class classifier: with 2 items per replica its logits are [2, 2] by chance."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.head(x)}


def test_feature_maps_and_attention_with_the_share_in_another_dim_are_not_taken_for_coupled() -> None:
    class Maps(nn.Module):
        @parallel_method
        def maps(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            # [n_r, 3, 2, 2] feature maps and [n_r, 2 heads, 4, 4] attention, 2 == share on 8-on-4
            return {"maps": x.view(-1, 3, 1, 1).expand(-1, 3, 2, 2) * 1, "attn": x[:, :1, None, None].expand(-1, 2, 4, 4) * 1}

    x = torch.randn(8, 3)
    with _no_warnings():
        got = DataParallel(Maps(), device_ids=["cpu"] * 4).maps(x)
    close(got, Maps().maps(x), terms=0)  # copies of x


def test_equal_shares_are_no_evidence_and_a_named_output_is_trusted() -> None:
    # 2 classes, 2 rows per replica: [2, 2] logits that can't be told from a [2, 2] matrix.
    model = _TwoClasses()
    x = torch.randn(8, 4)
    with _no_warnings():
        out = DataParallel(model, ["cpu"] * 4)(x)
    close(out["logits"], model(x)["logits"], terms=mlp_terms(4))
    # Uneven shares are evidence; naming the output says how it joins, which trusts it.
    pad = DataParallel(Contrastive(), ["cpu"] * 2, methods={"forward": {"gather": {"sim": "pad", "loss": "mean"}}})
    with _no_warnings():
        sims = pad(torch.randn(7, 4), torch.randn(7, 4))["sim"]
    assert sims.shape == (7, 4)
