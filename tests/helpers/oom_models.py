"""Models and callables for tests/map/test_oom_hooks.py: module-level, so spawned worker
processes import them. Out of memory is forced with tests/helpers/long_runs.py's
:func:`~tests.helpers.long_runs.record_rows`: a method raises ``torch.OutOfMemoryError``
above a number of rows and records every run in a file, which worker processes write too."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import dpmethods
import dpmethods.extending
from tests.helpers.long_runs import record_rows


class OnlyMine:
    """``prefix_allowed_tokens_fn``: item ``i`` of the batch may only emit the four tokens
    from ``4 + 4 * i`` (mod 40): a constraint per item, by its index in the batch."""

    def __call__(self, batch_id: int, ids: torch.Tensor) -> list[int]:
        first = 4 + (4 * batch_id) % 40
        return list(range(first, first + 4))


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
        record_rows(self.workdir, ids.shape[0], self.limit, "big")
        return self.lm(ids).logits

    @dpmethods.parallel_method
    def small(self, ids: torch.Tensor) -> torch.Tensor:
        record_rows(self.workdir, ids.shape[0], None, "small")
        return self.lm(ids).logits


class InBatch(nn.Module):
    """Scores every row against every row of its batch (an in-batch-negatives pattern),
    marked as coupling its batch; runs out of memory above ``limit`` rows."""

    def __init__(self, workdir: str | Path, limit: int) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)
        self.workdir, self.limit = str(workdir), limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        record_rows(self.workdir, x.shape[0], self.limit)
        y = self.lin(x)
        return (y @ y.T).softmax(-1).diagonal()


dpmethods.extending.mark_batch_coupled(InBatch, what="in-batch scores")
