"""Spot check of the small-leaf gather target: 256 leaves x 4 replicas of float32 [8, 16].

Times per-leaf ``torch.cat`` (the pure-PyTorch gather) against the fused op, with and
without autograd, in interleaved rounds; prints medians and p10/p90 in microseconds.
The full benchmark is ``bench_gather.py``; this is the one case, quick to rerun.

Usage: PYTHONPATH=. python benchmarks/spot_gather_target.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

import dpmethods.ops as ops

__all__ = ["main"]


def main() -> None:
    """Run the interleaved rounds and print one line per path."""
    torch.set_num_threads(1)
    leaves, replicas = 256, 4
    grad = [torch.randn(8, 16, requires_grad=True) for _ in range(leaves * replicas)]
    plain = [t.detach() for t in grad]
    cpu = torch.device("cpu")

    def per_leaf(ts: list[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.cat(ts[i : i + replicas]) for i in range(0, len(ts), replicas)]

    paths: dict[str, Callable[[], object]] = {
        "per-leaf cat, grad": lambda: per_leaf(grad),
        "per-leaf cat, no grad": lambda: per_leaf(plain),
        "fused, grad": lambda: ops.gather_coalesced(grad, replicas, 0, cpu),
        "fused, no grad": lambda: ops.gather_coalesced(plain, replicas, 0, cpu),
    }
    times: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(40):
        for name, fn in paths.items():
            start = time.perf_counter()
            for _ in range(5):
                fn()
            times[name].append((time.perf_counter() - start) / 5 * 1e6)
    for name, v in times.items():
        deciles = statistics.quantiles(v, n=10)
        print(f"{name:24s} median {statistics.median(v):7.0f} us  p10 {deciles[0]:7.0f}  p90 {deciles[-1]:7.0f}")
    for mode in ("grad", "no grad"):
        ratio = statistics.median(times[f"per-leaf cat, {mode}"]) / statistics.median(times[f"fused, {mode}"])
        print(f"speed-up, {mode}: {ratio:.2f}x (target 10x with grad)")


if __name__ == "__main__":
    main()
