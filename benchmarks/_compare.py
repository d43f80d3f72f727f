"""Before and after: one benchmark on two commits' code, in one sitting, paired round by
round. ``bench_map.py`` and ``bench_gather.py`` take ``--compare-with REF``.

The code of ``REF`` ("before") is checked out into a temporary ``git worktree``; this
checkout is "after". The benchmark script of this checkout runs twice, as two
processes, one importing each code (``PYTHONPATH``), with the same arguments, so the
only difference is the library. The two runs take turns: each stops at every round of
:func:`_common.interleave` (a :func:`_common.gate`) and goes on only when this driver
says so, one run at a time, so that everything between two gates (the round, and the
set-up before the next one) runs alone on the host, and each round of one code runs
back to back with the same round of the other, the code going first alternating. Both
runs must reach the same gates in the same order, or the comparison stops.

The result, ``<benchmark>_<device>_compare.json`` beside its plot, names both commits
and the host, holds both runs' own JSON whole, and pairs them: for every path (every
workload's path for bench_map; every case's and target's fused and baseline paths for
bench_gather), the median over the rounds of before's time over after's (above 1: the
after code is faster) with its p10-p90. Paths that run no dpmethods code (bench_map's
``one-device`` loop, bench_gather's baselines) show the sitting's noise.

The extension: a ``dpmethods/_C*.so`` built here is copied into the worktree when
``csrc/`` and ``setup.py`` are the same at ``REF``; otherwise the worktree builds its
own (``setup.py build_ext --inplace``, minutes).

Example:
    >>> child_args(["--quick", "--out", "x", "--compare-with=HEAD~1", "--only", "gil"])
    ['--quick', '--only', 'gil']
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for _common, imported as a script's sibling
import _common

__all__ = ["child_args", "main", "report", "series"]

_ROOT = Path(__file__).resolve().parent.parent
_SIDES = ("before", "after")
_DROPPED = ("--compare-with", "--out")  # the driver's own options, not the runs'


def child_args(argv: list[str]) -> list[str]:
    """``argv`` without the options only the driver reads (``--compare-with``, ``--out``)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in _DROPPED:
            skip = True
        elif not a.startswith(tuple(d + "=" for d in _DROPPED)):
            out.append(a)
    return out


def _git(*args: str, cwd: Path = _ROOT) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"--compare-with: git {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout.strip()


def _prepare(commit: str, where: Path) -> None:
    """Check ``commit`` out at ``where`` and give it an extension."""
    _git("worktree", "add", "--detach", str(where), commit)
    built = sorted((_ROOT / "dpmethods").glob("_C*.so"))
    same = subprocess.run(["git", "diff", "--quiet", commit, "--", "csrc", "setup.py"], cwd=_ROOT).returncode == 0
    if built and same:
        for f in [*built, _ROOT / "dpmethods" / "_build_info.json"]:
            if f.exists():
                shutil.copy2(f, where / "dpmethods" / f.name)
    elif built:
        print(f"--compare-with: csrc/ or setup.py differ at {commit[:12]}: building its extension", file=sys.stderr)
        subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=where, check=True,
                       stdout=subprocess.DEVNULL)


class _Run:
    """One side's benchmark process, and the two pipes of its gates."""

    def __init__(self, side: str, root: Path, script: Path, args: list[str], out: Path) -> None:
        self.side, self.out = side, out
        go_r, self._go = os.pipe()
        self._ready, ready_w = os.pipe()
        env = {**os.environ, "PYTHONPATH": str(root), _common.LOCKSTEP_ENV: f"{go_r},{ready_w}"}
        self.log: IO[str] = open(out.with_suffix(".log"), "w")
        self.proc = subprocess.Popen([sys.executable, str(script), *args, "--out", str(out)], cwd=root, env=env,
                                     stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
                                     pass_fds=(go_r, ready_w))
        os.close(go_r)
        os.close(ready_w)
        self.at: str | None = self._next()

    def _next(self) -> str | None:
        """The gate the run waits at, or None once it has ended (loudly, if it failed)."""
        line = b""
        while not line.endswith(b"\n"):
            # A process the run forked may hold the pipe open after the run exits: poll.
            if not select.select([self._ready], [], [], 1.0)[0]:
                if self.proc.poll() is None:
                    continue
                chunk = b""
            else:
                chunk = os.read(self._ready, 1)
            if not chunk:
                if self.proc.wait() != 0:
                    raise SystemExit(f"--compare-with: the {self.side} run failed (exit {self.proc.returncode}):\n"
                                     f"{self.out.with_suffix('.log').read_text()[-3000:]}")
                return None
            line += chunk
        return line.decode().removeprefix("ready ").rstrip("\n")

    def go(self) -> None:
        os.write(self._go, b"go\n")
        self.at = self._next()

    def finish(self) -> dict[str, Any]:
        code = self.proc.wait()
        self.log.close()
        for fd in (self._go, self._ready):
            os.close(fd)
        text = self.out.with_suffix(".log").read_text()
        if code != 0:
            raise SystemExit(f"--compare-with: the {self.side} run failed (exit {code}):\n{text[-3000:]}")
        found = sorted(self.out.glob("*.json"))
        if len(found) != 1:
            raise SystemExit(f"--compare-with: the {self.side} run wrote {len(found)} JSON files, not one")
        print(f"--- {self.side} run ---\n{text}", file=sys.stderr)
        return {"file": found[0].name, **json.loads(found[0].read_text())}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _lockstep(runs: list[_Run]) -> int:
    """Let the runs go one at a time, gate by gate, the first alternating; returns the gates."""
    steps = 0
    while True:
        gates = {r.side: r.at for r in runs}
        if len(set(gates.values())) != 1:
            raise SystemExit(f"--compare-with: the runs parted after {steps} gates: {gates}")
        if runs[0].at is None:
            return steps
        for r in runs if steps % 2 == 0 else runs[::-1]:
            r.go()
        steps += 1


def series(saved: dict[str, Any]) -> dict[str, list[float]]:
    """The per-round seconds of every path of one run's JSON, by a name that holds in
    both runs: ``<workload> <path>`` (bench_map), ``<case or target> <path>`` (bench_gather)."""
    if "cases" in saved:
        out = {f"{c['case']} {p}": ts for c in saved["cases"] for p, ts in c["rounds_s"].items()}
        for name, t in (saved.get("targets") or {}).items():
            out.update({f"{name} {p}": ts for p, ts in t["rounds_s"].items()})
        return out
    return {f"{f['workload']} {f['path']}": f["rounds"] for f in saved["figures"]}


def _pairs(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    b, a = series(before), series(after)
    if b.keys() != a.keys():
        raise SystemExit(f"--compare-with: the runs timed different paths: {sorted(b.keys() ^ a.keys())[:10]}")
    out = {}
    for key in b:
        p = _common.paired({"before": b[key], "after": a[key]}, "before", "after")
        out[key] = {"before_s": _common.quantile(b[key], 0.5), "after_s": _common.quantile(a[key], 0.5), **p}
    return out


def main(script: Path, ref: str, argv: list[str], out: Path) -> int:
    """Run ``script`` with ``argv`` on ``ref``'s code and on this checkout's, in lockstep;
    write ``<its result's name>_compare.json`` and ``.png`` to ``out``."""
    commit = _git("rev-parse", "--verify", f"{ref}^{{commit}}")
    clock = _common.started_run()
    args = child_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="dpmethods_compare_"))
    runs: list[_Run] = []
    try:
        _prepare(commit, tmp / "before")
        for side, root in zip(_SIDES, (tmp / "before", _ROOT), strict=True):
            (tmp / "out").mkdir(exist_ok=True)
            runs.append(_Run(side, root, script, args, tmp / "out" / side))  # its set-up alone
        steps = _lockstep(runs)
        saved = dict(zip(_SIDES, (r.finish() for r in runs), strict=True))
    finally:
        for r in runs:
            r.kill()
        subprocess.run(["git", "worktree", "remove", "--force", str(tmp / "before")], cwd=_ROOT, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    for side, want in zip(_SIDES, (commit, _git("rev-parse", "HEAD")), strict=True):
        if saved[side]["machine"]["commit"] != want:
            raise SystemExit(f"--compare-with: the {side} run imported dpmethods at "
                             f"{saved[side]['machine']['commit']}, not {want}")
    stem = saved["after"].pop("file").removesuffix(".json")
    saved["before"].pop("file")
    result = {
        "benchmark": script.name, "args": args, "machine": {**_common.machine_info(), **_common.finished_run(clock)},
        "before": {"ref": ref, "commit": commit, "run": saved["before"]},
        "after": {"commit": saved["after"]["machine"]["commit"], "run": saved["after"]},
        "gates": steps, "pairs": _pairs(saved["before"], saved["after"]),
    }
    path = _common.write_json(out / f"{stem}_compare.json", result)
    pairs = result["pairs"]
    _common.plot_ratios(path.with_suffix(".png"), list(pairs), [p["median"] for p in pairs.values()],
                        lows=[p["p10"] for p in pairs.values()], highs=[p["p90"] for p in pairs.values()],
                        title=f"{script.name}: {commit[:7]} (before) against {result['after']['commit'][:7]} (after), "
                        "one sitting", ylabel="before time / after time, paired")
    print(report(result))
    print(f"wrote {path} and its plot")
    return 0


def report(saved: dict[str, Any]) -> str:
    """The README's text of a comparison: both commits, the host, and every path's paired
    ratio (bench_gather's grid: the spread of its cases' ratios, per path)."""
    b, a = saved["before"]["commit"][:7], saved["after"]["commit"][:7]
    head = (f"{saved['benchmark']} {' '.join(saved['args'])}".rstrip() + f": before {b}, after {a}, in one "
            f"sitting, {saved['gates']} gates taken in turns. " + _common.provenance_line(saved["machine"]))
    rows = ["| path | before s | after s | before / after time, paired (p10-p90) | rounds |",
            "|---|---:|---:|---:|---:|"]
    grid: dict[str, list[float]] = {}
    cases = {c["case"] for c in saved["after"]["run"].get("cases", [])}
    for key, p in saved["pairs"].items():
        name, path = key.rsplit(" ", 1)
        if name in cases:
            grid.setdefault(path, []).append(p["median"])
            continue
        rows.append(f"| {key} | {p['before_s']:.4g} | {p['after_s']:.4g} | **{p['median']:.3f}x** "
                    f"({p['p10']:.3f}-{p['p90']:.3f}) | {p['rounds']} |")
    for path, ms in grid.items():
        xs = sorted(ms)
        rows.append(f"| grid, {len(xs)} cases, {path} | | | cases' paired medians: min {xs[0]:.3f}x, median "
                    f"{_common.quantile(xs, 0.5):.3f}x, max {xs[-1]:.3f}x | |")
    return head + "\n\n" + "\n".join(rows)
