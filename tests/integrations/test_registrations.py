"""Built-in registrations: the libraries dpmethods knows (listed by ``info``, checked in
tests/docs/test_cli.py), none of them imported by dpmethods itself, and their rules and
gather modes in effect once the user imports them, after dpmethods."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dpmethods.integrations import INTEGRATIONS

# Every library dpmethods knows of: the integrations, and Ray (the engine of dpmethods.ray).
_LIBRARIES = (*INTEGRATIONS, "ray")
_HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
# One fresh interpreter, step by step: after each step, the libraries it has imported.
# Steps only add modules, so a library absent after a later step was absent before it.
# Last, where transformers is installed, the user imports it: a method that named its
# gather mode "generate" before, and a gather of its caches, use the shipped rules that
# dpmethods never imported itself.
_STEPS = """
import json, sys, traceback
seen = {}
def look(step):
    seen[step] = sorted(m for m in LIBRARIES if m in sys.modules)
import torch, dpmethods
from torch import nn
look("import dpmethods")
dpmethods.gather([{'a': torch.ones(1)}, {'a': torch.ones(1)}], 'cpu')  # the shipped rules load
look("a gather")
import dpmethods.ray
look("import dpmethods.ray")

class Chat(nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    @property
    def generation_config(self):
        return self.lm.generation_config

    @dpmethods.parallel_method(gather="generate")
    def generate(self, input_ids, **kwargs):
        return self.lm.generate(input_ids, **kwargs)

look("a method naming the generate mode")


def check(name, step):
    try:
        seen[name] = step()
    except Exception:
        seen[name] = {"error": traceback.format_exc()}


def generate():
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1,
                                     n_head=2, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    torch.manual_seed(0)
    chat = Chat(transformers.GPT2LMHeadModel(config).eval())
    ids = torch.randint(2, 64, (3, 4))
    with torch.no_grad():
        got = dpmethods.DataParallel(chat, device_ids=["cpu"] * 2).generate(ids, max_new_tokens=3)
        want = chat.generate(ids, max_new_tokens=3)
    return [got.tolist(), want.tolist()]


def caches():
    def cache(n):
        c = transformers.DynamicCache()
        c.update(torch.ones(n, 2, 3, 4), torch.ones(n, 2, 3, 4), 0)
        return c
    g = dpmethods.gather([cache(3), cache(2)], 'cpu')
    return [type(g).__name__, g.layers[0].keys.shape[0]]


if WITH_TRANSFORMERS:
    import transformers
    check("generate equals one device", generate)
    check("gathered caches", caches)
print(json.dumps(seen))
"""


@pytest.fixture(scope="module")
def imported() -> dict[str, Any]:
    root = Path(__file__).resolve().parents[2]
    code = f"LIBRARIES = {_LIBRARIES!r}\nWITH_TRANSFORMERS = {_HAS_TRANSFORMERS!r}\n{_STEPS}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root)}, timeout=120)
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_importing_dpmethods_imports_no_third_party_library(imported: dict[str, Any]) -> None:
    assert imported["import dpmethods"] == []


def test_no_library_is_imported_by_dpmethods(imported: dict[str, Any]) -> None:
    # The shipped rules are installed only for libraries the user imported.
    assert imported["a gather"] == []


def test_importing_dpmethods_does_not_import_ray(imported: dict[str, Any]) -> None:
    # A Predictor is a callable class that Ray calls: dpmethods.ray needs no Ray of its own.
    assert imported["import dpmethods.ray"] == []


def _result(imported: dict[str, Any], step: str) -> Any:
    if not _HAS_TRANSFORMERS:
        pytest.skip("needs transformers")
    result = imported[step]
    assert not isinstance(result, dict), result["error"]  # the step's traceback
    return result


def test_a_method_may_name_a_libraries_gather_mode_before_the_library_is_imported(
    imported: dict[str, Any],
) -> None:
    assert imported["a method naming the generate mode"] == []  # naming it imports nothing
    got, want = _result(imported, "generate equals one device")
    assert got == want


def test_the_shipped_rules_of_a_library_imported_after_dpmethods_apply(imported: dict[str, Any]) -> None:
    # dpmethods imports its modules lazily; the shipped cache rules must still be found.
    assert _result(imported, "gathered caches") == ["DynamicCache", 5]
