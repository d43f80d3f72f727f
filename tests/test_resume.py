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
