"""Every figure the docs quote is one of a committed benchmark result's.

``benchmarks/results/`` holds the latest result of each benchmark; each names the commit
and host it was measured on. ``benchmarks/README.md`` shows each result as its script's
``--from-json`` prints it, the README and ``docs/`` quote figures of it (``_QUOTES``, each
drawn from the JSON here), and no other measured figure appears in any of them: a figure
the scan finds outside a checked quote, a generated block, code or ``_NOT_MEASURED``
fails the last test.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

_ROOT = Path(__file__).resolve().parents[2]
_RESULTS = _ROOT / "benchmarks" / "results"
_DOCS = ["README.md", *sorted(str(p.relative_to(_ROOT)) for p in (_ROOT / "docs").glob("*.md")),
         "benchmarks/README.md"]
# A result per benchmark and device: <script>_<device>.json, and the script that draws its text;
# and the latest before/after sitting of a benchmark, <script>_<device>_compare.json (--compare-with).
_RESULT_NAME = re.compile(r"(dispatch|gather|map|ray|items)_(cpu|cuda)(_compare)?\.json")
_REPORTS = {"dispatch": ("bench_dispatch", "report"), "gather": ("bench_gather", "markdown"),
            "map": ("bench_map", "report"), "ray": ("bench_ray", "report"), "items": ("bench_items", "report")}

# What reads like a measurement: a number with a unit of time, a ratio, a rate or a share.
_FIGURE = re.compile(
    r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?(?:e-?\d+)?"
    r"(?:x|%|\s?(?:ns|us|µs|ms|s|sec|seconds?|minutes?|hours?|GB/s|MB/s|CPU-s|CPU-seconds))(?![\w/])"
    r"|(?<![\w.])\d+\.\d+-\d+\.\d+(?![\w.])"  # a spread, p10-p90
    r"|\bload average (?:of )?\d"
    r"|\btwice as\b|\bhalf as\b|(?<![\w.])\d+(?:\.\d+)? times\b"
)
# Figures that are no measurement, each with why, as they appear in a doc.
_NOT_MEASURED: dict[str, list[tuple[str, str]]] = {
    "README.md": [
        ("under 1 ms each", "the run time under which a worker process holds four batches, a constant of the code"),
    ],
    "docs/map.md": [
        ("under 1 ms each", "the run time under which a worker process holds four batches, a constant of the code"),
        ("every 2 seconds", "the checkpoint file's write interval, a constant of the code"),
        ("after 5 seconds", "how long an orphaned worker waits for its own exit, a constant of the code"),
    ],
    "docs/contributing.md": [
        ("at least 10 times", "the mutation report's rule for a kill, a threshold, not a result"),
    ],
    "benchmarks/README.md": [
        ("at most 1.05 times", "targets (bench_dispatch's, the checkpoint workload's), not results"),
        ("within 2x of", "the batch-cost workload's target, not a result"),
        ("sleeps 0.05 s", "what the sigkill workload's method does per batch, a setting"),
    ],
}


def _results() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(_RESULTS.rglob("*.json"))}


def _script(name: str) -> Any:
    sys.path.insert(0, str(_ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(_ROOT / "benchmarks"))


def _flat(text: str) -> str:
    return " ".join(text.split())


def _map_quotes(saved: dict[str, Any]) -> dict[str, list[str]]:
    """What the docs quote from bench_map's result, drawn from it."""
    bench_map = _script("bench_map")
    w = saved["workloads"]
    t = {(wl, x["slower"]): x for wl in w for x in w[wl]["targets"]}
    speed = {wl: bench_map.speeds({f["path"]: f["rounds"] for f in saved["figures"] if f["workload"] == wl})
             for wl in w}
    gil_map, gil_one = t["gil", "map"]["median"], t["gil", "one-device"]["median"]
    gil_calls = t["gil", "calls"]["median"]
    ragged, uniform, uniform_map = t["ragged", "calls"], t["uniform", "map"], t["uniform", "calls"]
    encode, encode_start = t["encode", "st-pool"], t["encode", "st-pool start-up"]
    starts = w["encode"]["startup_s"]
    pools = [s for x in w.values() for p, s in x["startup_s"].items() if p in ("processes", "processes start-up")]
    pool_range = f"{min(pools):.1f} to {max(pools):.1f} s"
    ragged_rounds = bench_map.target_rounds(w["ragged"], ragged)
    commit = saved["machine"]["commit"][:7]
    by_hand = t["gil", "by-hand"]
    cost = {(x["faster"], x["slower"]): x["median"] for x in w["batch-cost"]["targets"]}
    per_batch = [cost[f"map-{n}", f"map-processes-{n}"] for n in (2, 200, 2000)]
    per_batch_ms = w["batch-cost"]["per_batch_ms"]
    standard = {kind: [cost[f"map-processes-{n}", f"{kind}-{n}"] for n in (2, 200, 2000)]
             for kind in ("mp-pool", "executor")}
    return {
        "README.md": [
            f"`map` on processes was {gil_map:.2f}x the thread map and {gil_one:.2f}x one device",
            f"(1.28x on ragged `generate`, {uniform_map['median']:.2f}x on uniform batches, two CPU replicas)"
            .replace("1.28", f"{ragged['median']:.2f}"),
        ],
        "docs/map.md": [
            f"took {pool_range} for two workers in the benchmark below (sentence-transformers' own "
            f"pool: {starts['st-pool start-up']:.2f} s for the same model)",
            f"`generate` with `map` {gil_map:.2f}x the thread map and {gil_one:.2f}x one device "
            f"(the thread map ran at {speed['gil']['map']:.2f}x one device); a loop of `dp.generate` "
            f"calls {gil_calls:.2f}x the same loop on threads",
            f"`dp.encode` {speed['encode']['calls-processes']:.2f}x one device, against "
            f"{speed['encode']['calls']:.2f}x on threads and {speed['encode']['st-pool']:.2f}x for "
            "sentence-transformers' own pool",
            f"two workers took {pool_range} to start",
            f"a map of one-number batches took {per_batch_ms['map-processes-2']['median']:.2f} ms per batch on "
            f"processes against {per_batch_ms['map-2']['median']:.3f} ms on threads",
            f"(processes {uniform['median']:.2f}x threads in the run below, its rounds "
            f"{uniform['p10']:.2f}x-{uniform['p90']:.2f}x)",
            f"(at commit {commit}, on a 2-core host, load average {saved['machine']['loadavg_before'][0]:.1f} "
            "at its start)",
            f"`map` {ragged['median']:.2f}x the calls loop (target {ragged['at_least']:.2f}x, "
            f"{ragged_rounds} rounds)",
            f"`map` on processes {gil_map:.2f}x `map` on threads and {gil_one:.2f}x one device; uniform, "
            f"processes {uniform['median']:.2f}x threads (target {uniform['at_least']:.1f}x), and `map` "
            f"{uniform_map['median']:.3f}x the calls loop ({_side(uniform_map)} {uniform_map['at_least']:.2f}x target",
        ],
        "benchmarks/README.md": [
            f"On processes, `map` is {gil_map:.2f}x the thread map and {gil_one:.2f}x one device",
            f"`map` is {ragged['median']:.2f}x the calls loop (rounds {ragged['p10']:.2f}x-"
            f"{ragged['p90']:.2f}x, {ragged_rounds} of them), {_side(ragged)} target",
            f"`map` on processes is {uniform['median']:.2f}x `map` on threads (rounds "
            f"{uniform['p10']:.2f}x-{uniform['p90']:.2f}x)",
            f"`map` was {uniform_map['median']:.3f}x the calls loop, {_side(uniform_map)} target",
            f"`dp.encode` on processes is {speed['encode']['calls-processes']:.2f}x one device and "
            f"{encode['median']:.2f}x sentence-transformers' own pool",
            f"Two plain processes, split by hand, ran at {speed['gil']['by-hand']:.2f}x one device: the map is "
            f"{by_hand['median']:.2f}x of them, paired (rounds {by_hand['p10']:.2f}x-{by_hand['p90']:.2f}x)",
            f"Per batch, processes cost {per_batch[0]:.2f}x threads with 2 parameter tensors, {per_batch[1]:.2f}x "
            f"with 200 and {per_batch[2]:.2f}x with 2,000, {'within' if max(per_batch) <= 2 else 'not all within'} "
            "the 2x target; the standard pools cost "
            f"{standard['mp-pool'][0]:.1f}x, {standard['mp-pool'][1]:.1f}x and {standard['mp-pool'][2]:.1f}x (`Pool.imap`) "
            f"and {standard['executor'][0]:.1f}x, {standard['executor'][1]:.1f}x and {standard['executor'][2]:.1f}x "
            "(`ProcessPoolExecutor.map`) what the process map costs",
            f"Its pool reached its first output in {starts['processes start-up']:.2f} s, "
            f"sentence-transformers' in {starts['st-pool start-up']:.2f} s: {encode_start['median']:.2f}x, paired",
        ],
    }


def _items_quotes(saved: dict[str, Any]) -> dict[str, list[str]]:
    """What the docs quote from bench_items' result, drawn from it."""
    w = saved["workloads"]
    t = {(wl, x["faster"], x["slower"]): x["median"] for wl in w for x in w[wl]["targets"]}
    pos = {p: f["padded_positions"] for p, f in w["bert"]["paths"].items()}
    extra = 100 * (pos["batch_size"] / pos["hand-sorted"] - 1)
    return {
        "docs/map.md": [
            f"at commit {saved['machine']['commit'][:7]}), `batch_size=32` ran "
            f"{t['bert', 'batch_size', 'input-order']:.2f}x and `max_tokens=2048` "
            f"{t['bert', 'max_tokens', 'input-order']:.2f}x faster than batches of 32 in input order, which "
            f"computed {pos['input-order']:,} positions for {w['bert']['real_tokens']:,} real tokens; "
            f"`batch_size=32` was {t['bert', 'batch_size', 'hand-sorted']:.3f}x the hand-sorted ideal",
            f"and `max_tokens=2048` {t['bert', 'max_tokens', 'hand-sorted']:.2f}x; `encode` "
            f"{t['encode', 'items-processes', 'st-pool']:.2f}x sentence-transformers' own pool, `generate` "
            f"{t['generate', 'batch_size', 'input-order']:.2f}x its batches in input order, and the Ray "
            f"Predictor with `max_tokens=` {t['ray', 'max_tokens', 'no-max_tokens']:.2f}x the same Predictor",
        ],
        "benchmarks/README.md": [
            f"`batch_size=32` is {t['bert', 'batch_size', 'hand-sorted']:.3f}x the hand-sorted ideal",
            f"pads {extra:.0f}% more positions than one global sort ({pos['batch_size']:,} against "
            f"{pos['hand-sorted']:,})",
        ],
    }


# Per result file: what its figures are quoted as, doc by doc.
def _side(target: dict[str, Any]) -> str:
    """Where a paired ratio stands against its target, as the docs word it."""
    return "at or above its" if target["met"] else "below its"


_QUOTES: dict[str, Callable[[dict[str, Any]], dict[str, list[str]]]] = {
    "map_cpu.json": _map_quotes, "items_cpu.json": _items_quotes}


def _quotes() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, saved in _results().items():
        for doc, quotes in _QUOTES.get(name, lambda _: {})(saved).items():
            out.setdefault(doc, []).extend(quotes)
    return out


def _report(name: str, saved: dict[str, Any]) -> str:
    match = _RESULT_NAME.fullmatch(name)
    assert match, name
    module, function = ("_compare", "report") if match.group(3) else _REPORTS[match.group(1)]
    return str(getattr(_script(module), function)(saved))


def test_results_hold_the_latest_result_of_each_benchmark_only() -> None:
    """One result per benchmark and device, named as the scripts write them, each plot beside
    its JSON; earlier results and before/after sittings are in the git history."""
    files = sorted(p.relative_to(_RESULTS) for p in _RESULTS.rglob("*") if p.is_file())
    for f in files:
        assert len(f.parts) == 1, f"{f}: results/ holds no folders"
        stem = f.name.removesuffix("_long_runs.png").removesuffix("_batch_cost.png").removesuffix(".png")
        assert _RESULT_NAME.fullmatch(f.name) or _RESULT_NAME.fullmatch(stem + ".json"), f


def test_every_result_names_the_commit_and_host_it_measured() -> None:
    for name, saved in _results().items():
        m = saved["machine"]
        assert re.fullmatch(r"[0-9a-f]{40}", str(m.get("commit"))), f"{name}: no commit"
        assert m.get("host"), f"{name}: no host"
        # Measured code that differed from the commit makes the result no commit's. A run
        # from before the scripts recorded it says how its commit was established instead.
        assert m.get("uncommitted_code") == [] or (
            m.get("uncommitted_code") is None and m.get("provenance_note")), name


def test_the_benchmarks_readme_shows_each_result_as_its_script_draws_it() -> None:
    readme = (_ROOT / "benchmarks" / "README.md").read_text()
    for name, saved in _results().items():
        assert _report(name, saved) in readme, f"benchmarks/README.md does not show {name} as its script draws it"
        assert f"(results/{name})" in readme, name


def test_every_quoted_figure_is_its_result_s() -> None:
    quotes = _quotes()
    assert quotes, "no result is quoted"
    for doc, qs in quotes.items():
        text = _flat((_ROOT / doc).read_text())
        missing = [q for q in qs if _flat(q) not in text]
        assert not missing, f"{doc} does not quote, as its result has them: {missing}"


def test_every_path_of_a_quoted_map_result_gave_the_one_device_outputs() -> None:
    # The docs say so of every path ("outputs of every path equal the one-device loop's").
    saved = _results()["map_cpu.json"]
    for wl, facts in saved["workloads"].items():
        assert all(facts["outputs_match_one_device"].values()), wl


def _unchecked(doc: str, checked: list[str]) -> list[str]:
    """The figures in ``doc`` outside code, checked text and ``_NOT_MEASURED``."""
    text = (_ROOT / doc).read_text()
    text = re.sub(r"```.*?```", " ", text, flags=re.S)  # code blocks
    text = _flat(text)
    for block in sorted(checked, key=len, reverse=True):
        text = text.replace(_flat(block), " [checked] ")
    for phrase, _ in _NOT_MEASURED.get(doc, []):
        text = text.replace(phrase, " [not measured] ")
    text = re.sub(r"`[^`]*`", " ", text)  # inline code: names, arguments, settings
    text = re.sub(r"\]\([^)]*\)", "]", text)  # link targets
    return [text[max(0, m.start() - 40): m.end() + 20] for m in _FIGURE.finditer(text)]


@pytest.mark.parametrize("doc", _DOCS)
def test_no_figure_is_quoted_without_its_result(doc: str) -> None:
    text = _flat((_ROOT / doc).read_text())
    assert all(phrase in text for phrase, _ in _NOT_MEASURED.get(doc, [])), "a stale _NOT_MEASURED entry"
    results = _results()
    checked = _quotes().get(doc, [])
    if doc == "benchmarks/README.md":
        checked = checked + [_report(name, saved) for name, saved in results.items()]
    assert not _unchecked(doc, checked), (
        f"{doc}: figures with no committed result behind them (quote them from one in "
        f"tests/docs/test_figures.py, or list them in _NOT_MEASURED if they measure nothing)")
