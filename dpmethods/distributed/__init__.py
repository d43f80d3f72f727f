"""Parallel methods under DistributedDataParallel, FSDP2 and other forward-only wrappers.

``ddp.module.training_step(batch)`` skips DDP's forward, so the reducer never
prepares for backward: gradients are not all-reduced and ranks drift apart, or the
next step fails with "Expected to have finished reduction in the prior iteration".
The wrappers here run such methods *through* the wrapper's own forward (see
:mod:`dpmethods.distributed.redirect`), so every feature of the wrapper's forward applies.
"""

from __future__ import annotations

from dpmethods.distributed.ddp import DistributedDataParallel
from dpmethods.distributed.fsdp import fully_shard, register_fsdp_methods
from dpmethods.distributed.route import route

__all__ = [
    "DistributedDataParallel",
    "fully_shard",
    "register_fsdp_methods",
    "route",
]
