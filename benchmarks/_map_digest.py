"""The digest workload of bench_map: what ``checkpoint=`` costs a map per batch to know
its input again. Selected with ``--only digest`` (never by default).

Paths, each a block of calls in interleaved rounds, timed in this process's CPU time
(the time others hold the cores of a shared host is left out) beside the wall time:

- ``digest-<kind>``: the digest of one batch of each kind: a float32 [8, 16] tensor (the
  checkpoint workload's batch, 512 bytes, digested whole), a tokenizer's output (a dict
  of two int64 [32, 128] tensors, sampled), 32 sentences of about 60 characters, an
  image batch (a float32 [32, 3, 224, 224] tensor, 19 MB, sampled);
- ``record-8x16``: the record's bookkeeping of one [8, 16] batch: its digest checked
  against the record and its output marked taken (nothing written).

The workload ``checkpoint`` (benchmarks/_map_long_runs.py) times what this adds to a map.

Example:
    >>> sorted(_batches())[0]
    'digest-image-32x3x224x224'
"""

from __future__ import annotations

import itertools
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for _common, imported as a script's sibling
import _common
from _map_long_runs import Measured

__all__ = ["NAMES", "rows", "run"]

NAMES = ("digest",)


def _batches() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "digest-tensor-8x16": torch.randn(8, 16, generator=g),
        "digest-tokens-2x32x128": {"input_ids": torch.randint(0, 30000, (32, 128), generator=g),
                                   "attention_mask": torch.ones(32, 128, dtype=torch.long)},
        "digest-sentences-32": [f"sentence number {i} of the batch, with a few more words" for i in range(32)],
        "digest-image-32x3x224x224": torch.randn(32, 3, 224, 224, generator=g),
    }


def _digest(quick: bool, tmp: Path) -> Measured:
    # The library's own record and digest, imported here: only this workload needs them.
    from dpmethods.streaming.record import Identity, Record
    from dpmethods.types.digests import digest

    calls, rounds = (500, 3) if quick else (5000, 7)
    batches = _batches()
    record = Record(tmp / "map.json", Identity("forward"))
    index = itertools.count()
    small = batches["digest-tensor-8x16"]

    def bookkeeping() -> None:
        i = next(index)
        record.check_batch(i, digest(small))
        record.done.add(i)  # what taken() does between two writes

    paths = {name: (lambda b=b: digest(b)) for name, b in batches.items()}
    paths["record-8x16"] = bookkeeping
    try:
        times, cpu = _common.interleave(paths, rounds, calls=calls, label="digest")
    finally:
        record.close(save=False)
    facts = {
        "workload": f"the digest of one batch of four kinds, and the record's bookkeeping of one [8, 16] batch; "
        f"blocks of {calls} calls",
        "method": "digest", "devices": [], "rounds": rounds, "calls_per_round": calls, "startup_s": {},
        "per_batch_us": {p: _us(ts) for p, ts in times.items()},
        "per_batch_cpu_us": {p: _us(cs) for p, cs in cpu.items()},
        "targets": [], "outputs_match_one_device": {},
    }
    return Measured("digest", dict.fromkeys(times, 1), times, cpu, facts)


def _us(ts: list[float]) -> dict[str, float]:
    s = _common.summarize([t * 1e6 for t in ts])
    return {"median": s["median"], "p10": s["p10"], "p90": s["p90"]}


def run(ids: list[Any], quick: bool, only: list[str] | None) -> list[Measured]:
    """The digest workload when ``only`` names ``digest`` (never by default: it times the
    checkpoint's bookkeeping, not a map)."""
    if only is None or "digest" not in only:
        return []
    with torch.no_grad(), tempfile.TemporaryDirectory(prefix="bench_map_digest_") as tmp:
        return [_digest(quick, Path(tmp))]


def rows(facts: dict[str, Any]) -> list[str]:
    """Markdown rows of the per-batch costs, when measured."""
    x = facts.get("digest")
    if x is None:
        return []
    out = ["", "| digest | CPU us per batch, median (p10-p90) | wall us (p10-p90) |", "|---|---:|---:|"]
    for path, c in x["per_batch_cpu_us"].items():
        w = x["per_batch_us"][path]
        out.append(f"| {path} | {c['median']:.2f} ({c['p10']:.2f}-{c['p90']:.2f}) | "
                   f"{w['median']:.2f} ({w['p10']:.2f}-{w['p90']:.2f}) |")
    return out
