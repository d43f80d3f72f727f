"""Hooks a method registers on its replica stay in that call's replicas.

torch's replicas share the module's hook dicts, so a hook registered on a replica
while a method runs (peft's per-call ``adapter_names`` hooks; transformers' output
capturing hooks, installed once per model object) ran in every replica and stayed on
the module. Each replica now has its own copies; the module's own hooks still run in
every replica, and adding or removing one is seen by cached replicas.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

from dpmethods import DataParallel, parallel_method
from dpmethods.testing import assert_close_to_reference as close

CACHE = [pytest.param(False, id="fresh-replicas"), pytest.param(True, id="cached-replicas")]


class InstallsOnce(nn.Module):
    """Installs a capturing hook the first time an object runs, as transformers does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @parallel_method
    def features(self, x: torch.Tensor) -> dict[str, Any]:
        if not getattr(self, "_hooked", False):
            self.lin.register_forward_hook(lambda m, a, out: self._captured.append(out))
            self._hooked = True
        self._captured: list[torch.Tensor] = []
        y = self.lin(self.lin(x))
        return {"y": y, "captured": torch.stack(self._captured, 1)}


class PerCallHook(nn.Module):
    """Registers a pre-hook bound to this call's rows and removes it, as peft's adapter_names does."""

    def __init__(self, parties: int = 0) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        # Every replica registers its hook before any runs lin: a deterministic overlap.
        self.barrier = threading.Barrier(parties, timeout=10) if parties else None

    @parallel_method
    def scaled(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        handle = self.lin.register_forward_pre_hook(lambda m, args: (args[0] * scale.unsqueeze(1),))
        try:
            if self.barrier is not None:
                self.barrier.wait()
            return self.lin(x)
        finally:
            handle.remove()


def _hooks(module: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules())


@pytest.mark.parametrize("cache", CACHE)
def test_hook_installed_once_per_object_in_a_replica_neither_repeats_nor_reaches_the_module(cache: bool) -> None:
    torch.manual_seed(0)
    model = InstallsOnce()
    x = torch.randn(7, 4)
    dp = DataParallel(model, device_ids=["cpu"] * 3, cache_replicas=cache)
    with torch.no_grad():
        for _ in range(3):
            out = dp.features(x)
            assert out["captured"].shape == (7, 2, 4)  # two lin calls, not two per call so far
            assert _hooks(model) == 0  # nothing left on the module
        ref = model.features(x)
    close(out, ref, terms=2 * 5)  # Linear(4, 4) twice


def test_per_call_hooks_of_concurrent_replicas_do_not_cross() -> None:
    torch.manual_seed(0)
    model = PerCallHook(parties=4)
    x, scale = torch.randn(8, 3), torch.arange(1.0, 9.0)
    dp = DataParallel(model, device_ids=["cpu"] * 4)
    out = dp.scaled(x, scale)
    model.barrier = None
    close(out, model.scaled(x, scale), terms=1 + 4)  # a scale, then Linear(3, 3)
    assert _hooks(model) == 0


def test_module_hooks_run_in_every_replica_and_cached_replicas_see_them_change() -> None:
    torch.manual_seed(0)
    model = PerCallHook()
    x, scale = torch.randn(6, 3), torch.ones(6)
    dp = DataParallel(model, device_ids=["cpu"] * 3, cache_replicas=True)
    with torch.no_grad():
        plain = dp.scaled(x, scale)
        handle = model.lin.register_forward_hook(lambda m, a, out: out * 10)
        close(dp.scaled(x, scale), plain * 10, terms=5)  # added: seen
        close(dp.scaled(x, scale), plain * 10, terms=5)  # and kept
        handle.remove()
        close(dp.scaled(x, scale), plain, terms=5)  # removed: seen


def test_replica_hook_registrations_stay_out_of_the_module_in_training() -> None:
    torch.manual_seed(0)
    model = InstallsOnce()
    x = torch.randn(5, 4)
    dp = DataParallel(model, device_ids=["cpu"] * 2)
    dp.features(x)["y"].sum().backward()
    grad = model.lin.weight.grad.clone()
    model.zero_grad()
    ref = InstallsOnce()
    ref.load_state_dict(model.state_dict())
    ref.features(x)["y"].sum().backward()
    close(grad, ref.lin.weight.grad, terms=2 * 10 + 5 * 4)  # back through both, summed over 5 x 4
    assert _hooks(model) == 0
