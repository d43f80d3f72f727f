"""Embed a dataset with ``DataParallel.map`` on every rank of a torchrun job, then collect.

    torchrun --nproc-per-node=2 examples/map_torchrun.py --batches 20
    torchrun --nproc-per-node=2 examples/map_torchrun.py --out embeddings/   # per-rank files

Each rank wraps the model in ``dpmethods.DataParallel`` over its own devices (its
GPU, or ``--replicas`` CPU replicas) and calls ``dp.map(..., shard=True)``: rank r
runs batch i only when ``i % world_size == r``, each batch whole on whichever of its
replicas is free. ``ordered=False`` yields ``(index, output)`` pairs, and the
indices are what put the results back together: ``all_gather_object`` gives rank 0
every rank every rank's pairs (or, with ``--out``, each rank writes its own file). Rank 0
then checks the collected embeddings against the model run on the whole dataset in one
process and prints a checksum. On GPUs the backend is nccl; otherwise gloo on the CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

import dpmethods


class Encoder(nn.Module):
    """A small MLP encoder with an ``embed`` parallel method."""

    def __init__(self, features: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, 64), nn.GELU(), nn.Linear(64, dim))

    @dpmethods.parallel_method
    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.normalize(self.net(x), dim=-1)


def dataset(batches: int, batch_size: int, features: int = 32) -> list[torch.Tensor]:
    """The same synthetic batches on every rank (a DataLoader would do as well)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(batch_size, features, generator=g) for _ in range(batches)]


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")  # one write per line: the ranks share one stdout
    sys.stdout.flush()


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends each option's default, unless its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default:" in (action.help or "") or action.default is None:
            return action.help
        return super()._get_help_string(action)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Embed a dataset with DataParallel.map(shard=True) on every rank of a "
        "torchrun job, then collect the results on rank 0 and check them against one "
        "process. Run: torchrun --nproc-per-node=2 examples/map_torchrun.py",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--batches", type=int, default=20, help="batches in the dataset")
    parser.add_argument("--batch-size", type=int, default=8, help="items per batch")
    parser.add_argument("--replicas", type=int, default=2,
                        help="CPU replicas per rank (on GPUs: one, the rank's own)")
    parser.add_argument("--out", default=None,
                        help="a folder for per-rank result files (default: none, the "
                        "results are collected with all_gather_object)")
    parser.add_argument("--progress", action="store_true", help="a progress bar on rank 0")
    args = parser.parse_args(argv)

    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)  # ranks and replicas share the CPU cores

    torch.manual_seed(0)  # every rank builds the same weights
    model = Encoder().eval()
    devices: list[int | str] = [local_rank] if use_cuda else ["cpu"] * args.replicas
    dp = dpmethods.DataParallel(model.to(devices[0]), device_ids=devices, cache_replicas=True)
    data = dataset(args.batches, args.batch_size)

    with torch.no_grad():
        mine = list(
            dp.map("embed", data, shard=True, ordered=False, progress=args.progress and rank == 0)
        )
    mine = [(i, out.cpu()) for i, out in mine]
    _say(f"rank {rank} ran batches {sorted(i for i, _ in mine)}")

    if args.out is not None:  # one file per rank; merge them later by index
        os.makedirs(args.out, exist_ok=True)
        torch.save(dict(mine), os.path.join(args.out, f"rank{rank}.pt"))

    # Every rank's (index, output) pairs on every rank, put back in dataset order.
    gathered: list[list[tuple[int, torch.Tensor]]] = [[] for _ in range(world)]
    dist.all_gather_object(gathered, mine)
    pairs = sorted((p for part in gathered for p in part), key=lambda p: p[0])
    assert [i for i, _ in pairs] == list(range(args.batches)), "a batch is missing"
    embeddings = torch.cat([out for _, out in pairs])
    if rank == 0:
        with torch.no_grad():
            reference = model.cpu().embed(torch.cat(data))
        diff = (embeddings - reference).abs().max().item()
        _say(f"max diff against one process: {diff:.3g}")
        _say(
            f"world {world} collected {embeddings.shape[0]} embeddings "
            f"checksum {embeddings.double().sum().item():.8f}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
