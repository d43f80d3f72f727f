"""Loading of the compiled extension ``dpmethods._C``.

The extension is optional: when it is missing, fails to import, was built against
another torch than the one running, lacks CUDA for a CUDA target, or
``DPMETHODS_DISABLE_EXTENSION=1`` is set, dpmethods falls back to pure PyTorch and
says why once on the ``dpmethods`` logger (warning for a failed import, another torch
or a missing CUDA build, info when disabled on purpose).

setup.py writes ``dpmethods/_build_info.json`` beside the library: the torch version
and CUDA version it was compiled against. A library built against another torch
(pip's isolated build fetches a torch of its own) fails to load, or worse, loads and
misbehaves, so it is not imported then; the message names both torches and the fix.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

__all__ = ["BUILD_RECORD", "DISABLE_ENV", "LOADER", "Loaded", "Loader", "info", "module", "unsupported_reason"]

_log = logging.getLogger("dpmethods")

DISABLE_ENV = "DPMETHODS_DISABLE_EXTENSION"
BUILD_RECORD = Path(__file__).resolve().parent.parent / "_build_info.json"
_FIX = (
    "reinstall dpmethods from its source folder with "
    "`pip install --no-build-isolation -e .`, which compiles it against the torch in use "
    "(without --no-build-isolation pip compiles against a torch it downloads for the build)"
)


@dataclass(frozen=True)
class Loaded:
    """What loading ``dpmethods._C`` came to: the module, or None and why the fallback is in use.

    Example:
        >>> loaded = LOADER.load()
        >>> (loaded.module is None) == (loaded.reason is not None)
        True
    """

    module: ModuleType | None
    reason: str | None


class Loader:
    """Imports ``dpmethods._C`` once, checked against the build record at ``record``,
    remembers the outcome, and says each reason for the fallback once on the
    ``dpmethods`` logger.

    :data:`LOADER` is the one the package uses; a test puts a loader of another record
    in its place to load as a fresh process would. A loader given ``disabled`` (the
    reason) never tries the extension, as with ``DPMETHODS_DISABLE_EXTENSION=1``.

    Example:
        >>> import tempfile
        >>> missing = Path(tempfile.mkdtemp()) / "_build_info.json"  # no record: the library's own version is compared
        >>> Loader(missing).load().module is LOADER.load().module
        True
    """

    def __init__(self, record: Path, disabled: str | None = None) -> None:
        self.record = record
        self.disabled = disabled  # why the fallback is in use without trying the extension
        self._loaded: Loaded | None = None
        self._logged: set[str] = set()

    def load(self) -> Loaded:
        """Import ``dpmethods._C`` on the first call; every call returns that outcome."""
        if self._loaded is None:
            self._loaded = self._first_load()
        return self._loaded

    def say_once(self, reason: str, level: int) -> None:
        """Log that the pure-PyTorch gather is in use because of ``reason``, once per reason."""
        if reason not in self._logged:
            self._logged.add(reason)
            _log.log(level, "dpmethods: using the pure-PyTorch gather (%s)", reason)

    def _first_load(self) -> Loaded:
        disabled = self.disabled
        if disabled is None and os.environ.get(DISABLE_ENV, "") not in ("", "0"):
            disabled = f"disabled by {DISABLE_ENV}={os.environ[DISABLE_ENV]}"
        if disabled is not None:
            self.say_once(disabled, logging.INFO)
            return Loaded(None, disabled)
        built = _recorded_build(self.record)
        reason = _mismatch(built)
        if reason is None:
            try:
                # Importing the module loads the shared library, whose static
                # initializers register torch.ops.dpmethods.*.
                from dpmethods import _C  # type: ignore[attr-defined]
            except Exception as exc:  # ImportError, OSError (undefined symbol), ...
                reason = _import_failure(exc, built)
            else:
                # A build without a record: the library itself knows its torch version.
                lib: Any = _C
                reason = _mismatch({"torch": lib.torch_version()}) if built is None else None
                if reason is None:
                    return Loaded(_C, None)
        self.say_once(reason, logging.WARNING)
        return Loaded(None, reason)


LOADER = Loader(BUILD_RECORD)


def _import_failure(exc: Exception, built: dict[str, Any] | None) -> str:
    if importlib.util.find_spec("dpmethods._C") is None:
        return (
            "dpmethods._C is not installed (an install with DPMETHODS_SKIP_EXTENSION=1 has "
            f"none); to build it, {_FIX}"
        )
    return (
        f"import of dpmethods._C failed: {type(exc).__name__}: {exc}; it was built against "
        f"torch {_describe(built)}, torch {_describe(_running())} is running; if torch "
        f"changed since dpmethods was installed, {_FIX}"
    )


def _recorded_build(path: Path) -> dict[str, Any] | None:
    """The torch ``dpmethods._C`` was compiled against, as setup.py recorded it at ``path`` (None: no record)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _running() -> dict[str, Any]:
    return {"torch": str(torch.__version__), "torch_cuda": torch.version.cuda}


def _describe(build: dict[str, Any] | None) -> str:
    if build is None:
        return "unknown (no dpmethods/_build_info.json)"
    if "torch_cuda" not in build:
        return str(build.get("torch"))
    cuda = build["torch_cuda"]
    return f"{build.get('torch')} ({f'CUDA {cuda}' if cuda else 'CPU-only'})"


def _mismatch(built: dict[str, Any] | None) -> str | None:
    """Why a library built against ``built`` must not load into the torch running (None: it may).

    Compares the keys ``built`` has: ``torch`` (the version) and ``torch_cuda`` (the CUDA
    version torch was built with, None for a CPU-only torch).

    Example:
        >>> import torch
        >>> _mismatch({"torch": str(torch.__version__), "torch_cuda": torch.version.cuda}) is None
        True
        >>> print(_mismatch({"torch": "0.1.0"}))  # doctest: +ELLIPSIS
        dpmethods._C was built against torch 0.1.0, but torch ... is running; reinstall ...
    """
    if built is None:
        return None
    running = _running()
    if all(built[k] == running[k] for k in ("torch", "torch_cuda") if k in built):
        return None
    return (
        f"dpmethods._C was built against torch {_describe(built)}, but torch "
        f"{_describe(running)} is running; {_FIX}"
    )


def module() -> ModuleType | None:
    """The imported ``dpmethods._C``, or None when the fallback is in use.

    Example:
        >>> (module() is None) == (info()["in_use"] == "pytorch fallback")
        True
    """
    return LOADER.load().module


def unsupported_reason(device: torch.device) -> str | None:
    """Why the compiled op cannot gather to ``device`` (None when it can); logs once.

    Example:
        >>> unsupported_reason(torch.device("cpu")) == info()["reason"]
        True
    """
    state = LOADER.load()
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
    LOADER.say_once(reason, logging.WARNING)
    return reason


def info() -> dict[str, Any]:
    """Build and runtime facts; see :func:`dpmethods.ops.extension_info`.

    Example:
        >>> info()["torch_runtime"] == str(torch.__version__)
        True
    """
    state = LOADER.load()
    mod = state.module
    record = _recorded_build(LOADER.record) or {}
    archs: list[str] = []
    built: str | None = record.get("torch")
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
        "torch_cuda_built_against": record.get("torch_cuda"),
        "torch_runtime": str(torch.__version__),
        "torch_cuda_runtime": torch.version.cuda,
        "in_use": "compiled" if mod is not None else "pytorch fallback",
        "reason": state.reason,
        "path": getattr(mod, "__file__", None),
    }
