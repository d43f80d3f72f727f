"""Test helpers: check that each replica computed with its own parameters and buffers.

With ``cpu_replicas="distinct"`` every CPU replica has its own copies, as on
distinct GPUs. A replica that reads another replica's tensors (say, a list of
weights kept beside ``_parameters`` and not re-pointed, as ``nn.LSTM``'s
``_flat_weights`` were) computes right on one machine and fails with a device
mismatch on several GPUs. :func:`assert_replicas_isolated` finds that on CPU: it
records, in each replica's thread, the storages every operator reads or writes
(a ``TorchDispatchMode``), and fails if a replica touched the parameters or buffers
of another replica of the same call, or holds one in a plain attribute (a tensor,
or a list or tuple of tensors) when its call starts.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode

from dpmethods.core.parallel_apply import _REPLICA_CONTEXTS

__all__ = ["IsolationReport", "assert_replicas_isolated"]


def _storage(t: Tensor) -> tuple[torch.device, int] | None:
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse, nested, or no storage at all
        return None
    return (t.device, ptr) if ptr else None


class _Recorder(TorchDispatchMode):
    """The storages of every tensor an operator gets, in the thread that entered it."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: set[tuple[torch.device, int]] = set()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        for leaf in _pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, Tensor):
                key = _storage(leaf)
                if key is not None:
                    self.storages.add(key)
        return func(*args, **(kwargs or {}))


def _owned(replica: nn.Module) -> dict[tuple[torch.device, int], str]:
    """Storage -> name, for the replica's parameters and buffers."""
    out: dict[tuple[torch.device, int], str] = {}
    for prefix, m in replica.named_modules(remove_duplicate=False):
        for kind, group in (("parameter", m._parameters), ("buffer", m._buffers)):
            for name, t in group.items():
                key = None if t is None else _storage(t)
                if key is not None:
                    out.setdefault(key, f"{kind} {prefix + '.' if prefix else ''}{name}")
    return out


def _held(replica: nn.Module) -> Iterator[tuple[Tensor, str]]:
    """Tensors a replica's modules hold in plain attributes (alone, or in a list or tuple)."""
    for prefix, m in replica.named_modules(remove_duplicate=False):
        for attr, value in m.__dict__.items():
            items = value if isinstance(value, (list, tuple)) else (value,)
            for k, item in enumerate(items):
                if isinstance(item, Tensor):
                    where = f"{prefix + '.' if prefix else ''}{attr}"
                    yield item, where if items is not value else f"{where}[{k}]"


@dataclass
class IsolationReport:
    """What :func:`assert_replicas_isolated` saw.

    Attributes:
        replica_runs: replica calls recorded (one per replica per parallel call).
        checked_runs: those whose replica had tensors no other replica shared, so the
            check could fail (0 with shared CPU replicas: then there is nothing to check).
        violations: one line per replica that touched another replica's tensor.

    Example:
        >>> IsolationReport()
        IsolationReport(replica_runs=0, checked_runs=0, violations=[])
    """

    replica_runs: int = 0
    checked_runs: int = 0
    violations: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @contextlib.contextmanager
    def _record(self, i: int, replicas: Sequence[nn.Module]) -> Iterator[None]:
        # What the replica holds as it was made (its method may repair it, as
        # nn.LSTM's forward re-reads its weights when they changed identity).
        held = [(_storage(t), where) for t, where in _held(replicas[i])]
        recorder = _Recorder()
        with recorder:
            yield
        own = _owned(replicas[i])
        others: dict[tuple[torch.device, int], str] = {}
        for j, replica in enumerate(replicas):
            if j != i:
                for key, name in _owned(replica).items():
                    if key not in own:
                        others.setdefault(key, f"replica {j}'s {name}")
        bad = sorted(others[k] for k in recorder.storages if k in others)
        # Held, used or not: on distinct GPUs a use is a device mismatch.
        bad.extend(f"{others[k]} (held as {where})" for k, where in held if k in others)
        with self._lock:
            self.replica_runs += 1
            self.checked_runs += bool(others)
            if bad:
                self.violations.append(f"replica {i} touched {', '.join(bad)}")


@contextlib.contextmanager
def assert_replicas_isolated(*, require_checks: bool = True) -> Iterator[IsolationReport]:
    """Fail if, inside the block, a replica touches another replica's parameters or buffers.

    Every parallel call in the block (any thread) is recorded. On leaving the block
    it raises ``AssertionError`` naming each replica and the tensors it touched that
    belong to another replica of the same call, and those it holds in a plain
    attribute (a tensor, or a list or tuple of tensors) when its call starts: on
    distinct GPUs using such a tensor is a device mismatch. Only replicas with tensors of their
    own can be checked: use ``cpu_replicas="distinct"`` on CPU devices (or distinct
    GPUs). With ``require_checks`` (the default) it also fails if nothing could be
    checked, so a test using it cannot pass vacuously.

    Args:
        require_checks: fail when no recorded replica had tensors of its own.

    Example:
        >>> import torch, dpmethods
        >>> from dpmethods.testing import assert_replicas_isolated
        >>> dp = dpmethods.DataParallel(
        ...     torch.nn.Linear(3, 5), device_ids=["cpu"] * 2, cpu_replicas="distinct")
        >>> with assert_replicas_isolated() as report:
        ...     _ = dp(torch.randn(4, 3))
        >>> report.replica_runs, report.violations
        (2, [])
    """
    report = IsolationReport()
    hooks = _REPLICA_CONTEXTS
    hooks.append(report._record)
    try:
        yield report
    finally:
        hooks.remove(report._record)
    if report.violations:
        raise AssertionError(
            "replicas touched tensors of other replicas:\n" + "\n".join(sorted(report.violations))
        )
    if require_checks and not report.checked_runs:
        raise AssertionError(
            f"assert_replicas_isolated: expected replicas with tensors of their own, got "
            f"{report.replica_runs} replica runs that share all their tensors (use "
            f"cpu_replicas='distinct' and at least 2 devices)"
        )
