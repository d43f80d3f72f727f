"""The package's layout keeps its design: layers import downwards only, third-party
libraries are known only in dpmethods/integrations (and an engine only in its front-end,
as Ray in dpmethods/ray.py), modules and functions stay small,
and the top level has twelve public names (and the old ones as aliases)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import dpmethods

_PKG = Path(dpmethods.__file__).resolve().parent
_LIBRARIES = (
    "transformers", "diffusers", "sentence_transformers", "peft", "timm", "open_clip",
    "torchvision", "accelerate", "ray",
)
# Front-ends of an engine, beside distributed/ (torchrun's): each may name its engine only.
_ENGINES = {"ray": "ray"}
# Bottom to top; a module may import its own layer's modules and the layers below.
_LAYERS: list[tuple[str, ...]] = [
    ("_loading", "options", "call_hooks", "gather_modes", "_warn_once"),
    ("types", "ops"),
    ("registry",),
    ("core",),
    ("_wrapping",),
    ("processes",),
    ("streaming", "distributed"),
    ("data_parallel", "extending", "parallel", "checkpoints", "testing"),
    ("integrations",),
    ("ray",),
    ("__init__", "__main__"),
]


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(_PKG.rglob("*.py")):
        parts = path.relative_to(_PKG).with_suffix("").parts
        found[".".join(parts)] = path
    return found


def _layer(module: str) -> int:
    head = module.split(".")[0]
    if module.endswith("__init__") and "." not in module:
        head = "__init__"
    return next(i for i, names in enumerate(_LAYERS) if head in names)


def _imports(path: Path) -> list[tuple[str, int]]:
    """The dpmethods modules ``path`` imports (at any depth), with their line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dpmethods"):
            base = node.module.removeprefix("dpmethods").lstrip(".")
            for alias in node.names:
                name = f"{base}.{alias.name}".lstrip(".")
                found.append((name if f"{name}".split(".")[0] else base, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name.removeprefix("dpmethods."), node.lineno) for a in node.names
                      if a.name.startswith("dpmethods.")]
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules and f"{name}.__init__" not in modules:
        name = name.rpartition(".")[0]
    if not name:
        return None
    return name if name in modules else f"{name}.__init__"


def test_layers_import_downwards_only() -> None:
    modules = _modules()
    wrong = []
    for module, path in modules.items():
        for name, line in _imports(path):
            target = _resolve(name, modules)
            if target is None or target in ("_C",):
                continue
            if _layer(target) > _layer(module):
                wrong.append(f"{module}:{line} imports {target}")
    assert wrong == []


def test_no_import_cycles() -> None:
    modules = _modules()
    # A package's __init__ re-exporting its own submodules is not a cycle through the code.
    def own(m: str, t: str) -> bool:
        return m.endswith("__init__") and t.startswith(m.removesuffix("__init__"))

    graph = {
        m: {t for n, _ in _imports(p) if (t := _resolve(n, modules)) not in (None, m) and not own(m, t)}
        for m, p in modules.items()
    }
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append([*stack[stack.index(t):], t] if t in stack else [m, t])
            elif t not in state:
                visit(t, [*stack, t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_third_party_libraries_only_in_integrations() -> None:
    wrong = []
    for module, path in _modules().items():
        if module.startswith("integrations"):
            continue
        engine = _ENGINES.get(module.split(".")[0])
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [w.strip("`'\":") for w in node.value.split() if "." in w]
            for name in names:
                if name.split(".")[0] == engine:
                    continue
                if name.split(".")[0] in _LIBRARIES and "." in name:
                    wrong.append(f"{module}:{node.lineno}: {name}")
                elif isinstance(node, (ast.Import, ast.ImportFrom)) and name.split(".")[0] in _LIBRARIES:
                    wrong.append(f"{module}:{node.lineno}: imports {name}")
    assert wrong == []


def test_modules_and_functions_stay_small() -> None:
    big, long = [], []
    for module, path in _modules().items():
        text = path.read_text()
        if text.count("\n") > 400:
            big.append(f"{module}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if length > 80:
                    long.append(f"{module}.{node.name}: {length} lines")
    assert big == [] and long == []


def test_streaming_stays_within_its_budget() -> None:
    # The map (one iterator, a thread backend, a process backend) and resumable maps:
    # what concurrent.futures and the worker pool (dpmethods/processes) do not do already.
    lines = {p.name: p.read_text().count("\n") for p in (_PKG / "streaming").glob("*.py")}
    assert sum(lines.values()) <= 1200, lines


def test_twelve_public_names_and_the_old_ones_as_aliases() -> None:
    assert sorted(dpmethods.__all__) == sorted([
        "DataParallel", "DistributedDataParallel", "fully_shard", "route", "parallel_method",
        "register", "register_type", "MethodOptions", "get_options", "parallel_methods",
        "unwrap", "load_state_dict",
    ])
    from dpmethods import checkpoints, distributed, ops, parallel

    aliases = {
        "chunk_sizes": parallel.chunk_sizes, "scatter": parallel.scatter,
        "scatter_call": parallel.scatter_call, "replicate": parallel.replicate,
        "parallel_apply": parallel.parallel_apply, "gather": parallel.gather,
        "extension_info": ops.extension_info, "strip_prefix": checkpoints.strip_prefix,
        "register_fsdp_methods": distributed.register_fsdp_methods,
    }
    for name, value in aliases.items():
        assert getattr(dpmethods, name) is value and name not in dpmethods.__all__
    assert callable(dpmethods.gather_generate)
    with pytest.raises(AttributeError, match="module 'dpmethods' has no attribute 'nope'"):
        _ = dpmethods.nope  # type: ignore[attr-defined]


def test_importing_dpmethods_imports_no_third_party_library() -> None:
    import subprocess

    code = (
        "import sys, dpmethods\n"
        f"print(sorted(m for m in {_LIBRARIES!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def _dpmethods_imports(path: Path) -> list[tuple[str, int]]:
    """Every name ``path`` imports from dpmethods, spelled in full (``import dpmethods``
    alone is ``dpmethods``; ``from dpmethods import x`` is ``dpmethods.x``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "dpmethods"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "dpmethods":
            found += [(node.module if node.module != "dpmethods" else f"dpmethods.{a.name}", node.lineno)
                      for a in node.names]
    return found


def test_integrations_enter_through_the_extension_api_only() -> None:
    # An integration is a plugin: it may name dpmethods.extending and integration modules
    # (peft builds on the transformers one), nothing else, so core modules can move.
    # The package's __init__ is the loader, not an integration.
    wrong = []
    for module, path in _modules().items():
        if not module.startswith("integrations.") or module == "integrations.__init__":
            continue
        for name, line in _dpmethods_imports(path):
            if name != "dpmethods.extending" and not name.startswith("dpmethods.integrations."):
                wrong.append(f"{module}:{line} imports {name}")
    assert wrong == []


def test_the_door_check_sees_a_bare_import(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("import dpmethods\nfrom dpmethods import registry\nfrom dpmethods.extending import gather\n")
    assert [n for n, _ in _dpmethods_imports(probe)] == [
        "dpmethods", "dpmethods.registry", "dpmethods.extending"]


def test_data_parallel_keeps_the_seams_and_the_constructor_only() -> None:
    # The per-call flow lives in core/call.py; the wrapper delegates to it.
    assert (_PKG / "data_parallel.py").read_text().count("\n") <= 300
    assert not (_PKG / "wrapper_checks.py").exists()
