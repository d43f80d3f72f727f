"""Spot check of what ``checkpoint=`` costs a map per batch to know its input again.

Times, with ``timeit`` (the best of several repeats, in this process's CPU time), the digest of one batch of each
kind below and the record's bookkeeping of one batch (its digest checked or recorded,
its output marked taken), in microseconds per batch:

- the long-run benchmark's batch: a float32 [8, 16] tensor (512 bytes, digested whole);
- a tokenizer's output: a dict of two int64 [32, 128] tensors (sampled);
- 32 sentences of about 60 characters;
- an image batch: a float32 [32, 3, 224, 224] tensor (19 MB, sampled).

With ``--map`` it also times the long-run benchmark's checkpoint workload briefly (a map
of ``nn.Linear(16, 16)`` over 1,000 such batches on two CPU replicas, with and without
``checkpoint=``, in interleaved rounds), printing the medians: an indication on a quiet
host, not the benchmark (``bench_map.py --only checkpoint``).

Usage: PYTHONPATH=. python benchmarks/spot_digest.py [--map]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import timeit
from typing import Any

import torch

from dpmethods.streaming.record import Identity, Record
from dpmethods.types.digests import digest

__all__ = ["main"]


def _per_call_us(fn: Any, number: int) -> float:
    # CPU time of this process: on a shared host, the time others hold the cores is left out.
    return min(timeit.repeat(fn, number=number, repeat=7, timer=time.process_time)) / number * 1e6


def _batches() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "float32 [8, 16] (the long-run benchmark's)": torch.randn(8, 16, generator=g),
        "dict of two int64 [32, 128]": {"input_ids": torch.randint(0, 30000, (32, 128), generator=g),
                                        "attention_mask": torch.ones(32, 128, dtype=torch.long)},
        "32 sentences of ~60 characters": [f"sentence number {i} of the batch, with a few more words" for i in range(32)],
        "float32 [32, 3, 224, 224]": torch.randn(32, 3, 224, 224, generator=g),
    }


def _bookkeeping_us(batch: torch.Tensor) -> float:
    """Digest, check and take one batch through a fresh record (nothing written)."""
    with tempfile.TemporaryDirectory() as tmp:
        record = Record(os.path.join(tmp, "map.json"), Identity("forward"))
        index = iter(range(10**9))

        def one() -> None:
            i = next(index)
            record.check_batch(i, digest(batch))
            record.done.add(i)  # what taken() does between two writes

        us = _per_call_us(one, 20000)
        record.close(save=False)
    return us


def _map_rounds(rounds: int) -> None:
    from dpmethods import DataParallel

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16).eval()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(8, 16, generator=g) for _ in range(1000)]
    dp = DataParallel(model, device_ids=["cpu"] * 2, cache_replicas=True)
    times: dict[str, list[float]] = {"map": [], "map-checkpoint": []}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        for r in range(rounds):
            for name in times:
                path = os.path.join(tmp, f"{r}.json") if name == "map-checkpoint" else None
                t0 = time.perf_counter()
                list(dp.map("forward", batches, checkpoint=path))
                times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["map"])
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:16s} {m * 1e3:7.1f} ms per 1,000 batches ({m / base:.3f}x the map)")


def main() -> None:
    """Print the costs per batch."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--map", action="store_true", help="also time the checkpoint workload's maps briefly")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds with --map (default: 15)")
    args = parser.parse_args()
    for name, batch in _batches().items():
        number = 200 if batch is not None and isinstance(batch, torch.Tensor) and batch.numel() > 10**6 else 20000
        print(f"digest of {name:45s} {_per_call_us(lambda b=batch: digest(b), number):7.2f} us")
    small = _batches()["float32 [8, 16] (the long-run benchmark's)"]
    print(f"{'record bookkeeping of a float32 [8, 16] batch':55s} {_bookkeeping_us(small):7.2f} us")
    if args.map:
        _map_rounds(args.rounds)


if __name__ == "__main__":
    main()
