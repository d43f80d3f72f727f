"""Spot check of the small-leaf gather target: 256 leaves x 4 replicas of float32 [8, 16].

Times per-leaf ``torch.cat`` (the pure-PyTorch gather) against the fused op in
interleaved rounds, for three kinds of input: autograd leaves that require grad (the
benchmark's case), replica outputs (non-leaf tensors with a ``grad_fn``, what
DataParallel's gather really receives) and tensors without grad. It also times
``torch.unbind_copy`` of one [256, 32, 16] tensor: one torch op that returns 256 new
tensors of the same sizes, a floor for any single call that returns 256 tensors.
Prints medians and p10/p90 in microseconds.

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
    plain = [torch.randn(8, 16) for _ in range(leaves * replicas)]
    grad = [t.clone().requires_grad_() for t in plain]
    scale = torch.ones(16, requires_grad=True)
    nonleaf = [t * scale for t in plain]  # like replica outputs: each has a grad_fn
    stacked = torch.randn(leaves, 8 * replicas, 16)
    cpu = torch.device("cpu")

    def per_leaf(ts: list[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.cat(ts[i : i + replicas]) for i in range(0, len(ts), replicas)]

    inputs = {"leaf, grad": grad, "replica outputs": nonleaf, "no grad": plain}
    paths: dict[str, Callable[[], object]] = {}
    for kind, ts in inputs.items():
        paths[f"per-leaf cat, {kind}"] = lambda ts=ts: per_leaf(ts)
        paths[f"fused, {kind}"] = lambda ts=ts: ops.gather_coalesced(ts, replicas, 0, cpu)
    paths["floor: unbind_copy, no grad"] = lambda: torch.unbind_copy(stacked)
    times: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(40):
        for name, fn in paths.items():
            start = time.perf_counter()
            for _ in range(5):
                fn()
            times[name].append((time.perf_counter() - start) / 5 * 1e6)
    for name, v in times.items():
        deciles = statistics.quantiles(v, n=10)
        print(f"{name:30s} median {statistics.median(v):7.0f} us  p10 {deciles[0]:7.0f}  p90 {deciles[-1]:7.0f}")
    for kind in inputs:
        ratio = statistics.median(times[f"per-leaf cat, {kind}"]) / statistics.median(times[f"fused, {kind}"])
        print(f"speed-up, {kind}: {ratio:.2f}x (target 10x)")


if __name__ == "__main__":
    main()
