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
from dpmethods.extending import register_gather_mode
from dpmethods.testing import assert_close_to_reference as close

TERMS = 5  # _Mixed: Linear(4, 3)


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
    close(got, ref, terms=TERMS)


@pytest.mark.parametrize("batch,devices", [(8, 4), (4, 4), (5, 2)])
def test_same_per_tuple_position_keeps_a_scale_0_dim(batch: int, devices: int) -> None:
    torch.manual_seed(0)
    model = _Mixed()
    x = torch.randn(batch, 4)
    dp = DataParallel(model, device_ids=["cpu"] * devices)
    got, ref = dp.features(x), model.features(x)
    assert got[2].dim() == 0
    close(got, ref, terms=TERMS)  # the scale's exp is computed alike everywhere
    # Gradients flow to the scale through the one value.
    (g,) = torch.autograd.grad(got[2], model.scale)
    close(g, torch.autograd.grad(ref[2], model.scale)[0], terms=1)
    # One mapping serves tuples of several arities and dict outputs, without warnings.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for as_dict in (False, True):
            out = dp.clip_like(x, as_dict)
            scale = out["logit_scale"] if as_dict else out[2]
            assert scale.dim() == 0
            close(scale, model.scale.exp(), terms=1)


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
    close(got["loss"], model.step(x)["loss"], terms=2 * TERMS + 3 * batch)  # a mean of squares
    shares = [c.shape[0] for c in x.tensor_split(devices)] if batch % devices else [batch // devices] * devices
    parts = x.split(shares)
    assert isinstance(got["image_outputs"], list) and len(got["image_outputs"]) == devices
    for value, part in zip(got["image_outputs"], parts):
        ref = model.step(part)["image_outputs"]
        assert len(value) == len(ref)
        close(value, ref, terms=TERMS)


def test_mode_keys_and_tuples_are_validated() -> None:
    assert MethodOptions(gather=("extend", "same")).gather == {0: "extend", 1: "same"}
    with pytest.raises(ValueError, match=r"gather\[1\]: expected one of \['cat'"):
        MethodOptions(gather=("cat", "nope"))
    with pytest.raises(TypeError, match=r"gather: expected output keys or field names \(str\) or tuple positions \(int\) as the mapping's keys, got float 1.5"):
        MethodOptions(gather={1.5: "cat"})
    with pytest.raises(ValueError, match=r"needs outputs with keys, fields or positions"):
        gather([torch.ones(2), torch.ones(2)], "cpu", mode={0: "cat"})


def test_a_mode_name_unknown_when_decorated_is_resolved_when_called() -> None:
    class Late(nn.Module):
        runs = 0

        @parallel_method(gather="late_first")  # not registered yet, not a typo: accepted
        def f(self, x: torch.Tensor) -> torch.Tensor:
            Late.runs += 1
            return x * 2

    dp = DataParallel(Late(), device_ids=["cpu"] * 2)
    with pytest.raises(ValueError) as info:
        dp.f(torch.ones(4, 1))
    message = str(info.value)
    assert message.startswith(
        "gather: expected one of the built-in modes ['cat', 'stack', 'mean', 'sum', 'pad', "
        "'list', 'extend', 'same'], a named mode (registered so far: "
    )
    assert (
        "a library's named mode, such as transformers' 'generate', exists once the library "
        "is imported), a mapping of output keys, field names or tuple positions to built-in "
        "modes, a tuple of built-in modes (one per tuple position), or a callable "
        "fn(outputs, output_device); got 'late_first'"
    ) in message
    assert Late.runs == 0  # refused before any replica ran
    register_gather_mode("late_first", lambda outputs, device, call: outputs[0].to(device))
    assert dp.f(torch.ones(4, 1)).tolist() == [[2.0], [2.0]]  # replica 0's share


def test_a_typo_of_a_built_in_mode_is_refused_when_decorated() -> None:
    with pytest.raises(ValueError, match=r"^gather: expected one of \['cat', 'stack', 'mean', 'sum', "
                       r"'pad', 'list', 'extend', 'same'\] or a named mode, got 'extnd': did you mean 'extend'\?$"):
        parallel_method(gather="extnd")
    with pytest.raises(ValueError, match=r"got 'Mean': did you mean 'mean'\?$"):
        MethodOptions(gather="Mean")


def test_every_builtin_mode_is_one_row_of_the_table() -> None:
    # A built-in mode is a Mode member and a row of MODES; nothing else dispatches on it.
    from dpmethods.core.gather.modes import MODES, ModeRow
    from dpmethods.vocab.gather_modes import Mode

    assert set(MODES) == {m.value for m in Mode}
    assert all(isinstance(row, ModeRow) for row in MODES.values())
    assert {m for m, row in MODES.items() if row.reduces} == {"mean", "sum"}
