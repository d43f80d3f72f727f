"""Every ```python block in README.md is a program that runs, or is marked as a fragment.

A block is skipped only when the line before it is ``<!-- readme-test: skip (why) -->``;
any other block runs in a fresh interpreter from the repository root. A top-level
``print(...)  # text`` line states what the program prints: the test checks it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
_README = _ROOT / "README.md"
_FENCE = re.compile(r"^```python\n(.*?)^```\n", re.S | re.M)
_SKIP = re.compile(r"<!-- readme-test: skip \((.+?)\) -->\s*$")


def _blocks() -> list[tuple[int, str, str | None]]:
    """(line number, code, skip reason or None) for each python block of the README."""
    text = _README.read_text()
    out: list[tuple[int, str, str | None]] = []
    for m in _FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = _SKIP.search(before)
        line = text.count("\n", 0, m.start()) + 1
        out.append((line, m.group(1), skip.group(1) if skip else None))
    return out


_BLOCKS = _blocks()


def _expected_prints(code: str) -> list[str]:
    """The ``# text`` comments of top-level ``print(...)`` lines, in order."""
    return [
        line.split("  # ", 1)[1].strip()
        for line in code.splitlines()
        if line.startswith("print(") and "  # " in line
    ]


def test_readme_has_a_runnable_block() -> None:
    assert any(skip is None for _, _, skip in _BLOCKS), "README.md: no runnable python block"


_IMPORT = re.compile(r"^\s*(?:import|from)\s+([A-Za-z_][\w.]*(?:\s*,\s*[A-Za-z_][\w.]*)*)", re.M)


def _imported(code: str) -> list[str]:
    """The top-level packages a block imports (``import a, b.c`` and ``from d.e import f``)."""
    names = [n.strip().split(".")[0] for m in _IMPORT.finditer(code) for n in m.group(1).split(",")]
    return list(dict.fromkeys(n.split()[0] for n in names if n))


@pytest.mark.parametrize(
    ("line", "code", "skip"), _BLOCKS, ids=[f"README.md:{line}" for line, _, _ in _BLOCKS]
)
def test_readme_block_runs(line: int, code: str, skip: str | None) -> None:
    if skip is not None:
        pytest.skip(f"README.md:{line} is marked as not a program: {skip}")
    missing = [m for m in _imported(code) if importlib.util.find_spec(m) is None]
    if missing:  # an optional library (torchvision, transformers) that is not installed
        pytest.skip(f"README.md:{line} needs {missing}, which cannot be imported here")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=_ROOT, env=env,
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, f"README.md:{line} failed:\n{proc.stderr}"
    expected = _expected_prints(code)
    if expected:
        assert proc.stdout.splitlines() == expected, (
            f"README.md:{line}: printed {proc.stdout!r}, the README says {expected!r}"
        )
