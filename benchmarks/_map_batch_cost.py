"""The batch-cost workload of bench_map: what one batch of a map costs the caller, on
threads and on processes, as the model's number of parameter tensors grows. Selected
with ``--only batch-cost``.

Maps on two CPU replicas of tiny batches (one row of one number), whose method touches
one parameter only, so the workers' own work is small and the same whatever the model's
size: the time per batch is what the map costs around the method (for processes: the
check that the model did not change, pickling, the trip to the worker and back).
Models of ``n`` parameter tensors (``n // 2`` ``Linear(1, 1)``, a module each); paths
``map-<n>`` (threads, ``cache_replicas=True``), ``map-processes-<n>``,
``one-device-<n>``, and what a user would use instead of a process map, the standard
library's two process pools (forkserver, the model sent once to each worker at its
start, so they never look at it again): ``mp-pool-<n>`` (``multiprocessing.Pool.imap``)
and ``executor-<n>`` (``concurrent.futures.ProcessPoolExecutor.map``). Every model's paths
run in the same interleaved rounds (so the sizes compare too); targets:
``map-processes-<n>`` within 2x of ``map-<n>``, paired per round, and (no target)
``map-processes-<n>`` over ``map-processes-2`` and over each standard pool.

Example:
    >>> Many(4)(torch.ones(1, 1)).shape
    torch.Size([1, 1])
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import pickle
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for _common, imported as a script's sibling
import _common
from _map_long_runs import Measured, _equal, _interleave, _ratio

import dpmethods
from dpmethods import DataParallel

__all__ = ["NAMES", "SIZES", "Many", "commit", "plot", "rows", "run"]

NAMES = ("batch-cost",)
_STANDARD = ("mp-pool", "executor")  # the standard library's process pools' paths
SIZES = (2, 200, 2000)  # parameter tensors: a tiny model, a BERT, a large UNet's order


class Many(nn.Module):
    """``n // 2`` ``Linear(1, 1)`` layers (``n`` parameter tensors); ``forward`` runs
    the first one only."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(1, 1) for _ in range(max(1, n // 2)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0](x)  # type: ignore[no-any-return]


_held: nn.Module | None = None  # a standard pool's worker's model


def _hold(model: bytes) -> None:
    global _held
    torch.set_num_threads(1)
    _held = pickle.loads(model)


def _forward_held(x: torch.Tensor) -> torch.Tensor:
    assert _held is not None
    with torch.no_grad():
        return _held(x)  # type: ignore[no-any-return]


class _Pools:
    """The standard library's two process pools for one model: what a user would use
    instead of a process map."""

    def __init__(self, model: nn.Module) -> None:
        context = multiprocessing.get_context("forkserver")
        # As bytes: passed as it is, each storage would cross as a file descriptor, more
        # than a fork server takes at once for a model of 2,000 tensors.
        data = pickle.dumps(model)
        self.pool = context.Pool(2, _hold, (data,))
        self.executor = cf.ProcessPoolExecutor(2, context, _hold, (data,))

    def close(self) -> None:
        self.pool.terminate()
        self.executor.shutdown()


def commit() -> str:
    """The git commit of the dpmethods package imported here (with ``+dirty`` for local
    changes), or ``"unknown"``: before and after runs name the code they ran."""
    where = Path(dpmethods.__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], cwd=where, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def _batch_cost(ids: list[Any], quick: bool) -> Measured:
    """Every model's paths in the same interleaved rounds, so that the sizes compare too."""
    batches_n, rounds = (100, 3) if quick else (200, 7)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(1, 1, generator=g) for _ in range(batches_n)]
    paths: dict[str, Callable[[], Any]] = {}
    pools: list[Any] = []
    startup: dict[str, float] = {}
    tensors: dict[str, int] = {}  # str keys, as the JSON has them
    for n in SIZES:
        torch.manual_seed(n)
        model = Many(n).eval()
        tensors[str(n)] = len(list(model.parameters()))
        dp = DataParallel(model, device_ids=ids, cache_replicas=True)
        dpp = DataParallel(model, device_ids=ids, workers="processes")
        pools.append(dpp)
        t0 = time.perf_counter()
        list(dpp.map("forward", []))  # a map of no batch starts the pool
        startup[f"processes-{n}"] = time.perf_counter() - t0
        paths[f"one-device-{n}"] = lambda model=model: [model(b) for b in batches]
        paths[f"map-{n}"] = lambda dp=dp: list(dp.map("forward", batches))
        paths[f"map-processes-{n}"] = lambda dpp=dpp: list(dpp.map("forward", batches))
        standard = _Pools(model)
        pools.append(standard)
        paths[f"mp-pool-{n}"] = lambda p=standard.pool: list(p.imap(_forward_held, batches))
        paths[f"executor-{n}"] = lambda e=standard.executor: list(e.map(_forward_held, batches))
    outputs, times, cpu = _interleave(paths, rounds, tuple(pools))
    targets = [_ratio(times, f"map-processes-{n}", f"map-{n}", at_most=2.0) for n in SIZES]
    targets += [_ratio(times, f"map-processes-{n}", f"map-processes-{SIZES[0]}") for n in SIZES[1:]]
    targets += [_ratio(times, f"{kind}-{n}", f"map-processes-{n}") for kind in _STANDARD for n in SIZES]
    facts = {
        "workload": f"a map of {batches_n} batches of 1 x 1 on models of "
        f"{', '.join(map(str, tensors.values()))} parameter tensors (n // 2 x Linear(1, 1), forward "
        "on the first); every model's paths interleaved in the same rounds",
        "method": "forward", "devices": [str(i) for i in ids], "rounds": rounds,
        "parameter_tensors": tensors, "commit": commit(), "startup_s": startup,
        "per_batch_ms": {p: {k: v * 1e3 / batches_n for k, v in _ms(ts).items()} for p, ts in times.items()},
        # This process's CPU (all its threads): less moved by other jobs on a shared host.
        "per_batch_cpu_ms": {p: {k: v * 1e3 / batches_n for k, v in _ms(cs).items()} for p, cs in cpu.items()},
        "targets": targets,
        "outputs_match_one_device": {
            p: _equal(o, outputs[f"one-device-{p.rsplit('-', 1)[1]}"])
            for p, o in outputs.items() if not p.startswith("one-device")
        },
    }
    return Measured("batch-cost", dict.fromkeys(times, batches_n), times, cpu, facts)


def _ms(ts: list[float]) -> dict[str, float]:
    return {"median": statistics.median(ts), "p10": _common.quantile(ts, 0.1), "p90": _common.quantile(ts, 0.9)}


def run(ids: list[Any], quick: bool, only: list[str] | None) -> list[Measured]:
    """The batch-cost workloads when ``only`` names ``batch-cost`` (never by default: they
    measure the map's overhead, not a model's throughput), on CPU devices ``ids``."""
    if only is None or "batch-cost" not in only:
        return []
    with torch.no_grad():
        return [_batch_cost(ids, quick)]


def rows(facts: dict[str, Any]) -> list[str]:
    """Markdown rows of the per-batch times, when measured."""
    x = facts.get("batch-cost")
    if x is None:
        return []
    out = ["", f"batch-cost, dpmethods {_short(x['commit'])}", "",
           "| parameter tensors | path | ms per batch, median (p10-p90) | CPU ms per batch (p10-p90) |",
           "|---:|---|---:|---:|"]
    for path, s in x["per_batch_ms"].items():
        n, c = path.rsplit("-", 1)[1], x["per_batch_cpu_ms"][path]
        out.append(f"| {x['parameter_tensors'][n]} | {path.rsplit('-', 1)[0]} | "
                   f"{s['median']:.3f} ({s['p10']:.3f}-{s['p90']:.3f}) | "
                   f"{c['median']:.3f} ({c['p10']:.3f}-{c['p90']:.3f}) |")
    return out


def _short(commit: str) -> str:
    return commit[:12] + ("+dirty" if commit.endswith("+dirty") else "")


def plot(facts: dict[str, Any], path: Path, title: str) -> None:
    """Milliseconds per batch (median, p10-p90) of each path, per model size."""
    x = facts.get("batch-cost")
    if x is None:
        return
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    kinds = tuple(k for k in ("one-device", "map", "map-processes", *_STANDARD) if f"{k}-{SIZES[0]}" in x["per_batch_ms"])
    colors = {"one-device": "tab:gray", "map": "tab:green", "map-processes": "tab:blue",
              "mp-pool": "tab:orange", "executor": "tab:red"}
    for k, kind in enumerate(kinds):
        ms = [x["per_batch_ms"][f"{kind}-{n}"] for n in SIZES]
        xs = [i * (len(kinds) + 1) + k for i in range(len(SIZES))]
        ax.bar(xs, [m["median"] for m in ms], color=colors[kind], label=kind, capsize=3,
               yerr=[[m["median"] - m["p10"] for m in ms], [m["p90"] - m["median"] for m in ms]])
    ax.set_yscale("log")
    ax.set_xticks([i * (len(kinds) + 1) + 1 for i in range(len(SIZES))])
    ax.set_xticklabels([f"{x['parameter_tensors'][str(n)]} parameter tensors" for n in SIZES], fontsize=8)
    ax.set_ylabel("ms per batch (median, p10-p90)", fontsize=8)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    where = title.split("threads and processes, ", 1)[-1]
    ax.set_title(f"what one batch of a map costs; dpmethods {_short(x['commit'])}; {where}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
