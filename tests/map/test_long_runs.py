"""Long maps that lose nothing: retries of a dead worker, per-batch timeouts and
out-of-memory splitting, on threads and on worker processes, compared with one device."""

from __future__ import annotations

import concurrent.futures as cf
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import dpmethods
from dpmethods.processes.pool import WorkerDiedError
from dpmethods.testing import assert_close_to_reference
from tests.helpers import WORKERS
from tests.helpers.long_runs import (
    Faulty,
    arm_hang,
    out_of_memory_above,
    records,
    release_hung,
    rows_run,
)
from tests.helpers.models import tiny_gpt2
from tests.helpers.processes import build_net, gone
from tests.helpers.terms import mlp_terms

pytestmark = pytest.mark.timeout(180)
N, ROWS, TIMEOUT = 8, 3, 1.0  # TIMEOUT: what a hung batch waits out; the others take milliseconds


@pytest.fixture(autouse=True)
def _free_hung_threads() -> Iterator[None]:
    arm_hang()
    yield
    release_hung()  # a thread that timed out may go on (its replica is no longer used)


def _batches(rows: int = ROWS, n: int = N) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(3)
    return [{"x": torch.randn(rows, 6, generator=g), "tag": i} for i in range(n)]


def _dp(model: torch.nn.Module, workers: str, devices: int = 2, **options: Any) -> Any:
    torch.manual_seed(0)
    return dpmethods.DataParallel(model, device_ids=["cpu"] * devices, workers=workers, **options)


def _reference(model: Faulty, method: str, batches: list[dict[str, Any]]) -> list[Any]:
    with torch.no_grad():
        return [model.unlimited(method, b["x"]) for b in batches]


# --- retries: a worker process that dies ------------------------------------------


# How each fault ends a worker: SIGKILL kills it; SIGTERM (kill <pid>) makes it leave
# after replying (its batch's SystemExit once ended the caller mid-map).
_ENDED = {"kill": r"died with exit code -9 \(SIGKILL\)", "term": r"was stopped by SIGTERM \(SystemExit\)"}


@pytest.mark.parametrize("fault", list(_ENDED))
def test_an_ended_worker_is_replaced_and_its_batch_runs_again(tmp_path: Path, fault: str) -> None:
    model = Faulty(tmp_path)
    dp = _dp(model, "processes")
    batches = _batches()
    with torch.no_grad():
        outs = list(dp.map("encode", batches, fault=fault, at=3))
    dp.close()
    assert (tmp_path / fault).exists()  # the fault struck
    assert_close_to_reference(outs, _reference(model, "encode", batches), terms=mlp_terms(6))


@pytest.mark.parametrize("fault", list(_ENDED))
@pytest.mark.parametrize("errors", ["raise", "yield"])
def test_with_no_retries_the_error_names_the_batch_the_worker_and_how_it_ended(
    tmp_path: Path, errors: str, fault: str
) -> None:
    model = Faulty(tmp_path)
    dp = _dp(model, "processes")
    batches = _batches()
    with torch.no_grad():
        if errors == "raise":
            with pytest.raises(WorkerDiedError) as info:
                list(dp.map("encode", batches, fault=fault, at=3, retries=0))
            error: BaseException = info.value
        else:
            outs = list(dp.map("encode", batches, fault=fault, at=3, retries=0, errors="yield"))
            error = outs.pop(3)
            assert_close_to_reference(outs, [r for i, r in enumerate(_reference(model, "encode", batches)) if i != 3],
                                      terms=mlp_terms(6))
        again = list(dp.map("encode", batches))  # the caller goes on, on a fresh worker
    dp.close()
    assert isinstance(error, WorkerDiedError)
    found = re.search(r"DataParallel.map: batch 3 failed 1 time\(s\) \(retries=0\): worker \d \(pid (\d+), "
                      rf"device cpu\) {_ENDED[fault]} while running it; a fresh worker replaced it", str(error))
    assert found, error
    assert_close_to_reference(again, _reference(model, "encode", batches), terms=mlp_terms(6))
    assert gone(int(found.group(1)))


def test_batches_waiting_behind_a_call_whose_worker_died_run_again_without_using_a_retry(tmp_path: Path) -> None:
    model = Faulty(tmp_path)
    dp = _dp(model, "processes")
    batches = _batches()

    def kill_once_the_map_ran_a_batch(pid: int) -> None:
        # The map sends both workers a batch before it takes any: one now waits behind
        # the hung share.
        while ROWS not in [rows for rows, _ in rows_run(tmp_path)]:
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)

    with torch.no_grad(), cf.ThreadPoolExecutor(2) as threads:
        call = threads.submit(torch.no_grad()(dp.encode), torch.randn(4, 6), tag=0, fault="hang", at=0)  # one hangs
        while not records(tmp_path, "struck"):
            time.sleep(0.01)
        [(hung,)] = records(tmp_path, "struck")
        killer = threads.submit(kill_once_the_map_ran_a_batch, hung)
        outs = list(dp.map("encode", batches, retries=0))
        killer.result()
        with pytest.raises(WorkerDiedError, match=rf"\(pid {hung}, device cpu\) died with exit code -9") as info:
            call.result()
    dp.close()
    assert info.value.started  # the call's share was running
    assert_close_to_reference(outs, _reference(model, "encode", batches), terms=mlp_terms(6))


def test_a_batch_that_kills_every_worker_fails_after_its_retries(tmp_path: Path) -> None:
    dp = _dp(Faulty(tmp_path), "processes")
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"batch 2 failed 3 time\(s\) \(retries=2\): worker"):
        list(dp.map("encode", _batches(), fault="kill-always", at=2, retries=2))
    with torch.no_grad():  # the map after it has fresh workers
        assert len(list(dp.map("encode", _batches()))) == N
    dp.close()


# --- timeouts ----------------------------------------------------------------------


def test_a_hung_worker_process_is_killed_replaced_and_its_batch_retried(tmp_path: Path) -> None:
    model = Faulty(tmp_path)
    dp = _dp(model, "processes")
    batches = _batches()
    with torch.no_grad():
        outs = list(dp.map("encode", batches, fault="hang", at=2, timeout=TIMEOUT))
    dp.close()
    assert (tmp_path / "hang").exists()
    assert_close_to_reference(outs, _reference(model, "encode", batches), terms=mlp_terms(6))


def test_a_hung_process_batch_without_retries_is_a_timeout_error(tmp_path: Path) -> None:
    model = Faulty(tmp_path)
    dp = _dp(model, "processes")
    with torch.no_grad(), pytest.raises(TimeoutError) as info:
        list(dp.map("encode", _batches(), fault="hang", at=2, timeout=TIMEOUT, retries=0))
    dp.close()
    assert re.search(r"batch 2 failed 1 time\(s\) \(retries=0\): it ran longer than timeout=1.0 s on "
                     r"worker \d \(pid \d+, device cpu\), which was killed", str(info.value)), info.value


@pytest.mark.parametrize("errors", ["raise", "yield"])
def test_a_hung_thread_is_a_timeout_error_and_its_replica_is_dropped(tmp_path: Path, errors: str) -> None:
    model = Faulty(tmp_path)
    dp = _dp(model, "threads")
    batches = _batches()
    pattern = (r"DataParallel.map: batch 2 ran longer than timeout=\S+ s on replica (\d) \(device cpu\); "
               r"a thread cannot be stopped, so replica \1 takes no more batches of this map")
    with torch.no_grad():
        if errors == "raise":
            with pytest.raises(TimeoutError, match=pattern):
                list(dp.map("encode", batches, fault="hang", at=2, timeout=1.0))
            return
        outs = list(dp.map("encode", batches, fault="hang", at=2, timeout=TIMEOUT, errors="yield"))
    assert isinstance(outs[2], TimeoutError) and re.search(pattern, str(outs[2]))
    fine = [i for i in range(N) if i != 2]
    ref = _reference(model, "encode", batches)
    assert_close_to_reference([outs[i] for i in fine], [ref[i] for i in fine], terms=mlp_terms(6))


@pytest.mark.parametrize("workers", WORKERS)
def test_a_hung_batch_under_errors_yield_is_a_timeout_error_in_its_place_on_both_backends(
    tmp_path: Path, workers: str,
) -> None:
    # One scheduler for both: the hung batch's TimeoutError takes its place, as its
    # (index, output) pair, and every other batch runs (threads: on the replica left;
    # processes: the killed worker's batches on its replacement).
    model = Faulty(tmp_path)
    dp = _dp(model, workers)
    batches = _batches()
    with torch.no_grad():
        pairs = list(dp.map("encode", batches, fault="hang", at=2, timeout=TIMEOUT, retries=0, errors="yield",
                            ordered=False))
    dp.close()
    assert sorted(i for i, _ in pairs) == list(range(N))
    outs = dict(pairs)
    assert isinstance(outs[2], TimeoutError), outs[2]
    assert re.search(r"DataParallel.map: batch 2 .*(ran|it ran) longer than timeout=1.0 s on "
                     r"(replica|worker) \d", str(outs[2])), outs[2]
    fine = [i for i in range(N) if i != 2]
    ref = _reference(model, "encode", batches)
    assert_close_to_reference([outs[i] for i in fine], [ref[i] for i in fine], terms=mlp_terms(6))


@pytest.mark.parametrize("workers", WORKERS)
def test_a_hung_batch_times_out_while_the_other_batches_keep_finishing(tmp_path: Path, workers: str) -> None:
    # The other slot finishes a batch every few milliseconds, so the caller never waits a
    # whole poll interval for news: the deadlines must still be looked at, or the hung
    # slot keeps its batch until every other batch of the stream has run.
    model = Faulty(tmp_path)
    dp = _dp(model, workers)
    length, pulled = 2000, [0]  # 2,000 batches of 5 ms on the slot left: 10 s, against a timeout of 1 s

    def stream() -> Iterator[dict[str, Any]]:
        for b in _batches(n=length):
            pulled[0] += 1
            yield b

    with torch.no_grad():
        it = dp.map("encode", stream(), fault="hang", at=2, pause=0.005, timeout=1.0, retries=0,
                    errors="yield", ordered=False)
        for index, out in it:  # noqa: B007 (index is checked after the loop)
            if isinstance(out, Exception):
                break
        it.close()
    dp.close()
    assert index == 2 and isinstance(out, TimeoutError), out
    assert pulled[0] < length  # told while the stream still ran


@pytest.mark.parametrize("workers", WORKERS)
def test_the_clock_starts_when_the_worker_starts_the_batch(workers: str) -> None:
    # A stopped map's batch still runs on the one worker: the next map's batches wait
    # behind it, and their timeout counts from when the worker starts them.
    net = build_net()
    dp = dpmethods.DataParallel(net, device_ids=["cpu"], workers=workers)
    x = torch.randn(3, 4)
    with torch.no_grad():
        list(dp.map("sleepy", [x]))  # the worker starts (processes) before anything is timed
        [first] = dp.map("pid", [x])
        pid = first.unique().tolist()  # the worker's (the caller's on threads)
        stopped = dp.map("sleepy", [{"x": x}, {"x": x, "seconds": 2.0}])
        next(stopped)  # the second batch is the worker's now
        stopped.close()
        outs = list(dp.map("sleepy", [x, 2 * x], timeout=1.0, retries=0))
        [last] = dp.map("pid", [x])
        assert last.unique().tolist() == pid  # not killed for it
        want = [net.sleepy(x), net.sleepy(2 * x)]
    dp.close()
    assert_close_to_reference(outs, want, terms=mlp_terms(4))


# --- out of memory -------------------------------------------------------------------


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("method", ["forward", "encode", "label"])
def test_a_batch_out_of_memory_runs_in_halves_and_equals_one_device(tmp_path: Path, workers: str, method: str) -> None:
    model = Faulty(tmp_path, limit=2)
    dp = _dp(model, workers)
    batches = _batches(rows=7, n=4)
    args = [(b["x"],) if method != "label" else (b["x"], [f"r{b['tag']}.{i}" for i in range(7)]) for b in batches]
    with torch.no_grad():
        ref = [model.unlimited(method, *a) for a in args]
        (tmp_path / "rows").unlink()
        outs = list(dp.map(method, args, on_oom="split"))
    dp.close()
    ran = rows_run(tmp_path)
    assert any(out for _, out in ran) and max(r for r, out in ran if not out) <= 2
    if method == "label":
        assert [[n for n, _ in o] for o in outs] == [[n for n, _ in r] for r in ref]
        outs, ref = [[v for _, v in o] for o in outs], [[v for _, v in r] for r in ref]
    assert_close_to_reference(outs, ref, terms=mlp_terms(6))


@pytest.mark.parametrize("workers", WORKERS)
def test_later_batches_are_split_up_front(tmp_path: Path, workers: str) -> None:
    model = Faulty(tmp_path, limit=2)
    dp = _dp(model, workers, devices=1)
    with torch.no_grad():
        list(dp.map("forward", [b["x"] for b in _batches(rows=8, n=1)], on_oom="split"))
        first = sum(out for _, out in rows_run(tmp_path))
        (tmp_path / "rows").unlink()
        list(dp.map("forward", [b["x"] for b in _batches(rows=8, n=4)], on_oom="split"))
    dp.close()
    ran = rows_run(tmp_path)
    assert first > 0
    assert sum(out for _, out in ran) == first  # only the first batch ran out
    assert sum(r for r, out in ran if not out) == 4 * 8


@pytest.mark.parametrize("workers", WORKERS)
def test_one_row_that_does_not_fit_raises(tmp_path: Path, workers: str) -> None:
    model = Faulty(tmp_path, limit=0)
    dp = _dp(model, workers)
    with torch.no_grad(), pytest.raises(torch.OutOfMemoryError) as info:
        list(dp.map("forward", [torch.randn(3, 6)], on_oom="split"))
    dp.close()
    assert "dpmethods: on_oom='split': a share of 1 item does not fit" in info.value.__notes__


@pytest.mark.parametrize("workers", WORKERS)
def test_generate_out_of_memory_runs_in_halves_and_equals_one_device(tmp_path: Path, workers: str) -> None:
    torch.manual_seed(0)
    model = tiny_gpt2(eos_token_id=5, pad_token_id=0).eval()
    import functools

    hook = model.register_forward_pre_hook(functools.partial(out_of_memory_above, str(tmp_path), 2), with_kwargs=True)
    g = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(2, 48, (5, 4), generator=g)} for _ in range(3)]
    kwargs = dict(max_new_tokens=6, do_sample=False)
    dp = _dp(model, workers, methods=["generate"])
    with torch.no_grad():
        outs = list(dp.map("generate", batches, on_oom="split", **kwargs))
        hook.remove()
        ref = [model.generate(**b, **kwargs) for b in batches]
    dp.close()
    assert any(out for _, out in rows_run(tmp_path))
    assert [o.tolist() for o in outs] == [r.tolist() for r in ref]


def test_calls_on_worker_processes_split_too(tmp_path: Path) -> None:
    model = Faulty(tmp_path, limit=2)
    dp = _dp(model, "processes", on_oom="split")
    x = torch.randn(11, 6)
    with torch.no_grad():
        out = dp.encode(x)
        ref = model.unlimited("encode", x)
    dp.close()
    assert any(o for _, o in rows_run(tmp_path))
    assert_close_to_reference(out, ref, terms=mlp_terms(6))


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("rows", [4, 5])  # parts of 2 + 2, and of 2 + 1 + 2
def test_a_0_dim_output_of_a_split_share_is_an_error_naming_its_fix(tmp_path: Path, workers: str, rows: int) -> None:
    # The share that ran out returns one loss; its parts' losses concatenated would be a
    # vector that one device never returns, on even parts and uneven ones alike.
    model = Faulty(tmp_path, limit=2)
    x = torch.randn(2 * rows, 6, generator=torch.Generator().manual_seed(rows))
    fix = r"use gather=\{'loss': 'mean'\} if it is a mean over the batch's items"
    error = r"on_oom='split': output\['loss'\] is 0-dim: the share that ran out of memory returns one value"
    dp = _dp(model, workers, on_oom="split")
    with torch.no_grad():
        with pytest.raises(ValueError, match=f"{error}.*{fix}"):
            dp.scored(x)  # shares of `rows` on 2 replicas
        with pytest.raises(ValueError, match=f"{error}.*{fix}"):
            list(dp.map("scored", [x[:rows]], on_oom="split"))
    dp.close()
    # The fix it names gives one device's loss: the parts' means weighted by their rows.
    fixed = _dp(model, workers, on_oom="split", methods={"scored": {"gather": {"loss": "mean"}}})
    with torch.no_grad():
        out = fixed.scored(x)
        outs = list(fixed.map("scored", [x[:rows]], on_oom="split"))
        want = [model.unlimited("scored", x), model.unlimited("scored", x[:rows])]
    fixed.close()
    assert any(o for _, o in rows_run(tmp_path))
    assert_close_to_reference([out, *outs], want, terms=mlp_terms(6, rows=2 * rows * 3))


# --- the options themselves ------------------------------------------------------------


@pytest.mark.parametrize(("option", "value", "message"), [
    ("retries", -1, r"map: retries: expected an int >= 0 \(runs again after a worker died\), got int -1"),
    ("retries", True, r"map: retries: expected an int >= 0 .*, got bool True"),
    ("timeout", 0, r"map: timeout: expected None or a number of seconds > 0, got int 0"),
    ("timeout", "5", r"map: timeout: expected None or a number of seconds > 0, got str '5'"),
    ("on_oom", "spilt", r"on_oom: expected one of \['raise', 'split'\], got 'spilt': did you mean 'split'\?"),
])
def test_bad_options_are_refused_by_name(tmp_path: Path, option: str, value: Any, message: str) -> None:
    dp = _dp(Faulty(tmp_path), "threads")
    with pytest.raises(ValueError, match=message):
        dp.map("encode", _batches(), **{option: value})


@pytest.mark.parametrize("workers", WORKERS)
def test_a_method_argument_named_as_an_option_goes_in_a_mapping_batch(tmp_path: Path, workers: str) -> None:
    model = Faulty(tmp_path)
    dp = _dp(model, workers)
    xs = [torch.randn(3, 6) for _ in range(4)]
    with torch.no_grad():
        outs = list(dp.map("scaled", ({"x": x, "timeout": 2.0} for x in xs)))
        ref = [model.scaled(x, timeout=2.0) for x in xs]
    dp.close()
    assert_close_to_reference(outs, ref, terms=mlp_terms(6))
