"""Shared test setup: CUDA-marked tests skip without a GPU; every test is seeded and
runs with poisoned gather outputs.

The CPU replica mode comes from ``DPMETHODS_CPU_REPLICAS`` (``shared`` by default,
or ``distinct``); CI runs the suite once in each. The header names the mode.
"""

from __future__ import annotations

import pytest
import torch


def pytest_report_header(config: pytest.Config) -> str:
    from dpmethods.core.replicate import cpu_replicas_mode

    return f"dpmethods CPU replicas: {cpu_replicas_mode()} (DPMETHODS_CPU_REPLICAS)"


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


@pytest.fixture(autouse=True)
def _poison(monkeypatch: pytest.MonkeyPatch) -> None:
    # The compiled gather fills its outputs with 0xFF bytes before copying, in every
    # test: a byte it forgets to write shows (random data never is a run of 0xFF).
    monkeypatch.setenv("DPMETHODS_POISON", "1")
