"""DataParallel on a GPU: repeated device ids, streams, autocast and gathers to the CPU.

Only one GPU is ever lent to our checks, so multi-replica paths run on repeated ids.
Marked ``cuda``: skipped without a GPU.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dpmethods import DataParallel, parallel_method
from dpmethods.testing import assert_close_to_reference as close

pytestmark = pytest.mark.cuda
TERMS = 17  # Net.step's y: tanh(Linear(16, 8))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 8)
        self.streams: list[int] = []

    @parallel_method(gather={"loss": "mean"})
    def step(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        self.streams.append(torch.cuda.current_stream().stream_id)
        y = torch.tanh(self.lin(x))
        return {"y": y, "loss": (y**2).mean()}


def _pair() -> tuple[Net, Net]:
    ref = Net().cuda()
    return ref, copy.deepcopy(ref)


@pytest.mark.parametrize("ids", [[0], [0, 0], [0, 0, 0]])
def test_repeated_ids_match_one_device_with_gradients(ids: list[int]) -> None:
    ref, model = _pair()
    dp = DataParallel(model, device_ids=ids)
    x = torch.randn(11, 16, device="cuda")
    out, out_ref = dp.step(x), ref.step(x)
    close(out["y"], out_ref["y"], terms=TERMS)
    close(out["loss"], out_ref["loss"], terms=2 * TERMS + 11 * 8)  # a mean of 11 x 8 squares
    out["loss"].backward()
    out_ref["loss"].backward()
    close(model.lin.weight.grad, ref.lin.weight.grad, terms=4 * TERMS + 2 * 11 * 8)  # back, over the rows


def test_repeated_ids_share_parameters_and_use_their_own_streams() -> None:
    _, model = _pair()
    dp = DataParallel(model, device_ids=[0, 0, 0])
    replicas = dp.replicate(model, dp.device_ids)
    ptrs = {r.lin.weight.data_ptr() for r in replicas}
    assert ptrs == {model.lin.weight.data_ptr()}
    model.streams.clear()
    dp.step(torch.randn(9, 16, device="cuda"))
    assert len(set(model.streams)) == 3  # the caller's stream and two side streams


def test_gather_to_cpu_and_scatter_from_cpu() -> None:
    ref, model = _pair()
    dp = DataParallel(model, device_ids=[0, 0], output_device="cpu")
    x = torch.randn(6, 16)
    out = dp.step(x)  # inputs on the CPU are moved to each replica's device
    assert out["y"].device.type == "cpu"
    close(out["y"], ref.step(x.cuda())["y"].cpu(), terms=TERMS)


def test_autocast_and_cached_replicas_on_gpu() -> None:
    ref, model = _pair()
    dp = DataParallel(model, device_ids=[0, 0], cache_replicas=True)
    x = torch.randn(8, 16, device="cuda")
    with torch.no_grad():
        with torch.autocast("cuda", dtype=torch.float16):
            assert dp.step(x)["y"].dtype == torch.float16
        first = dp.step(x)["y"]
        model.lin.weight.mul_(2)
        ref.lin.weight.mul_(2)
        close(dp.step(x)["y"], ref.step(x)["y"], terms=TERMS)
        assert not torch.allclose(first, dp.step(x)["y"])


def test_module_on_the_wrong_device_is_named() -> None:
    model = Net()  # on the CPU
    dp = DataParallel(model, device_ids=[0, 0])
    with pytest.raises(RuntimeError, match=r"parameters and buffers on device cuda:0 .*'lin.weight' is on cpu"):
        dp.step(torch.randn(4, 16, device="cuda"))
