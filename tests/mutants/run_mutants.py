"""Break the library on purpose, one named mutation at a time, and check that the tests
aimed at each mutation fail, by a wide margin.

Each mutation (``mutations.py``) replaces one line of one source file, found by a short
anchor that must occur exactly once (else the run stops and says so). It is applied in
a temporary copy of the repository (tracked files, untracked files git does not ignore,
and the built extension), so the working tree is never modified, even when the run is
interrupted. For each mutation the runner runs only the tests aimed at it, and reports
for every test whether it killed the mutation and how: by an
``assert_close_to_reference`` failure (with the largest difference over its bound, which
must be at least ``--margin``, 10 by default), an exact comparison, or another error.
The unmutated copy runs the same tests first: they must pass.

Usage (from the repository root, with the test dependencies installed)::

    python tests/mutants/run_mutants.py                  # all; writes tests/mutants/report.*
    python tests/mutants/run_mutants.py loss-plain-mean  # only the mutations named
    python tests/mutants/run_mutants.py --list           # the mutations and their tests

It exits with status 1 when a mutation survives one of its tests, is killed by less
than the margin, or its anchor is not found.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutations import MUTATIONS, Mutation

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
_RATIO = re.compile(r"the largest difference is (\S+) times its bound")


class AnchorError(RuntimeError):
    """A mutation's anchor is missing, or found more than once."""


def mutate(text: str, mutation: Mutation) -> str:
    """``text`` with the one line holding ``mutation.anchor`` rewritten.

    The anchor is replaced by ``mutation.replacement`` in that line; further lines of
    the replacement get the line's indentation.

    Example:
        >>> m = Mutation("m", "", "f.py", "return a + b", "return a - b", ())
        >>> mutate("def f(a, b):\\n    return a + b\\n", m)
        'def f(a, b):\\n    return a - b\\n'
    """
    lines = text.splitlines(keepends=True)
    found = [i for i, line in enumerate(lines) if mutation.anchor in line]
    if len(found) != 1 or text.count(mutation.anchor) != 1:
        raise AnchorError(
            f"{mutation.name}: anchor {mutation.anchor!r} found {text.count(mutation.anchor)} "
            f"times in {mutation.path}, expected exactly once: re-target the mutation"
        )
    line = lines[found[0]]
    indent = line[: len(line) - len(line.lstrip())]
    first, *more = mutation.replacement.split("\n")
    new = line.replace(mutation.anchor, first)
    if more:
        new = new.rstrip("\n") + "\n" + "".join(f"{indent}{m}\n" for m in more)
    lines[found[0]] = new
    return "".join(lines)


def _copy_repo(dest: Path) -> None:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, check=True, capture_output=True,
    ).stdout.decode().split("\0")
    built = [*(ROOT / "dpmethods").glob("_C*.so"), ROOT / "dpmethods" / "_build_info.json"]
    extension = [p.relative_to(ROOT).as_posix() for p in built]
    for rel in [p for p in listed if p] + extension:
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def _outcome(case: ET.Element) -> dict[str, Any]:
    """One junit test case: how it ended, and the difference over the bound if it said."""
    node = case.find("failure")
    if node is None:
        node = case.find("error")
    if node is None:
        skipped = case.find("skipped") is not None
        return {"outcome": "skipped" if skipped else "passed"}
    message = node.get("message") or ""
    # The report's text has the whole exception (its "E" lines): every leaf that differs.
    raised = "\n".join(ln[1:].strip() for ln in (node.text or "").splitlines() if ln.startswith("E "))
    ratios = [float(r) for r in _RATIO.findall(raised or message)]
    first = next((ln for ln in message.splitlines() if ln.strip()), "")[:300]
    if ratios:
        how, ratio = "bound", max(ratios)
    elif first.startswith(("AssertionError", "assert ")):
        how, ratio = "assertion", math.inf
    else:  # an exception: the mutation broke the call, or the model refused its input
        how, ratio = f"error: {first.split(':')[0]}", math.inf
    return {"outcome": "killed", "how": how, "ratio": ratio, "message": first}


def _run_tests(copy: Path, tests: tuple[str, ...], out: Path) -> dict[str, dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", *tests, "-q", "-p", "no:cacheprovider",
           "-o", "addopts=", f"--junitxml={out}"]
    subprocess.run(cmd, cwd=copy, env=env, capture_output=True, timeout=3600)
    if not out.exists():
        raise RuntimeError(f"pytest wrote no report for {' '.join(tests)}")
    results = {}
    for case in ET.parse(out).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        results[name] = _outcome(case)
    return results


def _judge(results: dict[str, dict[str, Any]], margin: float) -> tuple[bool, float]:
    killed = [r for r in results.values() if r["outcome"] == "killed"]
    ratio = min((r["ratio"] for r in killed), default=0.0)
    ok = bool(results) and len(killed) == len(results) and ratio >= margin
    return ok, ratio


def run(names: list[str], margin: float, write: bool) -> int:
    chosen = [m for m in MUTATIONS if not names or m.name in names]
    unknown = set(names) - {m.name for m in MUTATIONS}
    if unknown:
        raise SystemExit(f"unknown mutations: {sorted(unknown)}; --list shows them")
    report: dict[str, Any] = {"commit": _git("rev-parse", "HEAD"), "dirty": bool(_git("status", "--porcelain", "--", "dpmethods", "tests")),
                              "python": platform.python_version(), "host": platform.node(),
                              "margin": margin, "mutations": []}
    try:
        import torch
        report["torch"] = torch.__version__
    except ImportError:
        pass
    tmp = Path(tempfile.mkdtemp(prefix="dpmethods-mutants-"))
    try:
        copy = tmp / "repo"
        _copy_repo(copy)
        for m in chosen:  # every anchor first: a stale one stops the run before any test
            mutate((copy / m.path).read_text(), m)
        tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        baseline = _run_tests(copy, tests, tmp / "baseline.xml")
        bad = {k: v for k, v in baseline.items() if v["outcome"] != "passed"}
        if bad:
            raise SystemExit(f"the aimed tests must pass on the unmutated code: {json.dumps(bad, indent=1)}")
        report["baseline_tests"] = len(baseline)
        for m in chosen:
            report["mutations"].append(_one(copy, tmp, m, margin))
            r = report["mutations"][-1]
            print(f"{m.name}: {'killed' if r['ok'] else 'NOT KILLED'} by {r['killed']}/{len(r['tests'])} "
                  f"tests, least ratio {r['least_ratio']:.3g} ({r['seconds']:.0f}s)", flush=True)
            for test, t in r["tests"].items():
                if t["outcome"] != "killed" or t["ratio"] < margin:
                    print(f"  {test}: {t['outcome']} {t.get('ratio', '')} {t.get('message', '')}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if write:
        (HERE / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        (HERE / "report.md").write_text(markdown(report))
    return 0 if all(r["ok"] for r in report["mutations"]) else 1


def _one(copy: Path, tmp: Path, m: Mutation, margin: float) -> dict[str, Any]:
    target = copy / m.path
    original = target.read_text()
    start = time.monotonic()
    try:
        target.write_text(mutate(original, m))
        results = _run_tests(copy, m.tests, tmp / f"{m.name}.xml")
    finally:
        target.write_text(original)
    ok, ratio = _judge(results, margin)
    return {"name": m.name, "description": m.description, "path": m.path, "anchor": m.anchor,
            "replacement": m.replacement, "tests": results, "ok": ok, "least_ratio": ratio,
            "killed": sum(r["outcome"] == "killed" for r in results.values()),
            "seconds": round(time.monotonic() - start, 1)}


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def _ratio(value: float) -> str:
    return "exact" if math.isinf(value) else f"{value:.3g}"


def markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown page (one table per mutation)."""
    out = [
        "# Mutation report", "",
        f"Generated by `python tests/mutants/run_mutants.py` at commit `{report['commit']}`"
        f"{' (with uncommitted changes)' if report['dirty'] else ''} on host `{report['host']}`, "
        f"Python {report['python']}, "
        f"torch {report.get('torch', '?')}. A mutation is killed when every test aimed at it "
        f"fails, an `assert_close_to_reference` failure by at least {report['margin']:g} times "
        "its bound (\"exact\": an exact comparison, a shape, or an error the mutation caused). "
        f"The {report.get('baseline_tests', 0)} aimed tests pass on the unmutated code.", "",
        "| mutation | file | killed by | least difference / bound |",
        "|---|---|---|---|",
    ]
    for m in report["mutations"]:
        verdict = f"{m['killed']}/{len(m['tests'])}" + ("" if m["ok"] else " **NOT KILLED**")
        out.append(f"| `{m['name']}` | `{m['path']}` | {verdict} | {_ratio(m['least_ratio'])} |")
    for m in report["mutations"]:
        out += ["", f"## `{m['name']}`", "", m["description"], "",
                f"In `{m['path']}`, the line holding `{m['anchor']}` becomes:", "",
                "```python", m["replacement"], "```", "",
                "| test | outcome | difference / bound |", "|---|---|---|"]
        for test, r in m["tests"].items():
            how = r["outcome"] if r["outcome"] != "killed" else f"killed ({r['how']})"
            out.append(f"| `{test}` | {how} | {_ratio(r['ratio']) if 'ratio' in r else ''} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutations and their tests")
    parser.add_argument("--margin", type=float, default=10.0,
                        help="least difference over the bound that counts as killed (default 10)")
    parser.add_argument("--no-write", action="store_true", help="do not write report.json and report.md")
    args = parser.parse_args(argv)
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name}  ({m.path})\n  {m.description}\n  " + "\n  ".join(m.tests))
        return 0
    write = not args.no_write and not args.names
    return run(args.names, args.margin, write)


if __name__ == "__main__":
    sys.exit(main())
