"""CPU replica modes: ``cpu_replicas="shared"`` and ``"distinct"``.

In distinct mode every CPU replica gets its own parameter and buffer copies, as on
distinct GPUs: the results and gradients must still equal the module's own, each
replica must compute with its own copies only (checked with
``dpmethods.testing.assert_replicas_isolated``), and in training mode only the first
replica's buffer updates reach the module, as in torch on GPUs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

from dpmethods import DataParallel, parallel_method
from dpmethods.core.cpu_broadcast import CpuBroadcast
from dpmethods.core.replicate import replicate
from dpmethods.testing import assert_close_to_reference as close
from dpmethods.testing import assert_replicas_isolated

__all__: list[str] = []

N = 3
DEVICES = ["cpu"] * N


class Mixed(nn.Module):
    """Linear, BatchNorm (buffers updated in place), an RNN and a tied weight."""

    def __init__(self, rnn: type[nn.RNNBase] = nn.LSTM) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.norm = nn.BatchNorm1d(6)
        self.rnn = rnn(6, 5, batch_first=True)
        self.out = nn.Linear(5, 4)

    @parallel_method
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm(self.inp(x).reshape(b * t, -1)).reshape(b, t, -1)
        y, _ = self.rnn(h)
        return self.out(y[:, -1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encode(x)


# Mixed.encode: Linear(4, 6); BatchNorm (in training, means over a replica's 2 x 3
# rows); 3 steps of an RNN summing 6 + 5 inputs and 2 biases; Linear(5, 4).
MIXED_TERMS = 5 + 2 * 6 + 3 * (6 + 5 + 2) + 6


def _clone(model: nn.Module, make: Callable[[], nn.Module]) -> nn.Module:
    ref = make()
    ref.load_state_dict(model.state_dict())
    return ref.train(model.training)


# --- the mode switch -----------------------------------------------------------------


def test_mode_from_keyword_env_and_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DPMETHODS_CPU_REPLICAS", raising=False)
    assert DataParallel(nn.Linear(2, 2), device_ids=DEVICES).cpu_replicas == "shared"
    monkeypatch.setenv("DPMETHODS_CPU_REPLICAS", "distinct")
    assert DataParallel(nn.Linear(2, 2), device_ids=DEVICES).cpu_replicas == "distinct"
    dp = DataParallel(nn.Linear(2, 2), device_ids=DEVICES, cpu_replicas="shared")
    assert dp.cpu_replicas == "shared"  # the keyword wins over the environment


def test_bad_mode_values_name_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="cpu_replicas: expected 'shared' or 'distinct', got str 'gpu'"):
        DataParallel(nn.Linear(2, 2), device_ids=DEVICES, cpu_replicas="gpu")
    with pytest.raises(ValueError, match="cpu_replicas: expected 'shared' or 'distinct', got bool True"):
        replicate(nn.Linear(2, 2), DEVICES, cpu_replicas=True)  # type: ignore[arg-type]
    monkeypatch.setenv("DPMETHODS_CPU_REPLICAS", "yes")
    with pytest.raises(ValueError, match="DPMETHODS_CPU_REPLICAS: expected 'shared' or 'distinct', got 'yes'"):
        DataParallel(nn.Linear(2, 2), device_ids=DEVICES)


# --- how replicas are made ------------------------------------------------------------


@pytest.mark.parametrize("detach", [False, True], ids=["grad", "no_grad"])
def test_distinct_replicas_own_their_tensors(detach: bool) -> None:
    model = Mixed().train()
    replicas = replicate(model, DEVICES, detach=detach, cpu_replicas="distinct")
    module_storages = {t.untyped_storage().data_ptr() for t in model.state_dict().values()}
    per_replica = []
    for j, r in enumerate(replicas):
        tensors = [t for m in r.modules() for t in (*m._parameters.values(), *m._buffers.values())]
        storages = {t.untyped_storage().data_ptr() for t in tensors if t is not None}
        assert len(tensors) == len(model.state_dict())
        if j == 0:
            assert storages == module_storages  # as torch: the source device's replica aliases
        else:
            assert not storages & module_storages
        per_replica.append(storages)
        for t, ref in zip(r.state_dict().values(), model.state_dict().values(), strict=True):
            close(t, ref, terms=0)  # copies
        assert all(p.requires_grad != detach for p in r.parameters())
    assert not per_replica[1] & per_replica[2]


def test_shared_replicas_share_the_module_tensors() -> None:
    model = Mixed().eval()
    replicas = replicate(model, DEVICES, cpu_replicas="shared")
    for r in replicas:
        for p, q in zip(r.parameters(), model.parameters(), strict=True):
            assert p is q


@pytest.mark.parametrize("rnn", [nn.RNN, nn.GRU, nn.LSTM])
@pytest.mark.parametrize("mode", ["shared", "distinct"])
def test_rnn_replicas_use_their_own_flat_weights(rnn: type[nn.RNNBase], mode: str) -> None:
    """Defect 8: replicate wrote ``_parameters`` directly, so ``_flat_weights`` kept the
    module's weights (a device mismatch on a second GPU)."""
    model = rnn(3, 4)
    for detach in (False, True):
        for r in replicate(model, DEVICES, detach=detach, cpu_replicas=mode):
            flat = r._flat_weights
            assert [w is getattr(r, n) for w, n in zip(flat, r._flat_weights_names)] == [True] * 4


def _stale(rnn: type[nn.RNNBase]) -> type[nn.RNNBase]:
    """``rnn`` whose weights, read by name, are those of the module it was built as: its
    replicas' flat weights, which replicate takes by name, are the module's."""

    class Stale(rnn):  # type: ignore[valid-type, misc]
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)
            self.built_as = [self]  # a plain list: the replicas share it

        def __getattr__(self, name: str) -> object:
            if "built_as" in self.__dict__ and name in self.__dict__["_flat_weights_names"]:
                return self.__dict__["built_as"][0]._parameters[name]
            return super().__getattr__(name)

    return Stale


@pytest.mark.parametrize("rnn", [nn.RNN, nn.GRU, nn.LSTM])
def test_isolation_helper_catches_rnn_weights_shared_across_replicas(rnn: type[nn.RNNBase]) -> None:
    """The helper sees replicas holding the module's RNN weights in their flat weights."""
    dp = DataParallel(Mixed(rnn), device_ids=DEVICES, cpu_replicas="distinct")
    x = torch.randn(6, 3, 4)
    with assert_replicas_isolated():
        dp(x)
    dp = DataParallel(Mixed(_stale(rnn)), device_ids=DEVICES, cpu_replicas="distinct")
    with pytest.raises(AssertionError, match=r"replica 1 touched .*replica 0's parameter rnn\.weight_ih_l0 \(held as rnn\._flat_weights\[0\]\)"):
        with assert_replicas_isolated():
            dp(x)


def test_isolation_helper_sees_a_computation_on_another_replicas_tensor() -> None:
    """A replica reading a tensor of replica 0 through a path replicate doesn't know."""

    class Leaky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.side = [self.lin]  # a plain list: replicas share it, so it is the module's

        @parallel_method
        def f(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.side[0].weight  # the module's weight, in every replica

    dp = DataParallel(Leaky(), device_ids=DEVICES, cpu_replicas="distinct")
    with pytest.raises(AssertionError) as info:
        with assert_replicas_isolated():
            dp.f(torch.randn(6, 3))
    lines = str(info.value).splitlines()[1:]
    assert lines == [
        "replica 1 touched replica 0's parameter lin.weight",
        "replica 2 touched replica 0's parameter lin.weight",
    ]


def test_isolation_helper_refuses_to_pass_vacuously() -> None:
    dp = DataParallel(nn.Linear(3, 3), device_ids=DEVICES, cpu_replicas="shared")
    with pytest.raises(AssertionError, match="expected replicas with tensors of their own, got 3 replica runs"):
        with assert_replicas_isolated():
            dp(torch.randn(6, 3))
    with assert_replicas_isolated(require_checks=False) as report:
        dp(torch.randn(6, 3))
    assert (report.replica_runs, report.checked_runs, report.violations) == (3, 0, [])


# --- results and gradients ------------------------------------------------------------


@pytest.mark.parametrize("rnn", [nn.GRU, nn.LSTM])
@pytest.mark.parametrize("cache", [False, True], ids=["no-cache", "cache"])
def test_distinct_results_and_gradients_equal_the_module(rnn: type[nn.RNNBase], cache: bool) -> None:
    torch.manual_seed(0)
    model = Mixed(rnn).double().eval()
    ref = _clone(model, lambda: Mixed(rnn).double())
    dp = DataParallel(model, device_ids=DEVICES, cpu_replicas="distinct", cache_replicas=cache)
    x = torch.randn(7, 3, 4, dtype=torch.double)
    with assert_replicas_isolated() as report:
        with torch.no_grad():
            for _ in range(2):
                close(dp.encode(x), ref.encode(x), terms=MIXED_TERMS)
        dp.encode(x).pow(2).sum().backward()
    assert report.replica_runs == 3 * 3
    ref.encode(x).pow(2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None, name
        close(p.grad, q.grad, terms=2 * MIXED_TERMS + 7 * 4, msg=name)  # back, summed over 7 x 4


def test_distinct_replicas_copy_sparse_parameters() -> None:
    # A sparse tensor has no memory format to keep: its copies are plain clones (torch
    # refuses preserve_format for the compressed layouts). Replicas for no_grad: a map's,
    # a call's under torch.no_grad().
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4, 4, generator=g) * (torch.rand(4, 4, generator=g) > 0.5)
    model = nn.Linear(4, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's CSR support is in beta
        model.csr = nn.Parameter(w.to_sparse_csr(), requires_grad=False)
    model.coo = nn.Parameter(w.to_sparse())
    for replica in replicate(model, ["cpu"] * N, True, cpu_replicas="distinct")[1:]:
        for name in ("csr", "coo"):
            copy, own = getattr(replica, name), getattr(model, name)
            assert copy.layout == own.layout and torch.equal(copy.to_dense(), own.to_dense())
            assert copy.values().data_ptr() != own.values().data_ptr()


def test_distinct_training_buffers_as_on_gpus() -> None:
    """Training mode: each replica normalises with its own batch statistics, and only
    replica 0's running-stat updates reach the module (torch's rule on GPUs)."""
    torch.manual_seed(0)
    model = Mixed().double().train()
    before = [_clone(model, lambda: Mixed().double()) for _ in range(N)]
    dp = DataParallel(model, device_ids=DEVICES, cpu_replicas="distinct")
    x = torch.randn(6, 3, 4, dtype=torch.double)
    with assert_replicas_isolated():
        out = dp(x)
    expected = torch.cat([m.encode(c) for m, c in zip(before, x.chunk(N), strict=True)])
    close(out, expected, terms=MIXED_TERMS)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        close(getattr(model.norm, name), getattr(before[0].norm, name), terms=MIXED_TERMS)
    assert not torch.equal(model.norm.running_mean, before[1].norm.running_mean)


def test_cpu_broadcast_gradients() -> None:
    a = torch.randn(3, dtype=torch.double, requires_grad=True)
    b = torch.randn(2, 2, dtype=torch.double, requires_grad=True)

    def f(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return CpuBroadcast.apply(3, a, b)  # type: ignore[no-any-return]

    torch.autograd.gradcheck(f, (a, b))
    torch.autograd.gradgradcheck(f, (a, b))
    c = torch.randn(3)  # no grad: its copies are marked non-differentiable
    outs = CpuBroadcast.apply(2, a, c)
    assert [o.requires_grad for o in outs] == [True, False, True, False]


def test_both_modes_give_the_module_results() -> None:
    """The mode changes how replicas are made, not the results."""
    torch.manual_seed(0)
    model = Mixed().double().eval()
    x = torch.randn(7, 3, 4, dtype=torch.double)
    outs = [
        DataParallel(model, device_ids=DEVICES, cpu_replicas=mode)(x) for mode in ("shared", "distinct")
    ]
    close(outs[0], outs[1], terms=MIXED_TERMS)
    close(outs[0], model(x), terms=MIXED_TERMS)
