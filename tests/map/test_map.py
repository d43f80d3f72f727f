"""DataParallel.map: each batch whole on whichever replica is free, on CPU replicas.

Every map's outputs are compared with the one-device loop ``[model.method(b) for b in
batches]`` on random data. An autouse fixture checks after every test that no worker
thread of a map is left running.
"""

from __future__ import annotations

import gc
import os
import threading
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dpmethods
from dpmethods.streaming.scheduler import PREFETCH
from dpmethods.testing import assert_close_to_reference as close
from tests.helpers import WORKERS, counting
from tests.helpers.processes import (
    SHARD_BATCHES,
    build_net,
    shard_batches,
    shard_checkpointed,
    shard_maps,
    spawn_gloo,
    tiny_gpt2,
)

_REPO = Path(__file__).resolve().parents[2]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    @dpmethods.parallel_method
    def encode(self, x: torch.Tensor, mask: torch.Tensor | None = None, *, scale: float = 1.0) -> Any:
        if torch.isnan(x).any():
            raise ValueError("encode: a NaN batch")
        y = self.lin(x) * scale
        if mask is not None:
            y = y * mask[:, None]
        return {"y": y, "n": x.shape[0], "norm": y.norm(dim=1)}

    @dpmethods.parallel_method
    def wait_for(self, x: torch.Tensor, event: threading.Event | None = None) -> torch.Tensor:
        # A batch that blocks until the caller has seen later batches' outputs: it can
        # only finish if the other replicas did not wait for it.
        if event is not None and not event.wait(30):
            raise TimeoutError("wait_for: the other batches never came back")
        return self.lin(x)

    @dpmethods.parallel_method
    def noisy(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.rand(len(x), 3, device=x.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def _map_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("dpmethods-map-")]


@pytest.fixture(autouse=True)
def _no_threads_left() -> Iterator[None]:
    yield
    if _map_threads():  # collecting finds no thread that is not there: it runs only for those that are
        gc.collect()
    assert _map_threads() == [], "a map left worker threads running"


@pytest.fixture
def net() -> Net:
    return Net().eval()


def _batches(n: int = 9) -> list[torch.Tensor]:
    return [torch.randn(1 + (i * 5) % 7, 4) for i in range(n)]


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert a.device == b.device
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    else:
        assert a == b


@pytest.mark.parametrize("devices", [["cpu"] * 3, ["cpu"], None])
def test_ordered_outputs_equal_one_device_loop(net: Net, devices: list[str] | None) -> None:
    dp = dpmethods.DataParallel(net, device_ids=devices)
    batches = _batches()
    with torch.no_grad():
        ref = [net.encode(b, scale=2.0) for b in batches]
        outs = list(dp.map("encode", batches, scale=2.0))
    assert len(outs) == len(ref)
    for a, b in zip(outs, ref):
        _same(a, b)


def test_unordered_yields_every_index_once(net: Net) -> None:
    dp = dpmethods.DataParallel(net, device_ids=["cpu"] * 2, cache_replicas=True)
    batches = _batches(11)
    with torch.no_grad():
        ref = [net.encode(b) for b in batches]
        pairs = list(dp.map("encode", batches, ordered=False, prefetch=1))
    assert sorted(i for i, _ in pairs) == list(range(len(batches)))
    for i, out in pairs:
        _same(out, ref[i])


def test_forward_with_grad_and_hooks(net: Net) -> None:
    calls: list[int] = []
    net.register_forward_hook(lambda m, i, o: calls.append(1))
    dp = dpmethods.DataParallel(net, device_ids=["cpu"] * 2)
    batches = _batches(4)
    outs = list(dp.map("forward", batches))
    assert len(calls) == 4  # forward runs through __call__, so hooks run
    sum(o.sum() for o in outs).backward()  # type: ignore[union-attr]
    grad = net.lin.weight.grad
    assert grad is not None
    net.lin.weight.grad = None
    sum(net(b).sum() for b in batches).backward()  # type: ignore[union-attr]
    # Each batch's rows summed (13 in all), then the 4 batches' gradients summed.
    close(grad, net.lin.weight.grad, terms=13 + 4)


def test_a_slow_batch_does_not_hold_back_the_others(net: Net) -> None:
    # Batch 0 blocks until the caller has received batches 1..5: in lock step (every
    # replica waiting for every batch) this could never finish, nor if a batch queued
    # behind batch 0 on its replica stayed there while the other replica is free.
    dp = dpmethods.DataParallel(net, device_ids=["cpu"] * 2)
    event = threading.Event()
    batches = [(torch.randn(2, 4), event)] + [(torch.randn(2, 4), None) for _ in range(5)]
    seen: list[int] = []
    with torch.no_grad():
        for i, out in dp.map("wait_for", batches, ordered=False, prefetch=3):
            seen.append(i)
            close(out, net.lin(batches[i][0]), terms=5)  # Linear(4, 3)
            if len(seen) == 5:
                event.set()
    assert sorted(seen[:5]) == [1, 2, 3, 4, 5] and seen[5] == 0


def test_dataloader_batches(net: Net) -> None:
    data = torch.randn(10, 4)
    loader = torch.utils.data.DataLoader(data, batch_size=3)
    dp = dpmethods.DataParallel(net, device_ids=["cpu"] * 2)
    with torch.no_grad():
        outs = list(dp.map("encode", loader, progress=False))
        ref = [net.encode(b) for b in loader]
    assert [o["n"] for o in outs] == [3, 3, 3, 1]
    for a, b in zip(outs, ref):
        _same(a, b)


def test_batch_kinds_mapping_tuple_single(net: Net) -> None:
    dp = dpmethods.DataParallel(net, device_ids=["cpu"] * 2)
    x, mask = torch.randn(5, 4), torch.rand(5)
    batches: list[Any] = [{"x": x, "mask": mask}, (x, mask), x, (x,)]
    with torch.no_grad():
        outs = list(dp.map("encode", batches, scale=3.0))
        _same(outs[0], net.encode(x, mask, scale=3.0))
        _same(outs[1], net.encode(x, mask, scale=3.0))
        _same(outs[2], net.encode(x, scale=3.0))
        _same(outs[3], net.encode(x, scale=3.0))
    with pytest.raises(TypeError, match=r"batch keys \['scale'\] are also keyword arguments"):
        list(dp.map("encode", [{"x": x, "scale": 2.0}], scale=3.0))
    with pytest.raises(TypeError, match=r"keys must be str, got int 0"):
        list(dp.map("encode", [{0: x}]))


@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("prefetch", [1, 3, None])
def test_endless_iterable_is_pulled_a_bounded_way_ahead(
    net: Net, ordered: bool, prefetch: int | None
) -> None:
    dp = dpmethods.DataParallel(net, device_ids=["cpu"] * 2)
    pulled: list[int] = []
    # docs/map.md: prefetch x replicas in flight, and in order no batch more than
    # 2 x prefetch x replicas ahead of the last one yielded.
    window = (PREFETCH if prefetch is None else prefetch) * 2 * (2 if ordered else 1)
    it = dp.map("encode", counting(pulled), ordered=ordered, prefetch=prefetch)
    with torch.no_grad():
        for taken in range(1, 40):
            next(it)
            assert len(pulled) <= taken + window
    it.close()
    assert len(pulled) <= 39 + window


def test_exception_in_batch_k_stops_the_map(net: Net) -> None:
    dp = dpmethods.DataParallel(net, device_ids=["cpu"] * 3)
    batches = _batches(30)
    batches[7] = torch.full((3, 4), float("nan"))
    got: list[Any] = []
    with torch.no_grad(), pytest.raises(ValueError, match="a NaN batch") as info:
        for out in dp.map("encode", batches):
            got.append(out)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "DataParallel.map: raised in batch 7 on replica" in notes
    assert "(device cpu)" in notes
    assert len(got) <= 7
    assert "encode" in "".join(traceback.format_tb(info.value.__traceback__))
    assert _map_threads() == []
    # The next map and the next call are correct.
    with torch.no_grad():
        ref = [net.encode(b) for b in batches[:7]]
        for a, b in zip(dp.map("encode", batches[:7]), ref):
            _same(a, b)
        _same(dp.encode(batches[1])["y"], net.encode(batches[1])["y"])


def test_close_and_break_stop_the_workers(net: Net) -> None:
    dp = dpmethods.DataParallel(net, device_ids=["cpu"] * 2, cache_replicas=True)
    pulled: list[int] = []
    with torch.no_grad():
        it = dp.map("encode", counting(pulled))
        next(it)
        assert len(_map_threads()) == 2
        it.close()
        assert _map_threads() == []
        with pytest.raises(StopIteration):
            next(it)
        for _ in dp.map("encode", counting(pulled)):
            break
        gc.collect()
        assert _map_threads() == []
        with dp.map("encode", counting(pulled)) as outs:
            next(outs)
        assert _map_threads() == []
        it = dp.map("encode", counting(pulled))
        next(it)
        del it  # abandoned: the garbage collector's finalizer stops the workers
        gc.collect()
        assert _map_threads() == []
        x = torch.randn(8, 4)  # 4 per replica: not the feature width 3
        _same(dp.encode(x)["y"], net.encode(x)["y"])  # a call gathers "n" as one int
        _same(next(iter(dp.map("encode", [x]))), net.encode(x))


def test_keyboard_interrupt_stops_cleanly(net: Net) -> None:
    dp = dpmethods.DataParallel(net, device_ids=["cpu"] * 2)

    def interrupted() -> Iterator[torch.Tensor]:
        for _ in range(3):
            yield torch.randn(2, 4)
        raise KeyboardInterrupt  # as if Ctrl-C came while the next batch was read

    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        list(dp.map("encode", interrupted()))
    assert _map_threads() == []
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        for _ in dp.map("encode", _batches()):
            raise KeyboardInterrupt  # Ctrl-C in the loop body
    gc.collect()
    assert _map_threads() == []


def test_progress_bar_output(net: Net, capsys: pytest.CaptureFixture[str]) -> None:
    dp = dpmethods.DataParallel(net, device_ids=["cpu"] * 2)
    with torch.no_grad():
        list(dp.map("encode", _batches(6), progress="embedding"))
        list(dp.map("encode", iter(_batches(4)), progress=True))
        # A DataLoader of an IterableDataset has __len__ but len() raises: no total.
        class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
            def __iter__(self) -> Iterator[torch.Tensor]:
                return iter(torch.randn(10, 4))

        loader = torch.utils.data.DataLoader(Stream(), batch_size=5)
        list(dp.map("encode", loader, progress="streamed"))
    err = capsys.readouterr().err
    assert "streamed: " in err and "2batch" in err.replace(" ", "")
    assert "embedding" in err
    assert "6/6" in err  # the total comes from len(batches)
    assert "items/s" in err and "batch/s" in err
    assert "4batch" in err.replace(" ", "")  # no total for a bare iterator


class Columns(nn.Module):
    """An undecorated forward that runs out of memory above two columns."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > 2:
            raise torch.OutOfMemoryError(f"{x.shape[1]} columns do not fit")
        return x * 2


@pytest.mark.parametrize("workers", WORKERS)
def test_a_map_of_an_undecorated_forward_splits_on_the_wrappers_dim(workers: str) -> None:
    # Cut on rows, the batches would run out of memory down to one row and raise.
    dp = dpmethods.DataParallel(Columns(), device_ids=["cpu"] * 2, dim=1, workers=workers)
    xs = [torch.randn(3, 7), torch.randn(2, 5)]
    try:
        with torch.no_grad():
            outs = list(dp.map("forward", xs, on_oom="split"))
    finally:
        dp.close()
    assert [o.tolist() for o in outs] == [(x * 2).tolist() for x in xs]


def test_invalid_arguments(net: Net) -> None:
    dp = dpmethods.DataParallel(net, device_ids=["cpu"] * 2)
    with pytest.raises(ValueError, match=r"method: expected 'forward' or the name of a parallel "
                       r"method of Net \['encode', 'noisy', 'wait_for'\], got str 'decode'"):
        dp.map("decode", [])
    with pytest.raises(ValueError, match=r"prefetch: expected an int >= 1 .*got int 0"):
        dp.map("encode", [], prefetch=0)
    with pytest.raises(TypeError, match=r"ordered: expected a bool, got str 'yes'"):
        dp.map("encode", [], ordered="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"progress: expected a bool or a str .*got int 1"):
        dp.map("encode", [], progress=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"batches: expected an iterable, got int"):
        dp.map("encode", 3)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"shard=True: expected torch.distributed to be "
                       r"initialized"):
        dp.map("encode", [], shard=True)
    assert list(dp.map("encode", [])) == []


def test_a_parallel_method_named_map_keeps_the_wrapper_map() -> None:
    class Mapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        @dpmethods.parallel_method
        def map(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

    with pytest.warns(UserWarning, match=r"parallel method 'map' has the name of a method of "
                      r"DataParallel itself"):
        dp = dpmethods.DataParallel(Mapper(), device_ids=["cpu"] * 2)
    with pytest.raises(ValueError, match=r"to call Mapper.map itself, use .module.map"):
        dp.map(torch.ones(2, 2), [])  # type: ignore[arg-type]


def test_generate_of_a_real_gpt2() -> None:
    pytest.importorskip("transformers")
    model = tiny_gpt2()  # the process-worker tests' GPT-2 (seeded, eval mode)
    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2, methods=["generate"])
    g = torch.Generator().manual_seed(0)
    batches = [
        {"input_ids": torch.randint(2, 64, (n, 5), generator=g), "max_new_tokens": k}
        for n, k in [(3, 4), (1, 9), (2, 2), (4, 6)]
    ]
    kwargs = {"do_sample": False, "pad_token_id": 1}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes about attention masks
        ref = [model.generate(**b, **kwargs) for b in batches]
        outs = list(dp.map("generate", batches, **kwargs))
    for a, b in zip(outs, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ------------------------------------------------------------ shard=True, 2 gloo ranks


_GLOO = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is not available in this build",
)


@pytest.mark.distributed
@pytest.mark.timeout(180)
@_GLOO
@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_shard_under_two_gloo_ranks(tmp_path: Path, workers: str) -> None:
    ranks = spawn_gloo(shard_maps, 2, tmp_path, workers)
    net = build_net()
    with torch.no_grad():
        ref = [net.encode(b) for b in shard_batches()]
    merged = []
    for rank, res in enumerate(ranks):
        mine = list(range(rank, SHARD_BATCHES, 2))
        assert sorted(res["indices"]) == mine
        assert len(res["ordered"]) == len(mine)
        for out, i in zip(res["ordered"], mine):
            _same(out, ref[i])
        merged += res["pairs"]
    assert sorted(i for i, _ in merged) == list(range(SHARD_BATCHES))
    for i, out in merged:
        _same(out, ref[i])


@pytest.mark.distributed
@pytest.mark.timeout(180)
@_GLOO
def test_a_sharded_map_resumes_per_rank(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    ranks = spawn_gloo(shard_checkpointed, 2, tmp_path, "threads", str(path))
    net = build_net()
    with torch.no_grad():
        ref = [net.encode(b) for b in shard_batches()]
    for rank, res in enumerate(ranks):
        assert Path(f"{path}.rank{rank}-of-2").exists()
        first, second = (i for i, _ in res["taken"])
        rest = [i for i, _ in res["rest"]]
        # The first output taken is not run again; the second was not asked past.
        assert sorted(rest) == sorted(set(range(rank, SHARD_BATCHES, 2)) - {first})
        assert second in rest
        for i, out in res["taken"] + res["rest"]:
            _same(out, ref[i])
    # The same map unsharded, or on another number of ranks, has no record of its own:
    # it would run and yield again what the two ranks took. It is refused instead.
    dp = dpmethods.DataParallel(net, device_ids=["cpu"])
    records = r"\('run\.json\.rank0-of-2', 'run\.json\.rank1-of-2'\)"
    with pytest.raises(ValueError, match=rf"run\.json': this map is unsharded and has no record, but records "
                       rf"of another sharding exist {records}; starting afresh would run again"):
        list(dp.map("encode", shard_batches(), checkpoint=path))
    dist = torch.distributed
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=rf"this map is sharded over 1 rank and has no record, but records "
                           rf"of another sharding exist {records}"):
            list(dp.map("encode", shard_batches(), shard=True, checkpoint=path))
    finally:
        dist.destroy_process_group()
    assert not path.exists() and not Path(f"{path}.rank0-of-1").exists()


@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is not available in this build",
)
def test_example_map_torchrun(tmp_path: Path) -> None:
    import re
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(_REPO), os.environ.get("PYTHONPATH", "")]))
    env["OMP_NUM_THREADS"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # the gloo CPU path, even on a GPU machine
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
        "--master-addr=127.0.0.1", f"--master-port={port}",
        str(_REPO / "examples" / "map_torchrun.py"), "--batches", "7", "--out", str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=_REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 0 ran batches [0, 2, 4, 6]" in proc.stdout, proc.stdout
    assert "rank 1 ran batches [1, 3, 5]" in proc.stdout, proc.stdout
    assert re.search(r"max diff against one process: (0|\d\.\d+e-0[7-9])\n", proc.stdout), proc.stdout
    assert "world 2 collected 56 embeddings" in proc.stdout, proc.stdout
    files = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert sorted(files[0]) == [0, 2, 4, 6] and sorted(files[1]) == [1, 3, 5]


@pytest.mark.cuda
@pytest.mark.parametrize("output_device", [None, "cpu"])
def test_cuda_map_matches_one_device(net: Net, output_device: str | None) -> None:
    # Two replicas on one GPU (repeated ids) or one per GPU; CPU batches are pinned and
    # uploaded on each replica's copy stream, GPU batches are ordered after the caller's.
    count = torch.cuda.device_count()
    ids = list(range(count)) if count > 1 else [0, 0]
    model = net.to("cuda:0")
    dp = dpmethods.DataParallel(model, device_ids=ids, output_device=output_device)
    batches = _batches(13)
    target = torch.device(output_device or "cuda:0")
    with torch.no_grad():
        ref = [model.encode(b.cuda()) for b in batches]
        outs = list(dp.map("encode", batches, prefetch=3))
        pairs = list(dp.map("encode", [b.cuda() * 1 for b in batches], ordered=False))
    torch.cuda.synchronize()
    assert sorted(i for i, _ in pairs) == list(range(len(batches)))
    for out, (i, unordered) in zip(outs, sorted(pairs, key=lambda p: p[0])):
        for got in (out, unordered):
            assert got["y"].device == target and got["n"] == ref[i]["n"]
            close(got["y"], ref[i]["y"].to(target), terms=5 + 1)  # Linear(4, 3), a scale
            close(got["norm"], ref[i]["norm"].to(target), terms=5 + 1 + 3)  # and a 3-wide norm


class _Exhausting(nn.Module):
    """A method that calls next() on an exhausted iterator for one batch."""

    @dpmethods.parallel_method
    def step(self, x: torch.Tensor) -> torch.Tensor:
        if float(x[0, 0]) < 0:
            next(iter(()))  # raises StopIteration, as a method's own next() may
        return x * 2


@pytest.mark.parametrize("ordered", [True, False])
def test_stop_iteration_in_a_method_is_an_error_not_the_end(ordered: bool) -> None:
    batches = [torch.rand(2, 3) for _ in range(6)]
    batches[2] = -batches[2]
    dp = dpmethods.DataParallel(_Exhausting(), device_ids=["cpu"] * 2)
    with pytest.raises(RuntimeError, match="raised StopIteration in batch 2") as info:
        list(dp.map("step", batches, ordered=ordered))
    assert isinstance(info.value.__cause__, StopIteration)
    # The map still works, and gives every output when no batch fails.
    good = [b.abs() for b in batches]
    outs = list(dp.map("step", good))
    assert len(outs) == 6 and all(torch.equal(o, b * 2) for o, b in zip(outs, good))


@pytest.mark.parametrize("end", ["exhausted", "close"])
def test_a_finished_map_iterator_gives_the_cached_replicas_back(
    net: Net, end: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dpmethods.wrapper import call

    built: list[int] = []  # replicate calls: a cache that is still lent makes a call build its own
    real = call.replicate
    monkeypatch.setattr(call, "replicate", lambda *a, **k: built.append(1) or real(*a, **k))
    dp = dpmethods.DataParallel(net, device_ids=["cpu"] * 2, cache_replicas=True)
    x = torch.randn(4, 4)
    with torch.no_grad():
        it = dp.map("encode", [x, x, x])
        if end == "exhausted":
            assert len(list(it)) == 3
        else:
            next(it)
            it.close()
        assert len(built) == 1
        dp.encode(x)  # a call meanwhile reuses the cache instead of building replicas
        dp.encode(x)
        assert len(built) == 1
        del it


def test_replicas_built_again_in_a_map_come_from_the_cache_and_go_back_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from dpmethods.wrapper import call

    built: list[int] = []  # replicate calls
    real = call.replicate
    monkeypatch.setattr(call, "replicate", lambda *a, **k: built.append(1) or real(*a, **k))
    model = Changing().eval()
    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2, cache_replicas=True)
    x = torch.randn(4, 4)
    with torch.no_grad():
        for k, _ in enumerate(dp.map("forward", [x] * 6, prefetch=1)):
            if k == 0:
                model.scale = 3.0
        assert len(built) == 2  # at the start, and once after the change (not per batch)
        close(dp(x), model(x), terms=5)
        close(dp(x), model(x), terms=5)
        assert len(built) == 2  # the calls after the map lend the replicas it built again


def test_replicas_that_cannot_be_built_again_fail_the_map_naming_the_batch() -> None:
    model = Changing().eval()
    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2)
    xs = [torch.randn(3, 4) for _ in range(6)]
    with torch.no_grad(), pytest.raises(RuntimeError, match="parameters and buffers on device") as info:
        for k, _ in enumerate(dp.map("forward", xs, prefetch=1)):
            if k == 0:
                model.lin.to("meta")  # off device_ids[0]: replicas cannot be built
    assert any("building the replicas again before batch" in n for n in info.value.__notes__)


@pytest.mark.parametrize("cache", [False, True])
def test_a_thread_map_of_inference_tensors_builds_its_replicas_again_only_when_the_module_changed(
    cache: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Inference tensors have no version counter: the look leaves their versions out, so
    # it does not take the module for changed before every batch.
    from dpmethods.wrapper import call

    built: list[int] = []  # replicate calls
    real = call.replicate
    monkeypatch.setattr(call, "replicate", lambda *a, **k: built.append(1) or real(*a, **k))
    with torch.inference_mode():
        model = Changing().eval()
    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2, cache_replicas=cache, cpu_replicas="distinct")
    xs = [torch.randn(3, 4) for _ in range(6)]
    with torch.inference_mode():
        outs = list(dp.map("forward", xs, prefetch=1))
        assert len(built) == 1
        for out, x in zip(outs, xs, strict=True):
            close(out, model(x), terms=5)
        outs = []
        for k, out in enumerate(dp.map("forward", xs, prefetch=1)):
            if k == 0:
                model.lin.register_forward_hook(_doubled)
            outs.append(out)
        assert len(built) == 3  # at the start, and once after the change
        close(outs[-1], model(xs[-1]), terms=5)


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)
def test_sampling_on_distinct_gpus_is_seeded_from_the_caller() -> None:
    # Each GPU has its own generator: a call seeds replica i, a map batch i, from one draw
    # of the caller's generator (docs/generate.md#sampling-and-seeds).
    net = Net().cuda().eval()
    dp = dpmethods.DataParallel(net, device_ids=[0, 1])
    x = torch.randn(6, 4, device="cuda:0")
    batches = [x[:2], x[2:5], x[5:], x]

    def run(seed: int) -> list[torch.Tensor]:
        torch.manual_seed(seed)
        with torch.no_grad():
            return [dp.noisy(x), *dp.map("noisy", batches)]

    first, again, other = run(0), run(0), run(1)
    for a, b in zip(first, again, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not any(torch.equal(a, b) for a, b in zip(first, other))
    # A batch's samples do not depend on which GPU ran it: a one-GPU map gives the same.
    one = dpmethods.DataParallel(net, device_ids=[0])
    torch.manual_seed(1)
    with torch.no_grad():
        dp.noisy(x)  # the same draws as run(1) before its map
        alone = list(one.map("noisy", batches))
    for a, b in zip(alone, other[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class Changing(nn.Module):
    """Its output shows each change a test makes in the loop over a map: a hook on
    ``lin``, ``scale`` replaced, ``train()`` (+1 in training) and ``lin``'s weight."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x) * self.scale
        return y + 1 if self.training else y


def _doubled(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    return out * 2


MAP_CHANGES = {
    "hook_added": lambda m: m.lin.register_forward_hook(_doubled),
    "attribute_replaced": lambda m: setattr(m, "scale", 3.0),
    "train_toggled": lambda m: m.train(not m.training),
    "parameter_updated_in_place": lambda m: m.lin.weight.mul_(2),  # under no_grad, as an optimizer step
}


@pytest.mark.parametrize("change", MAP_CHANGES)
@pytest.mark.parametrize(("workers", "cache"), [("threads", False), ("threads", True), ("processes", False)])
def test_a_change_in_the_loop_over_a_map_reaches_the_batches_sent_after_it(
    workers: str, cache: bool, change: str
) -> None:
    # Distinct CPU replicas hold copies of the parameters, as replicas on other GPUs do.
    torch.manual_seed(0)
    model = Changing().eval()
    xs = [torch.randn(3, 4) for _ in range(8)]
    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2, workers=workers, cache_replicas=cache,
                                cpu_replicas="distinct")
    outs: list[torch.Tensor] = []
    try:
        with torch.no_grad():
            before = [model(x) for x in xs]
            after = before
            for k, out in enumerate(dp.map("forward", xs, prefetch=1)):
                if k == 0:
                    MAP_CHANGES[change](model)
                    after = [model(x) for x in xs]
                outs.append(out)
    finally:
        dp.close()
    # The batches sent before the change are a prefix: when the first output is yielded
    # at most 4 were pulled (2 in flight, and the reorder window), the others come after.
    sent_before = next(k for k, (out, ref) in enumerate(zip(outs, before)) if not torch.allclose(out, ref))
    assert 1 <= sent_before <= 4
    for out, ref in zip(outs, before[:sent_before] + after[sent_before:], strict=True):
        close(out, ref, terms=5)  # Linear(4, 3)


@pytest.mark.parametrize("workers", WORKERS)
def test_a_cpu_batch_and_its_output_are_handed_on_without_a_call_into_torch(
    net: Net, workers: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each call into torch lets go of the GIL; a replica thread that let go of it to
    # "move" an output already where it goes would wait for the other threads once more
    # per batch. A thread map of small batches is bound by those waits; a process map's
    # caller reads every reply, and would rebuild each output it did not move.
    batches = _batches(5)
    with torch.no_grad():
        want = [(net(b), net.encode(b)) for b in batches]
    moves: list[torch.device] = []
    to = torch.Tensor.to

    def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        moves.append(self.device)
        return to(self, *args, **kwargs)

    dp = dpmethods.DataParallel(net, device_ids=["cpu"] * 2, workers=workers)
    try:
        with torch.no_grad():
            list(dp.map("encode", batches[:1]))  # the workers started and hold the model
            monkeypatch.setattr(torch.Tensor, "to", counted)
            tensors = list(dp.map("forward", batches))
            trees = list(dp.map("encode", batches))  # dicts
    finally:
        monkeypatch.undo()
        dp.close()
    assert moves == []
    for tensor, tree, (want_tensor, want_tree) in zip(tensors, trees, want):
        close(tensor, want_tensor, terms=5)
        assert tree["n"] == want_tree["n"]
        close(tree["y"], want_tree["y"], terms=5)
