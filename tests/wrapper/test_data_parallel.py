"""dpmethods.DataParallel on CPU devices, compared with a single-device reference."""

from __future__ import annotations

import copy
import gc
import inspect
import pickle
import threading
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpmethods
from dpmethods import DataParallel, parallel_method
from dpmethods.testing import assert_close_to_reference
from tests.helpers.long_runs import Faulty, rows_run
from tests.helpers.terms import mlp_terms

CPU4 = ["cpu"] * 4


@dataclass
class Encoded:
    mu: torch.Tensor
    logvar: torch.Tensor
    note: str = "vae"


class VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 6)
        self.dec = nn.Linear(3, 8)
        self.config = {"latent": 3}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x).mu)

    @parallel_method
    def encode(self, x: torch.Tensor) -> Encoded:
        """Encode x into a Gaussian."""
        h = self.enc(x)
        return Encoded(h[:, :3], h[:, 3:])

    @parallel_method
    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.dec(z))

    @parallel_method(gather={"loss": "mean"})
    def training_step(self, x: torch.Tensor, beta: float = 1.0) -> dict[str, Any]:
        enc = self.encode(x)
        recon = self.decode(enc.mu)
        rec = F.mse_loss(recon, x, reduction="none").mean(1)
        kl = -0.5 * (1 + enc.logvar - enc.mu**2 - enc.logvar.exp()).mean(1)
        per_item = rec + beta * kl
        return {"loss": per_item.mean(), "per_item": per_item}

    @parallel_method(broadcast=("mask", "rest", "extra"))
    def masked(self, x: torch.Tensor, mask: torch.Tensor, *rest: torch.Tensor, scale: float = 2.0,
               **extra: torch.Tensor) -> torch.Tensor:
        out = self.enc(x) * mask * scale
        for r in rest:
            out = out + r.sum()
        for e in extra.values():
            out = out + e.sum()
        return out

    def helper(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


# encode: Linear(8, 6); decode: Linear(3, 8), through a sigmoid.
VAE_TERMS = mlp_terms(8, 3)


def _ref_and_dp(devices: list[Any] = CPU4, **kwargs: Any) -> tuple[VAE, VAE, DataParallel]:
    ref = VAE()
    model = copy.deepcopy(ref)
    return ref, model, DataParallel(model, device_ids=devices, **kwargs)


# --- drop-in replacement ---------------------------------------------------------------


def test_is_a_torch_dataparallel_with_its_attributes() -> None:
    ref, model, dp = _ref_and_dp()
    assert isinstance(dp, nn.DataParallel) and isinstance(dp, DataParallel)
    assert dp.module is model
    assert dp.device_ids == [torch.device("cpu")] * 4
    assert list(dp.state_dict()) == ["module." + k for k in model.state_dict()]
    x = torch.randn(9, 8)
    assert_close_to_reference(dp(x), ref(x), terms=VAE_TERMS)
    assert "DataParallel" in repr(dp)


def test_torch_dataparallel_lacks_the_method_ours_has_it() -> None:
    with pytest.raises(AttributeError, match="'DataParallel' object has no attribute 'encode'"):
        nn.DataParallel(VAE()).encode  # noqa: B018
    dp = DataParallel(VAE(), device_ids=CPU4)
    assert "encode" in type(dp).__dict__


def test_method_signature_help_and_dir_show_the_models_method() -> None:
    _, _, dp = _ref_and_dp()
    assert inspect.signature(dp.encode) == inspect.signature(VAE().encode)
    assert list(inspect.signature(dp.masked).parameters) == ["x", "mask", "rest", "scale", "extra"]
    assert dp.encode.__doc__ == "Encode x into a Gaussian."
    assert "Encode x into a Gaussian." in __import__("pydoc").render_doc(dp.encode)
    names = dir(dp)
    for name in ["encode", "decode", "training_step", "helper", "config", "module"]:
        assert name in names


def test_attributes_and_undecorated_methods_forward_with_one_warning() -> None:
    _, _, dp = _ref_and_dp()
    assert dp.config == {"latent": 3}
    x = torch.randn(3, 8)
    with pytest.warns(UserWarning, match=r"VAE.helper is not a parallel method, so it runs on cpu only.*methods=\['helper'\]"):
        assert torch.equal(dp.helper(x), x + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dp.helper(x)  # once only
    with pytest.raises(AttributeError, match=r"^'DataParallel' object has no attribute 'nope', and neither has the "
                       r"wrapped VAE\. The parallel methods of VAE are \['decode', 'encode', 'masked', 'training_step'\]\.$"):
        dp.nope  # noqa: B018
    with pytest.raises(AttributeError, match=r"^'DataParallel' object has no attribute 'encod', and neither has the "
                       r"wrapped VAE: did you mean 'encode'\? The parallel methods of VAE are \['decode', "):
        dp.encod  # noqa: B018
    with pytest.raises(AttributeError, match=r"wrapped Linear: did you mean 'weight'\? Linear has no parallel "
                       r"methods besides forward\.$"):
        DataParallel(nn.Linear(2, 2), device_ids=["cpu"] * 2).wieght  # noqa: B018


def test_child_module_named_in_methods_runs_on_every_replica_and_unnamed_warns() -> None:
    model = SmallCNN()
    x = torch.randn(7, 3, 8, 8)
    calls: list[int] = []
    hook = model.conv1.register_forward_hook(lambda m, a, out: calls.append(out.shape[0]))
    dp = DataParallel(model, device_ids=["cpu"] * 3, methods=["conv1"])
    got = dp.conv1(x)
    assert sorted(calls) == [2, 2, 3]  # each replica's copy ran on its share, hooks included
    hook.remove()
    assert_close_to_reference(got, model.conv1(x), terms=28)  # 3 channels x 3 x 3, and a bias
    got.sum().backward()  # gradients reach the module's own parameters
    assert model.conv1.weight.grad is not None
    assert dp.conv1.__doc__ == "Call the wrapped module's child ``conv1`` on every replica."
    assert dp.module.conv1 is model.conv1
    # Not named: the submodule is returned as it is, with a warning that calling it
    # runs on one device (the silent `dp.module.encode(x)` trap, reached through dp).
    plain = DataParallel(model, device_ids=["cpu"] * 3)
    with pytest.warns(UserWarning, match=r"DataParallel: conv2 is a submodule of the wrapped SmallCNN, returned "
                      r"as it is, so calling it runs on cpu only\. Pass methods=\['conv2'\]"):
        assert plain.conv2 is model.conv2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain.conv2  # noqa: B018 (once only)
        DataParallel(model, device_ids=["cpu"]).conv2  # noqa: B018 (one device: nothing to say)
    with pytest.raises(AttributeError, match="methods: SmallCNN has no method or submodule 'conv9'"):
        DataParallel(model, device_ids=["cpu"] * 3, methods=["conv9"])
    for clone in (copy.deepcopy(dp), pickle.loads(pickle.dumps(dp))):
        assert_close_to_reference(clone.conv1(x), clone.module.conv1(x), terms=28)


def test_protocol_methods_of_the_module_are_not_forwarded() -> None:
    class Copyable(VAE):
        def __deepcopy__(self, memo: dict[int, Any]) -> VAE:
            return VAE()

    dp = DataParallel(Copyable(), device_ids=CPU4)
    assert isinstance(copy.deepcopy(dp), DataParallel)
    assert not hasattr(dp, "__deepcopy__")


def test_copy_and_pickle_keep_the_methods() -> None:
    _, _, dp = _ref_and_dp()
    x = torch.randn(5, 8)
    for clone in (copy.deepcopy(dp), pickle.loads(pickle.dumps(dp))):
        assert_close_to_reference(clone.encode(x).mu, dp.encode(x).mu, terms=VAE_TERMS)


# --- same results as one device ---------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 2, 3, 5, 8, 13])
def test_outputs_equal_single_device(batch: int) -> None:
    ref, _, dp = _ref_and_dp()
    x = torch.randn(batch, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # small batches warn; tested below
        enc, enc_ref = dp.encode(x), ref.encode(x)
        assert isinstance(enc, Encoded) and enc.note == "vae"
        assert_close_to_reference((enc.mu, enc.logvar), (enc_ref.mu, enc_ref.logvar), terms=VAE_TERMS)
        z = torch.randn(batch, 3)
        assert_close_to_reference(dp.decode(z), ref.decode(z), terms=VAE_TERMS)


@pytest.mark.parametrize("batch", [4, 7, 10])
def test_gradients_equal_single_device_with_uneven_chunks(batch: int) -> None:
    ref, model, dp = _ref_and_dp()
    x = torch.randn(batch, 8)
    out, out_ref = dp.training_step(x, beta=0.5), ref.training_step(x, beta=0.5)
    # per item: means over 8 and 3 values; the loss: a weighted mean over the rows.
    assert_close_to_reference(out, out_ref, terms=VAE_TERMS + 8 + batch)
    out["loss"].backward()
    out_ref["loss"].backward()
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None, name
        # back through both layers, summed over the rows
        assert_close_to_reference(p.grad, p_ref.grad, terms=2 * VAE_TERMS + 8 + batch, msg=name)


def test_binding_positional_keyword_defaults_star_args_and_kwargs() -> None:
    ref, _, dp = _ref_and_dp()
    x, mask = torch.randn(6, 8), torch.randn(6)
    r1, r2, e = torch.randn(3), torch.randn(4), torch.randn(5)
    terms = mlp_terms(8) + 2 + 5  # Linear(8, 6), then the sums of at most 5 values
    assert_close_to_reference(dp.masked(x, mask), ref.masked(x, mask), terms=terms)
    assert_close_to_reference(dp.masked(x, mask, r1, r2, scale=3.0, table=e),
                              ref.masked(x, mask, r1, r2, scale=3.0, table=e), terms=terms)
    assert_close_to_reference(dp.masked(x=x, mask=mask, a=e, b=r1), ref.masked(x=x, mask=mask, a=e, b=r1), terms=terms)


def test_broadcast_names_are_checked_against_the_signature() -> None:
    class Net(nn.Module):
        @parallel_method(broadcast=("maks",))
        def f(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return x

    with pytest.raises(ValueError, match=r"broadcast: \['maks'\] are not arguments of Net.f; its arguments are \['x', 'mask'\]"):
        DataParallel(Net(), device_ids=CPU4)


def test_small_batch_runs_fewer_replicas_and_warns_once() -> None:
    calls: list[int] = []

    class Count(nn.Module):
        @parallel_method
        def f(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(x.shape[0])
            return x

    dp = DataParallel(Count(), device_ids=CPU4)
    with pytest.warns(UserWarning, match="a batch of 2 items on 4 devices: only 2 replicas run"):
        dp.f(torch.randn(2, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dp.f(torch.randn(2, 1))
        calls.clear()
        dp.f(torch.randn(9, 1))
    assert sorted(calls) == [2, 2, 2, 3]


@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_an_empty_batch_runs_once_as_on_one_device(tmp_path: Path, workers: str) -> None:
    model = Faulty(tmp_path, limit=2)
    empty = torch.randn(0, 6)
    calls = [("forward", (empty,)), ("encode", (empty,)), ("label", (empty, []))]
    dp = DataParallel(model, device_ids=["cpu"] * 2, workers=workers)
    one = DataParallel(model, device_ids=["cpu"], workers=workers, on_oom="split")
    with torch.no_grad():
        want = [model.unlimited(m, *a) for m, a in calls]
        (tmp_path / "rows").unlink()
        got = [dp(*a) if m == "forward" else getattr(dp, m)(*a) for m, a in calls]
        assert rows_run(tmp_path) == [(0, False)] * 3  # each call ran once, on one replica
        mapped = list(dp.map("encode", [empty, torch.randn(2, 6), empty]))
        # A map that ran out of memory cuts larger batches up front; an empty one runs whole.
        split = list(one.map("encode", [torch.randn(3, 6), empty], on_oom="split"))
    dp.close()
    one.close()
    assert_close_to_reference(got, want, terms=mlp_terms(6))
    for out in (got[1], mapped[0], mapped[2], split[1]):
        assert out["y"].shape == (0, 3) and out["norm"].shape == (0,)


# --- threads, modes, errors -------------------------------------------------------------


def test_grad_mode_and_no_grad_replicas_are_detached() -> None:
    seen: list[bool] = []

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        @parallel_method
        def f(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(torch.is_grad_enabled() or self.lin.weight.requires_grad)
            return self.lin(x)

    dp = DataParallel(Probe(), device_ids=CPU4)
    with torch.no_grad():
        out = dp.f(torch.randn(8, 2))
    assert seen == [False] * 4 and not out.requires_grad
    seen.clear()
    assert dp.f(torch.randn(8, 2)).requires_grad and seen == [True] * 4
    with torch.inference_mode():
        assert dp.f(torch.randn(8, 2)).is_inference()


def test_autocast_is_carried_into_replica_threads() -> None:
    _, _, dp = _ref_and_dp()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = dp.decode(torch.randn(8, 3))
    assert out.dtype == torch.bfloat16


class Boom(nn.Module):
    @parallel_method
    def f(self, x: torch.Tensor) -> torch.Tensor:
        if x[0, 0] > 100:
            raise KeyError(f"bad item {int(x[0, 0])}")
        return x


def test_replica_exception_keeps_type_index_device_and_traceback() -> None:
    dp = DataParallel(Boom(), device_ids=CPU4)
    x = torch.zeros(8, 1)
    x[6] = 101  # replica 3 gets items 6 and 7
    before = set(threading.enumerate())
    with pytest.raises(KeyError, match="bad item 101") as info:
        dp.f(x)
    assert "dpmethods: raised in replica 3 on device cpu" in info.value.__notes__
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "f" in frames  # the original frame inside the replica
    assert set(threading.enumerate()) - before == set()  # every replica thread was joined


def test_no_reference_cycles_and_no_threads_after_calls() -> None:
    _, _, dp = _ref_and_dp()
    x = torch.randn(9, 8)
    dp.training_step(x)["loss"].backward()
    gc.collect()
    threads = set(threading.enumerate())
    gc.disable()
    try:
        for _ in range(3):
            dp.training_step(x)["loss"].backward()
            with torch.no_grad():
                dp.encode(x)
        found = gc.collect()
    finally:
        gc.enable()
    assert found == 0
    assert set(threading.enumerate()) - threads == set()


# --- devices ----------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without GPUs")
def test_no_device_ids_without_gpus_is_a_plain_call() -> None:
    ref, _, dp = _ref_and_dp(devices=None)  # type: ignore[arg-type]
    assert dp.device_ids == []
    x = torch.randn(4, 8)
    assert_close_to_reference((dp.encode(x).mu, dp(x)), (ref.encode(x).mu, ref(x)), terms=VAE_TERMS)


def test_device_id_errors() -> None:
    with pytest.raises(ValueError, match=r"device_ids: expected at least one device, got \[\]"):
        DataParallel(VAE(), device_ids=[])
    with pytest.raises(TypeError, match=r"device_ids\[1\]: expected an int, str or torch.device, got float"):
        DataParallel(VAE(), device_ids=["cpu", 1.5])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="device_ids: expected a list of devices, got str 'cpu'"):
        DataParallel(VAE(), device_ids="cpu")  # type: ignore[arg-type]
    count = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"output_device: expected a CUDA device index below {count}"):
        DataParallel(VAE(), device_ids=["cpu", "cpu"], output_device=count + 3)
    with pytest.raises(TypeError, match="module: expected an nn.Module, got int"):
        DataParallel(3)  # type: ignore[arg-type]


def test_single_cpu_device() -> None:
    ref, _, dp = _ref_and_dp(devices=["cpu"])
    x = torch.randn(5, 8)
    assert_close_to_reference(dp.encode(x).mu, ref.encode(x).mu, terms=VAE_TERMS)


# --- helpers ----------------------------------------------------------------------------


def test_unwrap_ours_and_torchs() -> None:
    m = VAE()
    assert dpmethods.unwrap(DataParallel(m, device_ids=CPU4)) is m
    assert dpmethods.unwrap(nn.DataParallel(m)) is m
    assert dpmethods.unwrap(m) is m


def test_state_dicts_move_between_wrapped_and_bare(tmp_path: Any) -> None:
    src = VAE()
    dp = DataParallel(VAE(), device_ids=CPU4)
    dp.load_state_dict(src.state_dict())  # bare into wrapped
    assert torch.equal(dp.module.enc.weight, src.enc.weight)
    bare = VAE()
    dpmethods.load_state_dict(bare, dp.state_dict())  # wrapped into bare
    assert torch.equal(bare.dec.weight, src.dec.weight)
    path = tmp_path / "ckpt.pt"
    torch.save(dp.state_dict(), path)
    other = DataParallel(VAE(), device_ids=CPU4)
    dpmethods.load_state_dict(other, path)
    assert torch.equal(other.module.dec.bias, src.dec.bias)
    torch.save({"w": object()}, tmp_path / "unsafe.pt")
    with pytest.raises(Exception, match="Weights only load failed"):
        dpmethods.load_state_dict(bare, tmp_path / "unsafe.pt")


def test_replicas_have_parameters_so_model_device_works() -> None:
    class UsesDevice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        @parallel_method
        def f(self, x: torch.Tensor) -> torch.Tensor:
            return x.to(next(self.parameters()).device) + 0

    dp = DataParallel(UsesDevice(), device_ids=CPU4)
    assert dp.f(torch.ones(4, 2)).shape == (4, 2)


# --- a real-size model ------------------------------------------------------------------


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.norm(self.conv1(x)))
        h = F.max_pool2d(h, 2)
        h = F.relu(self.conv2(h)).mean((2, 3))
        return self.head(h)

    @parallel_method(gather={"loss": "mean", "correct": "sum"})
    def training_step(self, images: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self(images)
        return {"loss": F.cross_entropy(logits, labels), "correct": (logits.argmax(1) == labels).sum()}


def test_cnn_trained_through_training_step_matches_single_device() -> None:
    ref = SmallCNN().double()
    model = copy.deepcopy(ref)
    dp = DataParallel(model, device_ids=["cpu"] * 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        images = torch.randn(10 + step, 3, 8, 8, dtype=torch.float64)
        labels = torch.randint(0, 10, (10 + step,))
        for net, optim in ((dp, opt), (ref, opt_ref)):
            optim.zero_grad()
            out = net.training_step(images, labels)
            out["loss"].backward()
            optim.step()
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        # float64; per step, back through conv1 (27 + 1), the GroupNorm's 4 x 64 values,
        # conv2 (72 + 1), the mean over 16 positions, the head (16 + 1) and the softmax
        # of 10, then the weight gradients' sums over up to 13 images x 64 positions.
        assert_close_to_reference(p, p_ref, terms=4 * (2 * (28 + 256 + 73 + 16 + 17 + 10) + 13 * 64), msg=name)
    assert not torch.equal(model.head.weight, SmallCNN().double().head.weight)


# --- threads kept with cached replicas ---------------------------------------------------


def _kept_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("dpmethods-replica-thread-")]


def test_cached_replicas_keep_threads_until_the_wrapper_goes() -> None:
    ref, _, dp = _ref_and_dp(cache_replicas=True)
    x = torch.randn(9, 8)
    with torch.no_grad():
        for _ in range(3):
            assert_close_to_reference(dp.encode(x).mu, ref.encode(x).mu, terms=VAE_TERMS)
    kept = _kept_threads()
    assert len(kept) == 3  # replica 0 runs in the caller
    x[5] = float("nan")
    with torch.no_grad():
        assert torch.isnan(dp.encode(x).mu[5]).all()  # the kept threads still serve after many calls
    del dp
    gc.collect()
    for t in kept:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in kept)


def test_worker_pool_errors_and_reentry() -> None:
    dp = DataParallel(Boom(), device_ids=CPU4, cache_replicas=True)
    x = torch.zeros(8, 1)
    x[2] = 101
    with torch.no_grad(), pytest.raises(KeyError, match="bad item 101") as info:
        dp.f(x)
    assert "dpmethods: raised in replica 1 on device cpu" in info.value.__notes__
    with torch.no_grad():
        assert torch.equal(dp.f(torch.ones(8, 1)), torch.ones(8, 1))  # the pool survived

    class Outer(nn.Module):
        def __init__(self, inner: DataParallel) -> None:
            super().__init__()
            self.inner = [inner]  # not a submodule: a second wrapper used from replicas

        @parallel_method
        def f(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner[0].f(x)

    outer = DataParallel(Outer(dp), device_ids=["cpu"] * 2, cache_replicas=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the inner batches are smaller than 4
        y = torch.randn(6, 1)
        assert torch.equal(outer.f(y), y)  # the busy inner pool falls back to fresh threads


class _Balanced(DataParallel):
    """The BalancedDataParallel pattern: an argument of its own before torch's."""

    def __init__(self, gpu0_bsz: int, *args: Any, **kwargs: Any) -> None:
        self.gpu0_bsz = gpu0_bsz
        super().__init__(*args, **kwargs)


class _Renamed(DataParallel):
    """Its own names for torch's arguments, and a keyword-only option."""

    def __init__(self, model: nn.Module, gpus: list[str], *, note: str = "") -> None:
        super().__init__(model, device_ids=gpus)
        self.note = note


class _Built(DataParallel):
    """Builds the module itself: no module argument at all."""

    def __init__(self, width: int) -> None:
        super().__init__(VAE(), ["cpu"] * 3)
        self.width = width


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda m: _Balanced(2, m, ["cpu"] * 3), id="own-arg-first"),
        pytest.param(lambda m: _Balanced(2, module=m, device_ids=["cpu"] * 3), id="own-arg-kw"),
        pytest.param(lambda m: _Renamed(m, ["cpu"] * 3, note="x"), id="renamed"),
    ],
)
def test_subclasses_with_their_own_constructor_arguments(make: Any) -> None:
    torch.manual_seed(0)
    ref = VAE()
    dp = make(copy.deepcopy(ref))
    x = torch.randn(5, 8)
    assert_close_to_reference(dp.encode(x).mu, ref.encode(x).mu, terms=VAE_TERMS)
    assert isinstance(dp, DataParallel) and "encode" in type(dp).__dict__
    dp2 = copy.deepcopy(dp)
    assert_close_to_reference(dp2.encode(x).logvar, ref.encode(x).logvar, terms=VAE_TERMS)
    built = _Built(4)
    assert built.width == 4 and built.encode(x).mu.shape == (5, 3)
    with pytest.raises(TypeError, match="module: expected an nn.Module, got int"):
        _Balanced(2, 3, ["cpu"] * 2)
