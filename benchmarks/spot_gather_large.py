"""Spot check of the large-leaf gather target: 64 MiB in all, 4 x [4096, 1024] float32.

Times the fused gather against ``torch.cat`` into new memory, at dim 0 and dim 1, in
interleaved calls, and prints medians with p10/p90 in milliseconds and the speed ratio
(``torch.cat`` time over fused time; the goal is at least 0.95). Both paths allocate
their output through torch's CPU allocator, so ``THP_MEM_ALLOC_ENABLE=1`` (transparent
huge pages for large tensors) applies to both.

Usage: PYTHONPATH=. python benchmarks/spot_gather_large.py [--calls 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import dpmethods.ops as ops

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    """Run the interleaved calls and print one line per dim."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--calls", type=int, default=15, help="timed calls per path and dim")
    args = ap.parse_args(argv)
    cpu = torch.device("cpu")
    pieces = [torch.randn(4096, 1024) for _ in range(4)]
    for dim in (0, 1):
        ops.gather_coalesced(pieces, 4, dim, cpu)  # warm-up
        torch.cat(pieces, dim)
        fused: list[float] = []
        cat: list[float] = []
        for _ in range(args.calls):
            start = time.perf_counter()
            ops.gather_coalesced(pieces, 4, dim, cpu)
            fused.append(time.perf_counter() - start)
            start = time.perf_counter()
            torch.cat(pieces, dim)
            cat.append(time.perf_counter() - start)
        line = []
        for name, v in (("fused", fused), ("torch.cat", cat)):
            q = statistics.quantiles(v, n=10)
            line.append(f"{name} {statistics.median(v) * 1e3:6.2f} ms [{q[0] * 1e3:.2f}, {q[-1] * 1e3:.2f}]")
        ratio = statistics.median(cat) / statistics.median(fused)
        print(f"dim {dim}: " + "  ".join(line) + f"  speed vs cat {ratio:.3f}x")


if __name__ == "__main__":
    main()
