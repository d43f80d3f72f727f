"""Models that fail on purpose, for the long maps' tests (tests/map), and the fault and
record helpers that tests.helpers.items_models shares: module-level, so spawned worker
processes import them.

A fault strikes once per test: the first replica or worker to reach the tagged batch
creates a marker file in ``workdir`` and then kills its own process or hangs; the batch
run again finds the marker and runs. Every batch that runs appends its rows, and whether
it ran out of memory, to ``workdir/rows`` (worker processes too), so a test can count.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import dpmethods

_HANG = threading.Event()  # never set in a worker process; the tests set it to free a thread


def arm_hang() -> None:
    """From now on, a "hang" fault in this process waits until :func:`release_hung`."""
    _HANG.clear()


def release_hung() -> None:
    """Let a thread that hangs in a fault go on (it is no longer used by then)."""
    _HANG.set()


def first_time(workdir: str, fault: str) -> bool:
    """Whether this is the first strike of ``fault`` in ``workdir`` (in any process)."""
    try:
        os.close(os.open(os.path.join(workdir, fault), os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


def strike(fault: str) -> None:
    """A "kill..." fault kills this process (SIGKILL); a "term" fault sends it SIGTERM, as
    ``kill <pid>`` does (worker processes only: the test's own process would end); a
    "hang" waits until :func:`release_hung`."""
    if fault.startswith("kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "term":
        os.kill(os.getpid(), signal.SIGTERM)  # a worker's handler raises in this job
        time.sleep(60)  # not reached in a worker process
    _HANG.wait()


def record(workdir: str, name: str, *numbers: int) -> None:
    """Append one run's ``numbers`` to ``workdir/name`` (worker processes write it too)."""
    with open(os.path.join(workdir, name), "a") as f:
        f.write(" ".join(map(str, numbers)) + "\n")


def records(workdir: str | Path, name: str) -> list[tuple[int, ...]]:
    """Every run recorded in ``workdir/name`` so far, in order."""
    path = Path(workdir) / name
    return [tuple(map(int, line.split())) for line in path.read_text().splitlines()] if path.exists() else []


def record_rows(workdir: str, rows: int, limit: int | None, name: str = "rows") -> None:
    """Record a run of ``rows`` in ``workdir/name``; more than ``limit`` rows raise
    torch.OutOfMemoryError (recorded as such)."""
    ran_out = limit is not None and rows > limit
    record(workdir, name, rows, int(ran_out))
    if ran_out:
        raise torch.OutOfMemoryError(f"{rows} rows do not fit (test limit {limit})")


def rows_run(workdir: str | Path, name: str = "rows") -> list[tuple[int, bool]]:
    """Every run recorded in ``workdir/name`` so far: (rows, ran out of memory)."""
    return [(rows, bool(ran_out)) for rows, ran_out in records(workdir, name)]


def out_of_memory_above(workdir: str, limit: int, module: nn.Module, args: Any, kwargs: Any) -> None:
    """A forward pre-hook (with kwargs): more than ``limit`` rows raise torch.OutOfMemoryError."""
    x = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    record_rows(workdir, int(x.shape[0]), limit)


class Faulty(nn.Module):
    """Methods that record their rows, run out of memory above ``limit`` rows, and on the
    batch whose ``tag`` is ``at`` strike ``fault`` the first time ("kill": SIGKILL of its
    own process; "term": SIGTERM of it; "hang": wait forever), or every time ("kill-always"),
    recording the pid that struck in ``workdir/struck``."""

    def __init__(self, workdir: str | Path, limit: int | None = None) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.workdir, self.limit = str(workdir), limit

    def _enter(self, rows: int, tag: int, fault: str | None, at: int) -> None:
        if fault is not None and tag == at and (fault == "kill-always" or first_time(self.workdir, fault)):
            record(self.workdir, "struck", os.getpid())
            strike(fault)
        record_rows(self.workdir, rows, self.limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._enter(x.shape[0], -1, None, -1)
        return self.lin(x)

    @dpmethods.parallel_method
    def encode(self, x: torch.Tensor, tag: int = -1, fault: str | None = None, at: int = -1,
               pause: float = 0.0) -> Any:
        self._enter(x.shape[0], tag, fault, at)
        time.sleep(pause)  # a batch that takes a while (the others finish in turn as one hangs)
        return {"y": self.lin(x), "norm": x.norm(dim=1)}

    @dpmethods.parallel_method(split=("names",), gather="extend")
    def label(self, x: torch.Tensor, names: list[str]) -> list[tuple[str, float]]:
        self._enter(x.shape[0], -1, None, -1)
        return [(n, float(v)) for n, v in zip(names, self.lin(x).sum(1))]

    @dpmethods.parallel_method
    def scored(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """A batch output beside a 0-dim loss (a mean over the rows)."""
        self._enter(x.shape[0], -1, None, -1)
        y = self.lin(x)
        return {"y": y, "loss": y.pow(2).mean()}

    @dpmethods.parallel_method
    def scaled(self, x: torch.Tensor, timeout: float) -> torch.Tensor:
        """A parameter named as an option of map (``timeout``)."""
        return self.lin(x) * timeout

    def unlimited(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method`` on this module, without the memory limit: the one-device reference."""
        limit, self.limit = self.limit, None
        try:
            return (self if method == "forward" else getattr(self, method))(*args, **kwargs)
        finally:
            self.limit = limit
