"""Models and rank targets for tests/map/test_items.py: module-level, so spawned worker
processes (and gloo ranks) import them.

:class:`Tokens` embeds token ids of any length and records every batch it runs
(rows, longest) in ``workdir/batches``, worker processes too. Items holding a marker
token strike a fault: ``FAIL`` raises a ValueError every time; ``KILL`` kills its own
process and ``HANG`` waits (until the test frees it), each the first time only, as
tests.helpers.long_runs' faults do.
``limit`` rows or more raise ``torch.OutOfMemoryError``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

import dpmethods
from tests.helpers.long_runs import first_time, record, records, strike

VOCAB, WIDTH = 40, 8
FAIL, KILL, HANG = 1, 2, 3  # marker tokens; 0 is the padding, ids of text are >= 4


class Tokens(nn.Module):
    """Per-position features of token ids, and their mean over the real positions."""

    def __init__(self, workdir: str | Path, limit: int | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.lin = nn.Linear(WIDTH, 4)
        self.workdir, self.limit = str(workdir), limit

    def _enter(self, ids: torch.Tensor) -> None:
        rows, longest = ids.shape
        record(self.workdir, "batches", rows, longest)
        if (ids == FAIL).any():
            raise ValueError("Tokens: a poisoned item")
        for marker, fault in ((KILL, "kill"), (HANG, "hang")):
            if (ids == marker).any() and first_time(self.workdir, fault):
                strike(fault)
        if self.limit is not None and rows >= self.limit:
            raise torch.OutOfMemoryError(f"{rows} rows do not fit (test limit {self.limit})")

    @dpmethods.parallel_method
    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        self._enter(input_ids)
        return self._features(input_ids, attention_mask)

    def _features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.lin(self.emb(input_ids))
        mask = attention_mask[..., None].to(hidden.dtype)
        return {"hidden": hidden, "pooled": (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)}

    @dpmethods.parallel_method(split=("ids", "names"), gather="extend")
    def tag(self, ids: list[torch.Tensor], names: list[str]) -> list[dict[str, Any]]:
        """Per-item lists in, one dict per item out (as detection models take and give)."""
        self._enter(torch.zeros(len(ids), max(len(i) for i in ids), dtype=torch.long))
        return [{"name": n, "pooled": self.alone(i)["pooled"]} for i, n in zip(ids, names)]

    @dpmethods.parallel_method(gather={"loss": "mean"})
    def with_loss(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.encode(input_ids, attention_mask)
        return {**out, "loss": out["pooled"].square().mean()}

    def alone(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """``encode`` of one item by itself, without faults or records: the one-device reference."""
        out = self._features(ids[None], torch.ones(1, len(ids), dtype=torch.long))
        return {k: v[0] for k, v in out.items()}


def batches_run(workdir: str | Path) -> list[tuple[int, int]]:
    """Every batch run so far: (rows, longest)."""
    return [(rows, longest) for rows, longest in records(workdir, "batches")]


def token_items(n: int, seed: int = 0, longest: int = 24) -> list[dict[str, torch.Tensor]]:
    """``n`` items of 1 to ``longest`` random text tokens (ids >= 4), lengths mixed."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest + 1, (n,), generator=g)
    return [{"input_ids": torch.randint(4, VOCAB, (int(k),), generator=g)} for k in lengths]


def build_tokens(workdir: str) -> Tokens:
    torch.manual_seed(0)
    return Tokens(workdir).eval()


def sharded_items(rank: int, world: int, workers: str, workdir: str) -> dict[str, Any]:
    """One rank of the shard test: an ordered and an unordered item-mode map."""
    model = build_tokens(workdir)
    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2, workers=workers)
    with torch.no_grad():
        ordered = list(dp.map("encode", token_items(11), batch_size=2, shard=True))
        pairs = list(dp.map("encode", iter(token_items(11)), batch_size=3, shard=True, ordered=False))
    dp.close()
    return {"ordered": ordered, "pairs": pairs}
