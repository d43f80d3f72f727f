"""The examples run on CPU replicas and match the single-device model."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from dpmethods.testing import assert_close_to_reference
from tests.helpers.terms import mlp_terms

_EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _env() -> dict[str, str]:
    """The environment of an example run as a script: this checkout's dpmethods first."""
    import os

    env = dict(os.environ)
    root = str(_EXAMPLES.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def _load(name: str) -> ModuleType:
    # examples/ is not a package; load the file so the test needs no sys.path setup.
    spec = importlib.util.spec_from_file_location(f"_dpm_example_{name}", _EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def vae() -> ModuleType:
    return _load("vae")


@pytest.fixture(scope="module")
def hf() -> ModuleType:
    pytest.importorskip(
        "transformers", reason="examples/hf_generate.py needs Hugging Face transformers"
    )
    return _load("hf_generate")


@pytest.fixture(scope="module")
def hf_summary(hf: ModuleType) -> dict[str, object]:
    # 7 prompts on 3 replicas: uneven chunks (3, 2, 2) as well as ragged lengths. Llama
    # returns CausalLMOutputWithPast; GPT-2 is run by the example's doctests.
    return hf.main(["--arch", "llama", "--devices", "cpu", "--replicas", "3", "--batch", "7",
                    "--max-new-tokens", "6", "--quiet"])


def test_vae_matches_one_device(vae: ModuleType) -> None:
    # 10 items on 4 replicas: chunks of 3, 3, 2, 2, so "mean" must weight by share.
    s = vae.main(["--devices", "cpu", "--replicas", "4", "--steps", "3", "--batch", "10",
                  "--features", "8", "--quiet"])
    assert s["replicas"] == 4
    assert s["posterior_type"] == "Posterior"  # the dataclass came back as itself
    # The summary has each largest difference and the largest |value| compared: bound the
    # difference as assert_close_to_reference does where the reference is 0 (its
    # strictest bound), beside the largest value (the magnitude).
    encode = decode = mlp_terms(8, 64)  # VAE(features=8, hidden=64, latent=8)
    loss = encode + decode + 8 + 8 + 10  # sums over 8 features and 8 latents, a mean of 10
    for key, terms in (("encode_max", encode), ("decode_max", decode), ("loss", loss), ("grad_max", 2 * loss)):
        diff, size = s[f"{key}_diff"], s[f"{key}_abs"]
        assert_close_to_reference(torch.tensor([diff, size]), torch.tensor([0.0, size]), terms=terms, msg=key)
    assert len(s["losses"]) == 3
    assert all(torch.isfinite(torch.tensor(s["losses"])))


def test_vae_encode_direct(vae: ModuleType) -> None:
    import dpmethods

    model = vae.VAE(features=6, hidden=8, latent=3)
    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 3)
    x = torch.randn(7, 6)
    with torch.no_grad():
        got, ref = dp.encode(x), model.encode(x)
    assert isinstance(got, vae.Posterior)
    terms = mlp_terms(6, 8)  # Linear(6, 8), then Linear(8, 3)
    assert_close_to_reference((got.mu, got.logvar), (ref.mu, ref.logvar), terms=terms)


def test_hf_generate_tokens_equal(hf_summary: dict[str, object]) -> None:
    tokens, reference = hf_summary["tokens"], hf_summary["reference"]
    assert isinstance(tokens, torch.Tensor) and isinstance(reference, torch.Tensor)
    assert tokens.shape == reference.shape
    assert torch.equal(tokens, reference)
    assert hf_summary["tokens_equal"] is True


def test_hf_generate_is_ragged_and_padded(hf_summary: dict[str, object]) -> None:
    lengths = hf_summary["lengths"]
    widths = hf_summary["replica_widths"]
    assert isinstance(lengths, list) and isinstance(widths, list)
    assert len(set(lengths)) > 1, f"sequences should finish at different lengths: {lengths}"
    assert len(set(widths)) > 1, f"replicas should return different widths: {widths}"
    tokens = hf_summary["tokens"]
    assert isinstance(tokens, torch.Tensor)
    pad = hf_summary["pad_token_id"]
    eos = hf_summary["eos_token_id"]
    prompt_len = tokens.shape[1] - max(widths)
    for row, n in zip(tokens[:, prompt_len:].tolist(), lengths, strict=True):
        if n < len(row):  # finished early: eos, then pad to the end
            assert row[n - 1] == eos
            assert row[n:] == [pad] * (len(row) - n)


def test_hf_forward_keeps_model_output_type(hf_summary: dict[str, object]) -> None:
    assert hf_summary["output_type"] == hf_summary["reference_type"]
    assert hf_summary["output_type"] == "CausalLMOutputWithPast"
    assert hf_summary["logits_equal_per_chunk"] is True
    assert isinstance(hf_summary["logits_max_diff"], float)
    assert hf_summary["logits_max_diff"] < 1e-5
    loss = hf_summary["loss"]
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0
    loss_diff = hf_summary["loss_diff"]
    assert isinstance(loss_diff, float) and loss_diff < 1e-5


def test_hf_cache_is_merged(hf_summary: dict[str, object]) -> None:
    # The shipped transformers Cache rule joins the replicas' caches into one.
    assert hf_summary["cache_type"] == "DynamicCache"


_HELP = """
import contextlib, io, json, runpy, sys, traceback

def run(path, *args):
    sys.argv, out, err, code = [path, *args], io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
            if isinstance(stop.code, str):  # what the interpreter prints of sys.exit("...")
                print(stop.code, file=sys.stderr)
        except Exception:
            code = 1
            traceback.print_exc()
    return {"path": path, "code": code, "out": out.getvalue(), "err": err.getvalue()}

for path in sys.argv[1:]:
    print(json.dumps(run(path, "--help")))
# Last: hf_generate.py as if transformers were not installed.
sys.modules["transformers"] = None
print(json.dumps(run(HF_GENERATE, "--quiet")))
"""


@pytest.fixture(scope="module")
def helps() -> dict[str, dict[str, Any]]:
    """Every example run as a script with --help, one after another in one interpreter
    (each would pay the torch import): its exit code and what it printed, by name; then,
    under ``"no transformers"``, hf_generate.py run where transformers cannot be imported."""
    import json
    import subprocess

    paths = sorted(str(p) for p in _EXAMPLES.glob("*.py"))
    code = f"HF_GENERATE = {str(_EXAMPLES / 'hf_generate.py')!r}\n{_HELP}"
    proc = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True,
                          timeout=240, env=_env())
    assert proc.returncode == 0, proc.stderr
    runs = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["path"] for r in runs[:-1]] == paths, proc.stdout
    return {**{Path(r["path"]).stem: r for r in runs[:-1]}, "no transformers": runs[-1]}


@pytest.mark.parametrize("name", sorted(p.stem for p in _EXAMPLES.glob("*.py")))
def test_example_help_gives_every_option_a_help_and_default(helps: dict[str, dict[str, Any]], name: str) -> None:
    import re

    run = helps[name]
    assert run["code"] == 0, run
    out = run["out"]
    assert "``" not in out and ":func:" not in out, out  # no docstring markup
    options = sorted(set(re.findall(r"^\s+(--[a-z-]+)", out, re.M)))
    assert options, out
    # Each option's help text, up to the next option: it says its default.
    for option, text in re.findall(r"^\s+(--[a-z-]+)(.*?)(?=^\s+--|\Z)", out, re.M | re.S):
        assert "default:" in text, f"{name} --help: {option} has no default:\n{out}"


def test_hf_generate_without_transformers_says_how_to_install(helps: dict[str, dict[str, Any]]) -> None:
    run = helps["no transformers"]
    assert run["code"] == 1, run
    assert "pip install transformers" in run["err"], run["err"]
    assert "Traceback" not in run["err"], run["err"]


def test_hf_generate_does_not_log_loss_type(hf: ModuleType) -> None:
    import subprocess

    proc = subprocess.run(
        [sys.executable, str(_EXAMPLES / "hf_generate.py"), "--devices", "cpu", "--replicas",
         "2", "--batch", "4", "--max-new-tokens", "4"],
        capture_output=True, text=True, timeout=240, env=_env(),
    )
    assert proc.returncode == 0, proc.stderr
    assert "dp.generate == model.generate: True" in proc.stdout
    assert "loss_type" not in proc.stderr, proc.stderr


def test_resumable_map_stops_and_resumes(tmp_path: Path) -> None:
    import subprocess

    script = [sys.executable, str(_EXAMPLES / "resumable_map.py"), "--out", str(tmp_path), "--batches", "12"]
    first = subprocess.run([*script, "--stop-after", "5"], capture_output=True, text=True, timeout=120, env=_env())
    assert first.returncode == 3, first.stderr
    assert len(list(tmp_path.glob("batch*.pt"))) == 5
    second = subprocess.run(script, capture_output=True, text=True, timeout=120, env=_env())
    assert second.returncode == 0, second.stderr
    # At least once: the fifth output was taken but not asked past, so it is written again.
    assert "wrote 8 batches this run; 12 of 12 on disk" in second.stdout, second.stdout
    worst = float(second.stdout.rsplit("one device ", 1)[1])
    # Each batch runs whole on one replica: the same arithmetic as one device (GELU MLP
    # of 32 and 64 inputs, then a normalization over 16).
    assert worst <= 4 * (33 + 65 + 16) * torch.finfo(torch.float32).eps
