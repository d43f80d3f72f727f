"""Model factories for the Ray tests: module-level, so Ray's workers import them by name.

Each factory is seeded, so the model an actor builds equals the one the test builds as
the one-device reference. The tests put the repository root on the workers' PYTHONPATH.
"""

from __future__ import annotations

from typing import Any

import torch

import dpmethods

FEATURES, HIDDEN = 8, 6


class Encoder(torch.nn.Module):
    """A decorated method with a dict output: a per-row vector, a per-row scalar."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(FEATURES, HIDDEN)

    @dpmethods.parallel_method
    def encode(self, x: torch.Tensor, scale: float = 1.0) -> dict[str, torch.Tensor]:
        return {"mean": self.lin(x) * scale, "norm": x.norm(dim=1)}


def encoder() -> Encoder:
    torch.manual_seed(0)
    return Encoder().eval()


def gpt2() -> Any:
    """The tests' tiny random GPT-2, seeded, in eval mode."""
    from tests.helpers.models import tiny_gpt2

    torch.manual_seed(0)
    return tiny_gpt2().eval()


class PerRow(torch.nn.Module):
    """Per-row outputs that are not one tensor: token lists of different lengths, tuples,
    dicts and tensors of different shapes (each at least 5 long: never a sub-batch's
    rows, which would make the list read as a list of batch tensors), beside a tensor."""

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        k = [int(v) for v in x[:, 0]]
        return {
            "tokens": [list(range(n % 4)) for n in k],
            "pair": [(n, f"w{n}") for n in k],
            "tag": [{"n": n, "half": n / 2} for n in k],
            "ramp": [torch.arange(5 + n % 3, dtype=torch.float32) * n for n in k],
            "y": x * 2,
        }


def per_row() -> PerRow:
    return PerRow().eval()
