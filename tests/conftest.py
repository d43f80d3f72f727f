"""Shared fixtures: CPU test devices, seeded randomness and a CUDA marker."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is available on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def no_leaks() -> Iterator[None]:
    """Fail if the test leaves threads behind or reference cycles for gc to find."""
    gc.collect()
    before = {t.ident for t in threading.enumerate()}
    gc.disable()
    try:
        yield
        found = gc.collect()
    finally:
        gc.enable()
    after = [t for t in threading.enumerate() if t.ident not in before]
    assert after == [], f"threads left behind: {after}"
    assert found == 0, f"gc found {found} objects in reference cycles"
