"""The long-run workloads of bench_map: what ``checkpoint=``, a killed worker and
``on_oom="split"`` cost a map. Selected with ``--only checkpoint sigkill oom-split``.

- ``checkpoint``: a 1,000-batch map of a tiny ``nn.Linear`` with ``checkpoint=`` (a fresh
  file per pass) against the same map without, on threads and on processes; target: at
  most 1.05x, paired per round.
- ``sigkill``: a map on 2 worker processes whose method sleeps per batch; the worker
  running batch k SIGKILLs its own process the first time (it writes the clock first),
  and the time from the kill to the map yielding batch k's output (run again on a fresh
  worker) is taken per round, with a fresh pool's start-up measured apart, in the same
  rounds.
- ``oom-split``: a map with ``on_oom="split"`` whose method raises
  ``torch.OutOfMemoryError`` above N rows, on batches of 2N rows (each needs one split),
  against the same batches cut in halves by hand (a plain map over the halves, joined
  after). Each replica runs out once, on its first batch, and then splits up front.
  ``split-first-processes`` shows the first batch's cost alone: 50 maps of one batch on
  one worker process (each batch runs out, then runs in halves) against 50 maps of its
  two halves. Not on threads: a thread map starts fresh threads, and on the CPU the
  first matmul of a fresh thread costs milliseconds, which would swamp it.

The models are module-level classes, so spawned worker processes import them (this
module's folder is on ``sys.path`` when bench_map runs as a script, and spawn passes
``sys.path`` on).

Example:
    >>> import torch
    >>> Capped(limit=2)(torch.ones(2, WIDTH)).shape
    torch.Size([2, 256])
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for _common, imported as a script's sibling
import _common

import dpmethods
from dpmethods import DataParallel

__all__ = ["NAMES", "WIDTH", "Capped", "Measured", "Sleeper", "Tiny", "plot", "rows", "run"]

NAMES = ("checkpoint", "sigkill", "oom-split")
WIDTH = 256
_OOMS = [0]  # out-of-memory errors raised in this process (thread replicas share it)


class Tiny(nn.Module):
    """``Linear(16, 16)``: a map of it costs the map's own work, nearly all of it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class Sleeper(nn.Module):
    """``step`` sleeps ``delay`` seconds per batch; on the batch whose ``tag`` is ``at``,
    the first process to reach it writes ``time.monotonic()`` to ``marker`` and SIGKILLs
    itself (the batch run again finds the marker and runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    @dpmethods.parallel_method
    def step(self, x: torch.Tensor, tag: int = -1, marker: str = "", at: int = -1, delay: float = 0.0) -> Any:
        if marker and tag == at:
            try:
                fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                pass
            else:
                os.write(fd, repr(time.monotonic()).encode())  # CLOCK_MONOTONIC: system-wide
                os.close(fd)
                os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(delay)
        return self.lin(x)


class Capped(nn.Module):
    """A two-layer MLP of width ``WIDTH`` that raises ``torch.OutOfMemoryError`` for more
    than ``limit`` rows (before computing, as an allocation failing early would)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.limit:
            _OOMS[0] += 1
            raise torch.OutOfMemoryError(f"{x.shape[0]} rows do not fit (benchmark limit {self.limit})")
        return self.net(x)


@dataclass
class Measured:
    """One workload: seconds per pass of each path, per round, and its facts."""

    name: str
    items: dict[str, int]  # per path: the items of one pass
    times: dict[str, list[float]]
    cpu: dict[str, list[float]]
    facts: dict[str, Any] = field(default_factory=dict)



def _spread(xs: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(xs), "p10": _common.quantile(xs, 0.1), "p90": _common.quantile(xs, 0.9), "rounds": xs}


def _ratio(times: dict[str, list[float]], slow: str, fast: str, **bound: float) -> dict[str, Any]:
    """``slow``'s time over ``fast``'s, paired per round; ``at_most=`` or ``at_least=`` a target."""
    out: dict[str, Any] = {"faster": fast, "slower": slow, **bound, **_common.paired(times, slow, fast)}
    med = out["median"]
    out["met"] = (med <= bound["at_most"]) if "at_most" in bound else (med >= bound["at_least"]) if bound else None
    return out


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.allclose(x, y, rtol=1e-4, atol=1e-5) for x, y in zip(a, b))


def _interleave(
    paths: dict[str, Callable[[], Any]], rounds: int, pools: tuple[DataParallel, ...],
) -> tuple[dict[str, Any], dict[str, list[float]], dict[str, list[float]]]:
    """Each path once untimed (its outputs), then ``rounds`` rounds in balanced random orders
    (:func:`_common.interleave`). The worker pools of ``pools`` are closed at the end,
    whatever happens."""
    try:
        outputs = {p: fn() for p, fn in paths.items()}
        times, cpu = _common.interleave(paths, rounds)
    finally:
        for pool in pools:
            pool.close()
    return outputs, times, cpu


def _checkpoint(ids: list[Any], quick: bool, tmp: Path) -> Measured:
    n, size, rounds = (200, 8, 4) if quick else (1000, 8, 100)
    torch.manual_seed(0)
    model = Tiny().eval()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(size, 16, generator=g) for _ in range(n)]
    dp = DataParallel(model, device_ids=ids, cache_replicas=True)
    dpp = DataParallel(model, device_ids=ids, workers="processes")
    t0 = time.perf_counter()
    list(dpp.map("forward", []))  # a map of no batch starts the pool
    startup = time.perf_counter() - t0
    passes = [0]

    def fresh() -> str:
        passes[0] += 1
        return str(tmp / f"checkpoint-{passes[0]}.json")

    paths = {
        "one-device": lambda: [model(b) for b in batches],
        "map": lambda: list(dp.map("forward", batches)),
        "map-checkpoint": lambda: list(dp.map("forward", batches, checkpoint=fresh())),
        "map-processes": lambda: list(dpp.map("forward", batches)),
        "map-processes-checkpoint": lambda: list(dpp.map("forward", batches, checkpoint=fresh())),
    }
    outputs, times, cpu = _interleave(paths, rounds, (dpp,))
    facts = {
        "workload": f"nn.Linear(16, 16); {n} batches of {size} x 16; checkpoint= a fresh file per pass",
        "method": "forward", "devices": [str(i) for i in ids], "rounds": rounds,
        "startup_s": {"processes": startup},
        "targets": [_ratio(times, "map-checkpoint", "map", at_most=1.05),
                    _ratio(times, "map-processes-checkpoint", "map-processes", at_most=1.05)],
        "outputs_match_one_device": {p: _equal(o, outputs["one-device"]) for p, o in outputs.items() if p != "one-device"},
    }
    return Measured("checkpoint", dict.fromkeys(times, n * size), times, cpu, facts)


def _sigkill(ids: list[Any], quick: bool, tmp: Path) -> Measured:
    n, k, delay, rounds = (12, 5, 0.05, 2) if quick else (16, 6, 0.05, 6)
    torch.manual_seed(0)
    model = Sleeper().eval()
    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(4, 16, generator=g), "tag": i} for i in range(n)]
    dpp = DataParallel(model, device_ids=ids, workers="processes")
    t0 = time.perf_counter()
    list(dpp.map("step", []))
    startup = time.perf_counter() - t0
    kills: list[float] = []
    starts: list[float] = []

    def killed() -> list[torch.Tensor]:
        marker = tmp / f"kill-{len(kills)}"
        outs: dict[int, torch.Tensor] = {}
        for i, out in dpp.map("step", batches, ordered=False, marker=str(marker), at=k, delay=delay):
            outs[i] = out
            if i == k:
                kills.append(time.monotonic() - float(marker.read_text()))
        return [outs[i] for i in range(n)]

    def pool_start() -> list[torch.Tensor]:
        fresh = DataParallel(model, device_ids=ids, workers="processes")
        t0 = time.perf_counter()
        list(fresh.map("step", []))
        starts.append(time.perf_counter() - t0)
        fresh.close()
        return []

    paths = {
        "one-device": lambda: [model.step(b["x"], delay=delay) for b in batches],
        "map-processes": lambda: [o for _, o in sorted(dpp.map("step", batches, ordered=False, delay=delay), key=lambda io: io[0])],
        "map-processes-kill": killed,
        "pool-start": pool_start,
    }
    outputs, times, cpu = _interleave(paths, rounds, (dpp,))
    for d in (times, cpu, outputs):
        d.pop("pool-start")
    facts = {
        "workload": f"Linear(16, 16) sleeping {delay} s per batch; {n} batches of 4 x 16, unordered; "
        f"the worker running batch {k} SIGKILLs itself in each pass (retries=1)",
        "method": "step", "devices": [str(i) for i in ids], "rounds": rounds,
        "startup_s": {"processes": startup},
        "kill_to_output_s": _spread(kills[1:]),  # the first: the untimed pass, same as the others
        "kill_to_output_s_untimed_pass": kills[0],
        "pool_start_s": _spread(starts[1:]),
        "targets": [_ratio(times, "map-processes-kill", "map-processes")],
        "outputs_match_one_device": {p: _equal(o, outputs["one-device"]) for p, o in outputs.items() if p != "one-device"},
    }
    return Measured("sigkill", dict.fromkeys(times, n * 4), times, cpu, facts)


def _joined(outs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.cat(outs[i : i + 2]) for i in range(0, len(outs), 2)]


def _oom_split(ids: list[Any], quick: bool, tmp: Path) -> Measured:
    n, limit, rounds, reps = (40, 32, 4, 10) if quick else (200, 32, 30, 50)
    model = Capped(limit).eval()
    g = torch.Generator().manual_seed(2)
    batches = [torch.randn(2 * limit, WIDTH, generator=g) for _ in range(n)]
    halves = [h for b in batches for h in b.split(limit)]
    first, first_halves = batches[:1], halves[:2]
    dp = DataParallel(model, device_ids=ids, cache_replicas=True)
    dpp = DataParallel(model, device_ids=ids, workers="processes")
    dpp1 = DataParallel(model, device_ids=ids[:1], workers="processes")
    list(dpp.map("forward", []))
    list(dpp1.map("forward", []))
    ooms: set[int] = set()

    def split() -> list[torch.Tensor]:
        before = _OOMS[0]
        outs = list(dp.map("forward", batches, on_oom="split"))
        ooms.add(_OOMS[0] - before)
        return outs

    def split_first() -> list[torch.Tensor]:
        return [o for _ in range(reps) for o in dpp1.map("forward", first, on_oom="split")][:1]

    def pre_split_first() -> list[torch.Tensor]:
        return [o for _ in range(reps) for o in _joined(list(dpp1.map("forward", first_halves)))][:1]

    paths = {
        "one-device": lambda: [model.net(b) for b in batches],
        "split": split,
        "pre-split": lambda: _joined(list(dp.map("forward", halves))),
        "split-processes": lambda: list(dpp.map("forward", batches, on_oom="split")),
        "pre-split-processes": lambda: _joined(list(dpp.map("forward", halves))),
        "split-first-processes": split_first,
        "pre-split-first-processes": pre_split_first,
    }
    outputs, times, cpu = _interleave(paths, rounds, (dpp, dpp1))
    reference = outputs["one-device"]
    facts = {
        "workload": f"MLP width {WIDTH} raising torch.OutOfMemoryError above {limit} rows; {n} batches of "
        f"{2 * limit} rows (split-first: {reps} maps of one batch on one worker process)",
        "method": "forward", "devices": [str(i) for i in ids], "rounds": rounds, "startup_s": {},
        "out_of_memory_errors_per_split_map": sorted(ooms),  # on threads, counted
        "targets": [_ratio(times, "split", "pre-split"), _ratio(times, "split-processes", "pre-split-processes"),
                    _ratio(times, "split-first-processes", "pre-split-first-processes")],
        "outputs_match_one_device": {
            p: _equal(o, reference[: len(o)]) for p, o in outputs.items() if p != "one-device"
        },
    }
    items = {p: (reps if "first" in p else n) * 2 * limit for p in times}
    return Measured("oom-split", items, times, cpu, facts)


def run(ids: list[Any], quick: bool, only: list[str] | None) -> list[Measured]:
    """The long-run workloads named in ``only`` (all when None), on CPU devices ``ids``."""
    makers = {"checkpoint": _checkpoint, "sigkill": _sigkill, "oom-split": _oom_split}
    done = []
    with torch.no_grad(), tempfile.TemporaryDirectory(prefix="bench_map_long_") as tmp:
        for name, make in makers.items():
            if only is None or name in only:
                done.append(make(ids, quick, Path(tmp)))
    return done


def rows(facts: dict[str, Any]) -> list[str]:
    """Markdown rows of the kill-to-output and pool start-up times, when measured."""
    x = facts.get("sigkill")
    if x is None:
        return []
    out = ["", "| sigkill | seconds, median (p10-p90) |", "|---|---:|"]
    for label, key in (("SIGKILL to the retried batch's output", "kill_to_output_s"),
                       ("a fresh 2-worker pool's start-up", "pool_start_s")):
        s = x[key]
        out.append(f"| {label} | {s['median']:.2f} ({s['p10']:.2f}-{s['p90']:.2f}) |")
    return out


def plot(facts: dict[str, Any], times: dict[str, dict[str, list[float]]], path: Path, title: str) -> None:
    """Pass times (median, p10-p90) per path, one panel per long-run workload, with the
    paired ratios in the titles; the kill-to-output and start-up times beside them."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in NAMES if n in facts]
    if not names:
        return
    fig, axes = plt.subplots(1, len(names), figsize=(5.2 * len(names), 4.4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        ts = dict(times[name])
        if name == "sigkill":
            ts["kill-to-output"] = facts[name]["kill_to_output_s"]["rounds"]
            ts["pool-start"] = facts[name]["pool_start_s"]["rounds"]
        meds = [statistics.median(v) for v in ts.values()]
        lo = [m - _common.quantile(v, 0.1) for m, v in zip(meds, ts.values())]
        hi = [_common.quantile(v, 0.9) - m for m, v in zip(meds, ts.values())]
        colors = {"one-device": "tab:gray", "kill-to-output": "tab:red", "pool-start": "tab:orange"}
        ax.bar(range(len(ts)), meds, yerr=[lo, hi], capsize=3,
               color=[colors.get(p, "tab:blue" if "processes" in p else "tab:green") for p in ts])
        ax.set_yscale("log")
        ax.set_xticks(range(len(ts)))
        ax.set_xticklabels(list(ts), fontsize=7, rotation=25)
        ax.set_ylabel("seconds per pass (median, p10-p90)" if name != "sigkill" else "seconds (median, p10-p90)",
                      fontsize=8)
        ratios = "\n".join(f"{t['slower']} / {t['faster']}: {t['median']:.3f}x (paired)"
                           for t in facts[name]["targets"])
        ax.set_title(f"{name}\n{ratios}", fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    where = title.split("threads and processes, ", 1)[-1]  # bench_map's title: devices, torch, load
    fig.suptitle(f"dpmethods long maps: checkpoint=, a SIGKILLed worker, on_oom='split'; {where}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
