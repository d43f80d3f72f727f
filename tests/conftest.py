"""Shared test setup: CUDA-marked tests skip without a GPU; every test is seeded and
runs with poisoned gather outputs.

The CPU replica mode comes from ``DPMETHODS_CPU_REPLICAS`` (``shared`` by default,
or ``distinct``); CI runs the suite once in each. The header names the mode.
"""

from __future__ import annotations

import compileall
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch


def pytest_report_header(config: pytest.Config) -> str:
    from dpmethods.core.replicate import cpu_replicas_mode

    return f"dpmethods CPU replicas: {cpu_replicas_mode()} (DPMETHODS_CPU_REPLICAS)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is available on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _poison(monkeypatch: pytest.MonkeyPatch) -> None:
    # The compiled gather fills its outputs with 0xFF bytes before copying, in every
    # test: a byte it forgets to write shows (random data never is a run of 0xFF).
    monkeypatch.setenv("DPMETHODS_POISON", "1")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """The whole suite (``python -m pytest`` with no paths) runs on 2 pytest-xdist workers
    where the plugin is installed, a file to each worker at a time (its module fixtures
    are built once): much of a test's time is spent waiting for the processes it starts,
    so 2 workers finish sooner even on 2 cores. A run of named paths, with ``-n`` or
    ``--dist``, or with ``-p no:xdist`` runs as asked."""
    if (
        config.args_source is not pytest.Config.ArgsSource.TESTPATHS
        or not config.pluginmanager.hasplugin("xdist")
        or os.environ.get("PYTEST_XDIST_WORKER")
        or config.getoption("numprocesses", None) is not None
        or config.getoption("dist", "no") != "no"
        or config.getoption("tx", None)
        or config.getoption("collectonly")
        or config.getoption("usepdb")
    ):
        return
    config.option.numprocesses = 2
    config.option.dist = "loadfile"
    config.option.tx = ["popen"] * 2


def _compile_once(config: pytest.Config) -> None:
    """Under ``PYTHONDONTWRITEBYTECODE=1`` (set on some CI hosts) no process writes
    bytecode, so every one of the suite's interpreters (pytest-xdist workers, scripts,
    worker processes) would compile this repository's sources again; a worker
    process that loads a transformers model spends more than half its start compiling the
    integration modules. The session compiles them once, before any of those start, and
    removes the ``__pycache__`` folders it made when it ends. Installed libraries are
    compiled by pip when installed."""
    if not sys.flags.dont_write_bytecode or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    root = Path(__file__).resolve().parents[1]
    folders = [root / name for name in ("dpmethods", "tests", "examples")]
    before = {p for folder in folders for p in folder.rglob("__pycache__")}
    for folder in folders:
        compileall.compile_dir(folder, quiet=2)  # writes whatever the flag says
    made = [p for folder in folders for p in folder.rglob("__pycache__") if p not in before]
    config.add_cleanup(lambda: [shutil.rmtree(p, ignore_errors=True) for p in made])


def pytest_configure(config: pytest.Config) -> None:
    _compile_once(config)
    # xdist workers share the cores: torch's intra-op threads of each would outnumber
    # them, and OpenMP threads waiting for a busy core slow every op they split.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if os.environ.get("PYTEST_XDIST_WORKER") and workers > 1:
        torch.set_num_threads(max(1, torch.get_num_threads() // workers))
    _preload_the_model_libraries()


# What a worker process imports to unpickle the tests' tiny models: transformers'
# modeling (GPT-2, BERT, CLIP, Qwen2-VL), sentence-transformers and diffusers' models
# (its autoencoders, VQ model and UNet); then the module that freezes what the server
# imported.
_PRELOADED = ("transformers.modeling_utils", "transformers.generation.utils", "sentence_transformers",
              "diffusers.models.autoencoders.autoencoder_kl", "tests.helpers.fork_server")


def _preload_the_model_libraries() -> None:
    """Worker processes fork from the fork server (``dpmethods.processes.pool``), which
    imports torch and dpmethods' worker once. Some 30 workers of the suite then import
    transformers, sentence-transformers or diffusers to unpickle a tiny model, up to
    seconds of CPU each; the tests' fork server imports them once instead, in its own
    process, when the first worker starts (or the first gloo run: one server serves both,
    with the preload of whichever starts it), and freezes them
    (tests/helpers/fork_server.py). A worker
    still registers a library's rules itself, at its first lookup after the library is
    in ``sys.modules`` (``dpmethods.vocab.loading``), as when the import comes with the
    model; and it still collects, then freezes, what its first model's build made."""
    import importlib.util

    from dpmethods.processes import pool
    from tests.helpers.processes import GLOO_PRELOAD

    names = [n for n in _PRELOADED if importlib.util.find_spec(n.split(".")[0]) is not None]
    pool.preload(*names)
    GLOO_PRELOAD.extend(n for n in names if n not in GLOO_PRELOAD)
