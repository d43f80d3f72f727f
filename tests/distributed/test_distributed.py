"""DistributedDataParallel, FSDP2 and route(): parallel methods that go through the wrapper.

The distributed checks run in spawned gloo process groups on 127.0.0.1. Spawning is
slow, so each spawned run does many checks and saves per-rank results, and the
tests below only compare them. Every run is bounded three ways: the process group's
``timeout``, the join deadline of the spawn context, and pytest-timeout.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpmethods.distributed import (
    DistributedDataParallel,
    fully_shard,
    register_fsdp_methods,
    route,
)
from dpmethods.state_dicts import unwrap
from dpmethods.testing import assert_close_to_reference as close
from dpmethods.wrapper.registry import parallel_method
from tests.helpers.processes import GLOO_PRELOAD

REPO = Path(__file__).resolve().parents[2]
_PG_TIMEOUT_S = 30  # a rank blocked on a dead peer gives up after this
_JOIN_TIMEOUT_S = 150  # the whole spawned run, start-up included


needs_gloo = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is not available in this build",
)


# ----------------------------------------------------------------------------- models


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)
        self.aux = nn.Linear(8, 1)
        self.register_buffer("scale", torch.ones(()))
        self.width = 8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        return self.head(h) + 0.5 * self.aux(h)

    @parallel_method
    def training_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # Calls self(x): the redirection must hand back the real forward first.
        return F.mse_loss(self(x) * self.scale, y)

    @parallel_method
    def partial_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # Leaves self.aux unused: needs find_unused_parameters=True.
        return F.mse_loss(self.head(torch.tanh(self.trunk(x))), y)

    def plain_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self(x), y)

    @parallel_method
    def failing_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if torch.distributed.get_rank() == 1:
            raise ValueError("rank 1 failed on purpose")
        return self.training_step(x, y)


_GLOBAL_BATCH = 12  # divisible by 2 and 3, and by 2 micro-batches on 2 ranks
_STEPS = 3
_LR = 0.1
# Per step: the forward (Linear(4, 8), then the two Linear(8, 1) heads) and back, the
# loss's mean over the global batch; the parameters sum _STEPS such updates.
_TRAIN_TERMS = _STEPS * (2 * (5 + 9 + 9) + _GLOBAL_BATCH)


def _make_net() -> _Net:
    torch.manual_seed(0)
    return _Net()


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(_GLOBAL_BATCH, 4, generator=g), torch.randn(_GLOBAL_BATCH, 1, generator=g)


def _shard(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _data(step)
    return x.chunk(world)[rank], y.chunk(world)[rank]


def _params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def _reference(method: str, steps: int = _STEPS) -> dict[str, torch.Tensor]:
    """One process, the full global batch: what DDP's averaging must reproduce."""
    net = _make_net()
    opt = torch.optim.SGD(net.parameters(), lr=_LR)
    for step in range(steps):
        opt.zero_grad()
        getattr(net, method)(*_data(step)).backward()
        opt.step()
    return _params(net)


def _train(
    call: Callable[..., torch.Tensor], module: nn.Module, rank: int, world: int, steps: int = _STEPS
) -> dict[str, torch.Tensor]:
    opt = torch.optim.SGD(module.parameters(), lr=_LR)
    for step in range(steps):
        opt.zero_grad()
        call(*_shard(step, rank, world)).backward()
        opt.step()
    return _params(module)


# ---------------------------------------------------------------- spawned suites


def _suite_train(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    net = _make_net()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp = DistributedDataParallel(net)
    out["init_warnings"] = [str(w.message) for w in caught]
    out["decorated"] = _train(ddp.training_step, net, rank, world)
    out["forward_restored"] = "forward" not in net.__dict__

    net = _make_net()
    ddp = DistributedDataParallel(net)
    out["bypass"] = _train(ddp.module.training_step, net, rank, world)
    return out


def _suite_features(rank: int, world: int) -> dict[str, Any]:
    out = _suite_train(rank, world)

    # no_sync: accumulate two micro-batches, all-reduce on the second.
    net = _make_net()
    ddp = DistributedDataParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=_LR)
    for step in range(_STEPS):
        opt.zero_grad()
        x, y = _shard(step, rank, world)
        (x1, x2), (y1, y2) = x.chunk(2), y.chunk(2)
        with ddp.no_sync():
            (ddp.training_step(x1, y1) / 2).backward()
        if step == 0:
            grad = net.head.weight.grad
            assert grad is not None
            out["no_sync_local_grad"] = grad.detach().clone()
        (ddp.training_step(x2, y2) / 2).backward()
        opt.step()
    out["no_sync"] = _params(net)

    # find_unused_parameters with a method that leaves self.aux out.
    net = _make_net()
    ddp = DistributedDataParallel(net, find_unused_parameters=True)
    out["unused"] = _train(ddp.partial_step, net, rank, world)

    net = _make_net()
    ddp = DistributedDataParallel(net, static_graph=True)
    out["static"] = _train(ddp.training_step, net, rank, world)

    # Buffers are broadcast from rank 0 before the method runs, as before forward.
    net = _make_net()
    ddp = DistributedDataParallel(net)
    scale = net.get_buffer("scale")
    scale.fill_(1.0 + rank)
    with torch.no_grad():
        ddp.module.training_step(*_shard(0, rank, world))
        out["scale_bypass"] = scale.item()
        ddp.training_step(*_shard(0, rank, world))
        out["scale_routed"] = scale.item()

    # join: rank r has 2 + r batches; the joined rank shadows the all-reduces.
    net = _make_net()
    ddp = DistributedDataParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=_LR)
    with ddp.join():
        for step in range(2 + rank):
            opt.zero_grad()
            ddp.training_step(*_shard(step, rank, world)).backward()
            opt.step()
    out["join"] = _params(net)

    # route() over torch's own DDP class.
    net = _make_net()
    tddp = torch.nn.parallel.DistributedDataParallel(net)
    out["route_torch_ddp"] = _train(route(tddp).training_step, net, rank, world)

    # An undecorated method warns once, at its first call with gradients (without
    # them it has none to all-reduce); methods= makes it a parallel method.
    net = _make_net()
    ddp = DistributedDataParallel(net)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            ddp.plain_step(*_shard(0, rank, world))
        with torch.inference_mode():
            ddp.plain_step(*_shard(0, rank, world))
    out["undecorated_no_grad_warnings"] = [str(w.message) for w in caught]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp.plain_step(*_shard(0, rank, world))
        ddp.plain_step(*_shard(0, rank, world))
    out["undecorated_warnings"] = [str(w.message) for w in caught]
    out["width"] = ddp.width
    net = _make_net()
    ddp = DistributedDataParallel(net, methods=["plain_step"])
    out["methods_arg"] = _train(ddp.plain_step, net, rank, world)
    out["unwrap"] = unwrap(ddp) is net
    return out


def _suite_train_then_fail(rank: int, world: int, save: Callable[[dict[str, Any]], None]) -> None:
    save(_suite_train(rank, world))
    # Then rank 1 raises inside a parallel method while the others wait for its
    # gradients: the run must end with rank 1's error, not hang.
    net = _make_net()
    ddp = DistributedDataParallel(net)
    try:
        _train(ddp.failing_step, net, rank, world)
    except ValueError:
        if "forward" in net.__dict__:
            raise AssertionError("forward was not restored after the method raised") from None
        raise


class _FsdpLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 8) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight)

    @parallel_method
    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class _FsdpNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = _FsdpLayer()
        self.out = nn.Parameter(torch.randn(8, 1) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x) @ self.out

    @parallel_method
    def training_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # Reads parameters directly, outside any forward: they are only whole
        # (not DTensor shards) if the method was registered with FSDP.
        return F.mse_loss(torch.tanh(self.layer.linear(x)) @ self.out, y)


def _make_fsdp_net() -> _FsdpNet:
    torch.manual_seed(0)
    return _FsdpNet()


def _fsdp_reference() -> dict[str, torch.Tensor]:
    net = _make_fsdp_net()
    opt = torch.optim.SGD(net.parameters(), lr=_LR)
    for step in range(_STEPS):
        opt.zero_grad()
        net.training_step(*_data(step)).backward()
        opt.step()
    return _params(net)


def _suite_fsdp(rank: int, world: int) -> dict[str, Any]:
    """dpmethods' fully_shard on two ranks; a skip only where torch's own fully_shard
    cannot run on CPU with gloo (it fails alike on every rank, so no peer is left waiting),
    and dpmethods' errors as the run's result, which fails the FSDP test alone."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        mesh = init_device_mesh("cpu", (world,))
        torch_fully_shard(_make_fsdp_net(), mesh=mesh)
    except Exception as e:
        return {"fsdp_skip": f"torch's own FSDP2 fully_shard fails on CPU with gloo in torch "
                f"{torch.__version__}: {e!r}"}
    try:
        return _fsdp_run(mesh, rank, world)
    except Exception:
        return {"fsdp_skip": None, "fsdp_error": traceback.format_exc()}


def _fsdp_run(mesh: Any, rank: int, world: int) -> dict[str, Any]:
    net = _make_fsdp_net()
    fully_shard(net.layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    # fully_shard registered the method (an instance attribute); registering again
    # must not wrap it a second time.
    first = net.__dict__.get("training_step")
    out: dict[str, Any] = {"fsdp_skip": None, "fsdp_error": None, "registered": register_fsdp_methods(net)}
    out["registered_once"] = first is not None and net.__dict__.get("training_step") is first
    opt = torch.optim.SGD(net.parameters(), lr=_LR)
    for step in range(_STEPS):
        opt.zero_grad()
        net.training_step(*_shard(step, rank, world)).backward()
        opt.step()
    out["params"] = {
        k: v.full_tensor().detach().clone()  # type: ignore[attr-defined]
        for k, v in net.named_parameters()
    }
    return out


def _suite_world2(rank: int, world: int, save: Callable[[dict[str, Any]], None]) -> None:
    out = _suite_features(rank, world)
    out["fsdp"] = _suite_fsdp(rank, world)
    save(out)


_SUITES: dict[str, Callable[[int, int, Callable[[dict[str, Any]], None]], None]] = {
    "world2": _suite_world2,
    "world3": _suite_train_then_fail,
}


def _worker(rank: int, world: int, port: int, outdir: str, suite: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=_PG_TIMEOUT_S)
    )

    def save(results: dict[str, Any]) -> None:
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))

    try:
        _SUITES[suite](rank, world, save)
    except BaseException:
        # The first error the parent sees may be a peer's "connection closed"; keep
        # each rank's own so the report names the rank that failed first.
        Path(outdir, f"error{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(suite: str, world: int, tmp: Path) -> list[dict[str, Any]]:
    """Run ``suite`` on ``world`` ranks; the per-rank results it saved, or its error."""
    import multiprocessing

    import torch.multiprocessing as mp

    # A forkserver imports torch (and the torch._dynamo that DDP imports) once for all
    # runs instead of once per rank; that is most of a run's time on two cores.
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    if method == "forkserver":
        multiprocessing.get_context("forkserver").set_forkserver_preload(GLOO_PRELOAD)
    context = mp.start_processes(
        _worker,
        args=(world, _free_port(), str(tmp), suite),
        nprocs=world,
        join=False,
        start_method=method,
    )
    # join() raises as soon as one rank fails, and then terminates the others; it
    # returns False while some ranks are still running.
    deadline = time.monotonic() + _JOIN_TIMEOUT_S
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() < deadline:
            continue
        for p in context.processes:
            if p.is_alive():
                p.kill()
        pytest.fail(f"spawned run {suite!r} on {world} ranks did not finish in {_JOIN_TIMEOUT_S} s")
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    close(a, b, terms=_TRAIN_TERMS)


def _differs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Whether two runs' parameters differ by more than rounding. They must be the same
    parameters (names, shapes, dtypes): a mismatch there fails, it is not a difference."""
    assert a.keys() == b.keys()
    assert {k: (v.shape, v.dtype) for k, v in a.items()} == {k: (v.shape, v.dtype) for k, v in b.items()}
    try:
        close(a, b, terms=_TRAIN_TERMS)
    except AssertionError:  # the structure matches: values differ
        return True
    return False


@pytest.fixture(scope="module")
def features(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available in this build")
    return _spawn("world2", 2, tmp_path_factory.mktemp("world2"))


@pytest.fixture(scope="module")
def world3(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], str]:
    """The 3-rank run: saved results, and the text of the error that ended it."""
    if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available in this build")
    from torch.multiprocessing import ProcessRaisedException

    tmp = tmp_path_factory.mktemp("world3")
    try:
        _spawn("world3", 3, tmp)
    except ProcessRaisedException as e:
        error = str(e) + "".join(p.read_text() for p in sorted(tmp.glob("error*.txt")))
    else:
        error = ""
    missing = [r for r in range(3) if not (tmp / f"rank{r}.pt").exists()]
    if missing:
        pytest.fail(f"ranks {missing} saved no results; the run ended with: {error}")
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(3)], error


# ------------------------------------------------------------------- DDP tests


@pytest.mark.distributed
@needs_gloo
@pytest.mark.timeout(180)
def test_three_ranks_match_single_process(world3: tuple[list[dict[str, Any]], str]) -> None:
    ranks, _ = world3
    ref = _reference("training_step")
    for r in ranks:
        _assert_same(r["decorated"], ref)
        assert r["init_warnings"] == []
    assert any(_differs(ranks[0]["bypass"], r["bypass"]) for r in ranks[1:])


@pytest.mark.distributed
@needs_gloo
@pytest.mark.timeout(180)
def test_two_ranks_match_single_process(features: list[dict[str, Any]]) -> None:
    ref = _reference("training_step")
    for r in features:
        _assert_same(r["decorated"], ref)
        assert r["forward_restored"]


# Each run of the two-rank suite that must equal one process training on the whole
# batch: the key its results are saved under, and how the reference trains.
_MATCHING = [
    pytest.param("static", lambda: _reference("training_step"), id="static_graph"),
    pytest.param("route_torch_ddp", lambda: _reference("training_step"), id="route_through_torch_ddp"),
    pytest.param("unused", lambda: _reference("partial_step"), id="find_unused_parameters"),
    pytest.param("join", lambda: _join_reference(2), id="join_with_uneven_inputs"),
]


@pytest.mark.distributed
@needs_gloo
@pytest.mark.parametrize(("key", "reference"), _MATCHING)
def test_two_rank_runs_match_single_process(
    features: list[dict[str, Any]], key: str, reference: Callable[[], dict[str, torch.Tensor]],
) -> None:
    ref = reference()
    for r in features:
        _assert_same(r[key], ref)


@pytest.mark.distributed
@needs_gloo
def test_an_unused_parameter_is_never_updated(features: list[dict[str, Any]]) -> None:
    for r in features:
        close(r["unused"]["aux.weight"], _params(_make_net())["aux.weight"], terms=0)


@pytest.mark.distributed
@needs_gloo
def test_module_method_bypasses_ddp_and_ranks_diverge(features: list[dict[str, Any]]) -> None:
    assert _differs(features[0]["bypass"], features[1]["bypass"])


@pytest.mark.distributed
@needs_gloo
def test_no_sync_accumulates_then_all_reduces(features: list[dict[str, Any]]) -> None:
    # Inside no_sync the gradients are still each rank's own...
    assert not torch.allclose(features[0]["no_sync_local_grad"], features[1]["no_sync_local_grad"])
    # ...and the synced step averages all four micro-batches.
    ref = _reference("training_step")
    for r in features:
        _assert_same(r["no_sync"], ref)


@pytest.mark.distributed
@needs_gloo
def test_buffers_broadcast_from_rank0(features: list[dict[str, Any]]) -> None:
    assert [r["scale_bypass"] for r in features] == [1.0, 2.0]
    assert [r["scale_routed"] for r in features] == [1.0, 1.0]


def _join_reference(world: int) -> dict[str, torch.Tensor]:
    # Joined ranks contribute zero gradients; DDP divides by the initial world size.
    net = _make_net()
    opt = torch.optim.SGD(net.parameters(), lr=_LR)
    for step in range(2 + world - 1):
        opt.zero_grad()
        active = [r for r in range(world) if step < 2 + r]
        losses = [net.training_step(*_shard(step, r, world)) for r in active]
        (torch.stack(losses).sum() / world).backward()
        opt.step()
    return _params(net)


@pytest.mark.distributed
@needs_gloo
@pytest.mark.timeout(180)
def test_undecorated_method_warns_once(features: list[dict[str, Any]]) -> None:
    for r in features:
        assert r["undecorated_no_grad_warnings"] == []  # no gradients: nothing to warn of
        assert len(r["undecorated_warnings"]) == 1
        message = r["undecorated_warnings"][0]
        assert "'plain_step'" in message
        assert "not all-reduced" in message
        assert "@dpmethods.parallel_method" in message
        assert "methods=['plain_step']" in message


@pytest.mark.distributed
@needs_gloo
def test_methods_argument_and_attribute_forwarding(features: list[dict[str, Any]]) -> None:
    ref = _reference("plain_step")
    for r in features:
        _assert_same(r["methods_arg"], ref)
        assert r["width"] == 8


@pytest.mark.distributed
@needs_gloo
def test_unwrap(features: list[dict[str, Any]]) -> None:
    assert all(r["unwrap"] for r in features)


@pytest.mark.distributed
@needs_gloo
@pytest.mark.timeout(180)
def test_failing_rank_does_not_hang(world3: tuple[list[dict[str, Any]], str]) -> None:
    _, error = world3
    assert "ValueError: rank 1 failed on purpose" in error
    assert "forward was not restored" not in error


# ------------------------------------------------------------------------ FSDP2


@pytest.mark.distributed
@needs_gloo
def test_fsdp2_methods_match_single_process(features: list[dict[str, Any]]) -> None:
    if features[0]["fsdp"]["fsdp_skip"]:
        pytest.skip(features[0]["fsdp"]["fsdp_skip"])
    errors = [f"rank {r}: {f['fsdp']['fsdp_error']}" for r, f in enumerate(features) if f["fsdp"]["fsdp_error"]]
    assert not errors, "\n".join(errors)
    ref = _fsdp_reference()
    for r in features:
        assert r["fsdp"]["registered"] == ["training_step", "layer.linear"]
        assert r["fsdp"]["registered_once"]
        _assert_same(r["fsdp"]["params"], ref)


def test_register_fsdp_methods_errors() -> None:
    with pytest.raises(ValueError, match=r"expected a tree with modules sharded by fully_shard"):
        register_fsdp_methods(_Net())
    with pytest.raises(ValueError, match=r"must be sharded \(an FSDPModule\)"):
        register_fsdp_methods(_Net(), methods=["plain_step"])
    with pytest.raises(TypeError, match=r"module: expected an nn.Module, got int"):
        register_fsdp_methods(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"methods= applies to one module"):
        fully_shard([_Net(), _Net()], methods=["plain_step"])


def test_register_fsdp_methods_rejects_a_submodule_name() -> None:
    import torch.distributed as dist

    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("this torch has no FSDP2 fully_shard")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        net = _Net()
        fsdp.fully_shard(net)
        with pytest.raises(ValueError, match=r"methods: 'head' is a submodule of _Net, not a method; FSDP2 runs "
                           r"methods only\. Shard it too \(fully_shard\(module\.head\)\)"):
            register_fsdp_methods(net, methods=["head"])
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ route, local


class _Toy(nn.Module):
    """A forward-only wrapper, as Accelerate's and DeepSpeed's are."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.calls = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.module(*args, **kwargs)


class _Ignores(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return torch.zeros(())


class _Raises(_Toy):
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("wrapper broke")


def test_route_calls_the_method_through_the_wrapper() -> None:
    net = _make_net()
    toy = _Toy(net)
    x, y = _data(0)
    routed = route(toy)
    assert routed.training_step.__name__ == "training_step"
    terms = 5 + 9 + 9 + len(x)  # the forward, then the loss's mean over the rows
    close(routed.training_step(x, y), net.training_step(x, y), terms=terms)
    assert toy.calls == 1
    # training_step calls self(x), which must be the real forward (no recursion).
    close(routed.plain_step(x, y=y), F.mse_loss(net(x), y), terms=terms)
    assert toy.calls == 2
    assert "forward" not in net.__dict__
    assert route(toy).forward(x).shape == (12, 1)


def test_route_restores_forward_on_errors() -> None:
    net = _make_net()
    with pytest.raises(RuntimeError, match="wrapper broke"):
        route(_Raises(net)).training_step(*_data(0))
    assert "forward" not in net.__dict__

    def patched(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(x.shape[0], 1)

    net.forward = patched  # type: ignore[method-assign]
    with pytest.raises(TypeError):
        route(_Toy(net)).training_step(torch.ones(2, 4))  # y missing
    assert net.__dict__["forward"] is patched


def test_route_errors() -> None:
    net = _make_net()
    with pytest.raises(RuntimeError, match=r"expected the wrapper's forward to call the forward"):
        route(_Ignores(net)).training_step(*_data(0))
    assert "forward" not in net.__dict__
    with pytest.raises(TypeError, match=r"function has none; pass module= explicitly"):
        route(lambda x: x)  # a module without .module routes through itself (test_compiled)
    with pytest.raises(TypeError, match=r"module: expected an nn.Module, got int"):
        route(_Toy(net), module=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"wrapper: expected a callable module, got int"):
        route(3)  # type: ignore[arg-type]
    with pytest.raises(AttributeError, match=r"expected a method of the wrapped _Net, got int"):
        _ = route(_Toy(net)).width
    with pytest.raises(AttributeError, match=r"_Net has no attribute 'nope'"):
        _ = route(_Toy(net)).nope
    with pytest.raises(AttributeError, match=r"route\(\.\.\.\) objects are read-only"):
        route(_Toy(net)).training_step = None
    assert route(_Ignores(net), module=net.trunk).forward(torch.ones(1, 4)).shape == ()


# ----------------------------------------------------------------- the example


@pytest.mark.distributed
@needs_gloo
@pytest.mark.timeout(150)
def test_example_ddp_train_under_torchrun() -> None:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    env["OMP_NUM_THREADS"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path here, even on a GPU machine
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={_free_port()}",
        str(REPO / "examples" / "ddp_train.py"),
        "--steps",
        "3",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sums = re.findall(r"rank (\d) world \d+ checksum (-?\d+\.\d{10})", proc.stdout)
    assert sorted(rank for rank, _ in sums) == ["0", "1"], proc.stdout
    assert len({value for _, value in sums}) == 1, proc.stdout
    assert proc.stdout.count("step ") >= 3, proc.stdout
