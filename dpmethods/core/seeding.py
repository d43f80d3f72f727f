"""Seeds for replicas that have random generators of their own.

Worker processes (``workers="processes"``) and replicas on distinct GPUs each draw from
a generator of their own, so the caller's ``torch.manual_seed`` alone does not make
their sampling reproducible. Each call or map draws one seed from the caller's default
generator, and replica (or batch) ``i`` is seeded from ``(seed, i)``. CPU replicas in
threads, and repeated GPU ids, share one generator: nothing is seeded there. See
docs/generate.md for which modes are reproducible.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

__all__ = ["cuda_distinct", "draw_seed", "replica_seed", "seed_cuda"]


def draw_seed() -> int:
    """One seed drawn from the caller's default torch generator (once per call or map).

    Where replicas have generators of their own (worker processes, distinct GPUs),
    each is seeded from it (:func:`replica_seed`): after ``torch.manual_seed(s)`` a
    sampling call gives the same result run to run, and another seed another result.

    Example:
        >>> _ = torch.manual_seed(0); a = draw_seed()
        >>> _ = torch.manual_seed(0); a == draw_seed()
        True
    """
    return int(torch.empty((), dtype=torch.int64).random_())


def replica_seed(seed: int, i: int) -> int:
    """The seed of replica (or batch) ``i`` of the call that drew ``seed``.

    Example:
        >>> replica_seed(7, 0) != replica_seed(7, 1)
        True
    """
    digest = hashlib.blake2b(f"{seed}/{i}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # below 2**63, as manual_seed takes


def seed_cuda(devices: Sequence[torch.device], seed: int | None, base: int = 0) -> None:
    """Seed the generator of each CUDA device in ``devices`` from ``seed`` (replica i from
    ``(seed, base + i)``); nothing unless they are all CUDA and distinct (repeated ids
    and CPU replicas share one generator: nothing can be made reproducible there).

    Example:
        >>> seed_cuda([torch.device("cpu")] * 2, 1)  # CPU replicas: nothing to seed
    """
    if seed is None or not cuda_distinct(devices):
        return
    for i, d in enumerate(devices):
        index = d.index if d.index is not None else torch.cuda.current_device()
        torch.cuda.default_generators[index].manual_seed(replica_seed(seed, base + i))


def cuda_distinct(devices: Sequence[torch.device | None]) -> bool:
    """Whether every device is a CUDA device and no two are the same (each has its own
    generator).

    Example:
        >>> cuda_distinct([torch.device("cpu")])
        False
    """
    indices = [d.index if d.index is not None else -1 for d in devices if d is not None and d.type == "cuda"]
    return len(indices) == len(devices) > 0 and len(set(indices)) == len(indices)
