"""Replica caching (``DataParallel(..., cache_replicas=True)``).

A stale replica is a wrong answer, so every change is checked twice: the cached
DataParallel output must equal the module's own output, and ``replicate`` must have
run again. The model is kept in training mode for some cases because then the 2nd
and 3rd replicas on a CPU device hold *clones* of the buffers, the one place where
a stale replica shows in the output on CPU (elsewhere CPU replicas alias the
module's storage).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import dpmethods
import dpmethods.data_parallel
from dpmethods import DataParallel, parallel_method
from dpmethods.core.replicate import fingerprint
from dpmethods.testing import assert_close_to_reference as close

__all__: list[str] = []

D = 6
DEVICES = ["cpu"] * 3
TERMS = 2 * (D + 1) + 2  # Net.encode: Linear(D, D), a scale and a shift, Linear(D, D)


class Sub(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.scale = 1.0
        self.register_buffer("shift", torch.randn(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x) * self.scale + self.shift
        return y.tanh() if self.training else y  # per-item, so DP equals the module


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sub = Sub()
        self.head = nn.Linear(D, D)

    @parallel_method
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.sub(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encode(x)


@dataclass
class Counter:
    n: int = 0


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Counts ``dpmethods.core.replicate.replicate`` calls made by DataParallel."""
    counter = Counter()
    real = dpmethods.wrapper.call.replicate

    def counting(*args: object, **kwargs: object) -> list[nn.Module]:
        counter.n += 1
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(dpmethods.wrapper.call, "replicate", counting)
    return counter


def _dtype(model: nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def _check(dp: DataParallel, model: nn.Module, method: str = "encode", batch: int = 7) -> None:
    """Under no_grad, DP's output on random data equals the module's own output."""
    x = torch.randn(batch, D, dtype=_dtype(model))
    with torch.no_grad():
        got = dp(x) if method == "forward" else getattr(dp, method)(x)
        want = model(x) if method == "forward" else getattr(model, method)(x)
    close(got, want, terms=TERMS)


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model.encode(torch.randn(5, D, dtype=_dtype(model))).pow(2).mean().backward()
    opt.step()


def _no_grad(fn: Callable[[Net], object]) -> Callable[[Net, DataParallel], None]:
    def change(model: Net, dp: DataParallel) -> None:
        with torch.no_grad():
            fn(model)

    return change


CHANGES: dict[str, Callable[[Net, DataParallel], object]] = {
    "inplace_param": _no_grad(lambda m: m.sub.lin.weight.mul_(2)),
    "inplace_buffer": _no_grad(lambda m: m.sub.shift.add_(1)),
    "sgd_step": lambda m, dp: _step(m, torch.optim.SGD(m.parameters(), lr=0.5)),
    "sgd_foreach_step": lambda m, dp: _step(
        m, torch.optim.SGD(m.parameters(), lr=0.5, foreach=True)
    ),
    # Fused kernels don't bump version counters; fingerprint counts optimizer steps.
    "adam_fused_step": lambda m, dp: _step(m, torch.optim.Adam(m.parameters(), lr=0.1, fused=True)),
    "to_double": lambda m, dp: m.double(),
    "train_eval_toggle": lambda m, dp: m.train(not m.training),
    "submodule_train_eval_toggle": lambda m, dp: m.sub.train(not m.sub.training),
    "load_state_dict": lambda m, dp: m.load_state_dict(Net().state_dict()),
    "load_state_dict_assign": lambda m, dp: m.load_state_dict(Net().state_dict(), assign=True),
    "dp_load_state_dict": lambda m, dp: dp.load_state_dict(Net().state_dict()),
    "attribute_float": lambda m, dp: setattr(m.sub, "scale", 3.0),
    "replace_submodule": lambda m, dp: setattr(m.sub, "lin", nn.Linear(D, D)),
    "replace_top_submodule": lambda m, dp: setattr(m, "head", nn.Linear(D, D)),
    "new_parameter": lambda m, dp: setattr(m.sub.lin, "weight", nn.Parameter(torch.randn(D, D))),
    "delete_then_new_parameter": lambda m, dp: (
        delattr(m.sub.lin, "bias"),
        setattr(m.sub.lin, "bias", nn.Parameter(torch.randn(D))),
    ),
    "assign_buffer": lambda m, dp: setattr(m.sub, "shift", torch.randn(D)),
    "forward_hook": lambda m, dp: m.sub.register_forward_hook(lambda mod, i, o: o * 2),
}


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", list(CHANGES))
def test_change_rebuilds_replicas(name: str, training: bool, calls: Counter) -> None:
    model = Net().train(training)
    dp = DataParallel(model, device_ids=DEVICES, cache_replicas=True)
    _check(dp, model)
    _check(dp, model)
    assert calls.n == 1, "replicas are reused while nothing changes"
    CHANGES[name](model, dp)
    _check(dp, model)
    if name != "forward_hook":  # hook dicts are shared with replicas: live either way
        assert calls.n == 2, f"{name}: replicas must be rebuilt"
    _check(dp, model)
    assert calls.n <= 2, "the rebuilt replicas are cached again"


@pytest.mark.parametrize("method", ["encode", "forward"])
def test_reused_when_nothing_changes(method: str, calls: Counter) -> None:
    model = Net().eval()
    dp = DataParallel(model, device_ids=DEVICES, cache_replicas=True)
    for _ in range(5):
        _check(dp, model, method)  # fresh random inputs every call
    assert calls.n == 1
    assert fingerprint(model) == fingerprint(model)


def test_forward_and_method_share_the_cache(calls: Counter) -> None:
    model = Net()
    dp = DataParallel(model, device_ids=DEVICES, cache_replicas=True)
    _check(dp, model, "encode")
    _check(dp, model, "forward")
    assert calls.n == 1


def test_fewer_replicas_share_the_cache(calls: Counter) -> None:
    # 2 items on 3 devices run 2 replicas: replicas are cached for every device, so a
    # smaller batch uses the first ones and nothing is rebuilt.
    model = Net()
    dp = DataParallel(model, device_ids=DEVICES, cache_replicas=True)
    _check(dp, model, batch=7)
    with pytest.warns(UserWarning, match="only 2 replicas run"):
        _check(dp, model, batch=2)
    _check(dp, model, batch=7)
    assert calls.n == 1


def test_many_steps_interleaved(calls: Counter) -> None:
    """Train steps with grad and cached evaluation under no_grad, alternating."""
    model = Net()
    dp = DataParallel(model, device_ids=DEVICES, cache_replicas=True)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(4):
        model.train()
        opt.zero_grad()
        dp.encode(torch.randn(9, D)).pow(2).mean().backward()
        opt.step()
        model.eval()
        _check(dp, model)
        _check(dp, model)
    assert calls.n == 4 * 2  # one training replicate per step, one cached per evaluation


def test_nothing_cached_with_grad(calls: Counter) -> None:
    model = Net()
    ref = Net()
    ref.load_state_dict(model.state_dict())
    dp = DataParallel(model, device_ids=DEVICES, cache_replicas=True)
    _check(dp, model)  # a cache exists under no_grad...
    assert calls.n == 1
    x = torch.randn(7, D)
    for k in range(3):  # ...but calls with grad never use it, nor fill it
        model.zero_grad()
        ref.zero_grad()
        dp.encode(x).pow(2).sum().backward()
        ref.encode(x).pow(2).sum().backward()
        assert calls.n == 2 + k
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert p.grad is not None, name
            close(p.grad, q.grad, terms=2 * TERMS + 7 * D, msg=name)  # back, then summed over 7 x D


def test_cached_replicas_are_detached(calls: Counter) -> None:
    model = Net()
    dp = DataParallel(model, device_ids=DEVICES, cache_replicas=True)
    seen: list[bool] = []  # each replica's head, as its call runs
    model.head.register_forward_pre_hook(lambda m, args: seen.extend(p.requires_grad for p in m.parameters()))
    with torch.no_grad():
        dp.encode(torch.randn(7, D))
        dp.encode(torch.randn(7, D))
    assert calls.n == 1 and seen == [False] * 2 * 2 * len(DEVICES)  # built once, lent twice


def test_cache_off_never_caches(calls: Counter) -> None:
    model = Net().eval()
    dp = DataParallel(model, device_ids=DEVICES)
    assert dp.cache_replicas is False
    for _ in range(3):
        _check(dp, model)
    with torch.inference_mode():
        dp.encode(torch.randn(7, D))
    assert calls.n == 4  # every call built its replicas


def test_inference_mode_caches(calls: Counter) -> None:
    model = Net().eval()
    dp = DataParallel(model, device_ids=DEVICES, cache_replicas=True)
    x = torch.randn(7, D)
    with torch.inference_mode():
        for _ in range(3):
            close(dp.encode(x), model.encode(x), terms=TERMS)
    assert calls.n == 1


def test_inference_tensor_parameters_are_never_reused(calls: Counter) -> None:
    # Inference tensors have no version counter, so no change to them can be seen.
    with torch.inference_mode():
        model = Net().eval()
        dp = DataParallel(model, device_ids=DEVICES, cache_replicas=True)
        x = torch.randn(7, D)
        close(dp.encode(x), model.encode(x), terms=TERMS)
        model.sub.lin.weight.mul_(2)
        close(dp.encode(x), model.encode(x), terms=TERMS)
    assert calls.n == 2
    assert fingerprint(model) != fingerprint(model)


@pytest.mark.xfail(
    strict=True,
    reason="writes through .data get a version counter of their own and are not seen; "
    "update under torch.no_grad() instead",
)
def test_data_write_is_not_seen(calls: Counter) -> None:
    model = Net().train()  # training: replicas 2 and 3 hold buffer clones
    dp = DataParallel(model, device_ids=DEVICES, cache_replicas=True)
    _check(dp, model)
    model.sub.shift.data.add_(1)
    _check(dp, model)


def test_fingerprint_sees_each_kind_of_change() -> None:
    model = Net()
    seen = {fingerprint(model)}
    for name, change in CHANGES.items():
        if name in ("dp_load_state_dict", "forward_hook"):
            continue  # hook dicts are shared with the replicas, so hooks need no rebuild
        change(model, DataParallel(model, device_ids=DEVICES))
        fp = fingerprint(model)
        assert fp not in seen, name
        seen.add(fp)


def test_small_batches_rebuild_after_a_change() -> None:
    # Fewer items than devices: the cache key must still be the module's fingerprint.
    model = nn.Linear(3, 3)
    dp = DataParallel(model, device_ids=["cpu"] * 4, cache_replicas=True)
    x = torch.randn(2, 3)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 2 items on 4 devices warns; tested elsewhere
        close(dp(x), model(x), terms=4)  # Linear(3, 3)
        model.weight = nn.Parameter(torch.randn(3, 3))
        close(dp(x), model(x), terms=4)
