"""Random gather inputs shared by the CPU and CUDA op tests: every dtype, never zeros."""

from __future__ import annotations

import torch

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
