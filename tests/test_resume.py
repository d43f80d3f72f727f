"""Resumable maps: DataParallel.map(..., checkpoint=path) records the batches whose
outputs were taken, and a rerun computes and yields only the rest, equal to one device."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from _close import mlp_terms
from torch import nn

import dpmethods
from dpmethods.testing import assert_close_to_reference

WORKERS = ["threads", "processes"]
N = 12


class Counted(nn.Module):
    """A Linear whose encode counts the rows it ran (in a file: workers are processes)."""

    def __init__(self, log: str) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 3)
        self.log = log

    @dpmethods.parallel_method
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        with open(self.log, "a") as f:
            f.write(f"{int(x[0, 0].item())}\n")
        return self.lin(x)


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    out = [torch.randn(3, 5, generator=g) for _ in range(N)]
    for i, b in enumerate(out):
        b[:, 0] = i  # the batch's index, read back by Counted.encode
    return out


def _ran(log: Path) -> list[int]:
    return sorted(int(line) for line in log.read_text().split()) if log.exists() else []


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Counted, list[torch.Tensor], Path, Path]:
    torch.manual_seed(0)
    log = tmp_path / "ran.txt"
    return Counted(str(log)), _batches(), tmp_path / "map.json", log


def _dp(model: Counted, workers: str) -> Any:
    return dpmethods.DataParallel(model, device_ids=["cpu"] * 2, workers=workers)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("stop", ["break", "raise"])
def test_a_stopped_map_resumes_without_recomputing_what_was_taken(
    setup: Any, workers: str, stop: str,
) -> None:
    model, batches, ckpt, log = setup
    dp = _dp(model, workers)
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
        dp.close()  # worker processes may still finish a batch they had begun
        log.unlink()
        rest = list(dp.map("encode", batches, checkpoint=ckpt))
        ran = _ran(log)
        ref = [model.encode(b) for b in batches]
    dp.close()
    # At least once: the 5th output was taken but not asked past, so it comes again.
    assert ran == list(range(4, N)) and len(rest) == N - 4
    assert_close_to_reference(taken[:4] + rest, ref, terms=mlp_terms(5))
    assert list(dp.map("encode", batches, checkpoint=ckpt)) == []  # finished


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", WORKERS)
def test_unordered_maps_keep_the_original_indices(setup: Any, workers: str) -> None:
    model, batches, ckpt, _ = setup
    dp = _dp(model, workers)
    with torch.no_grad():
        first = []
        for pair in dp.map("encode", batches, ordered=False, checkpoint=ckpt):
            first.append(pair)
            if len(first) == 6:
                break
        rest = list(dp.map("encode", batches, ordered=False, checkpoint=ckpt))
        ref = [model.encode(b) for b in batches]
    dp.close()
    got = dict(first[:5] + rest)
    assert sorted(got) == list(range(N))
    assert_close_to_reference([got[i] for i in range(N)], ref, terms=mlp_terms(5))


def test_another_methods_file_and_a_shorter_input_are_refused(setup: Any) -> None:
    model, batches, ckpt, _ = setup
    dp = _dp(model, "threads")
    with torch.no_grad():
        list(dp.map("encode", batches, checkpoint=ckpt))
        with pytest.raises(ValueError, match=r"checkpoint: '[^']*map\.json' records a map of 'encode', not of 'forward'"):
            list(dp.map("forward", batches, checkpoint=ckpt))
        with pytest.raises(ValueError, match=r"records 12 batches, but the input now has 7"):
            list(dp.map("encode", batches[:7], checkpoint=ckpt))


def test_the_record_is_replaced_atomically_and_compact(setup: Any) -> None:
    model, batches, ckpt, _ = setup
    with torch.no_grad():
        list(_dp(model, "threads").map("encode", batches, checkpoint=ckpt))
    record = json.loads(ckpt.read_text())
    assert record["done"] == [[0, N]] and record["finished"] and record["method"] == "encode"
    assert [p.name for p in ckpt.parent.iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.timeout(120)
def test_a_killed_caller_resumes(setup: Any, tmp_path: Path) -> None:
    model, batches, ckpt, log = setup
    torch.save({"state": model.state_dict(), "batches": batches}, tmp_path / "inputs.pt")
    script = textwrap.dedent(f"""
        import os, signal, sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_resume import Counted
        import dpmethods
        from dpmethods.streaming import resume
        resume.SAVE_EVERY_S = 0  # every taken output is written at once
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
    log.unlink()
    with torch.no_grad():
        rest = list(_dp(model, "threads").map("encode", batches, checkpoint=ckpt))
        ran = _ran(log)
        ref = [model.encode(b) for b in batches]
    assert ran == list(range(6, N))
    assert_close_to_reference(rest, ref[6:], terms=mlp_terms(5))


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
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        i = int(x[0, 0].item())
        if i in self.bad:
            raise ValueError(f"batch {i} is bad")
        return self.lin(x)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("ordered", [True, False])
def test_errors_yield_puts_each_exception_in_its_place(tmp_path: Path, workers: str, ordered: bool) -> None:
    torch.manual_seed(0)
    model = Flaky(str(tmp_path / "ran.txt"), bad=(3, 8))
    batches = _batches()
    dp = _dp(model, workers)
    with torch.no_grad():
        outs = list(dp.map("encode", batches, ordered=ordered, errors="yield"))
        ref = [model.lin(b) for b in batches]
    dp.close()
    got = dict(enumerate(outs)) if ordered else dict(outs)
    assert sorted(got) == list(range(N))
    for i in (3, 8):
        assert isinstance(got[i], ValueError) and str(got[i]) == f"batch {i} is bad"
        assert any(f"batch {i}" in n and "DataParallel.map" in n for n in got[i].__notes__)
    fine = [i for i in range(N) if i not in (3, 8)]
    assert_close_to_reference([got[i] for i in fine], [ref[i] for i in fine], terms=mlp_terms(5))


@pytest.mark.parametrize("workers", WORKERS)
def test_errors_raise_stops_the_map_and_names_the_batch(tmp_path: Path, workers: str) -> None:
    model = Flaky(str(tmp_path / "ran.txt"), bad=(2,))
    dp = _dp(model, workers)
    with pytest.raises(ValueError, match="batch 2 is bad") as info, torch.no_grad():
        list(dp.map("encode", _batches()))
    dp.close()
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
def test_a_resumed_map_names_its_batches_by_their_input_index(tmp_path: Path, workers: str) -> None:
    ckpt = tmp_path / "map.json"
    model = Flaky(str(tmp_path / "ran.txt"), bad=(5,))
    dp = _dp(model, workers)
    with torch.no_grad():
        list(dp.map("encode", _batches(), errors="yield", checkpoint=ckpt))
        [again] = list(dp.map("encode", _batches(), errors="yield", checkpoint=ckpt))  # batch 5 alone
    dp.close()
    assert isinstance(again, ValueError) and str(again) == "batch 5 is bad"
    assert any("raised in batch 5 " in n for n in again.__notes__), again.__notes__
