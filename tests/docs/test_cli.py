"""``python -m dpmethods``: usage, ``info``, ``info --json`` and ``demo``, run as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

_ROOT = Path(__file__).resolve().parents[2]


_COMMANDS: dict[str, tuple[str, ...]] = {
    "usage": (),
    "info": ("info",),
    "json": ("info", "--json"),
    "demo": ("demo",),
}


@pytest.fixture(scope="module")
def runs() -> dict[str, subprocess.CompletedProcess[str]]:
    """Every command run once, all at the same time: each pays the torch import, in parallel."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH")]))
    procs = {
        key: subprocess.Popen(
            [sys.executable, "-m", "dpmethods", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=_ROOT,
        )
        for key, args in _COMMANDS.items()
    }
    done: dict[str, subprocess.CompletedProcess[str]] = {}
    try:
        for key, proc in procs.items():
            out, err = proc.communicate(timeout=240)
            done[key] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


def test_usage_without_arguments(runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    proc = runs["usage"]
    assert proc.returncode == 0, proc.stderr
    assert "usage: python -m dpmethods" in proc.stdout
    assert "info" in proc.stdout and "demo" in proc.stdout


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    from dpmethods.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "usage: python -m dpmethods" in out and "info" in out and "demo" in out


def test_unknown_command_fails(capsys: pytest.CaptureFixture[str]) -> None:
    from dpmethods.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["nonsense"])
    assert exc.value.code != 0
    assert "invalid choice" in capsys.readouterr().err


def test_info_text(runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    proc = runs["info"]
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    import dpmethods

    assert f"dpmethods {dpmethods.__version__}" in out
    assert f"torch {torch.__version__}" in out
    assert f"Python {sys.version_info.major}.{sys.version_info.minor}" in out
    assert f"CPU count: {os.cpu_count()}" in out
    assert "extension: in use:" in out
    if torch.cuda.is_available():
        assert "GPU 0:" in out and "peer access (row can access column)" in out
    else:
        assert "peer access: n/a: no GPU" in out


def test_info_json(runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    proc = runs["json"]
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["torch"] == torch.__version__
    assert info["torch_cuda"] == torch.version.cuda
    assert info["devices"]["cpu_count"] == os.cpu_count()
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert len(info["devices"]["gpus"]) == n_gpus
    if not info["devices"]["gpus"]:
        assert info["peer_access"] == "n/a: no GPU"
    assert "in_use" in info["extension"]


def test_demo(runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    proc = runs["demo"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "torch.nn.DataParallel(model).encode -> AttributeError" in out
    assert "equal to model.encode(x): True" in out
    assert "equal to model.generate(x): True" in out
    assert "demo: OK" in out


def test_info_prints_no_none(runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    out = runs["info"].stdout
    assert "None" not in out, out


def test_info_lists_the_registrations(runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    from dpmethods.integrations import INTEGRATIONS

    out = runs["info"].stdout
    for library in INTEGRATIONS:
        assert library in out
    assert "generate (gather='generate')" in out


def test_help_works_and_the_op_is_registered() -> None:
    # `python -m dpmethods --help` imports the package first, which now imports torch and
    # loads the extension: --help still answers, and the op exists.
    code = (
        "import runpy, sys\n"
        "sys.argv = ['dpmethods', '--help']\n"
        "try:\n"
        "    runpy.run_module('dpmethods', run_name='__main__', alter_sys=True)\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        "import torch, dpmethods\n"
        "op = hasattr(torch.ops.dpmethods, 'gather_coalesced')  # before anything loads it\n"
        "print('op registered:', op == dpmethods.extension_info()['available'])\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=_ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "usage: python -m dpmethods" in proc.stdout
    assert proc.stdout.rstrip().endswith("op registered: True"), proc.stdout


def test_subcommand_help_gives_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    from dpmethods.__main__ import main

    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    assert "the number of CPU replicas (default: 4)" in out
    assert "(default: 10)" in out


@pytest.mark.parametrize("args", [("--replicas", "0"), ("--replicas", "-2"), ("--batch", "0"), ("--batch", "x")])
def test_demo_counts_below_one_are_usage_errors(args: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    from dpmethods.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["demo", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m dpmethods demo")
    assert err.rstrip().endswith(
        f"python -m dpmethods demo: error: argument {args[0]}: expected a whole number of at "
        f"least 1, got {args[1]!r}"
    )


def test_main_docstring_examples() -> None:
    # pytest --doctest-modules skips __main__.py files: run its examples here.
    import doctest

    import dpmethods.__main__ as cli

    result = doctest.testmod(cli, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 3 and result.failed == 0, result
