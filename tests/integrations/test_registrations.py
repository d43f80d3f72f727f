"""Built-in registrations: the libraries dpmethods knows (listed by ``info``, checked in
tests/docs/test_cli.py), and none of them imported by dpmethods itself (their rules load
once the user imports them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpmethods.integrations import INTEGRATIONS

# Every library dpmethods knows of: the integrations, and Ray (the engine of dpmethods.ray).
_LIBRARIES = (*INTEGRATIONS, "ray")
# One fresh interpreter, step by step: after each step, the libraries it has imported.
# Steps only add modules, so a library absent after a later step was absent before it.
_STEPS = """
import json, sys
seen = {}
def look(step):
    seen[step] = sorted(m for m in LIBRARIES if m in sys.modules)
import torch, dpmethods
look("import dpmethods")
dpmethods.gather([{'a': torch.ones(1)}, {'a': torch.ones(1)}], 'cpu')  # the shipped rules load
look("a gather")
import dpmethods.ray
look("import dpmethods.ray")
print(json.dumps(seen))
"""


@pytest.fixture(scope="module")
def imported() -> dict[str, list[str]]:
    root = Path(__file__).resolve().parents[2]
    code = f"LIBRARIES = {_LIBRARIES!r}\n{_STEPS}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root)}, timeout=120)
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_importing_dpmethods_imports_no_third_party_library(imported: dict[str, list[str]]) -> None:
    assert imported["import dpmethods"] == []


def test_no_library_is_imported_by_dpmethods(imported: dict[str, list[str]]) -> None:
    # The shipped rules are installed only for libraries the user imported.
    assert imported["a gather"] == []


def test_importing_dpmethods_does_not_import_ray(imported: dict[str, list[str]]) -> None:
    # A Predictor is a callable class that Ray calls: dpmethods.ray needs no Ray of its own.
    assert imported["import dpmethods.ray"] == []
