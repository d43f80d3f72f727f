"""``workers="processes"``: maps and inference calls in one worker process per CPU device.

Every output is compared with the one-device loop (or, for a call's gather modes, with
the same call on threads) on random data. Spawning costs seconds per worker, so most
tests share one wrapper whose pool lives for the module; no test asserts a time.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import gc
import logging
import math
import multiprocessing
import os
import random
import re
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import dpmethods
from dpmethods import ops
from dpmethods.extending import mark_batch_coupled, register_process_rule
from dpmethods.processes import executor as executor_module
from dpmethods.processes import pool as pool_module
from dpmethods.processes import state
from dpmethods.processes.classes import check, class_state, classes_of
from dpmethods.processes.state import Watch
from dpmethods.streaming import processes as process_backend
from dpmethods.testing import assert_close_to_reference
from tests.helpers import WORKERS, counting
from tests.helpers.models import random_sentences, tiny_sentence_transformer
from tests.helpers.processes import (
    NOTED,
    BeyondStorage,
    CodedError,
    Contract,
    DoubledLinear,
    EnvProbe,
    GcProbe,
    Grown,
    Holder,
    InBatchLoss,
    Locked,
    LockedLinear,
    MarkedLater,
    Net,
    Parametrized,
    Patched,
    PatchedChild,
    Shifted,
    SparseHeld,
    Ticker,
    Unloadable,
    Watched,
    build_gc_probe,
    build_net,
    build_net_doubled,
    count_calls,
    gone,
    library_addition,
    patched_forward,
    tiny_gpt2,
    wait_for,
)
from tests.helpers.terms import mlp_terms, transformer_terms

pytestmark = pytest.mark.timeout(180)
# The largest model compared here, tiny_gpt2: 2 blocks of width 16 (MLP 64) over up to
# 16 tokens and 64 logits (Net: Linear(4, 3), a scale and a 3-wide norm, far fewer).
TERMS = transformer_terms(width=16, ff=64, seq=16, layers=2) + 64


def _workers() -> list[multiprocessing.process.BaseProcess]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("dpmethods-worker-")]


@pytest.fixture(scope="module")
def net() -> Net:
    return build_net()


@pytest.fixture(scope="module")
def dp(net: Net) -> Iterator[dpmethods.DataParallel[Net]]:
    torch.set_num_threads(1)
    wrapper = dpmethods.DataParallel(net, device_ids=["cpu"] * 2, workers="processes")
    yield wrapper
    wrapper.close()
    assert _workers() == []


def _pids(dp: Any) -> list[int]:
    """Each device's worker's pid, in device order: a call gives each device one row."""
    with torch.no_grad():
        return [int(pid) for pid in dp.pid(torch.zeros(len(dp.device_ids), 4))]


def _batches(n: int = 9) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return [torch.randn(1 + (i * 5) % 7, 4, generator=g) for i in range(n)]


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, dict):  # ModelOutput too
        assert list(a.keys()) == list(b.keys())
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.device == b.device
        assert_close_to_reference(a, b, terms=TERMS)
    elif isinstance(a, np.ndarray):
        assert_close_to_reference(a, b, terms=TERMS)
    else:
        assert a == b


@pytest.mark.parametrize("method", ["encode", "output", "to_numpy", "words", "big"])
@pytest.mark.parametrize("ordered", [True, False])
def test_map_equals_the_one_device_loop(dp: Any, net: Net, method: str, ordered: bool) -> None:
    batches = _batches()
    with torch.no_grad():
        ref = [getattr(net, method)(b) for b in batches]
        outs = list(dp.map(method, batches, ordered=ordered, prefetch=1 if ordered else 3))
    if not ordered:
        assert sorted(i for i, _ in outs) == list(range(len(batches)))
        outs = [o for _, o in sorted(outs, key=lambda p: p[0])]
    assert len(outs) == len(ref)
    for a, b in zip(outs, ref):
        _same(a, b)


def test_batch_kinds_kwargs_and_progress(dp: Any, net: Net, capsys: pytest.CaptureFixture[str]) -> None:
    x = torch.randn(3, 4)
    batches = [{"x": x}, (x,), x]
    with torch.no_grad():
        ref = net.encode(x, scale=2.0)
        outs = list(dp.map("encode", batches, scale=2.0, progress="procs"))
    for out in outs:
        _same(out, ref)
    assert "procs" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:gather. output.'n'. .int. differs")
@pytest.mark.parametrize("method", ["encode", "stacked", "mean", "total", "padded", "listed", "words", "forward"])
def test_calls_gather_every_mode_as_threads(dp: Any, net: Net, method: str) -> None:
    threads = dpmethods.DataParallel(net, device_ids=["cpu"] * 2)
    x = torch.randn(5, 4)  # chunks of 3 and 2
    with torch.no_grad():
        want = threads(x) if method == "forward" else getattr(threads, method)(x)
        got = dp(x) if method == "forward" else getattr(dp, method)(x)
    _same(got, want)
    assert len(set(_pids(dp))) == 2


def test_calls_run_in_the_workers(dp: Any) -> None:
    with torch.no_grad():
        pids = dp.pid(torch.zeros(4, 4))
    assert len(set(pids.tolist())) == 2 and set(pids.tolist()) <= {p.pid for p in _workers()}
    assert os.getpid() not in pids.tolist()


def test_a_failing_batch_then_the_pool_still_works(dp: Any, net: Net) -> None:
    with torch.no_grad():
        list(dp.map("encode", _batches(2)))
    before = _pids(dp)
    batches = _batches(6)
    batches[3] = torch.full((2, 4), float("nan"))
    with torch.no_grad(), pytest.raises(ValueError, match="a NaN batch") as info:
        list(dp.map("encode", batches))
    note = "\n".join(getattr(info.value, "__notes__", []))
    assert "DataParallel.map: raised in batch 3 on worker" in note
    assert "device cpu" in note and "Traceback (most recent call last)" in note
    with torch.no_grad():
        outs = list(dp.map("encode", _batches()))
        ref = [net.encode(b) for b in _batches()]
    for a, b in zip(outs, ref):
        _same(a, b)
    assert _pids(dp) == before  # the same workers


@pytest.mark.parametrize("ordered", [True, False])
def test_stop_iteration_in_a_method_is_an_error_not_the_end_of_the_map(dp: Any, ordered: bool) -> None:
    batches = [b.abs() for b in _batches(6)]
    batches[2] = -batches[2]
    with torch.no_grad(), pytest.raises(RuntimeError, match="raised StopIteration in batch 2") as info:
        list(dp.map("exhausting", batches, ordered=ordered))
    assert isinstance(info.value.__cause__, StopIteration)


@pytest.mark.parametrize("retries", [0, 1])
def test_a_killed_worker_is_named_then_replaced(dp: Any, net: Net, retries: int) -> None:
    with torch.no_grad():
        list(dp.map("encode", _batches(2)))
    victim = _pids(dp)[0]
    batches = [torch.randn(2, 4) for _ in range(8)]
    with torch.no_grad():
        if retries:  # the batch it ran runs again on a fresh worker: nothing is lost
            outs = []
            for k, out in enumerate(dp.map("sleepy", batches, seconds=0.5, retries=retries)):
                if k == 0:
                    os.kill(victim, signal.SIGKILL)
                outs.append(out)
            assert len(outs) == len(batches)
            for a, b in zip(outs, [net.sleepy(b, seconds=0) for b in batches]):
                _same(a, b)
        else:
            with pytest.raises(RuntimeError) as info:
                for k, _ in enumerate(dp.map("sleepy", batches, seconds=0.5, retries=0)):
                    if k == 0:
                        os.kill(victim, signal.SIGKILL)
            assert re.search(rf"DataParallel.map: batch [1-7] failed 1 time\(s\) \(retries=0\): worker 0 "
                             rf"\(pid {victim}, device cpu\) died with exit code -9 \(SIGKILL\) while running "
                             rf"it; a fresh worker replaced it", str(info.value)), info.value
        outs = list(dp.map("encode", _batches()))
        ref = [net.encode(b) for b in _batches()]
    for a, b in zip(outs, ref):
        _same(a, b)
    assert _pids(dp)[0] != victim


def test_break_and_close_stop_the_map_and_keep_the_pool(dp: Any, net: Net) -> None:
    batches = [torch.randn(2, 4) for _ in range(10)]
    with torch.no_grad():
        for _ in dp.map("sleepy", batches, seconds=0.2):
            break
        it = dp.map("sleepy", batches, seconds=0.2)
        next(it)
        it.close()
        assert list(it) == []
        with dp.map("sleepy", batches) as it2:
            next(it2)
        outs = list(dp.map("encode", _batches()))  # the running batches are dropped first
        ref = [net.encode(b) for b in _batches()]
    for a, b in zip(outs, ref):
        _same(a, b)


def _most_ahead(dp: Any, taken: int, **options: Any) -> int:
    """How many batches an unordered map of ``sleepy`` was ever pulled ahead of the outputs taken."""
    pulled: list[int] = []
    most = 0
    with torch.no_grad():
        it = dp.map("sleepy", counting(pulled), ordered=False, **options)
        for k in range(1, taken + 1):
            next(it)
            most = max(most, len(pulled) - k)
    it.close()
    return most


@pytest.mark.parametrize(("short", "prefetch", "held"), [(True, None, 4), (False, None, 2), (True, 3, 3), (True, 1, 1)])
def test_a_worker_holds_four_short_batches_two_long_ones_or_the_prefetch_asked(
    dp: Any, monkeypatch: pytest.MonkeyPatch, short: bool, prefetch: int | None, held: int,
) -> None:
    # docs/map.md: with prefetch=None a worker process holds two batches of a map, four
    # while they run shorter than SHORT_S; here the threshold alone decides.
    monkeypatch.setattr(process_backend, "SHORT_S", math.inf if short else 0.0)
    # Once an output is taken, every batch in flight but it: ``held`` per worker, less one.
    assert _most_ahead(dp, 30, prefetch=prefetch) == held * len(dp.device_ids) - 1


def test_batches_longer_than_the_threshold_are_held_two_per_worker(dp: Any) -> None:
    # Each runs at least 5 ms, over SHORT_S: a worker never holds more than the one it
    # runs and the next (four would leave batches waiting behind it while another idles).
    assert process_backend.SHORT_S < 0.005
    assert _most_ahead(dp, 12, seconds=0.005) == 2 * len(dp.device_ids) - 1


def test_maps_and_calls_share_the_workers(dp: Any, net: Net) -> None:
    # Two maps zipped together, and a call and a map inside the loop over a map: each
    # gets its own outputs, as with threads.
    xs, ys = _batches(7), [b * 2 for b in _batches(5)]
    z = torch.randn(4, 4)
    with torch.no_grad():
        pairs = list(zip(dp.map("encode", xs), dp.map("forward", ys, ordered=False)))
        inner = []
        for k, out in enumerate(dp.map("encode", xs)):
            _same(out, net.encode(xs[k]))
            inner.append((dp(z * k), list(dp.map("forward", ys[:2]))))
    assert len(pairs) == 5
    for k, (a, (i, b)) in enumerate(pairs):
        _same(a, net.encode(xs[k]))
        _same(b, net(ys[i]))
    for k, (call, mapped) in enumerate(inner):
        _same(call, net(z * k))
        for y, m in zip(ys[:2], mapped):
            _same(m, net(y))


@torch.no_grad()  # grad mode is per thread: this runs in the pool's threads
def _mixed_use(dp: Any, x: torch.Tensor, seed: int) -> tuple[list[Any], list[torch.Tensor]]:
    """One thread's use of the shared workers: a call, a map (ordered or not), or a map
    closed after its first output; returns what it got and the batches it ran."""
    r = random.Random(seed)
    batches = [x * j for j in range(r.randrange(1, 6))]
    kind = r.randrange(4)
    if kind == 0:
        return [dp(x)], [x]
    if kind == 1:
        return list(dp.map("forward", batches, prefetch=r.randrange(1, 3))), batches
    if kind == 2:
        pairs = sorted(dp.map("forward", batches, ordered=False), key=lambda p: p[0])
        assert [i for i, _ in pairs] == list(range(len(batches)))
        return [out for _, out in pairs], batches
    with dp.map("forward", batches) as it:
        return [next(it)], batches[:1]


# Its 1-row batches on 2 devices are what the race needs; that one replica runs them is not
# what this test is about.
@pytest.mark.filterwarnings("ignore:DataParallel. a batch of 1 items on 2 devices:UserWarning")
def test_calls_and_maps_from_several_threads_at_once(dp: Any, net: Net) -> None:
    # Six threads share two workers; whichever thread reads a reply delivers it. A map
    # must never end short while another thread is reading its last reply (a lost output,
    # silently); thread switches as often as possible make such windows show.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        with torch.no_grad(), concurrent.futures.ThreadPoolExecutor(6) as pool:
            for round_ in range(40):
                xs = [torch.randn(1 + i % 5, 4) for i in range(32)]
                seeds = [round_ * 100 + i for i in range(32)]
                for got, ran in pool.map(_mixed_use, [dp] * 32, xs, seeds):
                    assert len(got) == len(ran)
                    for out, batch in zip(got, ran):
                        _same(out, net(batch))
    finally:
        sys.setswitchinterval(interval)


def test_a_request_the_worker_cannot_unpickle_fails_that_batch_only(dp: Any, net: Net) -> None:
    x = torch.randn(4, 4)
    with torch.no_grad():
        dp.encode(x)  # the workers are started, whichever test ran before
        before = _pids(dp)
        with pytest.raises(RuntimeError, match=r"a worker process could not unpickle a request: "
                           r"ModuleNotFoundError: No module named 'only_in_the_caller'.*"
                           r"define them in an importable module, or use workers='threads'"):
            list(dp.map("encode", [x, x], scale=Unloadable()))
        with pytest.raises(RuntimeError, match="could not unpickle a request"):
            dp.encode(x, scale=Unloadable())
        _same(dp.encode(x)["y"], net.encode(x)["y"])
    assert _pids(dp) == before


class _Scale(float):
    """A scale the caller holds but cannot pickle, as a lock or an open stream."""

    def __reduce__(self) -> Any:
        raise TypeError("cannot pickle '_Scale' object")


@pytest.mark.parametrize(("run", "what"), [
    (lambda dp, x, scale: dp.encode(x, scale=scale), r"DataParallel\.encode\(workers='processes'\): its arguments"),
    (lambda dp, x, scale: next(dp.map("encode", [x, x], scale=scale)),
     r"DataParallel\.map\(workers='processes'\): batch 0"),
], ids=["call", "map"])
def test_arguments_that_cannot_be_sent_name_what_and_a_fix_that_is_right(
    dp: Any, net: Net, run: Callable[..., Any], what: str
) -> None:
    x = torch.randn(7, 4)
    with torch.no_grad():
        with pytest.raises(TypeError, match=rf"^{what} cannot be sent to a worker process: TypeError: "
                           r"cannot pickle '_Scale' object; use workers='threads'$") as info:
            run(dp, x, _Scale(2.0))
        assert str(info.value.__cause__) == "cannot pickle '_Scale' object"
        threads = dpmethods.DataParallel(net, device_ids=["cpu"] * 3)  # the fix: the one-device answer
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out = run(threads, x, _Scale(2.0))
        _same(out["y"], net.encode(x, scale=2.0)["y"])
    # A call's shares count 3, 2 and 2 rows: only its row count comes back as a list, and says so.
    assert all("output['n'] (int) differs across replicas" in str(w.message) for w in seen)


@pytest.mark.parametrize("how", ["call", "map"])
def test_a_generator_argument_is_refused_before_any_work(dp: Any, how: str) -> None:
    # Pickled, each worker would get a copy: every share and every batch would draw the
    # same numbers, and the caller's generator would never advance.
    g = torch.Generator().manual_seed(5)
    state = g.get_state()
    x = torch.randn(7, 4)
    what = r"DataParallel\.drawn\(workers='processes'\): its arguments" if how == "call" else \
        r"DataParallel\.map\(workers='processes'\): batch 0"
    with torch.no_grad(), pytest.raises(TypeError, match=rf"^{what} cannot be sent to a worker process: "
                                        r"TypeError: a torch.Generator \(on cpu\) cannot be shared with "
                                        r"worker processes: each would draw the same numbers"):
        if how == "call":
            dp.drawn(x, generator=g)
        else:
            list(dp.map("drawn", [x, x], generator=g))
    assert torch.equal(g.get_state(), state)


@pytest.mark.parametrize("workers", WORKERS)
def test_the_callers_default_dtype_holds_in_calls_and_maps(dp: Any, net: Net, workers: str) -> None:
    # torch.set_default_dtype is the caller process's: a worker process takes it per job.
    runner = dp if workers == "processes" else dpmethods.DataParallel(net, device_ids=["cpu"] * 2)
    x = torch.randn(7, 4)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.no_grad():
            want = net.drawn(x).dtype
            call, mapped = runner.drawn(x), list(runner.map("drawn", [x, x[:3]]))
    finally:
        torch.set_default_dtype(before)
    assert want == torch.float64
    assert call.dtype == want and [m.dtype for m in mapped] == [want] * 2
    with torch.no_grad():
        assert runner.drawn(x).dtype == torch.float32  # and back with the caller's


@pytest.mark.parametrize("workers", WORKERS)
def test_a_call_whose_share_fails_gives_every_shares_warnings(dp: Any, net: Net, workers: str) -> None:
    # As one device would warn before it failed: every share ran and warned, one raised.
    runner = dp if workers == "processes" else dpmethods.DataParallel(net, device_ids=["cpu"] * 2)
    x = torch.randn(7, 4)
    x[0, 0] = float("nan")  # in the first share (4 rows), read first
    with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="warned: a NaN share"):
            runner.warned(x)
    assert sorted(str(w.message) for w in seen) == ["a share of 3 rows", "a share of 4 rows"]


def test_a_buffer_a_method_updates_in_place_is_each_workers_own_in_eval_mode() -> None:
    # As on devices of their own: each worker counts its own calls, where one shared
    # buffer would count every worker's.
    model = Ticker().eval()
    dp = dpmethods.DataParallel(copy.deepcopy(model), device_ids=["cpu"] * 2, workers="processes")
    x = torch.zeros(6)
    try:
        with torch.no_grad():
            for _ in range(3):
                assert dp.tick(x).tolist() == model.tick(x).tolist()
    finally:
        dp.close()


@pytest.mark.parametrize("how", ["call", "map"])
def test_a_warning_whose_category_no_worker_can_send_is_given_by_name(dp: Any, net: Net, how: str) -> None:
    # Its category was defined inside the method: the output still comes back, and the
    # warning is given as a UserWarning that names the category.
    x = torch.randn(7, 4)
    with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = dp.warns_locally(x) if how == "call" else torch.cat(list(dp.map("warns_locally", [x[:4], x[4:]])))
    _same(out, net.lin(x))
    texts = {(w.category, str(w.message)) for w in seen}
    assert texts == {(UserWarning, "tests.helpers.processes.Net.warns_locally.<locals>.LocalWarning: heads up")}


def test_an_output_that_cannot_be_sent_back_names_the_method(dp: Any, net: Net) -> None:
    x = torch.randn(4, 4)
    with torch.no_grad():
        with pytest.raises(TypeError, match=r"the output of unsendable cannot be sent back from "
                           r"the worker process: TypeError: cannot pickle 'generator' object; "
                           r"return picklable values .* or use workers='threads'"):
            list(dp.map("unsendable", [x]))
        _same(dp(x), net(x))


def test_a_map_left_open_does_not_hold_the_workers(dp: Any, net: Net) -> None:
    batches = [torch.randn(2, 4) for _ in range(6)]
    with torch.no_grad():
        first = dp.map("sleepy", batches, seconds=0.2)
        head = next(first)  # left open while others use the workers, then finished
        outs = list(dp.map("encode", _batches()))
        _same(dp(batches[0]), net(batches[0]))
        rest = list(first)
        dropped = dp.map("sleepy", batches, seconds=0.2)
        next(dropped)
        del dropped  # collected: its running batches are read and dropped on arrival
        _same(dp(batches[1]), net(batches[1]))
    for a, b in zip(outs, [net.encode(b) for b in _batches()]):
        _same(a, b)
    for a, b in zip([head, *rest], batches, strict=True):
        _same(a, net.sleepy(b))


def test_replies_nobody_waits_for_are_drained(dp: Any, net: Net) -> None:
    # A map stopped with big outputs in flight: each arrives in shared memory whose
    # descriptor the worker holds until a caller fetches it; the caller fetches and drops
    # every one, so no worker keeps memory for a reply nobody reads.
    batches = [torch.randn(2, 4) for _ in range(8)]
    x = torch.zeros(2, 4)
    with torch.no_grad():
        for _ in dp.map("big", batches):
            break
        end = time.monotonic() + 30  # the last replies are drained as they arrive
        while (held := dp.unfetched(x).tolist()) != [0, 0] and time.monotonic() < end:
            time.sleep(0.05)
    assert held == [0, 0]


@pytest.mark.parametrize("how", ["call", "map"])
def test_a_job_raising_system_exit_leaves_the_worker_usable(dp: Any, net: Net, how: str) -> None:
    x = torch.randn(4, 4)
    with torch.no_grad():
        dp(x)
        before = _pids(dp)
        with pytest.raises(SystemExit):
            if how == "call":
                dp.exits(x)
            else:
                list(dp.map("exits", [x, x]))
        _same(dp(x), net(x))
    assert _pids(dp) == before  # the same workers took their next job


def test_a_worker_sent_sigterm_in_a_call_is_a_died_error_not_the_callers_exit(dp: Any, net: Net) -> None:
    # kill <pid> of a worker in a call: its job's SystemExit once ended the caller (status 0).
    x = torch.randn(4, 4)
    with torch.no_grad():
        before = _pids(dp)
        with pytest.raises(pool_module.WorkerDiedError) as info:
            dp.terminated(x)  # each worker sends itself SIGTERM in its share
        assert str(info.value) == (f"DataParallel(workers='processes'): worker 0 (pid {before[0]}, device cpu) "
                                   f"was stopped by SIGTERM (SystemExit)")
        assert info.value.__notes__ == ["dpmethods: while running share 0 of DataParallel.terminated; the next "
                                        "map or call starts a fresh worker"]
        _same(dp(x), net(x))  # the next call starts fresh workers
        after = _pids(dp)
    assert set(after).isdisjoint(before)
    assert all(gone(pid) for pid in before)  # told to terminate, they left


def test_a_killed_worker_fails_exactly_its_pending_jobs(net: Net) -> None:
    from dpmethods.core.parallel_apply import ThreadState
    from dpmethods.processes.messages import Request

    x = torch.randn(3, 4)
    pool = pool_module.ProcessPool([torch.device("cpu")] * 2)
    with torch.no_grad(), contextlib.closing(pool):
        pool.prepare(net)
        victim, other = pool.workers

        def request(seconds: float) -> Request:
            return Request("sleepy", (x,), {"seconds": seconds}, ThreadState.capture(), None, False, None)

        doomed = [pool.submit(0, request(30.0)), pool.submit(0, request(0.0))]
        kept = pool.submit(1, request(0.5))
        pid = victim.process.pid
        os.kill(pid, signal.SIGKILL)
        for future in doomed:
            future.exception(timeout=30)  # fails at once, not after the 30 s job
        _same(other.reply(kept, "raised", "a test's job"), net.sleepy(x))
        pool.prepare(net)  # a fresh worker 0, before the failures are read (as a map in another thread may)
        fresh = pool.workers[0]
        died = []
        for future in doomed:
            with pytest.raises(pool_module.WorkerDiedError, match=rf"worker 0 \(pid {pid}, device cpu\) "
                               r"died with exit code -9 \(SIGKILL\)") as info:
                victim.reply(future, "raised", "a test's job")
            died.append(info.value)
        # The first was running; the second waited behind it (a map does not charge it a try).
        assert [e.started for e in died] == [True, False]
        assert [e.__notes__[0].split(";")[0] for e in died] == [
            "dpmethods: while running a test's job",
            "dpmethods: before a test's job started (it waited behind another job)"]
        _same(fresh.reply(pool.submit(0, request(0.0)), "raised", "a test's job"), net.sleepy(x))
        assert fresh.process.pid != pid


@pytest.fixture
def executor() -> Iterator[Any]:
    """One started worker executor of its own (no model: its jobs are plain functions)."""
    started = executor_module.WorkerExecutor(pool_module.start_method(), int, (), "dpmethods-test-worker")
    try:
        yield started
    finally:
        started.shutdown()


def test_a_dead_workers_executor_is_freed_without_a_reference_cycle() -> None:
    # Its error is kept to fail later sends; raised again, it would hold a traceback,
    # and through it the frame that raised it and the executor's outbox: a cycle only
    # the garbage collector frees, on whatever thread it next runs.
    started = executor_module.WorkerExecutor(pool_module.start_method(), int, (), "dpmethods-test-worker")
    os.kill(started.process.pid, signal.SIGKILL)
    with pytest.raises(concurrent.futures.BrokenExecutor):
        started.submit(int, 1).result(timeout=30)
    with pytest.raises(concurrent.futures.BrokenExecutor):
        started.submit(int, 1)  # a send after the break: the kept error
    gc.collect()
    gc.disable()
    try:
        del started  # its finalizer sends the stop frame, which fails as well
        found = gc.collect()
    finally:
        gc.enable()
    assert found == 0


def test_frames_bigger_than_the_pipe_to_a_busy_worker_neither_block_the_caller_nor_reorder(
    executor: Any, tmp_path: Path,
) -> None:
    # The busy job waits for a file that this thread creates only after every submit has
    # returned: a submit that waited for the worker to read its frame would leave the job
    # to give up (False) before the file appeared.
    flag = tmp_path / "go"
    executor.submit(int).result(timeout=60)  # started
    busy = executor.submit(wait_for, str(flag), 30.0)
    frames = [bytes([i]) * (8 << 20 if i % 2 == 0 else 1) for i in range(5)]  # 8 MiB, 1 B, ...
    echoed = [executor.submit(bytes, f) for f in frames]
    flag.touch()
    assert busy.result(timeout=60) is True
    assert [f.result(timeout=60) for f in echoed] == frames
    # While the worker drains what the pipe could not take, frames keep coming:
    # each goes behind the ones left, never into the middle of one.
    frames = [bytes([i]) * (2 << 20 if i % 2 == 0 else 1) for i in range(24)]
    echoed = [executor.submit(bytes, f) for f in frames]
    assert [f.result(timeout=60) for f in echoed] == frames


def test_a_jobs_clock_starts_when_the_job_before_it_finished_not_when_its_reply_was_read(
    executor: Any, tmp_path: Path,
) -> None:
    # The replies are read by the thread that waits; a map's timeout must not grow by
    # the time the caller spent elsewhere before it read the reply before.
    flag = tmp_path / "go"
    first, second = executor.submit(bytes, b"a"), executor.submit(wait_for, str(flag), 30.0)
    assert executor._conn.poll(60)  # the first job is finished: its reply waits in the pipe
    before_read = time.monotonic()
    assert executor.started(second) is None  # behind a job not known to be finished
    assert first.result(timeout=0) == b"a"  # a zero timeout still reads what is ready
    began = executor.started(second)
    assert began is not None and second.sent <= began < before_read  # type: ignore[attr-defined]
    flag.touch()
    assert second.result(timeout=60) is True
    assert executor.started(second) is None


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
def test_cpu_workers_never_take_the_core_from_the_caller(dp: Any) -> None:
    # worker.py: a worker woken by a batch waits for its turn (SCHED_BATCH) rather than
    # preempt the caller's thread that feeds it; the caller's own policy is left as it is.
    assert {os.sched_getscheduler(pid) for pid in _pids(dp)} == {os.SCHED_BATCH}
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


def test_a_jobs_run_time_starts_when_the_job_before_it_finished(executor: Any, tmp_path: Path) -> None:
    # A map keeps more batches at a worker while they run short (streaming/processes.py):
    # a job's time waiting behind another must not count as its own.
    flag = tmp_path / "go"
    waiting = executor.submit(wait_for, str(flag), 30.0)
    quick = executor.submit(bytes, b"b")
    assert executor_module.ran(waiting) is None  # not answered yet
    time.sleep(0.2)
    flag.touch()  # the first finishes at least 0.2 s after both were sent
    assert waiting.result(timeout=60) is True and quick.result(timeout=60) == b"b"
    ran = executor_module.ran(waiting), executor_module.ran(quick)
    assert ran[0] is not None and ran[0] >= 0.2
    # From the first one's end: at most what has passed since then; from its own send, 0.2 s more.
    assert ran[1] is not None and ran[1] <= time.monotonic() - (waiting.sent + 0.2)


class _Interrupted:
    """Raises KeyboardInterrupt once, where a Ctrl-C would land in the caller's read."""

    def __init__(self, real: Callable[..., Any]) -> None:
        self.real, self.raised = real, False

    def __call__(self, *args: Any) -> Any:
        if not self.raised:
            self.raised = True
            raise KeyboardInterrupt
        return self.real(*args)


def test_an_interrupt_inside_a_reply_kills_the_worker_and_fails_its_jobs(
    executor: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Halfway through a frame, the pipe can no longer be read in step: a worker left
    # running would answer each later job with the reply of the one before it.
    assert executor.submit(int).result(timeout=60) == 0
    jobs = [executor.submit(bytes, b"a"), executor.submit(bytes, b"b")]
    assert executor._conn.poll(60)  # the first reply is there to read
    monkeypatch.setattr(executor._conn, "recv_bytes", _Interrupted(executor._conn.recv_bytes))
    with pytest.raises(KeyboardInterrupt):
        jobs[0].result(timeout=60)
    for job in jobs:
        with pytest.raises(concurrent.futures.BrokenExecutor, match="interrupted while reading"):
            job.result(timeout=0)
    executor.process.join(30)
    assert executor.process.exitcode == -signal.SIGKILL
    with pytest.raises(concurrent.futures.BrokenExecutor):
        executor.submit(int)


def test_an_interrupt_after_a_whole_reply_fails_that_job_only(executor: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert executor.submit(int).result(timeout=60) == 0
    lost, kept = executor.submit(bytes, b"a"), executor.submit(bytes, b"b")
    monkeypatch.setattr(executor_module.pickle, "loads", _Interrupted(executor_module.pickle.loads))
    with pytest.raises(KeyboardInterrupt):
        lost.result(timeout=60)
    assert isinstance(lost.exception(timeout=0), RuntimeError)
    assert kept.result(timeout=60) == b"b"  # still in step: each job gets its own reply
    assert executor.submit(bytes, b"c").result(timeout=60) == b"c"


def _matches(out: torch.Tensor, ref: torch.Tensor) -> bool:
    try:
        assert_close_to_reference(out, ref, terms=5)  # Linear(4, 3)
    except AssertionError:
        return False
    return True


def test_changed_weights_and_hooks_are_seen(dp: Any, net: Net) -> None:
    x = torch.randn(4, 4)
    saved = net.lin.weight.detach().clone()
    try:
        with torch.no_grad():
            list(dp.map("forward", [x]))
            net.lin.weight.mul_(3)
            [out] = list(dp.map("forward", [x]))
            assert_close_to_reference(out, net(x), terms=5)  # Linear(4, 3)
            # Inside a map: the batches sent after the change see it. Which were sent
            # before depends on which worker finished first, but they are a prefix of
            # the batches, and the last one was sent after.
            xs = [torch.randn(3, 4) for _ in range(6)]
            outs, before, after = [], [], []
            for k, out in enumerate(dp.map("forward", xs, prefetch=1)):
                if k == 0:
                    before = [net(x) for x in xs]
                    net.lin.weight.mul_(0.5)
                    after = [net(x) for x in xs]
                outs.append(out)
            sent_before = sum(_matches(out, ref) for out, ref in zip(outs, before, strict=True))
            assert 1 <= sent_before < len(xs)
            for out, ref in zip(outs, before[:sent_before] + after[sent_before:], strict=True):
                assert_close_to_reference(out, ref, terms=5)
            handle = net.register_forward_hook(count_calls)
            try:
                [out] = list(dp.map("forward", [x]))
                assert_close_to_reference(out, net(x), terms=5)
                assert_close_to_reference(dp(x), net(x), terms=5)
            finally:
                handle.remove()
    finally:
        with torch.no_grad():
            net.lin.weight.copy_(saved)


# --- A change between two batches: what the pool's Watch sees, and the map.


def _no_grad(change: Callable[[Watched], object]) -> Callable[[Watched], object]:
    def changed(m: Watched) -> None:
        with torch.no_grad():
            change(m)

    return changed


def _stepped(fused: bool) -> Callable[[Watched], object]:
    def step(m: Watched) -> None:
        opt = (torch.optim.Adam(m.parameters(), lr=0.1, fused=True) if fused
               else torch.optim.SGD(m.parameters(), lr=0.5))
        with torch.enable_grad():
            m(torch.randn(5, 4)).pow(2).mean().backward()
        opt.step()  # a fused step bumps no version counter

    return step


def _class(m: Watched) -> None:
    m.lin.__class__ = DoubledLinear


# Each changes what the module computes, and each reaches the workers.
CHANGES: dict[str, Callable[[Watched], object]] = {
    "in_place_under_no_grad": _no_grad(lambda m: m.lin.weight.mul_(2)),
    "in_place_buffer": _no_grad(lambda m: m.shift.add_(1)),
    "sgd_step": _stepped(fused=False),
    "adam_fused_step": _stepped(fused=True),
    "load_state_dict": lambda m: m.load_state_dict(Watched().state_dict()),
    "load_state_dict_assign": lambda m: m.load_state_dict(Watched().state_dict(), assign=True),
    "data_assigned": lambda m: setattr(m.lin.weight, "data", torch.randn(4, 4)),
    # The same storage, data pointer and version counter: only the strides change.
    "data_transposed": lambda m: setattr(m.lin.weight, "data", m.lin.weight.data.t()),
    "attribute": lambda m: setattr(m, "scale", 3.0),
    "dict_edited_in_place": lambda m: m.options.__setitem__("shift", 1.0),
    "object_edited_in_place": lambda m: setattr(m.config, "shift", 1.0),
    "train_eval": lambda m: m.train(not m.training),
    "replaced_submodule": lambda m: setattr(m, "head", nn.Linear(4, 3)),
    "new_parameter": lambda m: setattr(m.lin, "weight", nn.Parameter(torch.randn(4, 4))),
    "assigned_buffer": lambda m: setattr(m, "shift", torch.randn(4)),
    "forward_hook": lambda m: m.lin.register_forward_hook(count_calls),
    "hook_written_into_its_dict": lambda m: m.head._forward_hooks.__setitem__(-1, count_calls),
    "class": _class,
}
# Changes the Watch sees that the map cannot show (the output stays, or the method fails).
UNSHOWN: dict[str, Callable[[Watched], object]] = {
    "data_narrowed": lambda m: setattr(m.head.weight, "data", m.head.weight.data[:2]),
    "data_viewed_as_another_dtype": lambda m: setattr(m.shift, "data", m.shift.data.view(torch.int32)),
    "requires_grad": lambda m: m.lin.requires_grad_(False),
    "equal_value_of_another_type": lambda m: setattr(m, "scale", 1),
    "new_attribute": lambda m: setattr(m, "extra", [1]),
    "dict_replaced_by_an_equal_one": lambda m: setattr(m.lin, "__dict__", dict(vars(m.lin))),
    "new_submodule": lambda m: setattr(m, "extra", nn.ReLU()),
    "equal_parameter": lambda m: setattr(m.lin, "bias", nn.Parameter(m.lin.bias.detach().clone())),
    "deleted_parameter": lambda m: delattr(m.lin, "bias"),
    "forward_pre_hook": lambda m: m.register_forward_pre_hook(lambda *a: None),
    "hooks_dict_filled_from_another": lambda m: m.head._forward_hooks.update({-1: count_calls}),
    "process_rule": lambda m: register_process_rule(attributes=("scale",)),
}


def _table_replaced(m: Watched) -> None:
    m.tables["offset"] = m.tables["offset"] + 1  # a new tensor at version 0, as the old one was


def _hook_setting(m: Watched) -> None:
    [hook] = [h for h in m.lin._forward_hooks.values() if isinstance(h, Shifted)]
    hook.shift += 1.0


# Changes to what a module holds beside its parameters, buffers and children: each can
# be made again, and changes the output again, and each reaches the workers of both kinds.
HELD: dict[str, Callable[[Watched], object]] = {
    "tensor_replaced_in_a_dict": _table_replaced,
    "module_in_a_list_edited_in_place": _no_grad(lambda m: m.helpers[0].weight.mul_(-2)),
    "module_in_a_list_given_a_new_parameter": lambda m: setattr(
        m.helpers[0], "bias", nn.Parameter(m.helpers[0].bias.detach() + 1)),
    "module_set_with_object_setattr_edited_in_place": _no_grad(lambda m: m.unlisted.bias.add_(1)),
    "hook_object_setting": _hook_setting,
}


# Where the running torch gives no dict versions, every look walks the module.
_WATCHING = pytest.mark.skipif(not state.versions_change(), reason="this torch gives no dict versions")


class Crowd(nn.Module):
    """A :class:`Watched` after 600 ``Linear(2, 2)`` (1,206 parameter tensors): a change
    to one module among many must show too."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(600))
        self.model = Watched()


# The Watch reads with the compiled extension where it is built, else in Python.
_READERS = ["compiled", "python"]


@pytest.fixture(params=_READERS)
def readers(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "python":
        with ops.without_extension():
            yield "python"
        return
    if ops.extension_info()["in_use"] != "compiled":
        pytest.skip("dpmethods._C is not built")
    yield "compiled"


@_WATCHING
@pytest.mark.parametrize("crowd", [False, True], ids=["alone", "among_600_modules"])
@pytest.mark.parametrize("name", [*CHANGES, *UNSHOWN, *HELD])
def test_the_watch_sees_each_kind_of_change(name: str, crowd: bool, readers: str) -> None:
    model = Crowd() if crowd else Watched()
    watch = Watch(model)
    watched = model.model if isinstance(model, Crowd) else model
    with torch.no_grad():
        watched(torch.randn(2, 4))
    assert watch.unchanged()  # running the module changes nothing
    made = {**CHANGES, **UNSHOWN, **HELD}[name](watched)
    try:
        assert not watch.unchanged()
    finally:
        if isinstance(made, state.ProcessRule):
            made.remove()  # a rule registered here goes


@_WATCHING
@pytest.mark.parametrize("layer", [0, 299, 599])
def test_the_watch_sees_an_in_place_change_to_any_of_many_tensors(layer: int, readers: str) -> None:
    model = Crowd()
    watch = Watch(model)
    assert watch.unchanged()
    with torch.no_grad():
        model.layers[layer].bias.add_(1)
    assert not watch.unchanged()


def test_the_compiled_readers_compare_with_a_record_as_their_bytes_do() -> None:
    # A later look compares in place with the first look's record: equal exactly when the
    # bytes would be, a record of another length never equal.
    if ops.extension_info()["in_use"] != "compiled":
        pytest.skip("dpmethods._C is not built")
    model = Crowd()
    reads = state.compiled_readers()
    watch = Watch(model)
    items = {"tensor_states": watch._tensors, "dict_versions": watch._dicts, "identities": watch._modules}
    for name, read in reads.items():
        record = read(items[name])
        assert isinstance(record, bytes) and len(record) > 8
        assert read(items[name], record) is True
        assert read(items[name], None) == record
        for other in (record[:-8], record + bytes(8), record[:-1], b"", bytes(len(record))):
            assert read(items[name], other) is False, name
        with pytest.raises(TypeError, match="record: expected bytes or None, got bytearray"):
            read(items[name], bytearray(record))
    before = reads["tensor_states"](watch._tensors)
    model.layers[599].weight.data = model.layers[599].weight.data.t()  # strides only
    assert reads["tensor_states"](watch._tensors, before) is False


def test_the_watch_sees_a_hook_removed() -> None:
    model = Watched()
    handle = model.lin.register_forward_hook(count_calls)
    watch = Watch(model)
    handle.remove()
    assert not watch.unchanged()


def test_the_watch_says_changed_when_it_cannot_tell(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Watched()
    monkeypatch.setattr(state, "versions_change", lambda: False)  # another torch
    assert not Watch(model).unchanged()
    monkeypatch.undo()
    with torch.inference_mode():
        model.register_buffer("frozen", torch.ones(1))  # no version counter
    assert not Watch(model).unchanged()


@_WATCHING
def test_a_versionless_watch_sees_all_but_an_inference_tensors_in_place_updates() -> None:
    # A thread map's look: a module holding inference tensors is not taken for changed at
    # every look (its replicas would be built again before every batch).
    model = Watched()
    with torch.inference_mode():
        model.register_buffer("frozen", torch.ones(1))  # no version counter
        model.tables["frozen"] = torch.ones(1)  # in an attribute object
    watch = Watch(model, versionless=True)
    assert watch.unchanged()
    with torch.inference_mode():
        model.frozen.add_(1)  # cannot be seen
        model.tables["frozen"].add_(1)
    assert watch.unchanged()
    assert state.versions_change() and not Watch(model).unchanged()  # the default: never unchanged
    model.lin.register_forward_hook(count_calls)
    assert not watch.unchanged()


@_WATCHING
@pytest.mark.xfail(strict=True, reason="writes through .data get a version counter of their own "
                   "and are not seen; update under torch.no_grad() instead")
def test_a_write_through_data_is_not_seen() -> None:
    model = Watched()
    watch = Watch(model)
    model.lin.weight.data.mul_(2)
    assert not watch.unchanged()


@pytest.fixture(scope="module")
def holder() -> Iterator[tuple[Holder, Any]]:
    torch.set_num_threads(1)
    h = Holder().eval()
    dp = dpmethods.DataParallel(h, device_ids=["cpu"] * 2, workers="processes")
    yield h, dp
    dp.close()


# Watched: Linear(4, 4), its hook's shift, a scale and four shifts, two Linear(4, 4),
# then Linear(4, 3).
_WATCHED_TERMS = 5 + 6 + 5 + 5 + 5


def _close(out: torch.Tensor, ref: torch.Tensor) -> bool:
    try:
        assert_close_to_reference(out, ref, terms=_WATCHED_TERMS)
    except AssertionError:
        return False
    return True


@pytest.mark.parametrize("name", list(CHANGES))
def test_a_change_between_batches_of_a_map_is_seen(holder: tuple[Holder, Any], name: str) -> None:
    h, dp = holder
    torch.manual_seed(1)
    h.model = Watched().eval()
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(3, 4, generator=g) for _ in range(6)]
    outs, before, after = [], [], []
    with torch.no_grad():
        for k, out in enumerate(dp.map("forward", xs, prefetch=1)):
            if k == 0:
                before = [h(x) for x in xs]
                CHANGES[name](h.model)
                after = [h(x) for x in xs]
            outs.append(out)
        called = dp(xs[0])
    assert not any(_close(a, b) for a, b in zip(before, after))  # the change shows
    # The batches sent before the change run with the module as it was: a prefix of
    # them (which depends on which worker finished first), and the last was sent after.
    sent_before = next((k for k, (out, ref) in enumerate(zip(outs, before)) if not _close(out, ref)), len(xs))
    assert 1 <= sent_before < len(xs)
    for out, ref in zip(outs, before[:sent_before] + after[sent_before:], strict=True):
        assert_close_to_reference(out, ref, terms=_WATCHED_TERMS)
    assert_close_to_reference(called, after[0], terms=_WATCHED_TERMS)


def _on(holder: tuple[Holder, Any], workers: str) -> tuple[Holder, Any]:
    """The holder's model on ``workers``: its pool of processes, or a thread wrapper."""
    h, dp = holder
    return (h, dp) if workers == "processes" else (h, dpmethods.DataParallel(h, device_ids=["cpu"] * 2))


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("name", list(HELD))
def test_what_a_module_holds_beside_its_tensors_and_children_is_seen(
    holder: tuple[Holder, Any], workers: str, name: str
) -> None:
    h, dp = _on(holder, workers)
    torch.manual_seed(1)
    h.model = Watched().eval()
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(3, 4, generator=g) for _ in range(6)]
    outs = []
    with torch.no_grad():
        dp(xs[0])  # the workers hold the model
        HELD[name](h.model)
        called, want = dp(xs[0]), h(xs[0])
        for k, out in enumerate(dp.map("forward", xs, prefetch=1)):
            if k == 0:  # again, between two batches: the last batch is sent after it
                before = h(xs[-1])
                HELD[name](h.model)
                after = h(xs[-1])
            outs.append(out)
    assert not _close(before, after)  # the change shows
    assert_close_to_reference(called, want, terms=_WATCHED_TERMS)
    assert_close_to_reference(outs[-1], after, terms=_WATCHED_TERMS)


@pytest.mark.parametrize("workers", WORKERS)
def test_an_inference_tensor_in_an_attribute_edited_in_place_is_seen(holder: tuple[Holder, Any], workers: str) -> None:
    # It has no version counter: its model is sent again at every look.
    h, dp = _on(holder, workers)
    h.model = Watched().eval()
    with torch.inference_mode():
        h.model.tables["offset"] = torch.zeros(4)
    xs = [torch.randn(3, 4) for _ in range(6)]
    outs = []
    with torch.inference_mode():
        dp(xs[0])
        h.model.tables["offset"].add_(1)
        called, want = dp(xs[0]), h(xs[0])
        for k, out in enumerate(dp.map("forward", xs, prefetch=1)):
            if k == 0:
                h.model.tables["offset"].add_(1)
            outs.append(out)
    assert_close_to_reference(called, want, terms=_WATCHED_TERMS)
    assert_close_to_reference(outs[-1], h(xs[-1]), terms=_WATCHED_TERMS)


def test_a_parameter_replaced_then_edited_in_place_is_seen(holder: tuple[Holder, Any]) -> None:
    # The second change is to a parameter the first look did not see: the look after
    # the first change must watch it.
    h, dp = holder
    h.model = Watched().eval()
    xs = [torch.randn(3, 4) for _ in range(8)]
    outs, refs = [], []
    with torch.no_grad():
        for k, out in enumerate(dp.map("forward", xs, prefetch=1)):
            outs.append(out)
            refs.append(h(xs[k]))
            if k == 1:
                h.model.lin.weight = nn.Parameter(h.model.lin.weight.detach().clone())  # equal values
            if k == 3:
                h.model.lin.weight.mul_(-1)
        called = dp(xs[-1])
    assert not _close(outs[-1], refs[3])  # the last batch ran after the edit
    assert_close_to_reference(outs[-1], h(xs[-1]), terms=_WATCHED_TERMS)
    assert_close_to_reference(called, h(xs[-1]), terms=_WATCHED_TERMS)


def test_a_class_marked_after_the_workers_hold_its_model_warns_there(holder: tuple[Holder, Any]) -> None:
    h, dp = holder
    h.model = MarkedLater()
    x = torch.randn(6, 4)
    with torch.no_grad():
        dp(x)  # the workers hold it, unmarked
        mark_batch_coupled(MarkedLater, what="marked by a test")
        dpmethods.vocab.warn_once.reset()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out = dp(x)  # split over both workers: the mark warns in them
    assert_close_to_reference(out, 2 * x, terms=1)
    assert [str(w.message) for w in seen if "MarkedLater couples the items of its batch (marked by a test)"
            in str(w.message)], [str(w.message) for w in seen]


def _on(holder: tuple[Holder, Any], workers: str) -> tuple[Holder, Any]:
    """The holder's model and a wrapper of it on ``workers`` (processes: the shared pool)."""
    h, dp = holder
    return h, (dp if workers == "processes" else dpmethods.DataParallel(h, device_ids=["cpu"] * 2))


@pytest.mark.parametrize("workers", WORKERS)
def test_a_method_patched_on_a_class_runs_in_the_workers(
    holder: tuple[Holder, Any], workers: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Workers import the model's classes from their modules: a method replaced on a class
    # in this process is set on theirs, before a call, between calls and between a map's
    # batches, and put back when it is restored here; no warning, as on threads.
    h, dp = _on(holder, workers)
    torch.manual_seed(0)
    h.model = Patched()
    x = torch.randn(5, 4)  # 3 + 2 rows
    original = Patched.forward
    with torch.no_grad():
        want = {"plain": h(x), "patched": patched_forward(h.model, x)}
        got: dict[str, Any] = {}
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            monkeypatch.setattr(Patched, "forward", patched_forward)
            got["patched"] = dp(x)
            monkeypatch.setattr(Patched, "forward", original)
            got["plain"] = dp(x)
            # 24: more than a map pulls ahead of its first output in order (the reorder
            # window, twice what the workers hold: 16 while each holds four short batches).
            batches = list(dp.map("forward", [x] * 24))
            it = dp.map("forward", [x] * 24)
            outs = [next(it)]
            monkeypatch.setattr(Patched, "forward", patched_forward)  # between two batches
            outs += list(it)
    assert not _close(want["plain"], want["patched"])  # the patch changes every row clearly
    for k in want:
        assert_close_to_reference(got[k], want[k], terms=_WATCHED_TERMS)
    assert_close_to_reference(batches, [want["plain"]] * 24, terms=_WATCHED_TERMS)
    assert_close_to_reference(outs[0], want["plain"], terms=_WATCHED_TERMS)
    assert_close_to_reference(outs[-1], want["patched"], terms=_WATCHED_TERMS)  # sent after the patch


def _class_warnings(seen: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in seen if "which import the class from its module" in str(w.message)]


@pytest.mark.parametrize("cls,there", [
    (Patched, "but the function tests.helpers.processes.Patched.forward"),
    # PatchedChild inherits forward: the workers' class lacks the one set here.
    (PatchedChild, "but not set on the class (it inherits one)"),
])
def test_a_patch_the_workers_cannot_import_is_a_warning(
    holder: tuple[Holder, Any], monkeypatch: pytest.MonkeyPatch, cls: type, there: str,
) -> None:
    # A lambda cannot be sent by reference: the workers would run the class's own method
    # (or the one it inherits), another model, so the caller is told once, with what to do.
    h, dp = holder
    h.model = cls()
    x = torch.randn(5, 4)
    monkeypatch.setattr(cls, "forward", lambda self, x: patched_forward(self, x))
    dpmethods.vocab.warn_once.reset()
    with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        dp(x)
        dp(x)
    said = _class_warnings(seen)
    assert len(said) == 1, said
    assert said[0].startswith(
        f"DataParallel(workers='processes'): tests.helpers.processes.{cls.__name__}.forward is the function "
        "tests.processes.test_process_workers.test_a_patch_the_workers_cannot_import_is_a_warning.<locals>.<lambda>"
    ), said[0]
    assert f"in this process, {there}" in said[0], said[0]
    assert "factory=" in said[0] and "workers='threads'" in said[0]


def test_a_patch_typed_in_the_main_module_is_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    # Code of `python -c` or an interactive session has no file ("<string>", "<stdin>"):
    # the workers cannot import it, so it is compared as the user's, where only code a
    # library generates ("<eval_with_key>.N") is not. check() as a worker runs it.
    ns: dict[str, Any] = {"__name__": "__main__"}
    exec("def fwd(self, x):\n    return x * 100\n", ns)  # as `python -c` defines it
    monkeypatch.setattr(Patched, "forward", ns["fwd"])
    sent = class_state(classes_of(Patched().modules()))
    monkeypatch.undo()  # the worker's class, as its module defines it
    dpmethods.vocab.warn_once.reset()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        check(sent, Patched())
    said = _class_warnings(seen)
    assert len(said) == 1 and "is the function __main__.fwd (<string>:1)" in said[0], said


def test_functions_a_library_adds_to_classes_as_it_runs_are_no_false_alarm(holder: tuple[Holder, Any]) -> None:
    # transformers gives nn.Module a smart_apply (a closure) and caches values on model
    # classes as it runs, and torch's dynamo wraps nn.Module.__init__: a worker's unpickled
    # model never made them, and needs none.
    h, dp = holder
    h.model = tiny_gpt2()
    assert hasattr(nn.Module, "smart_apply")  # made by the model's weight initialisation
    torch._dynamo.mutation_guard.install_generation_tagging_init()  # what compiling does
    assert "patched_init" in nn.Module.__init__.__qualname__
    ids = torch.tensor([[5, 6, 7], [8, 9, 10], [1, 2, 3]])
    with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        dp.module.model(ids)
        out = dp(ids)
    said = _class_warnings(seen)
    assert said == []
    assert out.logits.shape[0] == 3


@pytest.mark.parametrize("workers", WORKERS)
def test_a_function_a_library_from_its_source_checkout_adds_is_no_false_alarm(
    holder: tuple[Holder, Any], workers: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A library outside site-packages (pip install -e, a sys.path entry) adds a closure
    # to a class as it runs: the workers' class lacks it, and the model never uses it.
    h, dp = _on(holder, workers)
    h.model = Grown()
    x = torch.randn(5, 4)  # 3 + 2 rows
    monkeypatch.setattr(Grown, "tidy", library_addition(), raising=False)
    dpmethods.vocab.warn_once.reset()
    with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = [dp(x), *dp.map("forward", [x[:3], x[3:]])]
        want = [h(x), h(x[:3]), h(x[3:])]
    assert _class_warnings(seen) == []
    assert_close_to_reference(got, want, terms=5)  # Linear(4, 3)


@pytest.mark.parametrize("workers", WORKERS)
def test_a_method_added_in_the_caller_that_the_model_looks_up_is_a_warning(
    holder: tuple[Holder, Any], workers: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The other side: a lambda added to the class, which the model takes where its class
    # has one. The workers cannot import it, and run without it: the caller is told once,
    # when the model looks it up, with what to do.
    h, dp = _on(holder, workers)
    h.model = Grown()
    x = torch.randn(5, 4)
    with torch.no_grad():
        dp(x)  # the workers hold the model before the method is added
        monkeypatch.setattr(Grown, "fast_path", lambda self, x: self.lin(x) * 3, raising=False)
        dpmethods.vocab.warn_once.reset()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = [dp(x), dp(x), *dp.map("forward", [x[:3], x[3:]])]
        want = [h(x), h(x), h(x[:3]), h(x[3:])]
    said = _class_warnings(seen)
    if workers == "threads":
        assert said == []
        assert_close_to_reference(got, want, terms=5 + 1)  # Linear(4, 3), then the scaling
        return
    assert len(said) == 1, said
    assert said[0].startswith(
        "DataParallel(workers='processes'): tests.helpers.processes.Grown.fast_path is the function "
        "tests.processes.test_process_workers.test_a_method_added_in_the_caller_that_the_model_looks_up_is_a_warning"
        ".<locals>.<lambda>"), said[0]
    assert ("but absent from the class and its bases in the worker processes, which import the class from its "
            "module, and the model looked it up there") in said[0], said[0]
    assert "factory=" in said[0] and "workers='threads'" in said[0]
    # What the warning is about: the workers ran the class as its module defines it.
    assert_close_to_reference(got, [r / 3 for r in want], terms=5 + 1)


def test_a_model_with_gradient_checkpointing_enabled_is_sent(holder: tuple[Holder, Any]) -> None:
    # transformers 5's gradient_checkpointing_enable() hooks the input embeddings with a
    # local function (make_inputs_require_grads) and keeps its handles on the model: both
    # stay here, where the model could not be sent at all.
    h, dp = holder
    h.model = tiny_gpt2()
    h.model.gradient_checkpointing_enable()
    assert h.model.get_input_embeddings()._forward_hooks
    ids = torch.tensor([[5, 6, 7], [8, 9, 10], [1, 2, 3]])
    with torch.no_grad():
        want, got = h(ids), dp(ids)
    assert torch.allclose(got.logits, want.logits, atol=1e-5)


@pytest.fixture
def looks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per full look at a module (its fingerprint taken) by a pool."""
    taken: list[int] = []
    fingerprint = pool_module.fingerprint
    monkeypatch.setattr(pool_module, "fingerprint", lambda m: taken.append(1) or fingerprint(m))
    return taken


@_WATCHING
def test_an_unchanged_module_is_looked_at_once_per_change(holder: tuple[Holder, Any], looks: list[int]) -> None:
    h, dp = holder
    h.model = Watched().eval()
    xs = [torch.randn(3, 4) for _ in range(12)]
    with torch.no_grad():
        list(dp.map("forward", xs))  # the new model: one look
        list(dp.map("forward", xs))
        dp(xs[0])
        assert len(looks) == 1
        h.model.scale = 2.0
        dp(xs[0])
        list(dp.map("forward", xs))
    assert len(looks) == 2


def test_an_attribute_its_getstate_leaves_out_is_not_taken_for_a_change(
    holder: tuple[Holder, Any], looks: list[int]
) -> None:
    # The lock never crosses: what is sent, and so what is compared, is what
    # __getstate__ gives. Read from __dict__, it failed to pickle every time, and the
    # module was sent again before every batch and call.
    h, dp = holder
    h.model = Locked().eval()
    xs = [torch.randn(3, 4) for _ in range(6)]
    with torch.no_grad():
        outs = list(dp.map("forward", xs))
        dp(xs[0])
        list(dp.map("forward", xs))
        want = [h.model(x) for x in xs]
    assert len(looks) == 1
    for o, w in zip(outs, want):
        _same(o, w)


def test_the_module_is_not_moved_into_shared_memory(dp: Any, net: Net) -> None:
    with torch.no_grad():
        list(dp.map("encode", _batches(2)))
    assert not any(p.is_shared() for p in net.parameters())


def test_outputs_that_require_grad_are_an_error(dp: Any) -> None:
    x = torch.randn(4, 4)
    with pytest.raises(RuntimeError, match=r"requires grad, but autograd cannot cross processes.*workers='threads'") as info:
        list(dp.map("forward", [x]))
    assert "raised in batch 0 on worker" in "\n".join(info.value.__notes__)
    with pytest.raises(RuntimeError, match=r"requires grad.*workers='threads'"):
        dp(x)
    with torch.no_grad():
        assert dp(x).shape == (4, 3)  # and the pool still works


def test_no_worker_is_left_after_close_or_drop() -> None:
    dp = dpmethods.DataParallel(build_net(), device_ids=["cpu"] * 2, workers="processes")
    with torch.no_grad():
        list(dp.map("encode", _batches(3)))
    pids = _pids(dp)
    assert {p.pid for p in _workers()} >= set(pids)
    dp.close()
    assert not {p.pid for p in _workers()} & set(pids)
    with torch.no_grad():
        list(dp.map("encode", _batches(3)))  # starts fresh ones
    pids = _pids(dp)
    del dp
    gc.collect()
    assert not {p.pid for p in _workers()} & set(pids)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # joined: not even a zombie


def _run_script(tmp_path: Path, text: str, *flags: str) -> subprocess.CompletedProcess[str]:
    """``text`` run as a script file of its own (a worker needs a main module it can import)."""
    script = tmp_path / "script.py"
    script.write_text(text)
    # dpmethods as this test imported it: installed, or built in place (CI's torch 2.11 leg).
    root = str(Path(dpmethods.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, *flags, str(script)], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path, env=env)


_ORPHAN_SCRIPT = """
import multiprocessing, sys, time, torch, dpmethods
sys.path.insert(0, {tests!r})
from tests.helpers.long_runs import Faulty

if __name__ == "__main__":
    torch.set_num_threads(1)
    idle, busy = (dpmethods.DataParallel(Faulty(sys.argv[1]), device_ids=["cpu"] * 2, workers="processes")
                  for _ in range(2))
    x = torch.randn(3, 6)
    with torch.no_grad():
        idle.encode(x)
        busy.encode(x)
        print(*[p.pid for p in multiprocessing.active_children() if p.name.startswith("dpmethods-worker-")], flush=True)
        # batch 0 hangs in one of busy's workers; its other worker and idle's two wait
        list(busy.map("encode", [{{"x": x, "tag": i}} for i in range(4)], fault="hang", at=0))
        time.sleep(600)
"""


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc to tell a zombie from a process")
def test_workers_leave_when_their_caller_is_killed(tmp_path: Path) -> None:
    # SIGKILL leaves the caller no time to stop its workers: they must see it themselves,
    # busy (one runs a batch that hangs) or idle (the other, and another wrapper's two).
    script = tmp_path / "script.py"
    script.write_text(_ORPHAN_SCRIPT.format(tests=str(Path(__file__).resolve().parents[2])))
    root = str(Path(dpmethods.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    caller = subprocess.Popen([sys.executable, str(script), str(tmp_path)], cwd=tmp_path,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    pids: list[int] = []
    try:
        assert caller.stdout is not None
        pids = [int(p) for p in caller.stdout.readline().split()]
        assert len(pids) == 4, "the caller did not start its workers"
        end = time.monotonic() + 60
        while not (tmp_path / "hang").exists() and time.monotonic() < end:
            time.sleep(0.05)  # until a worker runs the batch that hangs
        assert (tmp_path / "hang").exists() and all(map(_running, pids))
        caller.kill()
        caller.wait()
        end = time.monotonic() + 60  # generous: they leave within seconds
        while any(map(_running, pids)) and time.monotonic() < end:
            time.sleep(0.1)
        assert not [p for p in pids if _running(p)], "workers outlived their killed caller"
    finally:
        caller.kill()
        caller.wait()
        if caller.stdout is not None:
            caller.stdout.close()
        for pid in pids:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


_UNGUARDED_SCRIPT = """
import torch, dpmethods

dp = dpmethods.DataParallel(torch.nn.Linear(4, 2), device_ids=["cpu"] * 2, workers="processes")
with torch.no_grad():
    list(dp.map("forward", [torch.randn(2, 4)], progress=True))
"""


def test_a_script_without_a_main_guard_is_told_why_its_workers_died(tmp_path: Path) -> None:
    # Each worker runs the main module again: unguarded, each worker reaches the
    # map again. It leaves quietly; the caller's one error says why.
    run = _run_script(tmp_path, _UNGUARDED_SCRIPT)
    assert run.returncode == 1
    assert run.stderr.count("Traceback") == 1, run.stderr  # the caller's, none from workers
    assert "it/s" not in run.stderr and "batch/s" not in run.stderr, run.stderr  # no progress bar
    last = run.stderr[run.stderr.index("Traceback"):]
    assert re.search(r"WorkerDiedError: DataParallel\(workers='processes'\): worker [01] "
                     r"\(pid \d+, device cpu\) stopped while starting: each worker runs the "
                     r"script's main module again, and this script starts its work without "
                     r"`if __name__ == \"__main__\":`", last), run.stderr
    assert "or use workers='threads'" in last
    assert "while running the construction of its model" not in run.stderr
    assert "its traceback is on stderr" not in run.stderr  # the general hint is for other deaths


_GUARDED_CLASS_SCRIPT = """
import torch, dpmethods

if __name__ == "__main__":
    class Net(torch.nn.Linear):  # a worker's __mp_main__ does not run this block
        pass

    dp = dpmethods.DataParallel(Net(4, 2), device_ids=["cpu"] * 2, workers="processes")
    with torch.no_grad():
        list(dp.map("forward", [torch.randn(2, 4)]))
"""


def test_a_model_class_the_workers_cannot_import_is_named(tmp_path: Path) -> None:
    run = _run_script(tmp_path, _GUARDED_CLASS_SCRIPT)
    assert run.returncode == 1
    assert "AttributeError: Can't get attribute 'Net'" in run.stderr, run.stderr
    assert ("raised while building its model (a class defined in __main__ of an interactive "
            "session, or inside `if __name__ == \"__main__\":`, cannot be imported by a worker "
            "process: define it at the top level of a module, or pass factory=, or use "
            "workers='threads')") in run.stderr


def test_a_model_that_cannot_be_pickled_fails_at_once() -> None:
    net = build_net()
    net.lin.register_forward_hook(lambda m, i, o: o)
    dp = dpmethods.DataParallel(net, device_ids=["cpu"] * 2, workers="processes")
    before = {p.pid for p in _workers()}
    with pytest.raises(TypeError) as info:
        next(dp.map("forward", [torch.randn(2, 4)]))
    text = str(info.value)
    assert "the module cannot be sent to a worker process" in text
    assert "module.lin._forward_hooks[" in text and "<lambda>" in text
    assert "workers='threads'" in text and "factory=" in text
    assert {p.pid for p in _workers()} <= before  # nothing was started


@pytest.mark.parametrize("devices", [1, 2])
def test_factory_builds_the_model_in_each_worker(devices: int) -> None:
    # Calls and maps alike, whatever the device count: one device runs in its worker too.
    dp = dpmethods.DataParallel(
        build_net(), device_ids=["cpu"] * devices, workers="processes", factory=build_net_doubled
    )
    try:
        model = build_net_doubled()
        batches = _batches(5)
        with torch.no_grad():
            for a, b in zip(dp.map("encode", batches), (model.encode(b) for b in batches)):
                _same(a, b)
            _same(dp(batches[2]), model(batches[2]))
            _same(dp.encode(batches[3])["y"], model.encode(batches[3])["y"])
    finally:
        dp.close()


def test_invalid_workers_and_factory() -> None:
    with pytest.raises(ValueError, match=r"workers: expected 'threads' or 'processes', got str 'fork'"):
        dpmethods.DataParallel(Net(), device_ids=["cpu"] * 2, workers="fork")
    with pytest.raises(TypeError, match=r"factory: expected a picklable zero-argument callable .*lambda"):
        dpmethods.DataParallel(Net(), device_ids=["cpu"] * 2, factory=lambda: Net())
    dp = dpmethods.DataParallel(Net(), device_ids=["cpu"] * 2)
    with pytest.raises(ValueError, match=r"workers: expected 'threads' or 'processes', got int 2"):
        dp.map("encode", [], workers=2)


def test_generate_without_no_grad_and_a_loss_in_maps_and_calls() -> None:
    pytest.importorskip("transformers")
    model = tiny_gpt2()
    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2, workers="processes")
    g = torch.Generator().manual_seed(0)
    batches = [
        {"input_ids": torch.randint(2, 64, (n, 5), generator=g), "max_new_tokens": k}
        for n, k in [(3, 4), (1, 9), (2, 2), (4, 6)]
    ]
    kwargs = {"do_sample": False, "pad_token_id": 1}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers' notes about attention masks
            ref = [model.generate(**b, **kwargs) for b in batches]
            outs = list(dp.map("generate", batches, **kwargs))  # grad on: generate turns it off
            call = dp.generate(**batches[3], **kwargs)
        for a, b in zip(outs, ref):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(call, ref[3], rtol=0, atol=0)
        # forward with labels: the loss joined as the full batch's, first in the output.
        ids = torch.randint(2, 64, (5, 6), generator=g)
        labels = ids.masked_fill(torch.rand(5, 6, generator=g) < 0.5, -100)
        with torch.no_grad():
            got, want = dp(input_ids=ids, labels=labels), model(input_ids=ids, labels=labels)
        assert list(got.keys()) == list(want.keys())
        assert_close_to_reference(got[0], want.loss, terms=TERMS + 5 * 6)  # a mean over the tokens
        assert_close_to_reference(got.logits, want.logits, terms=TERMS)
    finally:
        dp.close()


def test_sentence_transformers_encode(tmp_path: Path) -> None:
    model = tiny_sentence_transformer(tmp_path)
    sentences = random_sentences(24)
    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2, workers="processes")
    try:
        want = model.encode(sentences)
        terms = transformer_terms(width=32, ff=37, seq=7, layers=2) + 7  # tiny BERT, mean pooling
        assert_close_to_reference(dp.encode(sentences), want, terms=terms)
        parts = list(dp.map("encode", [sentences[:10], sentences[10:]]))
        assert_close_to_reference(np.concatenate(parts), want, terms=terms)
    finally:
        dp.close()


@pytest.mark.cuda
@pytest.mark.parametrize("output_device", [None, "cpu"])
def test_cuda_workers_match_one_device(output_device: str | None) -> None:
    # One worker per GPU, or two on one GPU (repeated ids). The model is on the GPU
    # (its tensors go to shared CPU memory, each worker moves them to its device);
    # CPU batches are moved in the worker, CUDA batches and outputs cross by CUDA IPC.
    count = torch.cuda.device_count()
    ids = list(range(count)) if count > 1 else [0, 0]
    net = build_net().to("cuda:0")
    dp = dpmethods.DataParallel(net, device_ids=ids, output_device=output_device, workers="processes")
    target = torch.device(output_device or "cuda:0")
    batches = [b for b in _batches(7) if b.shape[0] > 1]
    try:
        with torch.no_grad():
            ref = [net.encode(b.cuda()) for b in batches]
            outs = list(dp.map("encode", batches))
            outs += list(dp.map("encode", [b.cuda() for b in batches]))
            called = dp.encode(batches[0].cuda())
        torch.cuda.synchronize()
        for got, want in zip(outs, ref + ref, strict=True):
            assert got["y"].device == target and got["n"] == want["n"]
            # Linear(4, 3), a scale; then a 3-wide norm.
            assert_close_to_reference(got["y"], want["y"].to(target), terms=6)
            assert_close_to_reference(got["norm"], want["norm"].to(target), terms=9)
        assert called["y"].device == target
        assert_close_to_reference(called["y"], ref[0]["y"].to(target), terms=6)
        assert not any(p.is_shared() for p in net.parameters())
        assert all(p.device == torch.device("cuda:0") for p in net.parameters())
    finally:
        dp.close()
    assert _workers() == []


# --- One contract: each case on threads and on processes, the thread result the reference.


@pytest.fixture(scope="module")
def contract() -> Iterator[dict[str, Any]]:
    pytest.importorskip("transformers")
    torch.set_num_threads(1)
    model = Contract().eval()
    wrappers = {
        kind: dpmethods.DataParallel(model, device_ids=["cpu"] * 2, workers=kind)
        for kind in ("threads", "processes")
    }
    yield wrappers
    wrappers["processes"].close()


_KINDS = pytest.mark.parametrize("workers", ["threads", "processes"])


def _ids(n: int = 4, t: int = 5, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, 64, (n, t), generator=torch.Generator().manual_seed(seed))


@_KINDS
def test_attribute_objects_edited_in_place_are_seen(contract: dict[str, Any], workers: str) -> None:
    ref, dp = contract["threads"], contract[workers]
    gpt, x, ids = dp.module.gpt, torch.randn(4, 4), _ids()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes on generation settings
        dp.hidden(ids), dp.generate(ids), dp.scaled(x)  # the workers hold the model now
        saved = gpt.generation_config.max_new_tokens
        try:
            gpt.config.output_hidden_states = True
            gpt.generation_config.max_new_tokens = 6
            dp.module.options["scale"] = 3.0
            got = (dp.hidden(ids), dp.generate(ids), dp.scaled(x))
            want = (ref.hidden(ids), ref.generate(ids), ref.scaled(x))
        finally:
            gpt.config.output_hidden_states = False
            gpt.generation_config.max_new_tokens = saved
            dp.module.options["scale"] = 1.0
    assert int(want[0]["hidden"][0]) == gpt.config.n_layer + 1 and want[1].shape == (4, 5 + 6)
    _same(got[0], want[0])
    assert got[1].shape == want[1].shape and torch.equal(got[1], want[1])
    _same(got[2], want[2])
    # Linear(4, 3): 4 products and the bias, then one scaling.
    assert_close_to_reference(want[2], 3.0 * dp.module.lin(x).detach(), terms=6)


@_KINDS
def test_requires_grad_changes_are_seen(contract: dict[str, Any], workers: str) -> None:
    ref, dp = contract["threads"], contract[workers]
    x = torch.randn(4, 4)
    with torch.no_grad():
        dp.scaled(x)
    dp.module.lin.requires_grad_(False)
    try:
        got, want = dp.scaled(x), ref.scaled(x)  # grad on: nothing requires grad now
    finally:
        dp.module.lin.requires_grad_(True)
    assert not want.requires_grad
    _same(got, want)


@_KINDS
def test_output_capturing_hooks_of_one_call_are_not_sent(contract: dict[str, Any], workers: str) -> None:
    ref, dp = contract["threads"], contract[workers]
    ids = _ids(seed=1)
    with torch.no_grad():
        # transformers installs its output-capturing hooks on the model it ran on.
        dp.module.gpt(ids, output_attentions=True, output_hidden_states=True)
        assert any(m._forward_hooks for m in dp.module.gpt.modules())
        dp.module.gpt.config.output_hidden_states = True
        try:
            got, want = dp.hidden(ids), ref.hidden(ids)
            [mapped] = list(dp.map("hidden", [ids]))
        finally:
            dp.module.gpt.config.output_hidden_states = False
    assert int(want["hidden"][0]) == dp.module.gpt.config.n_layer + 1
    _same(got, want)
    _same(mapped, want)


@_KINDS
def test_an_output_object_that_requires_grad_is_never_detached(contract: dict[str, Any], workers: str) -> None:
    dp, x = contract[workers], torch.randn(3, 4)
    want = contract["threads"].module.boxed(x)
    if workers == "threads":
        [got] = list(dp.map("boxed", [x]))
        assert got.t.requires_grad and got.t.grad_fn is not None
        assert_close_to_reference(got.t, want.t, terms=5)  # Linear(4, 3)
        return
    with pytest.raises(RuntimeError, match=r"requires grad, but autograd cannot cross processes"):
        list(dp.map("boxed", [x]))
    with torch.no_grad():
        [got] = list(dp.map("boxed", [x]))
    assert_close_to_reference(got.t, want.t.detach(), terms=5)  # Linear(4, 3)


@_KINDS
def test_worker_warnings_reach_the_caller_once(contract: dict[str, Any], workers: str) -> None:
    dp, x = contract[workers], torch.randn(4, 4)
    a, b = torch.randn(8, 3), torch.randn(8, 3)
    mark_batch_coupled(InBatchLoss, what="in-batch negatives")  # after the workers started
    dpmethods.vocab.warn_once.reset()
    with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        dp.warns(x), dp.warns(x)
        list(dp.map("warns", [x, x, x]))
        per_share, again = dp.coupled(a, b), dp.coupled(a, b)
    texts = [str(w.message) for w in seen]
    # "always": the plain warning once per replica call (2 + 2 + 3); the warn-once ones once.
    assert texts.count("contract: a plain warning") == 7, texts
    assert texts.count("contract: a warn-once warning") == 1, texts
    coupled = [t for t in texts if "InBatchLoss couples the items of its batch (in-batch negatives)" in t]
    assert len(coupled) == 1, texts
    assert len(texts) == 9, texts
    with torch.no_grad():
        # Each share's a @ b.T (3 products), its cross-entropy over 4 columns, the row mean and the join.
        assert_close_to_reference(per_share, contract["threads"].coupled(a, b), terms=3 + 4 + 4 + 2)
        assert not torch.allclose(per_share, dp.module.loss(a, b))  # what the warning is about
    assert_close_to_reference(again, per_share, terms=3 + 4 + 4 + 2)  # the same computation again


@_KINDS
def test_records_a_method_logs_reach_the_callers_loggers(
    contract: dict[str, Any], workers: str, caplog: pytest.LogCaptureFixture,
) -> None:
    # A library logs (transformers' logger.warning and warning_once): the caller's level,
    # filters and handlers decide, as for a replica thread's; a *_once record once. The
    # workers make the records the caller's levels let through (an info it shows).
    dp, x = contract[workers], torch.randn(5, 4)  # 3 + 2 rows
    name = "tests.helpers.processes.contract"
    dpmethods.vocab.warn_once.reset()
    NOTED.clear()  # this process's: each worker has its own
    with torch.no_grad():
        with caplog.at_level(logging.WARNING, logger=name):
            dp.logs(x)
            list(dp.map("logs", [x[:3], x[3:]]))
        records = [r for r in caplog.records if r.name == name]
        logged = [(r.levelname, r.getMessage()) for r in records]
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger=name):  # the caller silences its warnings
            dp.logs(x)
        silenced = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == name]
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=name):  # and shows its info, a level under the default
            list(dp.map("logs", [x[:3], x[3:]]))
        informed = [r.getMessage() for r in caplog.records if r.name == name and r.levelno == logging.INFO]
    messages = [m for _, m in logged]
    shares = ["contract: logged 3 rows", "contract: logged 2 rows"] * 2
    assert sorted(m for m in messages if "rows" in m) == sorted(shares), logged
    assert messages.count("contract: logged with its traceback") == 4, logged  # a record per share
    assert messages.count("contract: logged once") == 1, logged  # once per worker, given once here
    assert {lvl for lvl, _ in logged} == {"WARNING", "ERROR"}, logged  # no info record under WARNING
    assert informed == ["contract: an info record"] * 2, informed  # a record per batch
    assert silenced == [("ERROR", "contract: logged with its traceback")] * 2, silenced
    traced = next(r for r in records if r.getMessage() == "contract: logged with its traceback")
    text = traced.exc_text or logging.Formatter().formatException(traced.exc_info)
    assert "ValueError: contract: the logged error" in text, text


@_KINDS
def test_an_exception_whose_init_takes_other_arguments_is_raised_as_its_own_class(
    contract: dict[str, Any], workers: str,
) -> None:
    # Pickle rebuilds an exception by calling its class with its args: one with a
    # keyword-only argument fails to, and must not come back as another class (an
    # `except CodedError` would miss it), nor lose its attributes.
    dp, x = contract[workers], torch.randn(5, 4)  # 3 + 2 rows
    with pytest.raises(CodedError) as called:
        dp.fails(x)
    with pytest.raises(CodedError) as mapped:
        list(dp.map("fails", [x[3:]]))
    assert str(called.value) in ("contract: failed with code 3", "contract: failed with code 2")
    assert str(mapped.value) == "contract: failed with code 2"
    assert called.value.code in (3, 2) and mapped.value.code == 2
    assert any("on " in n for n in mapped.value.__notes__), mapped.value.__notes__  # where it ran


@_KINDS
def test_a_warning_made_an_error_fails_the_batch_it_came_from(contract: dict[str, Any], workers: str) -> None:
    dp, x = contract[workers], torch.randn(4, 4)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # as -W error
        with pytest.raises(UserWarning, match="contract: a plain warning") as call:
            dp.warns(x)
        with pytest.raises(UserWarning, match="contract: a plain warning") as mapped:
            list(dp.map("warns", [x, x]))
        [yielded, _] = list(dp.map("warns", [x, x], errors="yield"))
    where = "replica 0" if workers == "threads" else "share 0"  # each names where it ran
    assert any(where in n for n in call.value.__notes__), call.value.__notes__
    # Both batches warn: the map fails with whichever finished first.
    assert any(re.search(r"batch [01] on", n) for n in mapped.value.__notes__), mapped.value.__notes__
    assert isinstance(yielded, UserWarning) and any("batch 0 on" in n for n in yielded.__notes__)


@_KINDS
def test_channels_last_survives_the_trip(contract: dict[str, Any], workers: str) -> None:
    dp = contract[workers]
    x = torch.randn(4, 3, 5, 6).to(memory_format=torch.channels_last)
    big = torch.randn(4, 3, 120, 120).to(memory_format=torch.channels_last)  # through shared memory
    with torch.no_grad():
        want = [contract["threads"](t) for t in (x, big)]
        got = [dp(t) for t in (x, big)] + list(dp.map("forward", [x, big]))
    for out, ref in zip(got, want + want, strict=True):
        assert ref.is_contiguous(memory_format=torch.channels_last)
        assert out.stride() == ref.stride()
        assert_close_to_reference(out, ref, terms=4)  # a 1x1 Conv2d of 3 channels and its bias


@_KINDS
def test_conjugate_and_negative_views_keep_their_values(contract: dict[str, Any], workers: str) -> None:
    # A view with the conjugate or negative bit shows other values than its storage holds.
    dp, g = contract[workers], torch.Generator().manual_seed(3)
    small = torch.randn(5, 3, dtype=torch.complex64, generator=g).conj()
    big = torch.randn(5, 8000, dtype=torch.complex64, generator=g).conj()  # through shared memory
    with torch.no_grad():
        got = [dp.views(z) for z in (small, big)] + list(dp.map("views", [small, big]))
    for out, z in zip(got, [small, big] * 2, strict=True):
        want = {"given": z, "conj": z.conj(), "neg": z.conj().imag}  # each value is exact
        for key, ref in want.items():
            assert torch.equal(out[key].resolve_conj().resolve_neg(), ref.resolve_conj().resolve_neg()), key




@_KINDS
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning")
def test_a_nested_tensor_output_keeps_its_pieces(contract: dict[str, Any], workers: str) -> None:
    dp, g = contract[workers], torch.Generator().manual_seed(6)
    batches = [torch.randn(n, 4, generator=g) for n in (3, 5)]
    with torch.no_grad():
        got = list(dp.map("nested", batches))
        want = [dp.module.lin(b) for b in batches]
    for out, ref in zip(got, want, strict=True):
        assert out.is_nested
        assert [torch.equal(a, b) for a, b in zip(out.unbind(), (ref[:1], ref[1:]), strict=True)] == [True, True]

@_KINDS
def test_a_model_whose_tensors_are_more_than_their_storage_keeps_their_values(workers: str) -> None:
    # The model's parameters and buffers cross as their storages: a conjugate or negative
    # view must arrive with the values it shows, a quantized tensor with its quantizer.
    model = BeyondStorage().eval()
    x = torch.randn(5, 3, dtype=torch.complex64, generator=torch.Generator().manual_seed(5))
    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2, workers=workers)
    try:
        with torch.no_grad():
            got = [dp(x), *dp.map("forward", [x[:3], x[3:]])]
            want = [model(x), model(x[:3]), model(x[3:])]  # elementwise products: exact
    finally:
        dp.close()
    for out, ref in zip(got, want, strict=True):
        assert {k: torch.equal(v, ref[k]) for k, v in out.items()} == dict.fromkeys(ref, True)

@_KINDS
def test_sparse_parameters_arrive_as_parameters(workers: str) -> None:
    # A sparse parameter crosses as its parts: it must arrive an nn.Parameter, with its
    # requires_grad, in parameters() and the state dict, as a replica thread sees it,
    # and without torch's note that CSR is in beta, which this process gave already.
    model = SparseHeld().eval()
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(6))  # 3 + 2 rows
    # Shared: a thread replica holds the module's parameters. Replicas on distinct
    # devices hold torch's copies, plain tensors (tests/stages/test_replica_modes.py).
    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2, workers=workers, cpu_replicas="shared")
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error")  # the model's rebuild in a worker gives none
            got = [dp.described(x), *dp.map("described", [x[:3], x[3:]])]
            want = [model.described(x), model.described(x[:3]), model.described(x[3:])]
    finally:
        dp.close()
    assert want[0]["facts"][0].tolist() == [3, 2, True, True, False, False, True, True, False, True]
    for out, ref in zip(got, want, strict=True):
        assert torch.equal(out["facts"], ref["facts"])
        assert_close_to_reference(out["y"], ref["y"], terms=4)  # one product of each of the 4 diagonals


def test_a_parametrized_module_is_sent_and_sent_again_when_changed() -> None:
    # torch refuses to pickle a parametrized module (its class is made per module), and
    # weight_norm's state-dict hook is a local function: both are made again in a worker.
    model = Parametrized().eval()
    x = torch.randn(5, 2, 8, generator=torch.Generator().manual_seed(3))
    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2, workers="processes")
    terms = mlp_terms(2 * 3, 4) + 8  # the conv's taps, the mean over 8 positions, the Linear
    try:
        with torch.no_grad():
            assert_close_to_reference(dp(x), model(x), terms=terms)
            model.conv.parametrizations.weight.original0.mul_(3.0)  # the norm g, in place
            want = model(x)
            assert_close_to_reference(dp(x), want, terms=terms)
            assert_close_to_reference(torch.cat(list(dp.map("forward", [x[:3], x[3:]]))), want, terms=terms)
    finally:
        dp.close()


def test_a_parametrized_module_is_sent_as_its_own_getstate_gives_it() -> None:
    # A parametrized module goes as its original class's state: a lock that class's
    # __getstate__ leaves out stays out, as for the module unparametrized.
    model = nn.utils.parametrizations.weight_norm(LockedLinear(4, 3)).eval()
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(4))
    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2, workers="processes")
    try:
        with torch.no_grad():
            assert_close_to_reference(dp(x), model(x), terms=mlp_terms(4) + 4)  # the Linear, the norm
    finally:
        dp.close()


_EXIT_SCRIPT = """
import os, sys, torch, dpmethods
sys.path.insert(0, {tests!r})
from tests.helpers.processes import SemaphoreNet


class Wide(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(256, 256)

    def forward(self, x, *rest):
        return self.lin(x)


SHM = os.path.isdir("/dev/shm")  # where Linux keeps named semaphores and torch's shared memory


def left(names, pids):
    if not SHM:
        return []
    shm = os.listdir("/dev/shm")
    return [n for n in shm if any(n == "sem." + s.lstrip("/") for s in names)
            or any(n.startswith(f"torch_{{p}}_") for p in pids)]


if __name__ == "__main__":
    torch.set_num_threads(1)
    x = torch.randn(2, 4)
    dp = dpmethods.DataParallel(SemaphoreNet(), device_ids=["cpu"] * 2, workers="processes")
    with torch.no_grad():
        made = dp.semaphore(x) + [s for out in dp.map("semaphore", [x, x]) for s in out]
    names, pids = made[0::2], made[1::2]
    assert not SHM or all(os.path.exists("/dev/shm/sem." + n.lstrip("/")) for n in names), names
    dp.close()
    print("after close:", left(names, pids))
    wide = dpmethods.DataParallel(Wide(), device_ids=["cpu"] * 2, workers="processes")
    # Each batch has 40 tensors over the inline size: 40 descriptors for a worker to fetch.
    batches = [tuple(torch.randn(300, 256) for _ in range(40)) for _ in range(4)]
    with torch.no_grad():
        list(wide.map("forward", batches))
    for _ in range(3):
        try:
            next(iter(wide.map("forward", batches)))  # fails (requires grad), batches in flight
        except RuntimeError:
            wide.close()  # stops the workers while they may still fetch the batches after
    dp = dpmethods.DataParallel(SemaphoreNet(), device_ids=["cpu"] * 2, workers="processes")
    with torch.no_grad():
        made = dp.semaphore(x)
    print("at exit:", " ".join(made))  # not closed: interpreter exit stops the workers
"""


def test_close_and_exit_leave_nothing_behind(tmp_path: Path) -> None:
    # Workers leave through the normal exit path, so the named semaphores their methods
    # made (as torch.compile and loky make them) are unlinked by multiprocessing; and a
    # worker stopped (by close, or by the interpreter's exit) while it fetched a batch's
    # shared memory leaves no traceback from multiprocessing's resource sharer. Where there
    # is no /dev/shm (macOS), only the latter is checked.
    tests = str(Path(__file__).resolve().parents[2])
    run = _run_script(tmp_path, _EXIT_SCRIPT.format(tests=tests), "-W", "always")
    assert run.returncode == 0, run.stderr
    assert "leaked" not in run.stderr and "Traceback" not in run.stderr, run.stderr
    if not os.path.isdir("/dev/shm"):
        return
    lines = dict(line.split(": ", 1) for line in run.stdout.splitlines())
    assert lines["after close"] == "[]", run.stdout
    made = lines["at exit"].split()
    names, pids = made[0::2], made[1::2]
    shm = os.listdir("/dev/shm")
    assert not [n for n in shm if n in {"sem." + s.lstrip("/") for s in names}], shm
    assert not [n for n in shm if any(n.startswith(f"torch_{p}_") for p in pids)], shm


def test_seeded_sampling_is_reproducible_in_process_workers(contract: dict[str, Any]) -> None:
    # Each worker has its own generator: a call seeds chunk i, a map batch i, from one
    # draw of the caller's generator. docs/generate.md#sampling-and-seeds.
    dp, x = contract["processes"], torch.randn(6, 4)
    batches = [x[:2], x[2:5], x[5:], x]

    def run(seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        torch.manual_seed(seed)
        with torch.no_grad():
            return dp.noisy(x), list(dp.map("noisy", batches))

    (call, mapped), (call_again, mapped_again), (other, other_mapped) = run(0), run(0), run(1)
    torch.testing.assert_close(call, call_again, rtol=0, atol=0)
    for a, b in zip(mapped, mapped_again, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(call, other)
    assert not any(torch.equal(a, b) for a, b in zip(mapped, other_mapped))
    # Each worker, and each batch, draws numbers of its own: on zeros an output is the
    # bias plus the draws, and no share or batch repeats another's.
    zeros = torch.zeros(6, 4)
    with torch.no_grad():
        shares = dp.noisy(zeros)
        first, second = dp.map("noisy", [zeros[:2], zeros[:3]])
    assert not torch.equal(shares[:3], shares[3:])
    assert not torch.equal(first, second[:2])
    # A batch's samples do not depend on which worker ran it: one worker gives the same.
    one = dpmethods.DataParallel(dp.module, device_ids=["cpu"], workers="processes")
    try:
        torch.manual_seed(1)
        with torch.no_grad():
            dp.noisy(x)  # the same draws as run(1) before its map
            alone = list(one.map("noisy", batches))
    finally:
        one.close()
    for a, b in zip(alone, other_mapped, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)



@pytest.mark.parametrize("user_setting", [None, "3"])
def test_workers_start_with_their_thread_count(monkeypatch: pytest.MonkeyPatch, user_setting: str | None) -> None:
    # OpenMP reads OMP_NUM_THREADS when a worker imports torch: it is set for the worker's
    # start only (a user's own setting is kept), and the caller's environment is left as it was.
    if user_setting is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", user_setting)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)  # what the workers share
    dp = dpmethods.DataParallel(EnvProbe(), device_ids=["cpu"] * 2, workers="processes")
    try:
        [(_, env, threads)] = list(dp.map("forward", [torch.ones(1)]))
    finally:
        dp.close()
    assert env == (user_setting or "2") and threads == 2
    assert os.environ.get("OMP_NUM_THREADS") == user_setting


def test_the_first_model_is_built_without_the_collector_then_frozen() -> None:
    # Its build imports the libraries: they are frozen (later collections skip them),
    # after one collection, so the build's cyclic garbage is not frozen with them.
    dp = dpmethods.DataParallel(GcProbe(), device_ids=["cpu"] * 2, workers="processes", factory=build_gc_probe)
    try:
        [(_, enabled, frozen, model_frozen, collected)] = list(dp.map("forward", [torch.ones(1)]))
    finally:
        dp.close()
    assert enabled and frozen > 0 and model_frozen and collected


def test_a_second_model_unfreezes_the_first() -> None:
    probe = GcProbe()
    dp = dpmethods.DataParallel(probe, device_ids=["cpu"] * 2, workers="processes")
    try:
        list(dp.map("forward", [torch.ones(1)]))
        probe.scale = 2.0  # a new model goes to the workers
        [(out, enabled, frozen, model_frozen, _)] = list(dp.map("forward", [torch.ones(1)]))
    finally:
        dp.close()
    assert out.tolist() == [2.0] and enabled and frozen == 0 and not model_frozen
