"""Train with DDP through a decorated ``training_step``; runs unchanged on CPUs and GPUs.

    torchrun --nproc-per-node=2 examples/ddp_train.py --steps 20

Each rank trains on its own slice of a synthetic global batch. ``ddp.training_step``
goes through DDP's forward, so gradients are all-reduced and every rank ends with
the same parameters: the checksum printed by each rank is identical. On GPUs the
backend is nccl and each rank uses ``cuda:LOCAL_RANK``; otherwise gloo on the CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dpmethods


class Regressor(nn.Module):
    def __init__(self, features: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @dpmethods.parallel_method
    def training_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self(x), y)


def _say(line: str) -> None:
    # One write per line: the ranks share one stdout, and print() writes the text and
    # the newline separately, so lines of different ranks could run together.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Train with DDP through a decorated training_step, under torchrun "
        "(gloo on CPUs, nccl on GPUs); every rank prints the same parameter checksum. "
        "Run: torchrun --nproc-per-node=2 examples/ddp_train.py",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=20, help="training steps")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per rank")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # DDP broadcasts rank 0's weights anyway; this keeps runs repeatable
    model = Regressor().to(device)
    ddp = dpmethods.DistributedDataParallel(model, device_ids=[local_rank] if use_cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)

    true_w = torch.randn(16, 1) / 4
    for step in range(args.steps):
        # A different, reproducible slice of the global batch on every rank.
        g = torch.Generator().manual_seed(step * world + rank)
        x = torch.randn(args.batch_size, 16, generator=g)
        y = x @ true_w + 0.1 * torch.randn(args.batch_size, 1, generator=g)
        opt.zero_grad()
        loss = ddp.training_step(x.to(device), y.to(device))
        loss.backward()
        opt.step()
        _say(f"rank {rank} step {step} loss {loss.item():.6f}")

    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    _say(f"rank {rank} world {world} checksum {checksum:.10f}")
    # torch stashes a Python object in thread-local state during every backward,
    # and the gloo all-reduces DDP starts there keep a copy of that state. The
    # gloo thread that finishes such a work frees it, which takes the GIL; if the
    # interpreter is already shutting down by then, that thread is killed inside
    # a destructor and the process aborts ("terminate called without an active
    # exception", seen in 2 of 20 runs). A short sleep releases the GIL, so a
    # worker waiting for it finishes first.
    del ddp, opt
    dist.destroy_process_group()
    time.sleep(0.05)


if __name__ == "__main__":
    main()
