"""``python -m dpmethods``: usage, ``--help``, ``info``, ``info --json`` and ``demo``, run as
``python -m`` runs them (runpy, from a fresh interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

_ROOT = Path(__file__).resolve().parents[2]


_COMMANDS: dict[str, tuple[str, ...]] = {
    "usage": (),
    "info": ("info",),
    "json": ("info", "--json"),
}

# One fresh interpreter runs ``python -m dpmethods --help`` first thing, checks the op,
# then each read-only command of _COMMANDS, each as ``python -m`` runs it (runpy, with
# sys.argv set); it prints each run's exit code and output as JSON.
_CLI = """
import contextlib, io, json, runpy, sys, traceback

def run(args):
    sys.argv, out, err, code = ["dpmethods", *args], io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module("dpmethods", run_name="__main__", alter_sys=True)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
            if isinstance(stop.code, str):
                print(stop.code, file=sys.stderr)
        except Exception:
            code = 1
            traceback.print_exc()
    return [code, out.getvalue(), err.getvalue()]

runs = {"help": run(["--help"])}
import torch, dpmethods
op = hasattr(torch.ops.dpmethods, "gather_coalesced")  # before anything else loads it
runs["op registered"] = op == dpmethods.extension_info()["available"]
for key, args in COMMANDS.items():
    runs[key] = run(args)
print(json.dumps(runs))
"""


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    """``--help``, then every read-only command, in one interpreter; ``demo`` in a process
    of its own, at the same time: each pays the torch import."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH")]))
    procs = {
        "cli": subprocess.Popen([sys.executable, "-c", f"COMMANDS = {_COMMANDS!r}\n{_CLI}"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=_ROOT),
        "demo": subprocess.Popen([sys.executable, "-m", "dpmethods", "demo"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=_ROOT),
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
    cli = done.pop("cli")
    assert cli.returncode == 0, cli.stderr
    ran = json.loads(cli.stdout.strip().splitlines()[-1])
    for key in ("help", *_COMMANDS):
        code, out, err = ran[key]
        done[key] = subprocess.CompletedProcess(["python", "-m", "dpmethods", *_COMMANDS.get(key, ("--help",))],
                                                code, out, err)
    return {**done, "op registered": ran["op registered"]}


def test_usage_without_arguments(runs: dict[str, Any]) -> None:
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


def test_info_text(runs: dict[str, Any]) -> None:
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


def test_info_json(runs: dict[str, Any]) -> None:
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


def test_demo(runs: dict[str, Any]) -> None:
    proc = runs["demo"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "torch.nn.DataParallel(model).encode -> AttributeError" in out
    assert "equal to model.encode(x): True" in out
    assert "equal to model.generate(x): True" in out
    assert "demo: OK" in out


def test_info_prints_no_none(runs: dict[str, Any]) -> None:
    out = runs["info"].stdout
    assert "None" not in out, out


def test_info_lists_the_registrations(runs: dict[str, Any]) -> None:
    from dpmethods.integrations import INTEGRATIONS

    out = runs["info"].stdout
    for library in INTEGRATIONS:
        assert library in out
    assert "generate (gather='generate')" in out


def test_help_works_and_the_op_is_registered(runs: dict[str, Any]) -> None:
    # `python -m dpmethods --help` imports the package first, which now imports torch and
    # loads the extension: --help still answers, and the op exists.
    proc = runs["help"]
    assert proc.returncode == 0, proc.stderr
    assert "usage: python -m dpmethods" in proc.stdout
    assert runs["op registered"] is True


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
