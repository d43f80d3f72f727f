"""Random gather inputs shared by the CPU and CUDA op tests: every dtype, never zeros;
and a module whose method returns its rows as a sparse tensor."""

from __future__ import annotations

import torch
from torch import nn

import dpmethods

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
]


def rand(shape: list[int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random values of ``dtype`` (integers within +-1000, clipped to the dtype's range)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -1000), min(info.max, 1000)
    return torch.randint(lo, hi, shape, generator=gen, dtype=dtype)


def pieces(
    shape: list[int], dim: int, sizes: list[int], dtype: torch.dtype, gen: torch.Generator
) -> list[torch.Tensor]:
    """One random piece per entry of ``sizes``: ``shape`` with ``sizes[r]`` along ``dim``."""
    d = dim % len(shape)
    out = []
    for s in sizes:
        sh = list(shape)
        sh[d] = s
        out.append(rand(sh, dtype, gen))
    return out


class Sparsify(nn.Module):
    """``codes(x, layout)``: the entries of ``x`` over a threshold, scaled, one row per
    item, as a sparse tensor of ``layout`` (blocks of 1 x 2 for BSR and BSC), alone or
    beside a dense leaf. Elementwise, so each row is the same bits in any batch."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(3.0))

    @dpmethods.parallel_method
    def codes(self, x: torch.Tensor, layout: str, alone: bool = True) -> object:
        y = torch.where(x > 0.5, x * self.scale.detach(), torch.zeros_like(x))
        codes = {
            "coo": y.to_sparse, "csr": y.to_sparse_csr, "csc": y.to_sparse_csc,
            "bsr": lambda: y.to_sparse_bsr((1, 2)), "bsc": lambda: y.to_sparse_bsc((1, 2)),
        }[layout]()
        return codes if alone else {"codes": codes, "norm": x.norm(dim=1)}
