"""A resumable map over a whole dataset: outputs written to files, progress on a bar.

    python examples/resumable_map.py --out /tmp/embeddings       # run; Ctrl-C at any time
    python examples/resumable_map.py --out /tmp/embeddings       # again: only the rest runs

``dp.map(..., checkpoint=path)`` records which batches' outputs this loop has taken
(written to a file), in ``path``. Stopped by Ctrl-C, a crash or a kill, the same command
computes only the batches not yet taken: at least once, so the last file written before
the stop may be written again, which is harmless since it is the same file. With
``--stop-after N`` the script stops itself after N batches, as a crash would.

The script then checks every file against the model run on the whole dataset in this
process, and prints the result.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

import dpmethods


class Encoder(nn.Module):
    """A small encoder whose ``embed`` is a parallel method."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))

    @dpmethods.parallel_method
    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.normalize(self.net(x), dim=1)


def dataset(batches: int, rows: int) -> list[torch.Tensor]:
    """The same batches on every run (a real job reads them from storage)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(rows, 32, generator=g) for _ in range(batches)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the outputs and the record (default: none, required)")
    parser.add_argument("--batches", type=int, default=40, help="batches in the dataset (default: 40)")
    parser.add_argument("--rows", type=int, default=16, help="rows per batch (default: 16)")
    parser.add_argument("--replicas", type=int, default=2, help="CPU replicas (default: 2)")
    parser.add_argument("--stop-after", type=int, default=None, help="stop after this many batches, as a crash would (default: run to the end)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(0)  # the same weights on every run (a real job loads a checkpoint)
    model = Encoder().eval()
    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * args.replicas)
    data = dataset(args.batches, args.rows)
    written = 0
    with torch.no_grad():
        # The with block closes the map on any exit, which writes the record at once.
        with dp.map("embed", data, ordered=False, progress="embed",
                    checkpoint=args.out / "progress.json") as outputs:
            for index, embedding in outputs:
                torch.save(embedding, args.out / f"batch{index:05d}.pt")
                written += 1
                if args.stop_after is not None and written >= args.stop_after:
                    print(f"stopped after {written} batches; run again to finish")
                    return 3
        reference = [model.embed(x) for x in data]
    missing = [i for i in range(args.batches) if not (args.out / f"batch{i:05d}.pt").exists()]
    worst = max(
        float((torch.load(args.out / f"batch{i:05d}.pt") - reference[i]).abs().max())
        for i in range(args.batches) if i not in missing
    )
    print(f"wrote {written} batches this run; {args.batches - len(missing)} of {args.batches} "
          f"on disk; largest difference from one device {worst:.2e}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
