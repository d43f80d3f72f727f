"""Regression tests for the defects of issue 12 (each failed before its fix).

CPU devices, compared with the bare model on random data.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

import dpmethods
from dpmethods import DataParallel

CPU3 = ["cpu"] * 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 3)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x))


def _equal_params(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def _randomized(m: nn.Module) -> nn.Module:
    with torch.no_grad():
        for t in m.state_dict().values():
            if t.is_floating_point():
                t.copy_(torch.randn_like(t))
    return m


# --- 2 and 13: state dicts ---------------------------------------------------------


@pytest.mark.parametrize("saved_wrapped", [False, True])
@pytest.mark.parametrize("into", ["bare", "ours", "torch"])
def test_averaged_model_checkpoints_load_bare_or_wrapped(saved_wrapped: bool, into: str) -> None:
    src = AveragedModel(_randomized(Net()))
    src.n_averaged.fill_(7)
    saved = DataParallel(src, CPU3).state_dict() if saved_wrapped else src.state_dict()
    dst = AveragedModel(Net())
    target: nn.Module = {
        "bare": dst, "ours": DataParallel(dst, CPU3), "torch": nn.DataParallel(dst)
    }[into]
    result = dpmethods.load_state_dict(target, saved)
    assert not result.missing_keys and not result.unexpected_keys
    assert _equal_params(src, dst) and dst.n_averaged.item() == 7


@pytest.mark.parametrize("saved_wrapped", [False, True])
def test_wrapper_load_state_dict_takes_averaged_model_checkpoints(saved_wrapped: bool) -> None:
    src = AveragedModel(_randomized(Net()))
    saved = DataParallel(src, CPU3).state_dict() if saved_wrapped else src.state_dict()
    dst = AveragedModel(Net())
    DataParallel(dst, CPU3).load_state_dict(saved)
    assert _equal_params(src, dst)


def test_compiled_models_orig_mod_prefix_is_fitted_both_ways() -> None:
    src = _randomized(Net())
    compiled = torch.compile(src)
    saved = compiled.state_dict()
    assert all(k.startswith("_orig_mod.") for k in saved)
    bare = Net()
    dpmethods.load_state_dict(bare, saved)
    assert _equal_params(src, bare)
    dst = Net()
    DataParallel(dst, CPU3).load_state_dict(saved)
    assert _equal_params(src, dst)
    # A bare checkpoint into a wrapper of a compiled module, and the wrapped one into it.
    dst2 = Net()
    DataParallel(torch.compile(dst2), CPU3).load_state_dict(src.state_dict())
    assert _equal_params(src, dst2)
    dst3 = Net()
    dpmethods.load_state_dict(torch.compile(dst3), DataParallel(src, CPU3).state_dict())
    assert _equal_params(src, dst3)


def test_strict_false_with_nothing_matching_warns_and_reports_keys() -> None:
    dst = Net()
    with pytest.warns(UserWarning, match=r"none of the 2 keys of the checkpoint .* nothing was loaded"):
        result = dpmethods.load_state_dict(dst, {"a.w": torch.ones(1), "a.b": torch.ones(1)}, strict=False)
    assert sorted(result.unexpected_keys) == ["a.b", "a.w"] and "lin.weight" in result.missing_keys
    with pytest.warns(UserWarning, match="nothing was loaded"):
        DataParallel(Net(), CPU3).load_state_dict({"x": torch.ones(1)}, strict=False)
    with warnings.catch_warnings():  # a partial load that matches is not warned about
        warnings.simplefilter("error")
        partial = {"lin.weight": torch.zeros(3, 5)}
        r = dpmethods.load_state_dict(dst, partial, strict=False)
    assert "lin.bias" in r.missing_keys and torch.equal(dst.lin.weight, torch.zeros(3, 5))


def test_strip_prefix_strips_once() -> None:
    sd = {"module.module.w": 1, "module.n": 2}
    assert list(dpmethods.strip_prefix(sd)) == ["module.w", "n"]


def test_bytes_and_file_objects_load_and_other_types_are_a_clear_error() -> None:
    src = _randomized(Net())
    buf = io.BytesIO()
    torch.save(DataParallel(src, CPU3).state_dict(), buf)
    a, b = Net(), Net()
    dpmethods.load_state_dict(a, buf.getvalue())
    buf.seek(0)
    dpmethods.load_state_dict(b, buf)
    assert _equal_params(src, a) and _equal_params(src, b)
    with pytest.raises(TypeError, match=r"state_dict: expected a mapping, a path, bytes or a binary file object, got int 5"):
        dpmethods.load_state_dict(Net(), 5)  # type: ignore[arg-type]
    buf2 = io.BytesIO()
    torch.save([1, 2], buf2)
    with pytest.raises(TypeError, match=r"state_dict: expected the checkpoint to hold a mapping .* got list"):
        dpmethods.load_state_dict(Net(), buf2.getvalue())
