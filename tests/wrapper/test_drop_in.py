"""DataParallel as a drop-in for torch's: state dicts, in-place updates of inputs,
iterator arguments, meta tensors, 0-dim outputs, subclasses, memory and errors.

CPU devices, compared with the bare model on random data.
"""

from __future__ import annotations

import copy
import gc
import io
import os
import warnings
import weakref
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

import dpmethods
from dpmethods import DataParallel, parallel_method
from dpmethods.testing import assert_close_to_reference as close

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


# --- state dicts ---------------------------------------------------------


@pytest.mark.parametrize("saved_wrapped", [False, True])
@pytest.mark.parametrize("into", ["bare", "ours", "torch"])
def test_averaged_model_state_dicts_load_bare_or_wrapped(saved_wrapped: bool, into: str) -> None:
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
def test_wrapper_load_state_dict_takes_averaged_model_state_dicts(saved_wrapped: bool) -> None:
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
    # A bare state dict into a wrapper of a compiled module, and the wrapped one into it.
    dst2 = Net()
    DataParallel(torch.compile(dst2), CPU3).load_state_dict(src.state_dict())
    assert _equal_params(src, dst2)
    dst3 = Net()
    dpmethods.load_state_dict(torch.compile(dst3), DataParallel(src, CPU3).state_dict())
    assert _equal_params(src, dst3)


def test_strict_false_with_nothing_matching_warns_and_reports_keys() -> None:
    dst = Net()
    with pytest.warns(UserWarning, match=r"none of the 2 keys of the state dict .* nothing was loaded"):
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
    with pytest.raises(TypeError, match=r"state_dict: expected the file to hold a mapping .* got list"):
        dpmethods.load_state_dict(Net(), buf2.getvalue())


# --- in-place update of an input under grad ---------------------------------------


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    @parallel_method
    def f(self, h: torch.Tensor) -> torch.Tensor:
        h += 1  # in place on the (scattered) input
        h.mul_(self.lin.bias.sum())
        return self.lin(h)


def test_in_place_update_of_an_input_under_grad_matches_the_bare_model() -> None:
    ref = InPlace()
    dp = DataParallel(copy.deepcopy(ref), CPU3)
    base = torch.randn(7, 4, requires_grad=True)
    out = dp.f(base * 2)  # a non-leaf input, as in a model's own forward
    out.square().sum().backward()
    grads = [base.grad.clone()] + [p.grad.clone() for p in dp.module.parameters()]  # type: ignore[union-attr]
    base.grad = None
    want = ref.f(base * 2)
    want.square().sum().backward()
    # (2 x + 1) times a sum of 3, then Linear(4, 3); the gradients run back over that
    # path and sum over 7 rows x 3 outputs.
    close(out, want, terms=10)
    for g, w in zip(grads, [base.grad] + [p.grad for p in ref.parameters()]):
        assert w is not None
        close(g, w, terms=2 * 10 + 7 * 3)


# --- iterator and generator arguments ----------------------------------------------


class Weighted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    @parallel_method
    def f(self, x: torch.Tensor, weights: Any, extra: Any = ()) -> torch.Tensor:
        out = self.lin(x)
        for w in weights:
            out = out * w
        for it in extra:  # iterators nested in a list
            for e in it:
                out = out + e
        return out


WEIGHTED_TERMS = 5 + 3 + 2  # Linear(4, 2), then up to 3 products and 2 sums


@pytest.mark.parametrize("make", [
    lambda: (w for w in [2.0, 3.0, 0.5]),
    lambda: iter([2.0, 3.0, 0.5]),
    lambda: map(float, [2, 3, 0.5]),
])
def test_every_replica_sees_every_item_of_an_iterator_argument(make: Any) -> None:
    ref = Weighted()
    dp = DataParallel(copy.deepcopy(ref), CPU3)
    x = torch.randn(9, 4)
    got = dp.f(x, make(), extra=[iter([1.0, -2.0])])
    want = ref.f(x, make(), extra=[iter([1.0, -2.0])])
    close(got, want, terms=WEIGHTED_TERMS)


def test_an_iterator_argument_to_worker_processes_is_refused_saying_why() -> None:
    # The replicas share one lazy pass over it in the caller: no worker process can read it.
    dp = DataParallel(Weighted(), CPU3, workers="processes")
    try:
        with pytest.raises(TypeError, match=r"^DataParallel\.f\(workers='processes'\): its arguments cannot be "
                           r"sent to a worker process: TypeError: an iterator argument is read lazily, once, in "
                           r"the caller's process.*pass its items as a list or tuple; use workers='threads'$"):
            dp.f(torch.randn(9, 4), iter([2.0, 3.0]))
    finally:
        dp.close()


def test_an_endless_iterator_is_read_lazily() -> None:
    import itertools

    class Take(nn.Module):
        @parallel_method
        def f(self, x: torch.Tensor, it: Any) -> torch.Tensor:
            return x * next(it) * next(it)

    dp = DataParallel(Take(), CPU3)
    x = torch.ones(6, 1)
    assert torch.equal(dp.f(x, itertools.count(2)), Take().f(x, itertools.count(2)))


# --- meta tensors ---------------------------------------------------------------


def test_meta_outputs_gathered_to_a_real_device_raise_like_torch() -> None:
    outs = [torch.empty(2, 3, device="meta"), torch.empty(1, 3, device="meta")]
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        torch.cat(outs).to("cpu")  # what torch does
    with pytest.raises(NotImplementedError, match=r"gather_coalesced\(\): Cannot copy out of meta tensor; no data!"):
        dpmethods.gather(outs, "cpu")
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        dpmethods.gather([{"a": o} for o in outs], "cpu", mode="list")
    assert dpmethods.gather(outs, "meta").shape == (3, 3)  # meta to meta is fine

    class Meta(nn.Module):
        @parallel_method
        def f(self, x: torch.Tensor) -> torch.Tensor:
            return torch.empty(x.shape, device="meta")

    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        DataParallel(Meta(), CPU3).f(torch.ones(4, 2))


# --- 0-dim outputs ----------------------------------------------------------------


class Scalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: Any) -> torch.Tensor:
        return (x * self.w).sum() if isinstance(x, torch.Tensor) else self.w * x

    @parallel_method
    def loss(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": (x * self.w).mean(), "y": x * self.w}


def test_a_one_device_wrapper_keeps_0_dim_outputs_0_dim() -> None:
    m = Scalar()
    dp = DataParallel(m, ["cpu"])
    x = torch.randn(5, 3)
    assert dp(x).shape == m(x).shape == ()
    close(dp(x), m(x), terms=15)  # a sum of 5 x 3 products
    out = dp.loss(x)
    assert out["loss"].shape == () and out["y"].shape == (5, 3)


def test_an_input_with_no_batch_dim_keeps_0_dim_outputs_0_dim() -> None:
    m = Scalar()
    dp = DataParallel(m, CPU3)
    dpmethods.vocab.warn_once.reset()
    with pytest.warns(UserWarning, match=r"Scalar\.forward: nothing in this call was split along dim 0"):
        assert dp(3.0).shape == m(3.0).shape == ()
    assert dp(torch.tensor(3.0)).shape == ()
    assert torch.equal(dp(torch.tensor(3.0)), m(torch.tensor(3.0)))


# --- subclasses that forward *args/**kwargs -------------------------------------


def test_a_subclass_with_star_args_init_works() -> None:
    class Sub(DataParallel):
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            self.note = "sub"

    ref = Weighted()
    dp = Sub(copy.deepcopy(ref), device_ids=CPU3)
    x = torch.randn(5, 4)
    assert dp.note == "sub" and isinstance(dp, Sub)
    close(dp.f(x, [2.0]), ref.f(x, [2.0]), terms=WEIGHTED_TERMS)
    dp2 = Sub(module=copy.deepcopy(ref), device_ids=CPU3, methods=["forward"])
    assert "f" in type(dp2).__dict__
    with pytest.raises(TypeError, match="module: expected an nn.Module, got int"):
        Sub(3, CPU3)


# --- memory -----------------------------------------------------------------------


def test_wrapped_module_classes_are_not_kept_alive_by_the_class_cache() -> None:
    def make() -> tuple[weakref.ref[type], weakref.ref[type]]:
        class Local(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin = nn.Linear(2, 2)

            @parallel_method
            def f(self, x: torch.Tensor) -> torch.Tensor:
                return super().__getattr__("lin")(x)  # a `super()` cell refers to Local

        dp = DataParallel(Local(), CPU3)
        dp.f(torch.randn(4, 2))
        return weakref.ref(Local), weakref.ref(type(dp))

    local, wrapper = make()
    gc.collect()
    assert local() is None and wrapper() is None


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc/self/statm")
@pytest.mark.parametrize("leaf_bytes", [1024, 9600])
def test_keeping_a_few_outputs_of_every_call_keeps_about_their_bytes(leaf_bytes: int) -> None:
    # Each call gathers ~1 MB of small leaves and about 19 KB of them are kept, 300 times.
    # Before: every kept output held its call's whole shared block (~280 MiB in all).
    n_leaves = (1 << 20) // leaf_bytes
    keep = -(-19 * 1024 // leaf_bytes)
    half = leaf_bytes // 8  # float32 elements per replica piece
    pieces = [torch.randn(half) for _ in range(2 * n_leaves)]
    outs = [pieces[:n_leaves], pieces[n_leaves:]]
    kept: list[torch.Tensor] = []
    gc.collect()
    before = _rss()
    for _ in range(300):
        kept += dpmethods.gather(outs, "cpu")[:keep]
    gc.collect()
    kept_bytes = sum(t.numel() * t.element_size() for t in kept)
    grown = _rss() - before
    assert kept_bytes >= 300 * 19 * 1000
    assert grown < 3 * kept_bytes + (16 << 20), (grown / 2**20, kept_bytes / 2**20)


# --- clear errors and torch's behaviour -------------------------------------------


def test_option_type_errors_name_the_argument_and_value() -> None:
    class M(nn.Module):
        def f(self, x: torch.Tensor) -> torch.Tensor:
            return x

    with pytest.raises(TypeError, match=r"broadcast: expected an argument name or a tuple of names \(str\), got int 5"):
        parallel_method(broadcast=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="methods: expected a list of method names or a dict of options per name, got int 123"):
        DataParallel(M(), CPU3, methods=123)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"broadcast: expected an argument name or a tuple of names \(str\), got NoneType None"):
        DataParallel(M(), CPU3, methods={"f": {"broadcast": None}})
    with pytest.raises(ValueError, match="dim: expected an int that fits in 64 bits, got 1180591620717411303424"):
        DataParallel(M(), CPU3, dim=2**70)
    with pytest.raises(ValueError, match="gather: dim: expected an int that fits in 64 bits, got 1180591620717411303424"):
        dpmethods.gather([torch.ones(2), torch.ones(1)], "cpu", dim=2**70)
    with pytest.raises(TypeError, match="cache_replicas: expected a bool, got str 'no'"):
        DataParallel(M(), CPU3, cache_replicas="no")  # type: ignore[arg-type]


def test_a_negative_dim_on_low_rank_inputs_names_the_argument_and_shape() -> None:
    class M(nn.Module):
        @parallel_method(dim=-3)
        def f(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return x

    dp = DataParallel(M(), CPU3)
    with pytest.raises(ValueError, match=r"scatter: dim: argument 'y' has shape \[4, 2\], which has no dim -3 to split; expected at least 3 dims"):
        dp.f(torch.ones(2, 4, 2), torch.ones(4, 2))
    with pytest.raises(ValueError, match=r"argument 'x' has shape \[4\], which has no dim -3"):
        dp.f(torch.ones(4), y=torch.ones(2, 4, 2))
    x = torch.randn(3, 5, 2)  # a negative dim that exists splits as torch would
    assert torch.equal(dp.f(x, x), x)


def test_setting_dim_after_construction_is_honoured_like_torch() -> None:
    class T(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    dp = DataParallel(T(), CPU3)
    seen: list[tuple[int, ...]] = []
    dp.module.register_forward_pre_hook(lambda m, a: seen.append(tuple(a[0].shape)))
    x = torch.randn(2, 6)
    dp.dim = 1
    assert torch.equal(dp(x), x * 2)
    assert sorted(seen) == [(2, 2)] * 3  # split along dim 1, as torch.nn.DataParallel does
    dp.dim = "x"  # type: ignore[assignment]
    with pytest.raises(TypeError, match="dim: expected an int, got str 'x'"):
        dp(x)


def test_a_reraised_exception_object_gets_one_note() -> None:
    boom = KeyError("same object every call")

    class Fail(nn.Module):
        @parallel_method
        def f(self, x: torch.Tensor) -> torch.Tensor:
            if x[0, 0] > 0:
                raise boom
            return x

    dp = DataParallel(Fail(), CPU3)
    x = torch.tensor([[-1.0], [1.0], [-1.0]])
    for _ in range(3):
        with pytest.raises(KeyError):
            dp.f(x)
    notes = [n for n in getattr(boom, "__notes__", []) if n.startswith("dpmethods")]
    assert notes == ["dpmethods: raised in replica 1 on device cpu"]


def test_channels_last_outputs_stay_channels_last_as_with_torch_cat() -> None:
    class Conv(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            y = self.conv(x)
            return {"y": y, "score": y.mean((1, 2, 3))}

    ref = Conv().to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    dp = DataParallel(copy.deepcopy(ref), CPU3)
    x = torch.randn(5, 3, 6, 6).contiguous(memory_format=torch.channels_last)
    want = ref(x)["y"]
    got = dp(x)["y"]
    assert want.is_contiguous(memory_format=torch.channels_last)
    assert got.is_contiguous(memory_format=torch.channels_last) and not got.is_contiguous()
    close(got, want, terms=28)  # 3 channels x 3 x 3, and a bias
    pieces = [want[:2], want[2:]]
    assert torch.cat(pieces).is_contiguous(memory_format=torch.channels_last)
    assert dpmethods.gather(pieces, "cpu").stride() == torch.cat(pieces).stride()


def test_a_missing_output_gpu_fails_at_construction() -> None:
    count = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"output_device: expected a CUDA device index below {count} \(torch.cuda.device_count\(\)\), got 'cuda:{count + 3}'"):
        DataParallel(Weighted(), CPU3, output_device=f"cuda:{count + 3}")
    with pytest.raises(TypeError, match=r"output_device: expected an int, str or torch.device, got list \[0\]"):
        DataParallel(Weighted(), CPU3, output_device=[0])  # type: ignore[arg-type]


def test_numbered_cpu_devices_are_the_cpu() -> None:
    ref = Weighted()
    dp = DataParallel(copy.deepcopy(ref), device_ids=["cpu:0", "cpu:1"], output_device="cpu:0")
    assert dp.device_ids == [torch.device("cpu")] * 2
    x = torch.randn(5, 4)
    close(dp.f(x, [2.0]), ref.f(x, [2.0]), terms=WEIGHTED_TERMS)
