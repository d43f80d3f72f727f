"""Gather modes per output position and key: "extend" on mixed tuples, "same", "list".

Each case is compared with the one-device call on random data.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from dpmethods import DataParallel, MethodOptions, parallel_method
from dpmethods.core.gather import gather


class _Mixed(nn.Module):
    """Returns per-item lists beside batch tensors and a parameter-derived scale."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.tensor(2.5))

    @parallel_method(gather="extend")
    def items_and_batch(self, x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        y = self.lin(x)
        return [row[: 1 + int(row.abs().sum() * 10) % 3] for row in y], y

    @parallel_method(gather=("cat", "cat", "same"))
    def features(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = self.lin(x)
        return y, y * 2, self.scale.exp()

    @parallel_method(gather={2: "same", "logit_scale": "same", 3: "same"})
    def clip_like(self, x: torch.Tensor, as_dict: bool) -> Any:
        y = self.lin(x)
        if as_dict:
            return {"features": y, "logit_scale": self.scale.exp()}
        return y, y * 2, self.scale.exp()

    @parallel_method(gather={"loss": "mean", "image_outputs": "list"})
    def step(self, x: torch.Tensor) -> dict[str, Any]:
        y = self.lin(x)
        return {"loss": y.pow(2).mean(), "image_outputs": [r for r in y if r.sum() > 0] + [y]}

    @parallel_method(gather="same")
    def wrong_same(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum()


@pytest.mark.parametrize("batch,devices", [(8, 4), (7, 3), (4, 4)])
def test_extend_on_a_tuple_of_a_per_item_list_and_a_batch_tensor(batch: int, devices: int) -> None:
    torch.manual_seed(0)
    model = _Mixed()
    x = torch.randn(batch, 4)
    got = DataParallel(model, device_ids=["cpu"] * devices).items_and_batch(x)
    ref = model.items_and_batch(x)
    assert isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], list)
    assert len(got[0]) == batch
    for a, b in zip(got[0], ref[0]):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(got[1], ref[1])


@pytest.mark.parametrize("batch,devices", [(8, 4), (4, 4), (5, 2)])
def test_same_per_tuple_position_keeps_a_scale_0_dim(batch: int, devices: int) -> None:
    torch.manual_seed(0)
    model = _Mixed()
    x = torch.randn(batch, 4)
    dp = DataParallel(model, device_ids=["cpu"] * devices)
    got, ref = dp.features(x), model.features(x)
    assert got[2].dim() == 0
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)
    # Gradients flow to the scale through the one value.
    (g,) = torch.autograd.grad(got[2], model.scale)
    torch.testing.assert_close(g, torch.autograd.grad(ref[2], model.scale)[0])
    # One mapping serves tuples of several arities and dict outputs, without warnings.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for as_dict in (False, True):
            out = dp.clip_like(x, as_dict)
            scale = out["logit_scale"] if as_dict else out[2]
            assert scale.dim() == 0
            torch.testing.assert_close(scale, model.scale.exp())


def test_same_errors_when_the_replicas_disagree() -> None:
    dp = DataParallel(_Mixed(), device_ids=["cpu"] * 2)
    with pytest.raises(ValueError, match=r"output: 'same' expects one value equal on every replica, but replica 1 has"):
        dp.wrong_same(torch.arange(4.0).reshape(4, 1))
    with pytest.raises(ValueError, match=r"output\[0\]: 'same' expects one value equal on every replica, got \['a', 'b'\]"):
        gather([("a",), ("b",)], "cpu", mode=("same",))


@pytest.mark.parametrize("batch,devices", [(6, 2), (7, 3)])
def test_per_key_list_keeps_each_replicas_value_whatever_its_structure(batch: int, devices: int) -> None:
    torch.manual_seed(0)
    model = _Mixed()
    x = torch.randn(batch, 4)
    x[0] = x[0].abs() + 1  # replica 0 keeps more rows than the others
    dp = DataParallel(model, device_ids=["cpu"] * devices)
    got = dp.step(x)
    torch.testing.assert_close(got["loss"], model.step(x)["loss"])
    shares = [c.shape[0] for c in x.tensor_split(devices)] if batch % devices else [batch // devices] * devices
    parts = x.split(shares)
    assert isinstance(got["image_outputs"], list) and len(got["image_outputs"]) == devices
    for value, part in zip(got["image_outputs"], parts):
        ref = model.step(part)["image_outputs"]
        assert len(value) == len(ref)
        for a, b in zip(value, ref):
            torch.testing.assert_close(a, b)


def test_mode_keys_and_tuples_are_validated() -> None:
    assert MethodOptions(gather=("extend", "same")).gather == {0: "extend", 1: "same"}
    with pytest.raises(ValueError, match=r"gather\[1\]: expected one of \['cat'"):
        MethodOptions(gather=("cat", "nope"))
    with pytest.raises(TypeError, match=r"gather: expected output keys or field names \(str\) or tuple positions \(int\) as the mapping's keys, got float 1.5"):
        MethodOptions(gather={1.5: "cat"})
    with pytest.raises(ValueError, match=r"needs outputs with keys, fields or positions"):
        gather([torch.ones(2), torch.ones(2)], "cpu", mode={0: "cat"})
