"""TEMPORARY STUB (replaced by the compiled-gather work): pure-PyTorch gather_coalesced."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["gather_coalesced"]


def gather_coalesced(
    tensors: Sequence[torch.Tensor], num_replicas: int, dim: int, device: torch.device
) -> list[torch.Tensor]:
    """Concatenate leaf-major ``tensors`` (``tensors[l * num_replicas + r]``) per leaf."""
    out = []
    for i in range(0, len(tensors), num_replicas):
        parts = [t.to(device) for t in tensors[i : i + num_replicas]]
        out.append(torch.cat(parts, dim))
    return out
