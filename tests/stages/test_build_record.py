"""An extension built against another torch: not loaded, and the message names both torches and the fix.

setup.py records the torch ``dpmethods._C`` was compiled against in ``dpmethods/_build_info.json``;
here a record in a temporary folder stands in for it (the package folder is not written).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import dpmethods
from dpmethods.__main__ import main
from dpmethods.ops import extension

_FIX = "pip install --no-build-isolation -e ."
# A torch no one runs: both its version and its CUDA version differ from the running one.
_OTHER = {"torch": "0.0.1+fake", "torch_cuda": "99.9", "cuda_kernels": True}


def _running() -> str:
    cuda = torch.version.cuda
    return f"{torch.__version__} ({f'CUDA {cuda}' if cuda else 'CPU-only'})"


@pytest.fixture
def reload(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """Load the extension again, as a fresh process would, with ``record`` as the build record."""

    # A record is read only when the extension is not disabled on purpose.
    monkeypatch.delenv(extension.DISABLE_ENV, raising=False)

    def run(record: dict[str, Any] | None) -> extension.Loaded:
        path = tmp_path / "_build_info.json"
        if record is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(json.dumps(record))
        monkeypatch.setattr(extension, "LOADER", extension.Loader(path))
        return extension.LOADER.load()

    return run


def test_another_torch_version_and_cuda_is_named_with_the_fix(
    reload: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="dpmethods"):
        state = reload(_OTHER)
        extension.LOADER.load(), extension.info()  # asked again: no second message
    assert state.module is None
    expected = (
        f"dpmethods._C was built against torch 0.0.1+fake (CUDA 99.9), but torch {_running()} "
        f"is running; reinstall dpmethods from its source folder with `{_FIX}`"
    )
    assert state.reason.startswith(expected), state.reason
    messages = [r.getMessage() for r in caplog.records if r.name == "dpmethods"]
    assert messages == [f"dpmethods: using the pure-PyTorch gather ({state.reason})"]


def test_the_cuda_variant_alone_differs(reload: Any) -> None:
    other_cuda = "99.9" if torch.version.cuda != "99.9" else "98.0"
    state = reload({"torch": str(torch.__version__), "torch_cuda": other_cuda})
    assert state.module is None
    assert f"built against torch {torch.__version__} (CUDA {other_cuda}), but torch {_running()}" in (
        state.reason
    )


def test_a_cpu_only_build_is_named_so(reload: Any) -> None:
    state = reload({"torch": "0.0.1+cpu", "torch_cuda": None})
    assert "built against torch 0.0.1+cpu (CPU-only), but" in state.reason


@pytest.mark.skipif(
    importlib.util.find_spec("dpmethods._C") is None, reason="installed without the extension"
)
def test_the_torch_running_loads_the_extension(reload: Any) -> None:
    state = reload({"torch": str(torch.__version__), "torch_cuda": torch.version.cuda})
    assert state.module is not None and state.reason is None
    # No record (an older build): the library's own version is compared.
    state = reload(None)
    assert state.module is not None and state.reason is None


def test_info_command_says_the_same(reload: Any, capsys: pytest.CaptureFixture[str]) -> None:
    state = reload(_OTHER)
    info = extension.info()
    assert info["in_use"] == "pytorch fallback" and info["reason"] == state.reason
    assert (info["torch_built_against"], info["torch_cuda_built_against"]) == ("0.0.1+fake", "99.9")
    assert (info["torch_runtime"], info["torch_cuda_runtime"]) == (
        str(torch.__version__), torch.version.cuda)
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    ext = out[out.index("extension:"):]
    # The reason (both torches and the fix) comes first, right under "in use".
    assert ext.splitlines()[:2] == [
        "extension: in use: pytorch fallback", f"  reason: {state.reason}"]
    assert "  torch_built_against: 0.0.1+fake" in ext and f"  torch_runtime: {torch.__version__}" in ext


class _FailingLibrary(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A ``dpmethods._C`` that is installed but fails to load, as a library linked
    against a CUDA runtime the machine lacks does."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(name, self) if name == "dpmethods._C" else None

    def exec_module(self, module: Any) -> None:
        raise OSError("libc10_cuda.so: cannot open shared object file: No such file or directory")


def test_a_failed_import_names_both_torches_and_the_fix(
    reload: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(dpmethods, "_C", raising=False)
    monkeypatch.delitem(sys.modules, "dpmethods._C", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_FailingLibrary(), *sys.meta_path])
    reason = reload({"torch": str(torch.__version__), "torch_cuda": torch.version.cuda}).reason
    assert reason.startswith(
        "import of dpmethods._C failed: OSError: libc10_cuda.so: cannot open shared object file"
    )
    assert f"it was built against torch {_running()}, torch {_running()} is running" in reason
    assert _FIX in reason
    unknown = reload(None).reason
    assert "built against torch unknown (no dpmethods/_build_info.json)" in unknown


def test_a_missing_library_says_how_to_build_it(
    reload: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(dpmethods, "_C", raising=False)
    monkeypatch.setitem(sys.modules, "dpmethods._C", None)  # as if no library was installed
    state = reload(None)
    assert state.module is None
    assert state.reason.startswith("dpmethods._C is not installed") and _FIX in state.reason
