"""Resumable maps: DataParallel.map(..., checkpoint=path) records the batches whose
outputs were taken, and a rerun computes and yields only the rest, equal to one device.
A rerun that is not the same map (another length, order, argument or model), a record
in use by a live map, a missing folder or a malformed record is refused before any batch
runs, and a refused run leaves the record as it found it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dpmethods
from dpmethods.testing import assert_close_to_reference
from tests.helpers import WORKERS, workers_of
from tests.helpers.terms import mlp_terms

N = 12


class Counted(nn.Module):
    """A Linear whose encode logs the ids (column 0) of the rows it ran, a line per batch
    (in a file: workers are processes)."""

    def __init__(self, log: str, bias: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 3, bias=bias)
        self.log = log

    @dpmethods.parallel_method
    def encode(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        with open(self.log, "a") as f:
            f.write(" ".join(str(int(v)) for v in x[:, 0].tolist()) + "\n")
        return self.lin(x) * scale


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    out = [torch.randn(3, 5, generator=g) for _ in range(N)]
    for i, b in enumerate(out):
        b[:, 0] = i  # the batch's index, read back by Counted.encode
    return out


def _ran(log: Path) -> list[int]:
    """The batches computed: the id of each logged batch's first row, sorted."""
    return sorted(int(line.split()[0]) for line in _lines(log))


def _lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def _dp(model: Counted, workers: str) -> Any:
    return dpmethods.DataParallel(model, device_ids=["cpu"] * 2, workers=workers)


@pytest.fixture(scope="module")
def wrappers() -> Iterator[dict[tuple[type, str], Any]]:
    """A wrapper of a Counted and one of a Flaky (the same weights) per worker kind, shared
    by the tests of this module, so that worker processes start once; each test gives the
    model its own log (and a Flaky its bad batches)."""
    dps = {}
    for cls in (Counted, Flaky):
        torch.manual_seed(0)
        model = Counted(os.devnull) if cls is Counted else Flaky(os.devnull, bad=())
        dps.update({(cls, w): _dp(model, w) for w in WORKERS})
    yield dps
    for dp in dps.values():
        dp.close()


def _shared(wrappers: dict[tuple[type, str], Any], cls: type, request: pytest.FixtureRequest,
            log: Path) -> Iterator[Any]:
    """The shared wrapper of ``cls`` for the test's worker kind, its model logging to ``log``;
    after the test, nothing of it still runs."""
    dp = wrappers[cls, workers_of(request)]
    dp.module.log = str(log)
    yield dp
    _settle(dp)
    dp.module.log = os.devnull
    if isinstance(dp.module, Flaky):
        dp.module.bad = ()


@pytest.fixture
def dp(wrappers: dict[tuple[type, str], Any], request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """The shared wrapper of a Counted for the test's worker kind (threads if it has none)."""
    yield from _shared(wrappers, Counted, request, tmp_path / "ran.txt")


@pytest.fixture
def flaky(wrappers: dict[tuple[type, str], Any], request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """The shared wrapper of a Flaky for the test's worker kind; the test sets ``bad``."""
    yield from _shared(wrappers, Flaky, request, tmp_path / "ran.txt")


@pytest.fixture
def setup(dp: Any, tmp_path: Path) -> tuple[Counted, list[torch.Tensor], Path, Path]:
    """The shared wrapper's model, the batches, a checkpoint path and the model's log."""
    return dp.module, _batches(), tmp_path / "map.json", tmp_path / "ran.txt"


def _settle(dp: Any, clear: Path | None = None) -> None:
    """Wait for the batches a stopped map left running on the worker processes (a worker
    goes on with a batch it had begun), keeping the workers: closing them would cost
    a restart: a call gives each worker a row, which it runs after them. A stopped map
    on threads leaves none. Then remove the run log ``clear``."""
    if dp.workers == "processes":
        log, dp.module.log = dp.module.log, os.devnull  # the call's row is not a batch run
        try:
            with torch.no_grad():
                dp.encode(torch.full((2, 5), -1.0))
        finally:
            dp.module.log = log
    if clear is not None:
        clear.unlink(missing_ok=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("stop", ["break", "raise"])
def test_a_stopped_map_resumes_without_recomputing_what_was_taken(
    dp: Any, setup: Any, workers: str, stop: str,
) -> None:
    model, batches, ckpt, log = setup
    taken = []
    with torch.no_grad():
        try:
            for out in dp.map("encode", batches, checkpoint=ckpt):
                taken.append(out)
                if len(taken) == 5:
                    if stop == "break":
                        break
                    raise KeyError("the consumer's own error")
        except KeyError:
            pass
        _settle(dp, clear=log)  # worker processes may still finish a batch they had begun
        rest = list(dp.map("encode", batches, checkpoint=ckpt))
        ran = _ran(log)
        ref = [model.encode(b) for b in batches]
    # At least once: the 5th output was taken but not asked past, so it comes again.
    assert ran == list(range(4, N)) and len(rest) == N - 4
    assert_close_to_reference(taken[:4] + rest, ref, terms=mlp_terms(5))
    assert list(dp.map("encode", batches, checkpoint=ckpt)) == []  # finished


def test_a_resumed_maps_progress_bar_counts_the_whole_input_from_what_was_done(
    dp: Any, setup: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    _, batches, ckpt, _ = setup
    with torch.no_grad():
        for i, _ in enumerate(dp.map("encode", batches, checkpoint=ckpt)):
            if i == 4:  # four taken; the fifth was not asked past
                break
        capsys.readouterr()
        list(dp.map("encode", batches, checkpoint=ckpt, progress="resumed"))
    err = capsys.readouterr().err.replace(" ", "")
    assert f"4/{N}" in err and f"{N}/{N}" in err, err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", WORKERS)
def test_unordered_maps_keep_the_original_indices(dp: Any, setup: Any, workers: str) -> None:
    model, batches, ckpt, _ = setup
    with torch.no_grad():
        first = []
        for pair in dp.map("encode", batches, ordered=False, checkpoint=ckpt):
            first.append(pair)
            if len(first) == 6:
                break
        rest = list(dp.map("encode", batches, ordered=False, checkpoint=ckpt))
        ref = [model.encode(b) for b in batches]
    got = dict(first[:5] + rest)
    assert sorted(got) == list(range(N))
    assert_close_to_reference([got[i] for i in range(N)], ref, terms=mlp_terms(5))


def test_another_methods_file_and_a_shorter_input_are_refused(setup: Any) -> None:
    model, batches, ckpt, _ = setup
    dp = _dp(model, "threads")
    with torch.no_grad():
        list(dp.map("encode", batches, checkpoint=ckpt))
        with pytest.raises(ValueError, match=r"checkpoint: '[^']*map\.json' records another map: its "
                           r"method is 'encode', this map's 'forward'"):
            list(dp.map("forward", batches, checkpoint=ckpt))
        with pytest.raises(ValueError, match=r"its input had 12 batches, this input has 7"):
            list(dp.map("encode", batches[:7], checkpoint=ckpt))


def test_the_record_is_replaced_atomically_and_compact(setup: Any) -> None:
    model, batches, ckpt, _ = setup
    with torch.no_grad():
        list(_dp(model, "threads").map("encode", batches, checkpoint=ckpt))
    record = json.loads(ckpt.read_text())
    assert record["done"] == [[0, N]] and record["finished"] and record["method"] == "encode"
    assert record["len"] == record["count"] == N and len(record["batches"]) == 4 * -(-4 * N // 3)
    # No temporary file left, and the lock is gone with the map.
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["map.json", "ran.txt"]


@pytest.mark.timeout(120)
def test_a_killed_caller_resumes_and_its_lock_is_taken_over(setup: Any, tmp_path: Path) -> None:
    model, batches, ckpt, log = setup
    torch.save({"state": model.state_dict(), "batches": batches}, tmp_path / "inputs.pt")
    script = textwrap.dedent(f"""
        import os, signal, sys, torch
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from tests.map.test_resume import Counted
        import dpmethods
        from dpmethods.streaming import record
        record.SAVE_EVERY_S = 0  # every taken output is written at once
        saved = torch.load({str(tmp_path / "inputs.pt")!r})
        model = Counted({str(log)!r}); model.load_state_dict(saved["state"])
        dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2)
        with torch.no_grad():
            for k, out in enumerate(dp.map("encode", saved["batches"], checkpoint={str(ckpt)!r})):
                if k == 6:
                    os.kill(os.getpid(), signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100)
    assert done.returncode == -signal.SIGKILL, done.stderr
    lock = Path(f"{ckpt}.lock")
    assert lock.read_text().strip().isdigit()  # the dead map's lock is left behind...
    log.unlink()
    with torch.no_grad():
        rest = list(_dp(model, "threads").map("encode", batches, checkpoint=ckpt))
        ran = _ran(log)
        ref = [model.encode(b) for b in batches]
    assert ran == list(range(6, N))
    assert_close_to_reference(rest, ref[6:], terms=mlp_terms(5))
    assert not lock.exists()  # ...taken over, and removed with the map that took it


def test_a_resumable_map_is_closed_by_a_with_block(setup: Any) -> None:
    model, batches, ckpt, _ = setup
    with torch.no_grad(), _dp(model, "threads").map("encode", batches, checkpoint=ckpt) as outputs:
        for k, _ in enumerate(outputs):
            if k == 2:
                break
    assert json.loads(ckpt.read_text())["done"] == [[0, 2]]  # written when the block closed it


class Flaky(Counted):
    """Counted, but batches whose index is in ``bad`` raise."""

    def __init__(self, log: str, bad: tuple[int, ...]) -> None:
        super().__init__(log)
        self.bad = bad

    @dpmethods.parallel_method
    def encode(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        i = int(x[0, 0].item())
        if i in self.bad:
            raise ValueError(f"batch {i} is bad")
        return super().encode(x, scale)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("ordered", [True, False])
def test_errors_yield_puts_each_exception_in_its_place(flaky: Any, workers: str, ordered: bool) -> None:
    model = flaky.module
    model.bad = (3, 8)
    batches = _batches()
    with torch.no_grad():
        outs = list(flaky.map("encode", batches, ordered=ordered, errors="yield"))
        ref = [model.lin(b) for b in batches]
    got = dict(enumerate(outs)) if ordered else dict(outs)
    assert sorted(got) == list(range(N))
    for i in (3, 8):
        assert isinstance(got[i], ValueError) and str(got[i]) == f"batch {i} is bad"
        assert any(f"batch {i}" in n and "DataParallel.map" in n for n in got[i].__notes__)
    fine = [i for i in range(N) if i not in (3, 8)]
    assert_close_to_reference([got[i] for i in fine], [ref[i] for i in fine], terms=mlp_terms(5))


@pytest.mark.parametrize("workers", WORKERS)
def test_errors_raise_stops_the_map_and_names_the_batch(flaky: Any, workers: str) -> None:
    flaky.module.bad = (2,)
    with pytest.raises(ValueError, match="batch 2 is bad") as info, torch.no_grad():
        list(flaky.map("encode", _batches()))
    assert any("batch 2" in n for n in info.value.__notes__)


def test_errors_is_checked() -> None:
    dp = _dp(Counted("unused"), "threads")
    with pytest.raises(ValueError, match=r"map: errors: expected one of \['raise', 'yield'\], got 'yeld': did you mean 'yield'\?"):
        dp.map("encode", _batches(), errors="yeld")


@pytest.mark.timeout(120)
def test_a_failed_batch_runs_again_on_a_resumed_map(tmp_path: Path) -> None:
    torch.manual_seed(0)
    log, ckpt = tmp_path / "ran.txt", tmp_path / "map.json"
    model = Flaky(str(log), bad=(5,))
    dp = _dp(model, "threads")
    with torch.no_grad():
        first = list(dp.map("encode", _batches(), errors="yield", checkpoint=ckpt))
        assert isinstance(first[5], ValueError)
        model.bad = ()
        again = list(dp.map("encode", _batches(), errors="yield", checkpoint=ckpt))
    assert len(again) == 1 and not isinstance(again[0], BaseException)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", WORKERS)
def test_a_resumed_map_names_its_batches_by_their_input_index(flaky: Any, tmp_path: Path, workers: str) -> None:
    ckpt = tmp_path / "map.json"
    flaky.module.bad = (5,)
    with torch.no_grad():
        list(flaky.map("encode", _batches(), errors="yield", checkpoint=ckpt))
        [again] = list(flaky.map("encode", _batches(), errors="yield", checkpoint=ckpt))  # batch 5 alone
    assert isinstance(again, ValueError) and str(again) == "batch 5 is bad"
    assert any("raised in batch 5 " in n for n in again.__notes__), again.__notes__


# The record knows what it records: another map is refused before any batch runs, and
# a refused run leaves the record as it found it.


def _stop_after(outputs: Iterator[Any], k: int) -> list[Any]:
    """The first ``k`` outputs of a map, which is then closed."""
    taken = []
    with outputs:  # type: ignore[attr-defined]
        for out in outputs:
            taken.append(out)
            if len(taken) == k:
                break
    return taken


def _stopped(dp: Any, inputs: Any, ckpt: Path, log: Path, k: int, **kwargs: Any) -> tuple[list[Any], bytes]:
    """Run ``encode`` over ``inputs`` with ``checkpoint=ckpt``, take ``k`` outputs and stop;
    clear the run log. Returns the outputs taken and the record as the stop left it."""
    taken = _stop_after(dp.map("encode", inputs, checkpoint=ckpt, **kwargs), k)
    _settle(dp, clear=log)
    return taken, ckpt.read_bytes()


def _untouched(log: Path, ckpt: Path, record: bytes) -> None:
    """No batch ran since the stop, and the record is as the stop left it."""
    assert _lines(log) == [] and ckpt.read_bytes() == record


# A shorter input than the 40 batches of a map stopped after 10 outputs, yet longer than
# what that map read: 10 taken and, in order, at most a reorder window more (twice the
# batches in flight: 2 x 4 per worker process while its batches are short).
_SHORTER = 30


def _generator(batches: list[torch.Tensor]) -> Iterator[torch.Tensor]:
    yield from batches  # no len()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", WORKERS)
def test_a_shorter_input_with_a_len_is_refused_before_any_batch_runs(dp: Any, setup: Any, workers: str) -> None:
    model, _, ckpt, log = setup
    batches = [torch.full((2, 5), float(i)) for i in range(40)]
    with torch.no_grad():
        taken, record = _stopped(dp, batches, ckpt, log, 10)
        # Longer than what the stopped map read (_SHORTER): its length alone differs.
        with pytest.raises(ValueError, match=rf"'{ckpt}' records another map: its input had 40 "
                           rf"batches, this input has {_SHORTER}\. It is not this map's record"):
            dp.map("encode", batches[:_SHORTER], checkpoint=ckpt)  # refused at the call
        _untouched(log, ckpt, record)
        rest = list(dp.map("encode", batches, checkpoint=ckpt))  # the right job goes on
        ref = [model.lin(b) for b in batches]
    assert _ran(log) == list(range(9, 40))  # the 10th output, not asked past, runs again
    assert_close_to_reference(taken[:9] + rest, ref, terms=mlp_terms(5))


@pytest.mark.timeout(120)
def test_a_record_of_batches_refuses_a_map_of_items_and_an_earlier_record_reads_as_batches(setup: Any) -> None:
    model, batches, ckpt, log = setup
    dp = _dp(model, "threads")
    with torch.no_grad():
        taken, record = _stopped(dp, batches, ckpt, log, 5)
        for earlier in (False, True):
            if earlier:  # as an earlier dpmethods wrote it: without "items"
                fields = json.loads(record)
                del fields["items"]
                record = json.dumps(fields).encode()
                ckpt.write_bytes(record)
            note = r" \(or it is a record of an earlier dpmethods, [^)]*\)" if earlier else ""
            with pytest.raises(ValueError, match=rf"'{ckpt}' records another map: its map read batches{note}, "
                               r"this map reads items \(batch_size= or max_tokens=\)\. It is not"):
                list(dp.map("encode", batches, batch_size=2, checkpoint=ckpt))
            _untouched(log, ckpt, record)
        rest = list(dp.map("encode", batches, checkpoint=ckpt))  # an earlier record of batches resumes
        ran = _ran(log)
        ref = [model.encode(b) for b in batches]
    assert ran == list(range(4, N))
    assert_close_to_reference(taken[:4] + rest, ref, terms=mlp_terms(5))
    dp.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("lookahead", [None, 4])
def test_a_shorter_input_without_a_len_is_refused_and_leaves_the_record_as_it_was(
    dp: Any, setup: Any, workers: str, lookahead: int | None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dpmethods.streaming import record as record_module
    from dpmethods.streaming import resume

    monkeypatch.setattr(record_module, "SAVE_EVERY_S", 0.0)  # a run writes every output it takes
    if lookahead is not None:  # the batches to run outnumber those held back: its end shows late
        monkeypatch.setattr(resume, "LOOKAHEAD", lookahead)
    model, _, ckpt, log = setup
    batches = [torch.full((2, 5), float(i)) for i in range(40)]
    with torch.no_grad():
        taken, record = _stopped(dp, batches, ckpt, log, 10)
        refused = []
        with pytest.raises(ValueError, match=rf"'{ckpt}' records an input of 40 batches, but this "
                           rf"input ended after {_SHORTER}"):
            for out in dp.map("encode", _generator(batches[:_SHORTER]), checkpoint=ckpt):
                refused.append(out)
        _settle(dp)
        if lookahead is None:  # read to its end before any batch ran
            assert refused == [] and _lines(log) == []
        else:
            assert len(refused) > 0 and _ran(log) == list(range(9, _SHORTER))
        assert ckpt.read_bytes() == record  # none of it reached the record
        log.unlink(missing_ok=True)
        rest = list(dp.map("encode", _generator(batches), checkpoint=ckpt))
        ref = [model.lin(b) for b in batches]
    assert _ran(log) == list(range(9, 40))
    assert_close_to_reference(taken[:9] + rest, ref, terms=mlp_terms(5))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", WORKERS)
def test_a_shorter_input_without_a_len_is_refused_before_any_batch_runs_where_the_record_read_it(
    flaky: Any, tmp_path: Path, workers: str,
) -> None:
    dp, model = flaky, flaky.module
    log, ckpt = Path(model.log), tmp_path / "map.json"
    bad = (1, 2, 3, 4, 5)  # more than the map holds in flight at once
    model.bad = bad
    batches = _batches()
    with torch.no_grad():
        first = list(dp.map("encode", _generator(batches), errors="yield", checkpoint=ckpt))
        # These batches are still to run; the input was read to its end.
        assert [i for i, out in enumerate(first) if isinstance(out, ValueError)] == list(bad)
        _settle(dp, clear=log)
        model.bad = ()
        record = ckpt.read_bytes()
        with pytest.raises(ValueError, match=rf"'{ckpt}' records an input of {N} batches, but this input ended after 7"):
            list(dp.map("encode", _generator(batches[:7]), checkpoint=ckpt))
        with pytest.raises(ValueError, match=rf"'{ckpt}' records an input of {N} batches, but this input has more"):
            list(dp.map("encode", _generator(batches + batches[:1]), checkpoint=ckpt))
        _settle(dp)
        _untouched(log, ckpt, record)
        again = list(dp.map("encode", _generator(batches), checkpoint=ckpt))  # those alone
    assert _ran(log) == list(bad)
    assert_close_to_reference(again, [model.lin(batches[i]) for i in bad], terms=mlp_terms(5))


class Items(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """48 items of 5 values, the first its id."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.cat([torch.tensor([float(i)]), torch.randn(4, generator=torch.Generator().manual_seed(i))])


def _loader(seed: int) -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    return torch.utils.data.DataLoader(Items(), batch_size=4, shuffle=True,
                                       generator=torch.Generator().manual_seed(seed))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", WORKERS)
def test_an_input_in_another_order_is_refused_before_any_batch_runs(dp: Any, setup: Any, workers: str) -> None:
    model, _, ckpt, log = setup
    order = [[int(v) for v in b[:, 0]] for b in _loader(0)]
    with torch.no_grad():
        taken, record = _stopped(dp, _loader(0), ckpt, log, 5)
        with pytest.raises(ValueError, match=rf"'{ckpt}' records another input: its batch 0 differs "
                           r"from the record's batch 0 \(another order: a DataLoader with shuffle=True reshuffles"):
            list(dp.map("encode", _loader(1), checkpoint=ckpt))  # reshuffled
        _untouched(log, ckpt, record)
        rest = list(dp.map("encode", _loader(0), checkpoint=ckpt))  # the same order: resumed
        ref = [model.lin(b) for b in _loader(0)]
    items = sorted(int(v) for line in _lines(log) for v in line.split())
    assert items == sorted(i for b in order[4:] for i in b)  # every item not taken, once
    assert_close_to_reference(taken[:4] + rest, ref, terms=mlp_terms(5))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", WORKERS)
def test_other_arguments_or_another_model_are_refused_before_any_batch_runs(dp: Any, setup: Any, workers: str) -> None:
    model, batches, ckpt, log = setup
    with torch.no_grad():
        _, record = _stopped(dp, batches, ckpt, log, 4, scale=2.0)
        named = rf"'{ckpt}' records another map: "
        cases: list[tuple[dict[str, Any], str]] = [
            ({"scale": 3.0}, r"scale \(another value\)"), ({}, r"scale \(not given\)"),
            ({"scale": torch.tensor(2.0)}, r"scale \(another value\)"),  # a tensor is not a float
        ]
        for kwargs, differs in cases:
            with pytest.raises(ValueError, match=named + "the method's keyword arguments differ: " + differs):
                dp.map("encode", batches, checkpoint=ckpt, **kwargs)
        torch.manual_seed(1)
        for other, differs in [
            (Counted(str(log)), "its model has other weights"),
            (Counted(str(log), bias=False), "its model's parameters and buffers have other names, shapes or dtypes"),
            (Flaky(str(log), bad=()), r"its model is a tests\.map\.test_resume\.Counted, this map's a tests\.map\.test_resume\.Flaky"),
        ]:
            with pytest.raises(ValueError, match=named + differs):
                _dp(other, workers).map("encode", batches, checkpoint=ckpt, scale=2.0)
        _untouched(log, ckpt, record)
        same = Counted(str(log))
        same.load_state_dict(model.state_dict())  # the same weights in another module: the same map
        other_dp = _dp(same, workers)
        rest = list(other_dp.map("encode", batches, checkpoint=ckpt, scale=2.0))
    other_dp.close()
    assert _ran(log) == list(range(3, N)) and len(rest) == N - 3


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", WORKERS)
def test_a_record_in_use_by_a_live_map_of_this_process_is_refused(dp: Any, setup: Any, workers: str) -> None:
    _, batches, ckpt, log = setup
    with torch.no_grad():
        first = dp.map("encode", batches, checkpoint=ckpt)
        outs = [next(first)]
        with pytest.raises(RuntimeError, match=rf"'{ckpt}' is in use by another live map in this "
                           rf"process \(pid {os.getpid()}\): close that map first"):
            dp.map("encode", batches, checkpoint=ckpt)
        outs += list(first)  # the first map goes on, alone
        assert list(dp.map("encode", batches, checkpoint=ckpt)) == []  # finished, released
    assert len(outs) == N and _ran(log) == list(range(N))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", WORKERS)
def test_a_record_in_use_by_a_live_map_of_another_process_is_refused(
    setup: Any, tmp_path: Path, workers: str,
) -> None:
    model, batches, ckpt, log = setup
    torch.save({"state": model.state_dict(), "batches": batches}, tmp_path / "inputs.pt")
    go = tmp_path / "go"
    script = textwrap.dedent(f"""
        import os, sys, time, torch
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from tests.map.test_resume import Counted
        import dpmethods
        saved = torch.load({str(tmp_path / "inputs.pt")!r})
        model = Counted({str(log)!r}); model.load_state_dict(saved["state"])
        dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2, workers={workers!r})
        with torch.no_grad():
            for k, out in enumerate(dp.map("encode", saved["batches"], checkpoint={str(ckpt)!r})):
                if k == 0:
                    print("holding", flush=True)
                    deadline = time.monotonic() + 60
                    while not os.path.exists({str(go)!r}) and time.monotonic() < deadline:
                        time.sleep(0.05)
        dp.close()
    """)
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        dp = _dp(model, "threads")
        with pytest.raises(RuntimeError, match=rf"'{ckpt}' is in use by a live map in process "
                           rf"{holder.pid}: two maps on one record would lose each other's work"):
            dp.map("encode", batches, checkpoint=ckpt)
        go.touch()
        _, err = holder.communicate(timeout=100)
        assert holder.returncode == 0, err
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert _ran(log) == list(range(N))  # each batch once, by the holder
    with torch.no_grad():
        assert list(dp.map("encode", batches, checkpoint=ckpt)) == []  # it finished the map
    assert _ran(log) == list(range(N))


@pytest.mark.parametrize("workers", WORKERS)
def test_a_checkpoint_in_a_missing_folder_is_refused_when_the_map_starts(setup: Any, tmp_path: Path, workers: str) -> None:
    model, batches, _, log = setup
    dp = _dp(model, workers)
    missing = tmp_path / "no" / "such" / "run.json"
    with pytest.raises(FileNotFoundError, match=rf"map: checkpoint: the folder '{missing.parent}' of "
                       rf"'{missing}' does not exist"):
        dp.map("encode", batches, checkpoint=missing)
    with pytest.raises(IsADirectoryError, match=rf"map: checkpoint: expected a file path, got the folder '{tmp_path}'"):
        dp.map("encode", batches, checkpoint=tmp_path)
    dp.close()
    assert _lines(log) == [] and not (tmp_path / "no").exists()


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("change, expected", [
    ({"done": 5}, r"expected \"done\" to be a list of \[start, end\] index pairs with 0 <= start < end, got int 5"),
    ({"done": [[3, 1]]}, r"expected \"done\" to be a list of \[start, end\] index pairs"),
    ({"finished": "yes"}, r"expected \"finished\" to be a bool, got str \"yes\""),
    ({"items": {"trim": 1}}, r"expected \"items\" to be null or an object of bools, strs and nulls, got dict"),
    ({"version": 1}, r"of this version: expected \"version\": 2, got 1 \(a record of an earlier dpmethods"),
    ({"batches": None}, r"expected a field \"batches\" \(a base64 str of 4-byte digests\), but it has none"),
    ({"batches": "AAAA"}, r"expected \"batches\" to be a base64 str of 4-byte digests$"),
    ({"done": [[0, 40]]}, r"expected the batches in \"done\" to be among the 3 in \"batches\", got batch 39"),
])
def test_a_malformed_record_names_the_file_and_what_was_expected(
    setup: Any, workers: str, change: dict[str, Any], expected: str,
) -> None:
    model, batches, ckpt, log = setup
    with torch.no_grad():
        list(_dp(model, "threads").map("encode", batches[:3], checkpoint=ckpt))
    log.unlink()
    dp = _dp(model, workers)
    record = {**json.loads(ckpt.read_text()), **change}
    if record.get("batches", 0) is None:
        del record["batches"]
    ckpt.write_text(json.dumps(record))
    with pytest.raises(ValueError, match=rf"map: checkpoint: '{ckpt}' is not a map checkpoint of dpmethods.*{expected}"):
        dp.map("encode", batches, checkpoint=ckpt)
    ckpt.write_text("{not json")
    with pytest.raises(ValueError, match=rf"'{ckpt}' is not a map checkpoint of dpmethods: it is not JSON"):
        dp.map("encode", batches, checkpoint=ckpt)
    dp.close()
    assert _lines(log) == [] and ckpt.read_text() == "{not json"


def _digest_cases() -> dict[str, Any]:
    """Values of every kind a batch or an argument holds, built the same in any process."""
    import dataclasses as dc

    import numpy as np

    g = torch.Generator().manual_seed(3)
    big = torch.randn(32, 3, 20, 20, generator=g)
    point = dc.make_dataclass("Point", [("x", Any), ("y", Any)])
    return {
        "small tensor": torch.randn(8, 16, generator=g),
        "sampled tensor": big,
        "bf16": big.to(torch.bfloat16),
        "transposed": big.transpose(1, 3),
        "tokens": {"input_ids": torch.randint(0, 999, (4, 300), generator=g), "mask": torch.ones(4, 300, dtype=torch.long)},
        "texts": [f"text {i} " * (i + 1) for i in range(100)],
        "long text": "a long document " * 5000,
        "numbers": (1, 2.5, True, None, -3),
        "numpy": np.arange(12.0).reshape(3, 4),
        "objects": np.array([1, "a", None], dtype=object),  # pointers: by class only
        "an object": object(),  # its repr holds an address: by class only
        "a configuration": _generation_config(6),  # by its to_dict()
        "dataclass": point(torch.ones(2), "y"),
        "bytes": b"\x00\x01" * 5000,
        "size": torch.Size([3, 4]),
    }


def test_digests_are_the_same_in_another_process_and_differ_where_the_batch_does(
    another_process: dict[str, Any],
) -> None:
    from dpmethods.types.digests import digest

    ours = {k: digest(v) for k, v in _digest_cases().items()}
    assert another_process["digests"] == ours
    assert len(set(ours.values())) == len(ours)
    cases = _digest_cases()
    big = cases["sampled tensor"]
    # Another order of rows, another dtype or shape, another text: another digest.
    for other in (big[torch.randperm(32, generator=torch.Generator().manual_seed(0))], big.double(),
                  big.reshape(16, 6, 20, 20), big.transpose(1, 3).contiguous()):
        assert digest(other) != ours["sampled tensor"]
    assert digest(big.transpose(1, 3).contiguous()) == ours["transposed"]  # the values, not the layout
    assert digest(cases["texts"][::-1]) != ours["texts"]
    assert digest(cases["tokens"]["input_ids"][[1, 0, 2, 3]]) != digest(cases["tokens"]["input_ids"])


def test_a_model_is_known_by_its_class_layout_and_weights_through_compile() -> None:
    from dpmethods.streaming.record import Identity
    from dpmethods.types.digests import module_identity

    torch.manual_seed(0)
    model = Counted("unused")
    same = Counted("unused")
    same.load_state_dict(model.state_dict())
    ident = module_identity(model)
    assert module_identity(same) == ident == Identity.of("encode", [], model=torch.compile(model)).model
    with torch.no_grad():
        same.lin.weight[2, 4] += 1  # the last value: sampled
    assert module_identity(same)["values"] != ident["values"]
    assert module_identity(same)["tensors"] == ident["tensors"]
    assert module_identity(nn.LazyLinear(3)) == {"class": "torch.nn.modules.linear.LazyLinear", "settings": ""}


def test_a_models_settings_are_known_by_their_dict_form_whoever_holds_them() -> None:
    """A transformers model's ``config`` and ``generation_config`` (a dict form both ways),
    held by it or by a submodule, are its settings; a one-way ``to_dict`` is not read."""
    from dpmethods.types.digests import module_identity
    from tests.helpers.models import tiny_gpt2

    torch.manual_seed(0)
    model = tiny_gpt2()
    ident = module_identity(model)
    assert [s.split("=")[0] for s in ident["settings"].split(";")] == ["config", "generation_config"]
    model.config._name_or_path = "/elsewhere"  # where it was loaded from: bookkeeping, not a setting
    model.config.transformers_version = "0.0"
    assert module_identity(model) == ident
    model.config.use_cache = not model.config.use_cache
    changed = module_identity(model)
    assert changed["settings"] != ident["settings"] and changed["values"] == ident["values"]

    class Report:  # its to_dict reads its owner: not a setting
        def to_dict(self) -> dict[str, Any]:
            raise AssertionError("read")

    wrapper = nn.Sequential(model)
    wrapper.report = Report()
    assert module_identity(wrapper)["settings"] == "0." + changed["settings"].replace(";", ";0.")


def _generation_config(tokens: int) -> Any:
    import transformers

    return transformers.GenerationConfig(max_new_tokens=tokens, do_sample=False)


def _generation_map(ckpt: str, workers: str, model_tokens: int, kwarg_tokens: int | None,
                    stop: int | None = None) -> tuple[nn.Module, list[torch.Tensor], Any]:
    """A checkpointed map of a tiny GPT-2's ``generate`` over 4 batches, its model generating
    ``model_tokens`` (``model.generation_config``) or ``kwarg_tokens`` (a ``generation_config=``
    argument): stopped after ``stop`` outputs, else the map itself, unstarted."""
    from tests.helpers.models import tiny_gpt2

    torch.manual_seed(0)
    model = tiny_gpt2().eval()
    model.generation_config.max_new_tokens = model_tokens
    batches = [torch.randint(2, 48, (2, 4), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    kwargs = {} if kwarg_tokens is None else {"generation_config": _generation_config(kwarg_tokens)}
    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2, workers=workers)
    with torch.no_grad():
        it = dp.map("generate", batches, checkpoint=ckpt, **kwargs)
        if stop is not None:
            for _ in range(stop):
                next(it)
            it.close()
            dp.close()
    return model, batches, (dp, it)


# The first runs of the generation maps below (the model's tokens, the argument's): stopped
# after 2 outputs, in another process.
_FIRST = {"model": (2, None), "argument": (9, 2)}


@pytest.fixture(scope="module")
def another_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What one process whose str hashes differ from this one's (``PYTHONHASHSEED``), as a
    map resumed on another day would, makes: the record each first run of ``_FIRST``
    leaves (``"records"``), then the digest of each of ``_digest_cases()`` (``"digests"``)."""
    folder = tmp_path_factory.mktemp("generation")
    runs = "\n".join(f"_generation_map({str(folder / where)!r}, 'threads', {m}, {k}, stop=2)"
                     for where, (m, k) in _FIRST.items())
    script = (f"import json, sys\nsys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})\n"
              f"from tests.map.test_resume import _digest_cases, _generation_map\n"
              f"from dpmethods.types.digests import digest\n{runs}\n"
              f"print(json.dumps({{k: digest(v) for k, v in _digest_cases().items()}}))\n")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # str hashes differ from this process's
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=200, env=env)
    assert done.returncode == 0, done.stderr
    return {"records": {where: (folder / where).read_text() for where in _FIRST},
            "digests": json.loads(done.stdout.strip().splitlines()[-1])}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("where", ["argument", "model"])
def test_a_map_resumed_with_other_generation_settings_is_refused_and_with_the_same_resumes(
        tmp_path: Path, workers: str, where: str, another_process: dict[str, Any]) -> None:
    """Settings in an object with a dict form (a GenerationConfig), as an argument or as the
    model's attribute, are part of the map: changed, a resumed map would mix outputs of
    both; unchanged, they digest the same in another process (the map resumes there)."""
    ckpt = tmp_path / "map.json"
    record = another_process["records"][where]
    ckpt.write_text(record)
    first = _FIRST[where]
    other = (6, None) if where == "model" else (9, 6)
    differs = (r"its model's settings differ: generation_config \(another value\)" if where == "model"
               else r"the method's keyword arguments differ: generation_config \(another value\)")
    with pytest.raises(ValueError, match=rf"records another map: {differs}"):
        _generation_map(str(ckpt), workers, *other)
    assert ckpt.read_text() == record
    model, batches, (dp, it) = _generation_map(str(ckpt), workers, *first)
    with torch.no_grad():
        rest = list(it)
        alone = [model.generate(b, max_new_tokens=2, do_sample=False) for b in batches[1:]]
    dp.close()
    assert len(rest) == 3  # the first output was taken; the second was asked for, not taken
    for got, want in zip(rest, alone):
        assert torch.equal(got, want)
