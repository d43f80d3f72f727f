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


def test_import_loads_only_the_op_and_walks_see_the_shipped_type_rules() -> None:
    # `import dpmethods` imports torch and the extension (its op must exist at once),
    # but the other submodules load on first use.
    out = _run(
        "import sys, dpmethods\n"
        "print('torch' in sys.modules, 'dpmethods.data_parallel' in sys.modules)\n"
        "dpmethods.scatter\n"
        "print('dpmethods.types.rules' in sys.modules)\n"
    )
    assert out.split() == ["True", "False", "True"]


def test_unknown_attribute_is_an_attribute_error() -> None:
    try:
        dpmethods.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("dpmethods.no_such_name did not raise")


@pytest.mark.skipif(
    importlib.util.find_spec("dpmethods._C") is None, reason="installed without the extension"
)
def test_the_extension_module_imports_first_thing() -> None:
    # The extension links against libtorch: dpmethods/__init__ imports torch before it.
    out = _run("import dpmethods._C, torch\nprint(hasattr(torch.ops.dpmethods, 'gather_coalesced'))")
    assert out.strip() == "True"
