"""What the tests share: tiny real models, their builders and the terms of their tolerances.

Module-level, so spawned worker processes and Ray's workers import them by name.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

__all__ = ["SPLITS", "WORKERS", "counting", "workers_of"]

# Items on replicas: uneven shares (7 on 3: 3, 2, 2) and even ones (8 on 4).
SPLITS = [pytest.param(7, 3, id="7-on-3"), pytest.param(8, 4, id="8-on-4")]

# The worker kinds, for tests that run on both.
WORKERS = ["threads", "processes"]


def workers_of(request: pytest.FixtureRequest) -> str:
    """The worker kind a test runs on: its ``workers`` parameter, threads if it has none
    (for fixtures that share one wrapper per kind between a module's tests)."""
    callspec = getattr(request.node, "callspec", None)
    return str(callspec.params.get("workers", "threads")) if callspec is not None else "threads"


def counting(pulled: list[int]) -> Iterator[torch.Tensor]:
    """An endless source of ``(2, 4)`` batches that appends each batch's index to
    ``pulled`` as it is pulled: how far ahead a map read."""
    while True:
        pulled.append(len(pulled))
        yield torch.randn(2, 4)
