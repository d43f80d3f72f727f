"""Loading of the compiled extension ``dpmethods._C``.

The extension is optional: when it is missing, fails to import, lacks CUDA for
a CUDA target, or ``DPMETHODS_DISABLE_EXTENSION=1`` is set, dpmethods falls
back to pure PyTorch and says why once on the ``dpmethods`` logger (warning
for a failed import or a missing CUDA build, info when disabled on purpose).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

__all__: list[str] = []

_log = logging.getLogger("dpmethods")

DISABLE_ENV = "DPMETHODS_DISABLE_EXTENSION"


@dataclass
class _State:
    module: ModuleType | None
    reason: str | None
    logged: set[str] = field(default_factory=set)


_STATE: _State | None = None


def _load() -> _State:
    """Import ``dpmethods._C`` once and remember the outcome."""
    global _STATE
    if _STATE is not None:
        return _STATE
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        _STATE = _State(None, f"disabled by {DISABLE_ENV}={os.environ[DISABLE_ENV]}")
        _log_once(_STATE, _STATE.reason or "", logging.INFO)
        return _STATE
    try:
        # Importing the module loads the shared library, whose static
        # initializers register torch.ops.dpmethods.*.
        from dpmethods import _C  # type: ignore[attr-defined]
    except Exception as exc:  # ImportError, OSError (undefined symbol), ...
        _STATE = _State(None, f"import of dpmethods._C failed: {type(exc).__name__}: {exc}")
        _log_once(_STATE, _STATE.reason or "", logging.WARNING)
        return _STATE
    _STATE = _State(_C, None)
    return _STATE


def _log_once(state: _State, reason: str, level: int) -> None:
    if reason not in state.logged:
        state.logged.add(reason)
        _log.log(level, "dpmethods: using the pure-PyTorch gather (%s)", reason)


def module() -> ModuleType | None:
    """The imported ``dpmethods._C``, or None when the fallback is in use."""
    return _load().module


def with_cuda() -> bool:
    """True when the loaded extension has its CUDA kernels compiled in."""
    mod = _load().module
    return bool(mod is not None and mod.with_cuda())


def unsupported_reason(device: torch.device) -> str | None:
    """Why the compiled op cannot gather to ``device`` (None when it can); logs once."""
    state = _load()
    if state.module is None:
        return state.reason
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        if state.module.with_cuda():
            return None
        reason = "dpmethods._C was built without CUDA kernels"
    else:
        reason = f"dpmethods._C has no kernels for device type {device.type!r}"
    _log_once(state, reason, logging.WARNING)
    return reason


def info() -> dict[str, Any]:
    """Build and runtime facts; see :func:`dpmethods.ops.extension_info`."""
    state = _load()
    mod = state.module
    archs: list[str] = []
    built: str | None = None
    cuda = False
    if mod is not None:
        archs = [a for a in mod.cuda_arch_list().split(";") if a]
        built = mod.torch_version()
        cuda = bool(mod.with_cuda())
    return {
        "available": mod is not None,
        "cuda": cuda,
        "cuda_archs": archs,
        "torch_built_against": built,
        "torch_runtime": torch.__version__,
        "in_use": "compiled" if mod is not None else "pytorch fallback",
        "reason": state.reason,
        "path": getattr(mod, "__file__", None),
    }
