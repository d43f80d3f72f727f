"""Built-in registrations: the libraries dpmethods knows, listed by ``info``, and none of
them imported by dpmethods itself (their rules load once the user imports them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dpmethods.integrations import INTEGRATIONS


def test_info_lists_the_registrations() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "dpmethods", "info"], capture_output=True, text=True, check=True,
        timeout=120, cwd=Path(__file__).resolve().parents[2],  # this checkout's dpmethods
    ).stdout
    for library in INTEGRATIONS:
        assert library in out
    assert "generate (gather='generate')" in out


def test_no_library_is_imported_by_dpmethods() -> None:
    # The shipped rules are installed only for libraries the user imported.
    code = (
        "import sys, torch, dpmethods; "
        "dpmethods.gather([{'a': torch.ones(1)}, {'a': torch.ones(1)}], 'cpu'); "
        "print(sorted(m for m in ('diffusers', 'transformers', 'sentence_transformers') if m in sys.modules))"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root)}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
