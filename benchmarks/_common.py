"""Shared helpers for the dpmethods benchmarks: timing, machine facts, JSON, plots.

Example:
    >>> import torch
    >>> from benchmarks._common import time_fn
    >>> stats = time_fn(lambda: torch.ones(8).sum(), warmup=2, repeat=5)
    >>> sorted(stats) == sorted(["median", "p10", "p90", "q1", "q3", "iqr", "mean", "min", "n"])
    True
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import random
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CODE",
    "LOCKSTEP_ENV",
    "MIN_ROUNDS",
    "copy_bandwidth",
    "cuda_sync",
    "finished_run",
    "gate",
    "interleave",
    "library_root",
    "machine_info",
    "orders",
    "paired",
    "plot_ratios",
    "provenance",
    "provenance_line",
    "quantile",
    "ratios",
    "started_run",
    "summarize",
    "time_fn",
    "verdict",
    "write_json",
]

_ROOT = Path(__file__).resolve().parent.parent
# What a benchmark measures: a result is of a commit only if none of these differed from it.
LIBRARY = ("dpmethods", "csrc", "setup.py", "pyproject.toml")
SCRIPTS = ("benchmarks/*.py", "benchmarks/*.sh")
CODE = LIBRARY + SCRIPTS


def _quantile(sorted_xs: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of an already sorted sequence."""
    if len(sorted_xs) == 1:
        return sorted_xs[0]
    pos = q * (len(sorted_xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile ``q`` (0 to 1) of ``xs``, in any order.

    Example:
        >>> quantile([3.0, 1.0, 2.0], 0.5)
        2.0
    """
    return _quantile(sorted(xs), q)


MIN_ROUNDS = 5  # fewer paired rounds than this give a median, but no verdict on a target
LOCKSTEP_ENV = "DPMETHODS_BENCH_LOCKSTEP"  # "<read fd>,<write fd>": set by _compare.py for its children


def gate(label: str) -> None:
    """Wait here for a go from the driver of a before/after comparison (``_compare.py``),
    after telling it that this run reached ``label``; a no-op in a run of its own. The
    driver lets one run go at a time, so everything between two gates (a round, and
    the setup before the next) runs alone on the host, back to back with the other
    code's same stretch."""
    fds = os.environ.get(LOCKSTEP_ENV)
    if not fds:
        return
    read_fd, write_fd = (int(x) for x in fds.split(","))
    os.write(write_fd, f"ready {label}\n".encode())
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(read_fd, 1)
        if not chunk:
            raise RuntimeError(f"{LOCKSTEP_ENV}: the comparison's driver went away at {label!r}")
        line += chunk
    if line != b"go\n":
        raise RuntimeError(f"{LOCKSTEP_ENV}: expected 'go' from the driver at {label!r}, got {line!r}")


def orders(k: int, rounds: int, seed: int = 0) -> list[list[int]]:
    """The order of ``k`` paths in each of ``rounds`` rounds: random, and balanced. Every
    ``k`` rounds are the rows of a fresh random Latin square, so that each path runs once
    in each position (a path timed first, after idle cores, or last, after the others'
    work, is not one path more often than another), and the path a path follows changes
    from square to square and, for four paths or more, from round to round (a rotation
    would keep each one after the same one: a thread map after a process map's busy
    workers, say, a bias no pairing removes).

    Example:
        >>> [sorted(col) for col in zip(*orders(3, 3))]
        [[0, 1, 2], [0, 1, 2], [0, 1, 2]]
    """
    rng = random.Random(seed)
    out: list[list[int]] = []
    while len(out) < rounds:
        cols, rows, names = (rng.sample(range(k), k) for _ in range(3))
        while k >= 4 and len({(b - a) % k for a, b in itertools.pairwise(cols)}) == 1:
            cols = rng.sample(range(k), k)  # evenly spaced columns: every row a rotation of one
        out += [[names[(i + c) % k] for c in cols] for i in rows]
    return out[:rounds]


def interleave(
    paths: dict[str, Callable[[], Any]], rounds: int, sync: Callable[[], Any] = lambda: None,
    *, calls: int = 1, label: str = "",
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """The benchmarks' one timing loop: each path runs a block of ``calls`` calls once per
    round, for ``rounds`` rounds, in the balanced random orders of :func:`orders`.
    Returns each path's wall seconds and this process's CPU seconds per call, one per
    round, in round order, for :func:`paired` to pair. Each round first passes a
    :func:`gate` named by ``label`` (default: the paths) and the round.

    Example:
        >>> times, cpu = interleave({"a": lambda: None, "b": lambda: None}, 3, calls=2)
        >>> len(times["a"]), len(cpu["b"])
        (3, 3)
    """
    times: dict[str, list[float]] = {p: [] for p in paths}
    cpu: dict[str, list[float]] = {p: [] for p in paths}
    items = list(paths.items())
    name = label or "/".join(paths)
    for r, order in enumerate(orders(len(items), rounds)):
        gate(f"{name} round {r}")
        for p, fn in (items[i] for i in order):
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(calls):
                fn()
            sync()
            times[p].append((time.perf_counter() - t0) / calls)
            cpu[p].append((time.process_time() - c0) / calls)
    return times, cpu


def ratios(times: dict[str, list[float]], slower: str, faster: str) -> list[float]:
    """``slower``'s time over ``faster``'s, round by round (in round order): the paired
    ratios of an :func:`interleave` (above 1: ``faster`` is faster).

    Example:
        >>> ratios({"a": [2.0, 3.0], "b": [1.0, 2.0]}, "a", "b")
        [2.0, 1.5]
    """
    return [s / f for s, f in zip(times[slower], times[faster], strict=True)]


def paired(times: dict[str, list[float]], slower: str, faster: str) -> dict[str, Any]:
    """The median of the paired ratios :func:`ratios` and their p10-p90, and how many
    rounds: never a ratio of two medians, or of quantiles of unpaired samples.

    Example:
        >>> paired({"a": [2.0, 3.0, 4.0], "b": [1.0, 2.0, 2.0]}, "a", "b")
        {'median': 2.0, 'p10': 1.6, 'p90': 2.0, 'rounds': 3}
    """
    rs = sorted(ratios(times, slower, faster))
    return {"median": statistics.median(rs), "p10": _quantile(rs, 0.1), "p90": _quantile(rs, 0.9),
            "rounds": len(rs)}


def verdict(met: bool | None, rounds: int) -> str:
    """A target's verdict: none without a target, none on fewer than :data:`MIN_ROUNDS`
    paired rounds, else met or not.

    Example:
        >>> verdict(True, 3), verdict(False, 6)
        ('too few rounds', 'NOT met')
    """
    if met is None:
        return "no target"
    if rounds < MIN_ROUNDS:
        return "too few rounds"
    return "met" if met else "NOT met"


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """Median, p10/p90, quartiles/IQR, mean, min and count of ``samples`` (seconds).

    Args:
        samples: one timing per repeat, in seconds.

    Example:
        >>> summarize([1.0, 2.0, 3.0])["median"]
        2.0
    """
    xs = sorted(samples)
    q1, q3 = _quantile(xs, 0.25), _quantile(xs, 0.75)
    return {
        "median": _quantile(xs, 0.5),
        "p10": _quantile(xs, 0.1),
        "p90": _quantile(xs, 0.9),
        "q1": q1,
        "q3": q3,
        "iqr": q3 - q1,
        "mean": statistics.fmean(xs),
        "min": xs[0],
        "n": float(len(xs)),
    }


def cuda_sync() -> None:
    """Synchronize every visible CUDA device (no-op without CUDA)."""
    if torch.cuda.is_available():
        for d in range(torch.cuda.device_count()):
            torch.cuda.synchronize(d)


def time_fn(
    fn: Callable[[], Any],
    warmup: int,
    repeat: int,
    sync: Callable[[], None] | None = None,
    *,
    cuda_events: bool = False,
    setup: Callable[[int], Any] | None = None,
) -> dict[str, float]:
    """Time ``fn`` ``repeat`` times after ``warmup`` untimed calls.

    Args:
        fn: the work to time; its result is dropped after each call.
        warmup: untimed calls first (allocator, caches, lazy init).
        repeat: timed calls.
        sync: called before starting and after each call on the host clock, e.g.
            ``torch.cuda.synchronize`` so asynchronous work is counted.
        cuda_events: time on the current CUDA stream with events instead of the
            host clock (the events are synchronized after each call).
        setup: called untimed with the repeat index before each call, e.g. to
            rotate inputs so caches do not flatter the result.

    Returns:
        :func:`summarize` of the per-call times in seconds.

    Example:
        >>> time_fn(lambda: None, warmup=1, repeat=3)["n"]
        3.0
    """
    for i in range(warmup):
        if setup is not None:
            setup(i)
        fn()
    if sync is not None:
        sync()
    samples: list[float] = []
    for i in range(repeat):
        if setup is not None:
            setup(warmup + i)
        if cuda_events:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            if sync is not None:
                sync()
            samples.append(time.perf_counter() - t0)
    return summarize(samples)


def copy_bandwidth(
    device: torch.device, nbytes: int = 256 << 20, repeat: int = 5
) -> dict[str, float]:
    """Measured copy bandwidth on ``device`` in GB/s of bytes written.

    Args:
        device: where to copy a ``nbytes`` float32 tensor.
        nbytes: size of the tensor.
        repeat: timed copies.

    Returns:
        ``gbps`` (median, ``dst.copy_(src)`` into preallocated memory: the machine's
        memory bandwidth), ``p10``/``p90`` of it, ``clone_gbps`` (``src.clone()``, which
        also pays for fresh pages like any gather into new memory) and ``nbytes``.
    """
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    is_cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if is_cuda else None
    copy = time_fn(lambda: dst.copy_(src), 2, repeat, sync, cuda_events=is_cuda)
    clone = time_fn(lambda: src.clone(), 2, repeat, sync, cuda_events=is_cuda)
    return {
        "gbps": nbytes / copy["median"] / 1e9,
        "p10": nbytes / copy["p90"] / 1e9,
        "p90": nbytes / copy["p10"] / 1e9,
        "clone_gbps": nbytes / clone["median"] / 1e9,
        "nbytes": float(nbytes),
    }


def _git(*args: str, cwd: Path = _ROOT) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def library_root() -> Path:
    """The checkout whose dpmethods this process imported (through ``PYTHONPATH`` it may
    be another than the benchmark scripts')."""
    import dpmethods

    return Path(dpmethods.__file__).resolve().parent.parent


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance() -> dict[str, Any]:
    """What a result was measured on: ``commit`` (git HEAD of the checkout whose dpmethods
    was imported, None outside one), ``uncommitted_code`` (code files, :data:`CODE`, that
    differ from their commit: a run with any measured code of no commit), ``host`` (the
    machine's name) and ``cpu_model``; and ``benchmarks_commit``, the scripts' own HEAD,
    when they ran from another checkout than the library's (a before/after comparison).

    Example:
        >>> sorted(provenance())
        ['commit', 'cpu_model', 'host', 'uncommitted_code']
    """
    lib = library_root()
    head = _git("rev-parse", "HEAD", cwd=lib)
    changed = _git("status", "--porcelain", "--untracked-files=no", "--", *(CODE if lib == _ROOT else LIBRARY),
                   cwd=lib)
    if lib != _ROOT and changed is not None:
        scripts = _git("status", "--porcelain", "--untracked-files=no", "--", *SCRIPTS)
        changed = None if scripts is None else changed + scripts
    out: dict[str, Any] = {
        "commit": head.strip() if head else None,
        "uncommitted_code": None if changed is None else [line[3:] for line in changed.splitlines()],
        "host": platform.node(),
        "cpu_model": _cpu_model(),
    }
    if lib != _ROOT:
        scripts_head = _git("rev-parse", "HEAD")
        out["benchmarks_commit"] = scripts_head.strip() if scripts_head else None
    return out


def started_run() -> dict[str, Any]:
    """The start of a run: its UTC time and load average (read by :func:`finished_run`)."""
    return {"started": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "loadavg_before": list(os.getloadavg()), "t0": time.perf_counter()}


def finished_run(start: dict[str, Any]) -> dict[str, Any]:
    """``started``, ``loadavg_before``, ``loadavg_after`` and ``wall_s`` of a run begun with
    :func:`started_run`, to merge into its ``machine`` record."""
    return {"started": start["started"], "loadavg_before": start["loadavg_before"],
            "loadavg_after": list(os.getloadavg()), "wall_s": time.perf_counter() - start["t0"]}


def provenance_line(machine: dict[str, Any]) -> str:
    """One paragraph naming the commit, the host and the conditions of a saved run, for
    the README beside the tables drawn from it.

    Example:
        >>> provenance_line({"commit": "0123456789abcdef", "host": "box", "cpu_model": "CPU X",
        ...                  "cpu_count": 2, "torch": "2.4.0", "wall_s": 61.0,
        ...                  "loadavg_before": [0.5, 0, 0], "loadavg_after": [1.25, 0, 0]})
        'Measured at commit 0123456 on box (CPU X, 2 CPUs, torch 2.4.0), in 61 s, load average 0.5 at its start and 1.2 at its end.'
    """
    host = machine.get("host") or "an unnamed host"
    facts = ", ".join(filter(None, [machine.get("cpu_model"), f"{machine.get('cpu_count')} CPUs",
                                    f"torch {machine.get('torch')}"]))
    parts = [f"Measured at commit {str(machine.get('commit'))[:7]} on {host} ({facts})"]
    if machine.get("started"):
        parts.append(f"started {machine['started']}")
    if machine.get("wall_s") is not None:
        parts.append(f"in {machine['wall_s']:.0f} s")
    loads = [f"{machine[k][0]:.1f} at its {w}" for k, w in (("loadavg_before", "start"), ("loadavg_after", "end"))
             if machine.get(k)]
    if loads:
        parts.append(f"load average {' and '.join(loads)}")
    return ", ".join(parts) + "."


def machine_info() -> dict[str, Any]:
    """Platform, CPU count, torch version, GPU names and :func:`provenance`, for benchmark JSON."""
    info: dict[str, Any] = {
        **provenance(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_num_threads": torch.get_num_threads(),
        "gpus": [],
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(d) for d in range(torch.cuda.device_count())]
    return info


def write_json(path: str | os.PathLike[str], data: Any) -> Path:
    """Write ``data`` as indented JSON, creating parent directories; returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    return p


def plot_ratios(
    path: str | os.PathLike[str],
    labels: Sequence[str],
    ratios: Sequence[float],
    *,
    lows: Sequence[float] | None = None,
    highs: Sequence[float] | None = None,
    title: str = "",
    ylabel: str = "speedup (baseline time / ours)",
) -> Path | None:
    """Bar chart of speedups (log scale) with optional spread whiskers; None without matplotlib.

    Args:
        path: PNG file to write.
        labels: one label per bar.
        ratios: one speedup per bar (> 1 means faster than the baseline).
        lows: optional lower ends of the spread (same length as ratios).
        highs: optional upper ends of the spread.
        title: figure title.
        ylabel: y axis label.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    # Long grids wrap onto several rows so labels stay readable.
    per_row = 60
    nrows = max(1, -(-len(labels) // per_row))
    width = max(6.0, 0.22 * min(len(labels), per_row) + 2)
    fig, axes = plt.subplots(nrows, 1, figsize=(width, 3.6 * nrows), squeeze=False)
    for row in range(nrows):
        ax = axes[row][0]
        sl = slice(row * per_row, (row + 1) * per_row)
        rs = list(ratios[sl])
        xs = list(range(len(rs)))
        yerr = None
        if lows is not None and highs is not None:
            yerr = [
                [max(r - lo, 0.0) for r, lo in zip(rs, lows[sl], strict=True)],
                [max(hi - r, 0.0) for r, hi in zip(rs, highs[sl], strict=True)],
            ]
        colors = ["tab:green" if r >= 1 else "tab:red" for r in rs]
        ax.bar(xs, rs, color=colors, yerr=yerr, capsize=1.5)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_xticks(xs)
        ax.set_xticklabels(list(labels[sl]), rotation=90, fontsize=6)
        ax.set_ylabel(ylabel, fontsize=7)
    axes[0][0].set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(p, dpi=130)
    plt.close(fig)
    return p
