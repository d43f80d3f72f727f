"""``import dpmethods``: public names load on first use, and nothing depends on eager imports."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import dpmethods

_ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=_ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_every_public_name_resolves() -> None:
    for name in dpmethods.__all__:
        assert getattr(dpmethods, name) is not None, name
    assert set(dpmethods.__all__) <= set(dir(dpmethods))


def test_functions_keep_their_names_over_submodules() -> None:
    # gather, scatter, replicate and parallel_apply are functions and submodules; importing
    # a submodule directly, first, must not rebind the package attribute to the module.
    out = _run(
        "import dpmethods.data_parallel, dpmethods.streaming.map, dpmethods\n"
        "names = ['gather', 'scatter', 'replicate', 'parallel_apply']\n"
        "print([callable(getattr(dpmethods, n)) for n in names])\n"
    )
    assert out.strip() == "[True, True, True, True]"
    assert isinstance(dpmethods.ops, types.ModuleType)  # a submodule, by attribute


_HAS_EXTENSION = importlib.util.find_spec("dpmethods._C") is not None


@pytest.fixture(scope="module")
def first_import() -> list[str]:
    """One fresh interpreter whose first import is the extension module (or, installed
    without it, the package; either imports the package first): what it then prints."""
    first = "import dpmethods._C, torch" if _HAS_EXTENSION else "import dpmethods"
    return _run(
        f"import sys\n{first}\n"
        "import torch\n"
        "print(hasattr(torch.ops.dpmethods, 'gather_coalesced'))\n"
        "print('torch' in sys.modules, 'dpmethods.data_parallel' in sys.modules)\n"
        "dpmethods.scatter\n"
        "print('dpmethods.types.rules' in sys.modules)\n"
    ).split()


def test_import_loads_only_the_op_and_walks_see_the_shipped_type_rules(first_import: list[str]) -> None:
    # `import dpmethods` imports torch and the extension (its op must exist at once),
    # but the other submodules load on first use.
    assert first_import[1:] == ["True", "False", "True"]


def test_unknown_attribute_is_an_attribute_error() -> None:
    try:
        dpmethods.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("dpmethods.no_such_name did not raise")


@pytest.mark.skipif(not _HAS_EXTENSION, reason="installed without the extension")
def test_the_extension_module_imports_first_thing(first_import: list[str]) -> None:
    # The extension links against libtorch: dpmethods/__init__ imports torch before it.
    assert first_import[0] == "True"
