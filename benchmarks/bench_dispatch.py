"""Per-call cost of ``dp.method(x)`` against DataParallel ``forward`` for the same work.

For a tiny (overhead-bound) and a medium model, on N CPU devices (and on GPUs when
present), this times, per call:

- ``module``      ``model.encode(x)`` alone, no DataParallel;
- ``dp.forward``  ``dp(x)``: dpmethods' ``DataParallel.forward`` (torch's subclass);
- ``dp.method``   ``dp.encode(x)``: the parallel-method path;
- ``torch.DP``    ``torch.nn.DataParallel(model)(x)`` (GPU only: on CPU it is a passthrough);

under ``no_grad`` without and with replica caching, and with grad (a training
forward). Paths are interleaved round by round (``_common.interleave``: a balanced
random order each round) so drift hits them alike; inputs rotate through a pool of
distinct tensors. Reports medians with p10/p90 and IQR,
the ratio ``dp.method / dp.forward`` (target <= 1.05) and the caching speed-up for
the tiny model (target >= 2x), a per-stage breakdown of one call, and writes
``dispatch_<device>.json`` and ``.png``.

Run: ``PYTHONPATH=. python benchmarks/bench_dispatch.py [--quick] [--out DIR] [--threads N]``
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import statistics
import sys
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for _common, run as a script
import _common

import dpmethods
import dpmethods.core.devices as devices_module
import dpmethods.data_parallel as dp_module
import dpmethods.wrapper.call as flow_module
from dpmethods import DataParallel, parallel_method

__all__ = ["Figure", "main", "report", "run", "table", "targets", "targets_table"]


class Model(nn.Module):
    """An MLP whose ``encode`` is a parallel method doing the same work as ``forward``."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        mods: list[nn.Module] = []
        for i in range(layers):
            mods.append(nn.Linear(width, width))
            if i < layers - 1:
                mods.append(nn.ReLU())
        self.net = nn.Sequential(*mods)

    @parallel_method
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


MODELS = {"tiny": (16, 1, 8), "medium": (512, 4, 256)}  # width, layers, batch
MODES = ("no_grad", "no_grad+cache", "grad")


@dataclass
class Figure:
    """One timed configuration: per-call seconds summarized."""

    model: str
    devices: str
    n: int
    mode: str
    path: str
    median_us: float
    p10_us: float
    p90_us: float
    iqr_us: float
    samples: int
    extra: dict[str, Any] = field(default_factory=dict)


def _summary(times: list[float]) -> dict[str, float]:
    xs = sorted(t * 1e6 for t in times)
    return {
        "median_us": statistics.median(xs),
        "p10_us": _common.quantile(xs, 0.10),
        "p90_us": _common.quantile(xs, 0.90),
        "iqr_us": _common.quantile(xs, 0.75) - _common.quantile(xs, 0.25),
    }


def machine_info() -> dict[str, Any]:
    """``_common.machine_info()`` plus what these figures also depend on."""
    info = _common.machine_info()
    info["dpmethods"] = dpmethods.__version__
    ext = getattr(dpmethods, "extension_info", None)
    info["extension_info"] = ext() if callable(ext) else None
    return info


def _mode(mode: str) -> contextlib.AbstractContextManager[Any]:
    return torch.enable_grad() if mode == "grad" else torch.no_grad()


def _interleaved(
    calls: dict[str, Callable[[torch.Tensor], Any]],
    pool: list[torch.Tensor],
    rounds: int,
    block: int,
    warmup: int,
    sync: Callable[[], None],
) -> dict[str, list[list[float]]]:
    """Per-call times of each callable per round: ``block`` calls at a time, each timed
    alone, in :func:`_common.interleave`'s rounds (a balanced random order each round)."""
    for fn in calls.values():
        for i in range(warmup):
            fn(pool[i % len(pool)])
        sync()
    times: dict[str, list[list[float]]] = {name: [] for name in calls}
    k = itertools.count()
    clock = time.perf_counter

    def blocks(name: str, fn: Callable[[torch.Tensor], Any]) -> None:
        out: list[float] = []
        times[name].append(out)
        for _ in range(block):
            x = pool[next(k) % len(pool)]
            t0 = clock()
            fn(x)
            sync()
            out.append(clock() - t0)

    _common.interleave({name: functools.partial(blocks, name, fn) for name, fn in calls.items()}, rounds)
    return times


def _device_sets() -> list[tuple[str, list[Any]]]:
    sets: list[tuple[str, list[Any]]] = [(f"cpu x{n}", ["cpu"] * n) for n in (2, 4)]
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        sets.append((f"cuda x{count}", list(range(count))))
        if count == 1:  # repeated ids: two replicas on one GPU
            sets.append(("cuda:0 x2", [0, 0]))
    return sets


def run(quick: bool = False) -> tuple[list[Figure], dict[str, Any]]:
    """Time every configuration; return the figures and the per-stage breakdowns."""
    figures: list[Figure] = []
    rounds = 6 if quick else 20
    for model_name, (width, layers, batch) in MODELS.items():
        tiny = model_name == "tiny"
        block = (20 if tiny else 3) if quick else (50 if tiny else 8)
        for devices_name, ids in _device_sets():
            cuda = not isinstance(ids[0], str)
            dev = torch.device("cuda", ids[0]) if cuda else torch.device("cpu")
            sync = torch.cuda.synchronize if cuda else (lambda: None)
            torch.manual_seed(0)
            model = Model(width, layers).to(dev).eval()
            pool = [torch.randn(batch, width, device=dev) for _ in range(16)]
            dp_plain = DataParallel(model, device_ids=ids)
            dp_cache = DataParallel(model, device_ids=ids, cache_replicas=True)
            # no_grad with and without caching share one round-robin, so the caching
            # speed-up is paired like the method/forward ratio.
            groups = {
                "no_grad": {
                    "module": model.encode,
                    "dp.forward": dp_plain,
                    "dp.method": dp_plain.encode,
                    "dp.forward+cache": dp_cache,
                    "dp.method+cache": dp_cache.encode,
                },
                "grad": {
                    "module": model.encode,
                    "dp.forward": dp_plain,
                    "dp.method": dp_plain.encode,
                },
            }
            for mode, calls in groups.items():
                if cuda:
                    calls["torch.DP"] = nn.DataParallel(model, device_ids=ids)
                with _mode(mode):
                    times = _interleaved(calls, pool, rounds, block, block, sync)
                for name, per_round in times.items():
                    path, cached, _ = name.partition("+cache")
                    ts = [t for r in per_round for t in r]
                    rounds_us = [statistics.median(r) * 1e6 for r in per_round]
                    for m in (
                        [mode + "+cache"]
                        if cached
                        else (
                            [mode, mode + "+cache"]
                            if mode == "no_grad" and path == "module"
                            else [mode]
                        )
                    ):
                        figures.append(
                            Figure(
                                model_name,
                                devices_name,
                                len(ids),
                                m,
                                path,
                                samples=len(ts),
                                **_summary(ts),
                                extra={"round_medians_us": rounds_us},
                            )
                        )
    breakdowns = {
        f"tiny cpu x{n} {mode}": breakdown(n, mode, calls=200 if quick else 1000)
        for n in (2, 4)
        for mode in ("no_grad", "no_grad+cache")
    }
    return figures, breakdowns


@contextlib.contextmanager
def _timed(obj: Any, name: str, acc: dict[str, float]) -> Iterator[None]:
    """Accumulate the time spent in ``obj.name`` (an instance or module attribute)."""
    real = getattr(obj, name)
    label = {"_replicate": "replicate.build"}.get(name, name.strip("_"))
    if obj is flow_module and name == "replicate":  # the build inside the replicate seam
        label = "replicate.build"

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            acc[label] = acc.get(label, 0.0) + time.perf_counter() - t0

    setattr(obj, name, wrapper)
    try:
        yield
    finally:
        if isinstance(obj, types.ModuleType):
            setattr(obj, name, real)
        else:
            delattr(obj, name)  # drop the instance attribute: the class method shows again


def breakdown(n: int, mode: str, calls: int = 1000) -> dict[str, float]:
    """Mean microseconds per ``dp.encode(x)`` call spent in each stage (tiny model, CPU)."""
    torch.manual_seed(0)
    model = Model(*MODELS["tiny"][:2]).eval()
    dp = DataParallel(model, device_ids=["cpu"] * n, cache_replicas=mode.endswith("cache"))
    pool = [torch.randn(MODELS["tiny"][2], MODELS["tiny"][0]) for _ in range(16)]
    acc: dict[str, float] = {}
    with contextlib.ExitStack() as stack, _mode(mode):
        for _ in range(50):
            dp.encode(pool[0])
        for name in ("scatter", "replicate", "parallel_apply", "gather"):
            stack.enter_context(_timed(dp, name, acc))
        stack.enter_context(_timed(devices_module, "check_source_device", acc))
        stack.enter_context(_timed(dp_module, "fingerprint", acc))  # the call's cache key
        stack.enter_context(_timed(flow_module, "fingerprint", acc))  # inside the replicate seam
        stack.enter_context(_timed(flow_module, "replicate", acc))
        t0 = time.perf_counter()
        for i in range(calls):
            dp.encode(pool[i % len(pool)])
        total = time.perf_counter() - t0
    out = {k: v / calls * 1e6 for k, v in acc.items()}
    out["total"] = total / calls * 1e6
    # fingerprint and replicate.build run inside the replicate seam: not counted twice.
    stages = ("check_source_device", "scatter", "replicate", "parallel_apply", "gather")
    out["other"] = out["total"] - sum(out.get(s, 0.0) for s in stages)
    return out


def _lookup(figures: list[Figure]) -> dict[tuple[str, str, str, str], Figure]:
    return {(f.model, f.devices, f.mode, f.path): f for f in figures}


def targets(figures: list[Figure]) -> dict[str, Any]:
    """The ratios behind the two targets, per configuration, and whether each is met."""
    look = _lookup(figures)
    ratio = {}
    for f in figures:
        if f.path == "dp.method":
            ref = look[(f.model, f.devices, f.mode, "dp.forward")]
            # Paired: each round ran both paths back to back, so load drift cancels.
            per_round = sorted(_common.ratios(
                {"method": f.extra["round_medians_us"], "forward": ref.extra["round_medians_us"]},
                "method", "forward"))
            r = statistics.median(per_round)
            ratio[f"{f.model} {f.devices} {f.mode}"] = {
                "ratio": r,
                "p10": _common.quantile(per_round, 0.1),
                "p90": _common.quantile(per_round, 0.9),
                "ratio_of_medians": f.median_us / ref.median_us,
                "met": r <= 1.05,
            }
    speedup = {}
    for f in figures:
        if (
            f.model == "tiny"
            and f.mode == "no_grad+cache"
            and f.path in ("dp.method", "dp.forward")
        ):
            ref = look[(f.model, f.devices, "no_grad", f.path)]
            per_round = sorted(_common.ratios(
                {"uncached": ref.extra["round_medians_us"], "cached": f.extra["round_medians_us"]},
                "uncached", "cached"))
            sp = statistics.median(per_round)
            speedup[f"{f.devices} {f.path}"] = {
                "speedup": sp,
                "p10": _common.quantile(per_round, 0.1),
                "p90": _common.quantile(per_round, 0.9),
                "speedup_of_medians": ref.median_us / f.median_us,
                "met": sp >= 2.0,
            }
    return {
        "method_over_forward<=1.05": ratio,
        "tiny_cache_speedup>=2": speedup,
        "all_ratio_met": all(v["met"] for v in ratio.values()),
        "all_speedup_met": all(v["met"] for v in speedup.values()),
    }


def table(figures: list[Figure]) -> str:
    """A markdown table: one row per configuration, one column per path."""
    paths = [
        p
        for p in ("module", "dp.forward", "dp.method", "torch.DP")
        if any(f.path == p for f in figures)
    ]
    look = _lookup(figures)
    ratios = targets(figures)["method_over_forward<=1.05"]
    rows = [
        "| model | devices | mode | "
        + " | ".join(f"{p} us (p10-p90)" for p in paths)
        + " | method/forward (paired p10-p90) |",
        "|" + "---|" * (len(paths) + 4),
    ]
    keys = dict.fromkeys((f.model, f.devices, f.mode) for f in figures)
    for m, d, mode in keys:
        cells = []
        for p in paths:
            f = look.get((m, d, mode, p))
            cells.append("-" if f is None else f"{f.median_us:.1f} ({f.p10_us:.1f}-{f.p90_us:.1f})")
        r = ratios[f"{m} {d} {mode}"]
        rows.append(
            f"| {m} | {d} | {mode} | "
            + " | ".join(cells)
            + f" | {r['ratio']:.3f} ({r['p10']:.2f}-{r['p90']:.2f}) |"
        )
    return "\n".join(rows)


def targets_table(figures: list[Figure]) -> str:
    """A markdown table of the two targets, per configuration: the paired ratios and verdicts."""
    status = targets(figures)
    rows = ["| target | configuration | paired ratio (p10-p90) | verdict |", "|---|---|---:|---|"]
    for name, key in (("dp.method / dp.forward <= 1.05", "method_over_forward<=1.05"),
                      ("uncached / cached time >= 2", "tiny_cache_speedup>=2")):
        for config, v in status[key].items():
            value = v.get("ratio", v.get("speedup"))
            rows.append(f"| {name} | {config} | {value:.3f} ({v['p10']:.2f}-{v['p90']:.2f}) | "
                        f"{'met' if v['met'] else 'NOT met'} |")
    return "\n".join(rows)


def report(saved: dict[str, Any]) -> str:
    """The README's text of a saved run: what it was measured on, the per-call table, the
    targets and where the time of a tiny call goes."""
    figures = [Figure(**f) for f in saved["figures"]]
    stages = "\n".join(f"{key}: " + ", ".join(f"{k} {v:.1f}" for k, v in st.items())
                       for key, st in saved["breakdown_us"].items())
    return "\n\n".join([
        _common.provenance_line(saved["machine"]), table(figures), targets_table(figures),
        "Where the time of a tiny call goes (each stage timed by wrapping it, mean us):",
        f"```\n{stages}\n```",
    ])


def plot(figures: list[Figure], path: Path) -> None:
    """Grouped bars (median, p10-p90 whiskers) per configuration, one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(f.model for f in figures))
    fig, axes = plt.subplots(len(models), 1, figsize=(11, 4.2 * len(models)))
    for ax, m in zip(axes if len(models) > 1 else [axes], models, strict=True):
        sub = [f for f in figures if f.model == m]
        groups = list(dict.fromkeys((f.devices, f.mode) for f in sub))
        paths = list(dict.fromkeys(f.path for f in sub))
        look = _lookup(sub)
        width = 0.8 / len(paths)
        for j, p in enumerate(paths):
            xs, ys, lo, hi = [], [], [], []
            for i, (d, mode) in enumerate(groups):
                f = look.get((m, d, mode, p))
                if f is None:
                    continue
                xs.append(i + (j - (len(paths) - 1) / 2) * width)
                ys.append(f.median_us)
                lo.append(f.median_us - f.p10_us)
                hi.append(f.p90_us - f.median_us)
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=p)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{d}\n{mode}" for d, mode in groups], fontsize=8)
        ax.set_yscale("log")  # the module alone is ~100x below the DP paths on the tiny model
        ax.set_ylabel("per call, us (median, p10-p90; log)")
        w, layers, b = MODELS[m]
        ax.set_title(f"{m}: {layers} x Linear({w},{w}), batch {b}")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"dpmethods dispatch cost, torch {torch.__version__}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, for a smoke run")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: the replica threads are the parallelism; "
        "with 2 OpenMP threads on a busy 2-core host the medium model alone ran 88 ms "
        "instead of 7 ms); 0 keeps torch's default",
    )
    parser.add_argument("--from-json", type=Path, help="redraw the table and plot of a saved run")
    args = parser.parse_args(argv)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        figures = [Figure(**f) for f in saved["figures"]]
        print(report(saved))
        try:
            plot(figures, args.from_json.with_suffix(".png"))
        except ModuleNotFoundError as exc:  # the table is what --from-json is mostly for
            print(f"no plot: {exc.name} is not installed (pip install matplotlib)")
        return 0
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    clock = _common.started_run()
    figures, breakdowns = run(args.quick)
    status = targets(figures)
    print(table(figures))
    print("\nTargets:")
    for name in ("method_over_forward<=1.05", "tiny_cache_speedup>=2"):
        for key, v in status[name].items():
            value = v.get("ratio", v.get("speedup"))
            spread = f"(paired p10-p90 {v['p10']:.2f}-{v['p90']:.2f})"
            verdict = "met" if v["met"] else "NOT met"
            print(f"  {name:26s} {key:30s} {value:6.3f} {spread}  {verdict}")
    print("\nPer-call stage breakdown, tiny model, dp.encode (mean us):")
    for key, stages in breakdowns.items():
        print(f"  {key}: " + ", ".join(f"{k} {v:.1f}" for k, v in stages.items()))
    args.out.mkdir(parents=True, exist_ok=True)
    tag = "cuda" if torch.cuda.is_available() else "cpu"
    result = {
        "machine": {**machine_info(), **_common.finished_run(clock)},
        "quick": args.quick,
        "models": {
            k: dict(zip(("width", "layers", "batch"), v, strict=True)) for k, v in MODELS.items()
        },
        "figures": [asdict(f) for f in figures],
        "targets": status,
        "breakdown_us": breakdowns,
    }
    json_path = args.out / f"dispatch_{tag}.json"
    _common.write_json(json_path, result)
    plot(figures, args.out / f"dispatch_{tag}.png")
    print(f"\nwrote {json_path} and {json_path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
