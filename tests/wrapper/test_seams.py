"""dpmethods.DataParallel as a drop-in at torch's seams.

A subclass that overrides scatter/replicate/parallel_apply/gather with
torch.nn.DataParallel's signatures, and calls super(), must keep working for
forward and for every parallel method; the per-call options travel in a context
that is safe under concurrent and re-entrant calls.
"""

from __future__ import annotations

import copy
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import nn

import dpmethods
from dpmethods import DataParallel, parallel_method
from dpmethods.testing import assert_close_to_reference as close
from dpmethods.vocab import warn_once
from tests.helpers.terms import mlp_terms

CPU3 = ["cpu"] * 3
# Net: Linear(6, 4). The step's loss squares it and takes the mean of up to 13 x 4 values.
TERMS = mlp_terms(6)
LOSS_TERMS = 2 * TERMS + 13 * 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    @parallel_method(dim=1)
    def encode_t(self, x: torch.Tensor) -> torch.Tensor:
        """Batch along dim 1 in and out."""
        return self.lin(x.transpose(0, 1)).transpose(0, 1)

    @parallel_method(gather={"loss": "mean"})
    def step(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        y = self.lin(x)
        return {"loss": (y**2).mean(), "y": y}


class Recorder(DataParallel):
    """Overrides every seam with torch's exact signature and records the call."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[str, int, tuple[str, ...]]] = []

    def scatter(self, inputs: Any, kwargs: Any, device_ids: Sequence[Any]) -> Any:
        self.seen.append(("scatter", len(device_ids), ()))
        return super().scatter(inputs, kwargs, device_ids)

    def replicate(self, module: Any, device_ids: Sequence[Any]) -> Any:
        self.seen.append(("replicate", len(device_ids), ()))
        return super().replicate(module, device_ids)

    def parallel_apply(self, replicas: Any, inputs: Any, kwargs: Any) -> Any:
        self.seen.append(("parallel_apply", len(replicas), ()))
        return super().parallel_apply(replicas, inputs, kwargs)

    def gather(self, outputs: Any, output_device: Any) -> Any:
        self.seen.append(("gather", len(outputs), ()))
        return super().gather(outputs, output_device)


def _pair() -> tuple[Net, Net]:
    ref = Net()
    return ref, copy.deepcopy(ref)


def test_every_seam_is_called_with_torchs_signature_for_every_method() -> None:
    ref, model = _pair()
    dp = Recorder(model, device_ids=CPU3)
    x = torch.randn(7, 6)
    close(dp(x), ref(x), terms=TERMS)
    xt = torch.randn(3, 7, 6)  # a batch of 7 along dim 1
    close(dp.encode_t(xt), ref.encode_t(xt), terms=TERMS)
    out = dp.step(x)
    # The method's own options reach gather through the call context: a weighted mean.
    close(out["loss"], ref.step(x)["loss"], terms=LOSS_TERMS)
    assert [s[0] for s in dp.seen] == ["scatter", "replicate", "parallel_apply", "gather"] * 3


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("seam", ["scatter", "replicate", "parallel_apply", "gather"])
def test_a_subclass_overriding_one_seam_like_torch_works(seam: str, cached: bool) -> None:
    calls: list[str] = []

    def scatter(self: Any, inputs: Any, kwargs: Any, device_ids: Any) -> Any:
        calls.append(seam)
        return DataParallel.scatter(self, inputs, kwargs, device_ids)

    def replicate(self: Any, module: Any, device_ids: Any) -> Any:
        calls.append(seam)
        return super(Sub, self).replicate(module, device_ids)

    def parallel_apply(self: Any, replicas: Any, inputs: Any, kwargs: Any) -> Any:
        calls.append(seam)
        return super(Sub, self).parallel_apply(replicas, inputs, kwargs)

    def gather(self: Any, outputs: Any, output_device: Any) -> Any:
        calls.append(seam)
        return super(Sub, self).gather(outputs, output_device)

    impl = {"scatter": scatter, "replicate": replicate, "parallel_apply": parallel_apply,
            "gather": gather}[seam]
    Sub = type("Sub", (DataParallel,), {seam: impl})
    ref, model = _pair()
    dp = Sub(model, CPU3, cache_replicas=cached)
    x = torch.randn(8, 6)
    with torch.set_grad_enabled(not cached):  # the replica cache works under no_grad
        close(dp(x), ref(x), terms=TERMS)
        close(dp.step(x)["loss"], ref.step(x)["loss"], terms=LOSS_TERMS)
        close(dp(x), ref(x), terms=TERMS)
    assert calls == [seam] * 3


def test_a_scatter_written_from_scratch_needs_no_sizes_attribute() -> None:
    # torch's own scatter returns plain tuples; ours must not rely on anything more.
    class Chunky(DataParallel):
        def scatter(self, inputs: Any, kwargs: Any, device_ids: Sequence[Any]) -> Any:
            chunks = inputs[0].chunk(len(device_ids))
            return tuple((c,) for c in chunks), tuple({} for _ in chunks)

    ref, model = _pair()
    dp = Chunky(model, CPU3)
    x = torch.randn(9, 6)
    close(dp(x), ref(x), terms=TERMS)
    close(dp.step(x)["loss"], ref.step(x)["loss"], terms=LOSS_TERMS)  # equal chunks


def test_parallel_apply_seam_takes_none_kwargs_and_bare_inputs_like_torch() -> None:
    ref, model = _pair()
    dp = DataParallel(model, CPU3)
    replicas = dp.replicate(model, dp.device_ids[:2])
    a, b = torch.randn(2, 6), torch.randn(3, 6)
    out = dp.parallel_apply(replicas, [a, (b,)], None)
    close((out[0], out[1]), (ref(a), ref(b)), terms=TERMS)
    g = dp.gather(out, dp.output_device)
    close(g, ref(torch.cat([a, b])), terms=TERMS)
    scattered = dp.scatter((torch.cat([a, b]),), None, dp.device_ids)
    assert [t[0].shape[0] for t in scattered[0]] == [2, 2, 1] and scattered[1] == ({},) * 3


def test_dict_outputs_with_keys_in_another_order_gather_by_key() -> None:
    class Flip(nn.Module):
        @parallel_method
        def f(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            if x[0, 0] > 0:
                return {"a": x, "b": x * 2}
            return {"b": x * 2, "a": x}

    dp = DataParallel(Flip(), CPU3)
    x = torch.tensor([[1.0], [-1.0], [1.0], [-1.0]])
    out = dp.f(x)
    assert list(out) == ["a", "b"]
    assert torch.equal(out["a"], x) and torch.equal(out["b"], x * 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without GPUs")
def test_gpu_ids_without_gpus_are_a_plain_call_with_one_warning() -> None:
    warn_once.reset()
    ref, model = _pair()
    with pytest.warns(UserWarning, match=r"device_ids \[0, 1\] were ignored because no GPU is available"):
        dp = DataParallel(model, device_ids=[0, 1])
    assert dp.device_ids == [] and nn.DataParallel(copy.deepcopy(ref), [0, 1]).device_ids == []
    x = torch.randn(5, 6)
    close((dp(x), dp.step(x)["y"]), (ref(x), ref.step(x)["y"]), terms=TERMS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DataParallel(Net(), device_ids=[0, 1])  # once


def test_dataparallel_is_generic_like_torchs() -> None:
    ref, model = _pair()
    dp = DataParallel[Net](model, CPU3)
    assert isinstance(dp, DataParallel) and isinstance(dp, nn.DataParallel)
    x = torch.randn(4, 6)
    close(dp(x), ref(x), terms=TERMS)
    assert nn.DataParallel[Net] is not None and dpmethods.DataParallel[nn.Linear] is not None


@pytest.mark.parametrize("cached", [False, True])
def test_four_threads_with_different_options_overlap_safely(cached: bool) -> None:
    # Four calls are held inside scatter together, so their contexts overlap for sure.
    barrier = threading.Barrier(4, timeout=30)

    class Wait(DataParallel):
        def scatter(self, inputs: Any, kwargs: Any, device_ids: Sequence[Any]) -> Any:
            barrier.wait()
            return super().scatter(inputs, kwargs, device_ids)

    ref, model = _pair()
    dp = Wait(model, CPU3, cache_replicas=cached)
    x = torch.randn(7, 6)
    xt = torch.randn(3, 7, 6)
    jobs = [lambda: dp(x), lambda: dp.encode_t(xt), lambda: dp.step(x)["loss"], lambda: dp.encode_t(xt)]
    expected = [ref(x), ref.encode_t(xt), ref.step(x)["loss"], ref.encode_t(xt)]
    results: list[Any] = [None] * 4

    def run(i: int) -> None:
        with torch.set_grad_enabled(not cached):
            results[i] = jobs[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for got, want in zip(results, expected):
        assert got is not None and got.shape == want.shape
        close(got, want, terms=LOSS_TERMS)


def test_a_call_made_inside_a_seam_leaves_the_outer_calls_options_intact() -> None:
    class Nested(DataParallel):
        inner: Any = None
        entered = False

        def gather(self, outputs: Any, output_device: Any) -> Any:
            if not self.entered:
                self.entered = True
                self.inner = self.encode_t(torch.randn(2, 5, 6))  # re-entrant call
            return super().gather(outputs, output_device)

    ref, model = _pair()
    dp = Nested(model, CPU3)
    x = torch.randn(7, 6)
    out = dp.step(x)
    assert dp.inner is not None and dp.inner.shape == (2, 5, 4)
    assert out["loss"].dim() == 0  # still the outer call's weighted mean
    close(out["loss"], ref.step(x)["loss"], terms=LOSS_TERMS)
