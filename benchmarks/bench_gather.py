"""Benchmark the fused gather (dpmethods.ops.gather_coalesced) against the baselines.

CPU: per-leaf ``torch.cat`` of ``.to(device)`` pieces (what the gather does without the
extension), with inputs requiring grad. CUDA: ``torch.nn.parallel.gather`` with every
replica on one GPU. Each case runs in paired rounds (a block of fused calls and one of
baseline calls back to back, in ``_common.interleave``'s balanced random orders) and
reports both paths' per-call medians with p10/p90, the ratio baseline / fused of each round (its median and
p10-p90), and the fused gather's GB/s (output bytes written per second) against the
copy bandwidth measured in the same run.

Usage (from the repository root, ``PYTHONPATH=.``):
    python benchmarks/bench_gather.py                  # full CPU grid
    python benchmarks/bench_gather.py --quick          # reduced grid
    python benchmarks/bench_gather.py --only targets   # the targets alone
    python benchmarks/bench_gather.py --compare-with main   # main's code against this checkout's
    python benchmarks/bench_gather.py --device cuda --quick --out out/
    python benchmarks/bench_gather.py --markdown-from benchmarks/results/gather_cpu.json
    python benchmarks/bench_gather.py --markdown-from benchmarks/results/gather_cpu.json --full-grid
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for _common, run as a script

import _common
import _compare
from _common import (
    copy_bandwidth,
    finished_run,
    interleave,
    machine_info,
    plot_ratios,
    provenance_line,
    started_run,
    summarize,
    write_json,
)

from dpmethods import ops

__all__ = ["ROUNDS", "Case", "main", "markdown", "paired", "run_case"]

# Leaf shapes per size class; "large" pieces are sized so a case moves 64 MiB.
_SHAPES = {"tiny": (8, 16), "medium": (32, 128)}
_LARGE_BYTES = 64 << 20
ROUNDS = 15  # paired rounds per case
_MIXED = [torch.float32, torch.float16, torch.int64, torch.bool, torch.bfloat16, torch.float64]


@dataclass(frozen=True)
class Case:
    """One benchmark configuration."""

    leaves: int
    replicas: int
    size: str  # tiny | medium | large
    dim: int
    mode: str  # nograd | fwd | fwd+bwd
    mixed: bool = False

    @property
    def name(self) -> str:
        mixed = "-mixed" if self.mixed else ""
        return f"L{self.leaves}-N{self.replicas}-{self.size}-d{self.dim}-{self.mode}{mixed}"


def _piece_shape(case: Case) -> tuple[int, int]:
    if case.size != "large":
        return _SHAPES[case.size]
    cols = 1024
    rows = max(1, _LARGE_BYTES // (4 * cols * case.leaves * case.replicas))
    return rows, cols


def _make_inputs(case: Case, device: torch.device, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rows, cols = _piece_shape(case)
    out = []
    for leaf in range(case.leaves):
        dtype = _MIXED[leaf % len(_MIXED)] if case.mixed else torch.float32
        for _ in range(case.replicas):
            if dtype == torch.bool:
                t = torch.randint(0, 2, (rows, cols), generator=gen).bool()
            elif dtype == torch.int64:
                t = torch.randint(0, 1000, (rows, cols), generator=gen)
            else:
                t = torch.randn(rows, cols, generator=gen).to(dtype)
            t = t.to(device)
            if case.mode != "nograd" and t.is_floating_point():
                t.requires_grad_()
            out.append(t)
    return out


def _per_leaf_cat(tensors: list[torch.Tensor], n: int, dim: int, device: torch.device) -> list:
    return [
        torch.cat([t.to(device) for t in tensors[i : i + n]], dim)
        for i in range(0, len(tensors), n)
    ]


def _nn_parallel_gather(
    tensors: list[torch.Tensor], n: int, dim: int, device: torch.device
) -> list:
    per_replica = [[tensors[i + r] for i in range(0, len(tensors), n)] for r in range(n)]
    return list(torch.nn.parallel.gather(per_replica, device, dim))


def _fused(tensors: list[torch.Tensor], n: int, dim: int, device: torch.device) -> list:
    return ops.gather_coalesced(tensors, n, dim, device)


def _runner(
    gather: Callable[..., list], sets: list[list[torch.Tensor]], case: Case, device: torch.device
) -> Callable[[int], Any]:
    """One gather of the ``i``-th input set (rotating, so caches do not flatter a path),
    with the backward too for ``fwd+bwd``."""
    grads: list[torch.Tensor] | None = None

    def run(i: int) -> Any:
        nonlocal grads
        outs = gather(sets[i % len(sets)], case.replicas, case.dim, device)
        if case.mode == "fwd+bwd":
            diff = [o for o in outs if o.requires_grad]
            if grads is None:
                grads = [torch.ones_like(o) for o in diff]
            torch.autograd.backward(diff, grads)
        return outs

    return run


def paired(
    a: Callable[[int], Any], b: Callable[[int], Any], rounds: int, calls: int,
    sync: Callable[[], Any] = lambda: None, label: str = "",
) -> dict[str, Any]:
    """``rounds`` rounds of :func:`_common.interleave`, each a block of ``calls`` calls of
    ``a`` and one of ``b`` in a balanced random order (each call gets the next index, so
    inputs rotate). Returns each path's per-call seconds (one per round,
    :func:`summarize`d, and raw in ``rounds_s``) and the per-round ratio ``b / a`` (above
    1: ``a`` is faster): its median and p10-p90 come from the rounds' own ratios, never
    from dividing quantiles of independent samples.

    Example:
        >>> out = paired(lambda i: None, lambda i: None, rounds=3, calls=2)
        >>> sorted(out), len(out["ratios"])
        (['a', 'b', 'ratio', 'ratios', 'rounds_s'], 3)
    """
    index = {"a": itertools.count(), "b": itertools.count()}
    paths = {"a": lambda: a(next(index["a"])), "b": lambda: b(next(index["b"]))}
    times, _ = interleave(paths, rounds, sync, calls=calls, label=label)
    ratios = _common.ratios(times, "b", "a")
    return {"a": summarize(times["a"]), "b": summarize(times["b"]), "ratio": summarize(ratios), "ratios": ratios,
            "rounds_s": times}


def run_case(case: Case, device: torch.device, budget_s: float) -> dict[str, Any]:
    """Time the fused gather and the baseline for ``case`` in paired rounds; returns a JSON-able dict."""
    is_cuda = device.type == "cuda"
    nsets = 2 if case.size == "large" else 3
    sets = [_make_inputs(case, device, seed) for seed in range(nsets)]
    nbytes = sum(t.numel() * t.element_size() for t in sets[0])
    baseline_fn = _nn_parallel_gather if is_cuda else _per_leaf_cat
    sync = torch.cuda.synchronize if is_cuda else (lambda: None)
    fused_run = _runner(_fused, sets, case, device)
    base_run = _runner(baseline_fn, sets, case, device)
    # Warm up both, then size the blocks: ROUNDS rounds of both paths fill the budget.
    est = 0.0
    for run in (fused_run, base_run):
        for i in range(2):
            sync()
            t0 = time.perf_counter()
            run(i)
            sync()
        est += max(time.perf_counter() - t0, 1e-6)
    calls = int(min(200, max(1, budget_s / ROUNDS / est)))
    out = paired(fused_run, base_run, ROUNDS, calls, sync, label=case.name)
    for s in sets:
        for t in s:
            t.grad = None
    fused, base, ratio = out["a"], out["b"], out["ratio"]
    return {
        "case": case.name,
        "leaves": case.leaves,
        "replicas": case.replicas,
        "size": case.size,
        "piece_shape": list(_piece_shape(case)),
        "dim": case.dim,
        "mode": case.mode,
        "mixed_dtypes": case.mixed,
        "bytes": nbytes,
        "rounds": ROUNDS,
        "calls_per_round": calls,
        "fused": fused,
        "baseline": base,
        "ratio": ratio["median"],
        "ratio_p10": ratio["p10"],
        "ratio_p90": ratio["p90"],
        "ratios": out["ratios"],
        "rounds_s": {"fused": out["rounds_s"]["a"], "baseline": out["rounds_s"]["b"]},
        "fused_gbps": nbytes / fused["median"] / 1e9,
        "baseline_gbps": nbytes / base["median"] / 1e9,
    }


def _grid(quick: bool) -> list[Case]:
    leaves = [1, 8, 256, 1024] if quick else [1, 8, 64, 256, 1024]
    replicas = [4] if quick else [2, 4, 8]
    cases: list[Case] = []
    for n in replicas:
        for size in ("tiny", "medium", "large"):
            for L in leaves:
                if size == "large" and L > 64:
                    continue  # "large" means few big leaves
                if size == "medium" and L * n > 2048 and quick:
                    continue
                for dim in (0, 1):
                    for mode in ("nograd", "fwd", "fwd+bwd"):
                        if quick and mode == "nograd" and size != "large":
                            continue
                        cases.append(Case(L, n, size, dim, mode))
    for mode in ("fwd", "fwd+bwd"):
        cases.append(Case(64 if quick else 256, 4, "tiny", 0, mode, mixed=True))
    return cases


def _target(name: str, paths: dict[str, Callable[[], Any]], rounds: int, calls: int) -> dict[str, Any]:
    """One target's paths (``fused`` first, the baseline second, then any floor) in
    interleaved rounds: each path's per-call seconds, and the paired ratio baseline /
    fused (above 1: the fused gather is faster)."""
    times, _ = interleave(paths, rounds, calls=calls, label=name)
    fused, base = list(paths)[:2]
    ratios = _common.ratios(times, base, fused)
    ratio = summarize(ratios)
    speed = "speed_vs_cat" if base == "torch_cat" else "speedup"
    return {**{p: summarize(ts) for p, ts in times.items()}, speed: ratio["median"], "ratio": ratio,
            "ratios": ratios, "rounds_s": times}


def cpu_targets(quick: bool = False) -> dict[str, Any]:
    """The CPU acceptance figures, measured with interleaved rounds.

    ``small``: 256 leaves of float32 [8, 16] per replica over 4 replicas (1024 inputs),
    forward, fused vs per-leaf torch.cat; with autograd leaves that require grad, with
    replica outputs (non-leaf tensors with a grad_fn, what DataParallel's gather
    receives), and without grad, where ``unbind_copy_floor`` (``torch.unbind_copy`` of
    one [256, 32, 16] tensor: one torch op returning 256 new tensors) is a floor for any
    single call that returns 256 tensors. ``large``: 64 MiB in all (4 pieces of [4096,
    1024] float32), fused vs one torch.cat into new memory.
    """
    cpu = torch.device("cpu")
    rounds = 8 if quick else 25
    small = [torch.randn(8, 16, requires_grad=True) for _ in range(256 * 4)]
    scale = torch.ones(16, requires_grad=True)
    kinds = {
        "small_256x4_fwd_requires_grad": small,
        "small_256x4_fwd_replica_outputs": [t.detach() * scale for t in small],
        "small_256x4_nograd": [t.detach() for t in small],
    }
    stacked = torch.randn(256, 8 * 4, 16)
    out: dict[str, Any] = {}
    for name, ts in kinds.items():
        paths: dict[str, Callable[[], Any]] = {
            "fused": lambda ts=ts: ops.gather_coalesced(ts, 4, 0, cpu),  # type: ignore[misc]
            "per_leaf_cat": lambda ts=ts: _per_leaf_cat(ts, 4, 0, cpu),  # type: ignore[misc]
        }
        if name.endswith("nograd"):
            paths["unbind_copy_floor"] = lambda: torch.unbind_copy(stacked)
        out[name] = _target(name, paths, rounds, 20)
    big = [torch.randn(4096, 1024) for _ in range(4)]
    for dim in (0, 1):
        name = f"large_64MiB_dim{dim}"
        out[name] = _target(name, {
            "fused": lambda d=dim: ops.gather_coalesced(big, 4, d, cpu),  # type: ignore[misc]
            "torch_cat": lambda d=dim: torch.cat(big, d),  # type: ignore[misc]
        }, max(4, rounds // 3), 3)
    return out


def cuda_targets(
    device: torch.device,
    quick: bool = False,
    baseline: Callable[..., list] = _nn_parallel_gather,
    copy_gbps: float | None = None,
) -> dict[str, Any]:
    """The two GPU acceptance figures, every replica on ``device``, interleaved rounds.

    ``small``: 256 leaves of float32 [8, 16] per replica over 4 replicas, forward, fused
    vs ``baseline`` (``torch.nn.parallel.gather``); with replica outputs (tensors with a
    grad_fn) and without grad. ``large``: 4 pieces of 64 MiB (256 MiB out) at dim 0 and
    1, fused vs ``torch.cat``, with the fused GB/s as a fraction of ``copy_gbps``.
    Every call is followed by a device synchronize, so launch and host costs count.
    ``baseline`` can be swapped to dry-run this on the CPU.
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rounds = 8 if quick else 25
    small = [torch.randn(8, 16, device=device) for _ in range(256 * 4)]
    scale = torch.ones(16, device=device, requires_grad=True)
    kinds = {
        "small_256x4_fwd_replica_outputs": [t * scale for t in small],
        "small_256x4_nograd": small,
    }
    out: dict[str, Any] = {}
    for name, ts in kinds.items():

        def fused(ts: list[torch.Tensor] = ts) -> None:
            ops.gather_coalesced(ts, 4, 0, device)
            sync()

        def base(ts: list[torch.Tensor] = ts) -> None:
            baseline(ts, 4, 0, device)
            sync()

        out[name] = _target(name, {"fused": fused, "baseline": base}, rounds, 20)
    big = [torch.randn(16384, 1024, device=device) for _ in range(4)]
    nbytes = sum(t.numel() * t.element_size() for t in big)
    for dim in (0, 1):

        def fused_l(d: int = dim) -> None:
            ops.gather_coalesced(big, 4, d, device)
            sync()

        def cat_l(d: int = dim) -> None:
            torch.cat(big, d)
            sync()

        name = f"large_256MiB_dim{dim}"
        out[name] = _target(name, {"fused": fused_l, "torch_cat": cat_l}, max(4, rounds // 3), 3)
        gbps = nbytes / out[name]["fused"]["median"] / 1e9
        out[name].update(fused_gbps=gbps, fraction_of_copy=gbps / copy_gbps if copy_gbps else None)
    return out


def _fmt_us(s: float) -> str:
    return f"{s * 1e6:10.1f}"


def _targets_table(targets: dict[str, Any]) -> list[str]:
    """Rows of the targets table (CPU runs)."""
    lines = [
        "| target | fused us [p10, p90] | baseline us [p10, p90] | ratio, paired (p10-p90) |",
        "|---|---:|---:|---:|",
    ]
    for name, t in targets.items():
        fused = t["fused"]
        base = t.get("per_leaf_cat") or t.get("baseline") or t["torch_cat"]
        ratio = t.get("speedup", t.get("speed_vs_cat"))
        cells = [
            f"{v['median'] * 1e6:.1f} [{v['p10'] * 1e6:.1f}, {v['p90'] * 1e6:.1f}]"
            for v in (fused, base)
        ]
        share = t.get("fraction_of_copy")
        note = f", {100 * share:.0f}% of copy bandwidth" if share else ""
        spread = f" ({t['ratio']['p10']:.2f}-{t['ratio']['p90']:.2f}{note})" if "ratio" in t else ""
        lines.append(f"| {name} | {cells[0]} | {cells[1]} | {ratio:.2f}x{spread} |")
    return lines


def _summary_table(cases: list[dict[str, Any]]) -> list[str]:
    """One row per leaf size and autograd mode: the spread of the cases' paired median ratios."""
    groups: dict[tuple[str, str], list[float]] = {}
    for r in cases:
        mode = r["mode"] + ("-mixed" if r.get("mixed_dtypes") else "")
        groups.setdefault((r["size"], mode), []).append(r["ratio"])
    lines = [
        "| size | mode | cases | ratio min | ratio median | ratio max | cases below 1 |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for (size, mode), ratios in groups.items():
        xs = sorted(ratios)
        below = sum(x < 1 for x in xs)
        lines.append(
            f"| {size} | {mode} | {len(xs)} | {xs[0]:.2f} | {statistics.median(xs):.2f} "
            f"| {xs[-1]:.2f} | {below} |"
        )
    return lines


def _grid_table(data: dict[str, Any]) -> list[str]:
    """Rows of the full grid: one per case."""
    bw = data["copy_bandwidth"]["gbps"]
    lines = [
        "| case | fused us | baseline us | ratio, paired | its p10-p90 | fused GB/s | % of copy BW |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for r in data["cases"]:
        gbps = r["bytes"] / r["fused"]["median"] / 1e9
        lines.append(
            f"| {r['case']} | {r['fused']['median'] * 1e6:.1f} | {r['baseline']['median'] * 1e6:.1f} "
            f"| {r['ratio']:.2f} | {r['ratio_p10']:.2f}-{r['ratio_p90']:.2f} | {gbps:.2f} "
            f"| {100 * gbps / bw:.0f}% |"
        )
    return lines


def markdown(data: dict[str, Any], full_grid: bool = False) -> str:
    """The README text of a results file: what it was measured on, the targets (CPU runs),
    a summary per leaf size and mode, the copy bandwidth, and with ``full_grid`` every case."""
    lines: list[str] = [provenance_line(data["machine"]), ""]
    targets = data.get("targets") or {}
    if targets:
        lines += [*_targets_table(targets), ""]
    lines += _summary_table(data["cases"])
    bw = data["copy_bandwidth"]
    lines += ["", f"Copy bandwidth (`copy_` into preallocated memory) in this run: {bw['gbps']:.1f} GB/s."]
    if full_grid:
        lines += ["", *_grid_table(data)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark grid, print a table, write JSON and PNG; returns the JSON dict."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--quick", action="store_true", help="reduced grid")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--budget", type=float, default=None, help="seconds per measurement")
    ap.add_argument("--tag", default=None, help="file stem (default gather_<device>[_quick])")
    ap.add_argument(
        "--markdown-from",
        default=None,
        metavar="JSON",
        help="print the README tables of a results file and exit",
    )
    ap.add_argument(
        "--full-grid", action="store_true", help="with --markdown-from: add every case's row"
    )
    ap.add_argument(
        "--only", nargs="+", choices=("grid", "targets"), default=["grid", "targets"],
        help="the grid of cases, the acceptance targets, or both (default both)",
    )
    ap.add_argument("--compare-with", metavar="REF", help="run on REF's code (before) and on this checkout's "
                    "(after) in one sitting, round by round in turns (benchmarks/_compare.py)")
    args = ap.parse_args(argv)
    if args.compare_with:
        _compare.main(Path(__file__).resolve(), args.compare_with, sys.argv[1:] if argv is None else argv,
                      Path(args.out))
        return {}
    if args.markdown_from:
        data = json.loads(Path(args.markdown_from).read_text())
        print(_compare.report(data) if "pairs" in data else markdown(data, full_grid=args.full_grid))
        return data
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_gather: CUDA requested but not available", file=sys.stderr)
        raise SystemExit(2)
    clock = started_run()
    budget = args.budget if args.budget is not None else (0.15 if args.quick else 0.25)
    copy_bytes = (256 << 20) if device.type == "cuda" else (64 << 20)
    bw = copy_bandwidth(device, copy_bytes)
    print(
        f"copy bandwidth ({device}, {copy_bytes >> 20} MiB): copy_ {bw['gbps']:.2f} GB/s, "
        f"clone {bw['clone_gbps']:.2f} GB/s"
    )
    print(f"extension: {ops.extension_info()}")
    header = (
        f"{'case':36s} {'fused us':>10s} {'base us':>10s} {'ratio':>7s} "
        f"{'[p10,p90]':>15s} {'GB/s':>7s} {'%copy':>6s}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    t_start = time.perf_counter()
    grid = _grid(args.quick) if "grid" in args.only else []
    # One unmeasured fwd+bwd case first: the first backward of the process starts
    # autograd's worker threads and warms the allocators, a one-off cost that would
    # otherwise land on whichever path the first measured case times first and skew
    # that case's ratio.
    if grid:
        run_case(next(c for c in grid if c.mode == "fwd+bwd"), device, budget / 4)
    for case in grid:
        b = budget * (0.5 if case.size == "large" else 1.0)
        r = run_case(case, device, b)
        r["fused_frac_of_copy"] = r["fused_gbps"] / bw["gbps"]
        rows.append(r)
        print(
            f"{case.name:36s} {_fmt_us(r['fused']['median'])} {_fmt_us(r['baseline']['median'])} "
            f"{r['ratio']:7.2f} [{r['ratio_p10']:6.2f},{r['ratio_p90']:6.2f}] "
            f"{r['fused_gbps']:7.2f} {100 * r['fused_frac_of_copy']:5.1f}%",
            flush=True,
        )
    targets = None
    if "targets" not in args.only:
        pass
    elif device.type == "cpu":
        targets = cpu_targets(args.quick)
    else:
        targets = cuda_targets(device, args.quick, copy_gbps=bw["gbps"])
    if targets:
        for name, t in targets.items():
            ratio = t.get("speedup", t.get("speed_vs_cat"))
            share = t.get("fraction_of_copy")
            print(
                f"target {name}: {ratio:.2f}x  "
                + (f"{100 * share:.0f}% of copy bandwidth  " if share else "")
                + "  ".join(
                    f"{k} median {v['median'] * 1e6:.1f} us [p10 {v['p10'] * 1e6:.1f}, p90 {v['p90'] * 1e6:.1f}]"
                    for k, v in t.items()
                    if isinstance(v, dict) and "median" in v and k != "ratio"
                )
            )
    elapsed = time.perf_counter() - t_start
    baseline = "torch.nn.parallel.gather" if device.type == "cuda" else "per-leaf torch.cat"
    data = {
        "benchmark": "gather_coalesced",
        "device": str(device),
        "baseline": baseline,
        "quick": args.quick,
        "machine": {**machine_info(), **finished_run(clock)},
        "extension_info": ops.extension_info(),
        "copy_bandwidth": bw,
        "elapsed_s": elapsed,
        "units": {"time": "seconds", "bandwidth": "GB/s of output bytes written"},
        "targets": targets,
        "cases": rows,
        "ratio_summary": summarize([r["ratio"] for r in rows]) if rows else None,
    }
    # A run without the whole grid is no result of the benchmark: it never takes its name.
    partial = ("_quick" if args.quick else "") + ("" if set(args.only) == {"grid", "targets"} else "_" + args.only[0])
    stem = args.tag or f"gather_{device.type}{partial}"
    out = Path(args.out)
    write_json(out / f"{stem}.json", data)
    png = None
    if rows:
        png = plot_ratios(
            out / f"{stem}.png",
            [r["case"] for r in rows],
            [r["ratio"] for r in rows],
            lows=[r["ratio_p10"] for r in rows],
            highs=[r["ratio_p90"] for r in rows],
            title=f"gather_coalesced vs {baseline} on {device} (median, p10-p90)",
            ylabel=f"speedup ({baseline} time / fused time)",
        )
    print(f"wrote {out / (stem + '.json')}" + (f" and {png}" if png else " (no PNG: no grid, or no matplotlib)"))
    print(f"elapsed {elapsed:.0f} s")
    return data


if __name__ == "__main__":
    main()
