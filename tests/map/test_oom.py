"""on_oom="split" on the wrapper: a replica's share that raises torch.OutOfMemoryError
runs in halves on the same replica, cut by the method's scatter rules and joined by its
gather rule; the result equals one device."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import dpmethods
from dpmethods.testing import assert_close_to_reference
from tests.helpers.terms import mlp_terms

DEVICES = [pytest.param(["cpu"], id="1-device"), pytest.param(["cpu"] * 2, id="2-devices")]


class Limited(nn.Module):
    """Raises torch.OutOfMemoryError for more than ``limit`` rows; counts its calls."""

    def __init__(self, limit: int | None = None) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.limit = limit
        self.calls: list[tuple[int, bool]] = []  # (rows, ran out)

    def _check(self, rows: int) -> None:
        out = self.limit is not None and rows > self.limit
        self.calls.append((rows, out))
        if out:
            raise torch.OutOfMemoryError(f"{rows} rows do not fit")

    @dpmethods.parallel_method
    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        self._check(x.shape[0])
        return {"y": self.lin(x), "norm": x.norm(dim=1)}

    @dpmethods.parallel_method(split=("names",), gather="extend")
    def label(self, x: torch.Tensor, names: list[str]) -> list[tuple[str, float]]:
        self._check(x.shape[0])
        return [(n, float(v)) for n, v in zip(names, self.lin(x).sum(1))]

    @dpmethods.parallel_method(gather={"loss": "mean"})
    def loss(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        self._check(x.shape[0])
        return {"loss": self.lin(x).pow(2).mean(), "y": self.lin(x)}


def _one_device(model: Limited, method: str, *args: Any) -> Any:
    limit, model.limit = model.limit, None
    try:
        return getattr(model, method)(*args)
    finally:
        model.limit = limit


# No devices and no GPU: a plain call, as torch's; it is split all the same.
_PLAIN = pytest.param(None, id="no-device", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here"))


@pytest.mark.parametrize("devices", [*DEVICES, _PLAIN])
def test_a_share_that_runs_out_runs_in_halves_and_equals_one_device(devices: list[str] | None) -> None:
    model = Limited(limit=2)
    dp = dpmethods.DataParallel(model, device_ids=devices, on_oom="split")
    x = torch.randn(11, 6)
    with torch.no_grad():
        ref = _one_device(model, "encode", x)
        model.calls.clear()
        out = dp.encode(x)
    assert_close_to_reference(out, ref, terms=mlp_terms(6))
    assert any(ran_out for _, ran_out in model.calls)
    assert max(rows for rows, ran_out in model.calls if not ran_out) <= 2


@pytest.mark.parametrize("devices", DEVICES)
def test_per_item_lists_and_weighted_means_join_as_one_device(devices: list[str]) -> None:
    model = Limited(limit=3)
    dp = dpmethods.DataParallel(model, device_ids=devices, on_oom="split")
    x = torch.randn(9, 6)
    names = [f"n{i}" for i in range(9)]
    with torch.no_grad():
        labels = dp.label(x, names)
        ref = _one_device(model, "label", x, names)
        assert [n for n, _ in labels] == names
        assert_close_to_reference([v for _, v in labels], [v for _, v in ref], terms=mlp_terms(6))
        loss = dp.loss(x)
        # The mean of squares over all 9 x 3 outputs: the halves' means weighted by rows.
        assert_close_to_reference(loss, _one_device(model, "loss", x), terms=mlp_terms(6, rows=27))


def test_later_batches_are_cut_up_front() -> None:
    model = Limited(limit=4)
    dp = dpmethods.DataParallel(model, device_ids=["cpu"], on_oom="split")
    with torch.no_grad():
        dp.encode(torch.randn(16, 6))
        assert [ran_out for _, ran_out in model.calls].count(True) == 2  # 16, then 8
        model.calls.clear()
        dp.encode(torch.randn(16, 6))
    # The replica remembers that 4 rows ran: 16 rows are cut to 4 before any runs out.
    assert model.calls == [(4, False)] * 4


def test_one_item_that_does_not_fit_raises() -> None:
    model = Limited(limit=0)
    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2, on_oom="split")
    with pytest.raises(torch.OutOfMemoryError, match="1 rows do not fit") as info, torch.no_grad():
        dp.encode(torch.randn(4, 6))
    assert any("a share of 1 item does not fit" in n for n in getattr(info.value, "__notes__", []))


def test_without_the_option_the_error_is_raised() -> None:
    dp = dpmethods.DataParallel(Limited(limit=2), device_ids=["cpu"] * 2)
    with pytest.raises(torch.OutOfMemoryError), torch.no_grad():
        dp.encode(torch.randn(8, 6))


def test_the_option_is_checked() -> None:
    with pytest.raises(ValueError, match=r"on_oom: expected one of \['raise', 'split'\], got 'spilt': did you mean 'split'\?"):
        dpmethods.DataParallel(Limited(), device_ids=["cpu"] * 2, on_oom="spilt")


def test_generate_runs_in_halves_and_equals_one_device() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=48, n_positions=64, n_embd=16, n_layer=2, n_head=2,
                                     bos_token_id=1, eos_token_id=None, pad_token_id=None)
    model = transformers.GPT2LMHeadModel(config).eval()
    limit = {"rows": None}

    def guard(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = args[0] if args else kwargs.get("input_ids")
        if limit["rows"] is not None and ids is not None and ids.shape[0] > limit["rows"]:
            raise torch.OutOfMemoryError("too many rows")

    model.transformer.register_forward_pre_hook(guard, with_kwargs=True)
    ids = torch.randint(2, 48, (7, 5))
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=4, do_sample=False)
        limit["rows"] = 2
        out = dpmethods.DataParallel(model, device_ids=["cpu"] * 2, on_oom="split").generate(
            ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, ref)

