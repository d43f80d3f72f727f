"""Models and callables for tests/map/test_oom_hooks.py: module-level, so spawned worker
processes import them. Out of memory is forced as in tests/helpers/long_runs.py: a method or a
forward pre-hook raises ``torch.OutOfMemoryError`` above a number of rows and records
every run in a file, which worker processes write too."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

import dpmethods
import dpmethods.extending


class OnlyMine:
    """``prefix_allowed_tokens_fn``: item ``i`` of the batch may only emit the four tokens
    from ``4 + 4 * i`` (mod 40): a constraint per item, by its index in the batch."""

    def __call__(self, batch_id: int, ids: torch.Tensor) -> list[int]:
        first = 4 + (4 * batch_id) % 40
        return list(range(first, first + 4))


def _record(path: str, rows: int, limit: int | None) -> None:
    ran_out = limit is not None and rows > limit
    with open(path, "a") as f:
        f.write(f"{rows} {int(ran_out)}\n")
    if ran_out:
        raise torch.OutOfMemoryError(f"{rows} rows do not fit (test limit {limit})")


def runs(path: str | Path) -> list[tuple[int, bool]]:
    """Every run recorded in ``path`` so far: (rows, ran out of memory)."""
    lines = Path(path).read_text().split() if Path(path).exists() else []
    return [(int(r), bool(int(o))) for r, o in zip(lines[::2], lines[1::2])]


class TwoMethods(nn.Module):
    """A tiny GPT-2 with two methods: ``big`` runs out of memory above ``limit`` rows,
    ``small`` never; each records its runs in its own file of ``workdir``."""

    def __init__(self, workdir: str | Path, limit: int) -> None:
        super().__init__()
        from tests.helpers.models import tiny_gpt2

        self.lm = tiny_gpt2().eval()
        self.workdir, self.limit = str(workdir), limit

    @dpmethods.parallel_method
    def big(self, ids: torch.Tensor) -> torch.Tensor:
        _record(os.path.join(self.workdir, "big"), ids.shape[0], self.limit)
        return self.lm(ids).logits

    @dpmethods.parallel_method
    def small(self, ids: torch.Tensor) -> torch.Tensor:
        _record(os.path.join(self.workdir, "small"), ids.shape[0], None)
        return self.lm(ids).logits


def hook_rows(workdir: str, limit: int, module: nn.Module, args: Any, kwargs: Any) -> None:
    """A forward pre-hook (with kwargs): more than ``limit`` rows of ``input_ids`` raise
    torch.OutOfMemoryError; every run is recorded in ``workdir/rows``."""
    x = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    _record(os.path.join(workdir, "rows"), int(x.shape[0]), limit)


class InBatch(nn.Module):
    """Scores every row against every row of its batch (an in-batch-negatives pattern),
    marked as coupling its batch; runs out of memory above ``limit`` rows."""

    def __init__(self, workdir: str | Path, limit: int) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)
        self.workdir, self.limit = str(workdir), limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _record(os.path.join(self.workdir, "rows"), x.shape[0], self.limit)
        y = self.lin(x)
        return (y @ y.T).softmax(-1).diagonal()


dpmethods.extending.mark_batch_coupled(InBatch, what="in-batch scores")
