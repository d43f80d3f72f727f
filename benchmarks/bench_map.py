"""Throughput of ``dp.map`` against a loop of ``dp.method`` calls and a one-device loop.

Two workloads, each a list of batches run to the end by every path:

- ``ragged``: ``generate`` of a small random GPT-2 (matmuls dominate a step), greedy,
  where every prompt stops at its own length (a StoppingCriteria reads each row's
  target length from its first token, so splitting a batch keeps it), so some
  sequences run several times longer than others;
- ``uniform``: ``forward`` of a random BERT encoder on batches of one shape.

Paths, interleaved round by round (the order rotates each round, so drift of the
shared host hits them alike):

- ``map``        ``list(dp.map(method, batches))``: each batch whole on the first free replica;
- ``lock-step``  ``[dp.method(**b) for b in batches]``: every batch split over every replica;
- ``one-device`` ``[model.method(**b) for b in batches]`` on the first device, on the CPU
  with ``--one-device-threads`` torch threads (default: one replica's, ``--threads``; on
  this busy 2-core host two OpenMP threads made the ragged loop 15x slower, 104 s
  against 6.9 s a pass, so "all cores" is an option, not the default).

It reports per path the median pass time and throughput with p10/p90, the paired
per-round ratio ``lock-step time / map time`` against the targets (ragged >= 1.25,
uniform >= 0.95), whether ``map``'s outputs equal the one-device loop's, and writes
``map_<device>.json`` and ``.png``.

Run: ``PYTHONPATH=. python benchmarks/bench_map.py [--quick] [--device cpu|cuda] [--out DIR]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for _common, run as a script
import _common

import dpmethods
from dpmethods import DataParallel

__all__ = ["Figure", "main", "run"]

PATHS = ("map", "lock-step", "one-device")
TARGETS = {"ragged": 1.25, "uniform": 0.95}  # lock-step time / map time, at least
PROMPT, PAD, VOCAB = 8, 1, 4096


@dataclass
class Figure:
    """One path on one workload: seconds per pass over all batches, summarized."""

    workload: str
    path: str
    median_s: float
    p10_s: float
    p90_s: float
    iqr_s: float
    items: int
    items_per_s: float
    rounds: list[float] = field(default_factory=list)
    cpu_rounds: list[float] = field(default_factory=list)  # process CPU seconds per pass


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


class _RowStop:
    """Stop each row at its own length, read from its first prompt token (so a split
    batch keeps every row's length): ``PROMPT + 4 + first_token % spread`` tokens."""

    def __init__(self, spread: int) -> None:
        self.spread = spread

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        target = PROMPT + 4 + input_ids[:, 0] % self.spread
        return input_ids.shape[1] >= target


def _ragged(device: torch.device, quick: bool) -> dict[str, Any]:
    import transformers
    from transformers import StoppingCriteria, StoppingCriteriaList

    stop = type("RowStop", (_RowStop, StoppingCriteria), {})(spread=44)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=128, n_embd=512, n_layer=4, n_head=8,
        bos_token_id=0, eos_token_id=PAD, pad_token_id=PAD,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval().to(device)
    g = torch.Generator().manual_seed(0)
    n, size = (6, 4) if quick else (12, 4)
    batches = [
        {"input_ids": torch.randint(2, VOCAB, (size, PROMPT), generator=g).to(device)}
        for _ in range(n)
    ]
    kwargs = {
        "do_sample": False, "pad_token_id": PAD, "max_new_tokens": 64,
        "stopping_criteria": StoppingCriteriaList([stop]),
    }
    return {
        "model": model, "method": "generate", "batches": batches, "kwargs": kwargs,
        "items": n * size, "options": {"generate": {"gather": "pad", "pad_value": PAD}},
        "describe": f"GPT-2 n_embd 512, 4 layers, vocab {VOCAB}; {n} batches of {size} "
        f"prompts of {PROMPT} tokens, greedy, each row stopping after 4..{3 + stop.spread} "
        "new tokens",
    }


def _uniform(device: torch.device, quick: bool) -> dict[str, Any]:
    import transformers

    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=1024, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval().to(device)
    g = torch.Generator().manual_seed(1)
    n, size, seq = (6, 32, 64) if quick else (12, 32, 64)
    batches = [
        {
            "input_ids": torch.randint(0, VOCAB, (size, seq), generator=g).to(device),
            "attention_mask": torch.ones(size, seq, dtype=torch.long, device=device),
        }
        for _ in range(n)
    ]
    return {
        "model": model, "method": "forward", "batches": batches, "kwargs": {},
        "items": n * size, "options": None,
        "describe": f"BERT hidden 256, 4 layers; {n} batches of {size} x {seq} tokens",
    }


def _same(a: Any, b: Any) -> bool:
    a = a.last_hidden_state if hasattr(a, "last_hidden_state") else a
    b = b.last_hidden_state if hasattr(b, "last_hidden_state") else b
    if a.dtype.is_floating_point:
        return bool(torch.allclose(a.cpu(), b.cpu(), rtol=1e-4, atol=1e-5))
    return bool(torch.equal(a.cpu(), b.cpu()))


def _devices(kind: str) -> list[Any]:
    if kind == "cuda":
        count = torch.cuda.device_count()
        return list(range(count)) if count > 1 else [0, 0]  # repeated ids: two replicas, one GPU
    return ["cpu"] * 2


def _paths(
    w: dict[str, Any], dp: DataParallel, device: str, per_replica: int, one_device_threads: int
) -> dict[str, Callable[[], Any]]:
    model, method, batches, kwargs = w["model"], w["method"], w["batches"], w["kwargs"]
    call = model if method == "forward" else getattr(model, method)
    dcall = dp if method == "forward" else getattr(dp, method)

    def one_device() -> Any:
        if device == "cpu":
            torch.set_num_threads(one_device_threads)
        try:
            return [call(**b, **kwargs) for b in batches]
        finally:
            if device == "cpu":
                torch.set_num_threads(per_replica)

    return {
        "map": lambda: list(dp.map(method, batches, **kwargs)),
        "lock-step": lambda: [dcall(**b, **kwargs) for b in batches],
        "one-device": one_device,
    }


def _measure(
    name: str, w: dict[str, Any], ids: list[Any], device: str, rounds: int, threads: tuple[int, int]
) -> tuple[list[Figure], dict[str, Any]]:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    dp = DataParallel(w["model"], device_ids=ids, methods=w["options"], cache_replicas=True)
    per_replica = threads[0] if threads[0] > 0 else torch.get_num_threads()
    paths = _paths(w, dp, device, per_replica, threads[1] if threads[1] > 0 else per_replica)
    times: dict[str, list[float]] = {p: [] for p in paths}
    cpu: dict[str, list[float]] = {p: [] for p in paths}
    order = list(paths.items())
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes on attention masks
        reference = paths["one-device"]()
        outputs = {p: fn() for p, fn in paths.items() if p != "one-device"}  # and warm-up
        sync()
        for r in range(rounds):
            for p, fn in order[r % len(order) :] + order[: r % len(order)]:
                t0, c0 = time.perf_counter(), time.process_time()
                fn()
                sync()
                times[p].append(time.perf_counter() - t0)
                cpu[p].append(time.process_time() - c0)
    figures = []
    for p, ts in times.items():
        med = statistics.median(ts)
        figures.append(
            Figure(
                name, p, med, _quantile(ts, 0.1), _quantile(ts, 0.9),
                _quantile(ts, 0.75) - _quantile(ts, 0.25), w["items"], w["items"] / med,
                rounds=ts, cpu_rounds=cpu[p],
            )
        )
    ratios = sorted(a / b for a, b in zip(times["lock-step"], times["map"], strict=True))
    med = {p: statistics.median(ts) for p, ts in times.items()}
    facts = {
        "workload": w["describe"],
        "method": w["method"],
        "devices": [str(i) for i in ids],
        "rounds": rounds,
        "ratio_lockstep_over_map": statistics.median(ratios),
        "ratio_p10": _quantile(ratios, 0.1),
        "ratio_p90": _quantile(ratios, 0.9),
        "ratio_of_medians": med["lock-step"] / med["map"],
        "target": TARGETS[name],
        "met": statistics.median(ratios) >= TARGETS[name],
        "one_device_over_map": med["one-device"] / med["map"],
        # CPU seconds spent per pass: on a host shared with other work (where a pass may
        # get less than one core) this shows each path's cost better than the wall clock.
        "cpu_lockstep_over_map": statistics.median(cpu["lock-step"]) / statistics.median(cpu["map"]),
        "cpu_one_device_over_map": statistics.median(cpu["one-device"]) / statistics.median(cpu["map"]),
        "cores_used": {p: statistics.median(c / t for c, t in zip(cpu[p], times[p])) for p in paths},
        "outputs_match_one_device": {
            p: all(_same(a, b) for a, b in zip(outs, reference, strict=True))
            for p, outs in outputs.items()
        },
        "new_tokens_per_batch": (
            [int(o.shape[1]) - PROMPT for o in reference] if name == "ragged" else None
        ),
    }
    return figures, facts


def run(device: str, quick: bool, threads: tuple[int, int] = (1, 0)) -> tuple[list[Figure], dict[str, Any]]:
    """Time every path on both workloads; return the figures and facts per workload."""
    ids = _devices(device)
    dev = torch.device("cuda", ids[0]) if device == "cuda" else torch.device("cpu")
    figures: list[Figure] = []
    facts: dict[str, Any] = {}
    for name, make in (("ragged", _ragged), ("uniform", _uniform)):
        # The uniform passes are short and the host is shared: more rounds for its median.
        rounds = (3 if quick else 5) * (2 if name == "uniform" else 1)
        figs, facts[name] = _measure(name, make(dev, quick), ids, device, rounds, threads)
        figures += figs
    return figures, facts


def table(figures: list[Figure], facts: dict[str, Any]) -> str:
    """A markdown table: one row per workload and path, and the ratio against the target."""
    rows = [
        "| workload | path | pass s (p10-p90) | items/s | lock-step / map (paired p10-p90) | target |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for f in figures:
        ratio = target = ""
        if f.path == "map":
            x = facts[f.workload]
            verdict = "met" if x["met"] else "NOT met"
            ratio = f"**{x['ratio_lockstep_over_map']:.2f}x** ({x['ratio_p10']:.2f}-{x['ratio_p90']:.2f})"
            target = f">= {x['target']} ({verdict})"
        rows.append(
            f"| {f.workload} | {f.path} | {f.median_s:.2f} ({f.p10_s:.2f}-{f.p90_s:.2f}) | "
            f"{f.items_per_s:.1f} | {ratio} | {target} |"
        )
    return "\n".join(rows)


def plot(figures: list[Figure], facts: dict[str, Any], path: Path, title: str) -> None:
    """Throughput bars (median, p10-p90 whiskers), one panel per workload."""
    try:
        import matplotlib
    except ImportError:
        print("no matplotlib (pip install matplotlib): no plot", file=sys.stderr)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(f.workload for f in figures))
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.2 * len(workloads), 4.2))
    for ax, wl in zip(axes if len(workloads) > 1 else [axes], workloads, strict=True):
        sub = [f for f in figures if f.workload == wl]
        ys = [f.items_per_s for f in sub]
        lo = [f.items_per_s - f.items / f.p90_s for f in sub]
        hi = [f.items / f.p10_s - f.items_per_s for f in sub]
        colors = ["tab:green" if f.path == "map" else "tab:gray" for f in sub]
        ax.bar(range(len(sub)), ys, yerr=[lo, hi], capsize=3, color=colors)
        ax.set_xticks(range(len(sub)))
        ax.set_xticklabels([f.path for f in sub], fontsize=8)
        ax.set_ylabel("items per second (median, p10-p90)")
        x = facts[wl]
        ax.set_title(
            f"{wl}: lock-step/map {x['ratio_lockstep_over_map']:.2f}x (target {x['target']})",
            fontsize=9,
        )
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches and rounds")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads per replica on the CPU (default 1: two replicas on two "
        "cores); 0 keeps torch's default",
    )
    parser.add_argument(
        "--one-device-threads",
        type=int,
        default=0,
        help="torch threads of the one-device loop on the CPU (default: --threads)",
    )
    parser.add_argument("--from-json", type=Path, help="redraw the table and plot of a saved run")
    args = parser.parse_args(argv)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        figures = [Figure(**f) for f in saved["figures"]]
        print(table(figures, saved["workloads"]))
        plot(figures, saved["workloads"], args.from_json.with_suffix(".png"), saved["title"])
        return 0
    try:
        import transformers
    except ImportError:
        print("bench_map needs transformers (pip install transformers)", file=sys.stderr)
        return 2
    transformers.logging.set_verbosity_error()  # its notes on attention masks, once per call
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is available", file=sys.stderr)
        return 2
    if args.device == "cpu" and args.threads > 0:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    figures, facts = run(args.device, args.quick, (args.threads, args.one_device_threads))
    print(table(figures, facts))
    for name, x in facts.items():
        print(f"{name}: outputs equal to the one-device loop: {x['outputs_match_one_device']}")
        cores = ", ".join(f"{p} {c:.2f}" for p, c in x["cores_used"].items())
        print(f"{name}: CPU seconds lock-step/map {x['cpu_lockstep_over_map']:.2f}, "
              f"one-device/map {x['cpu_one_device_over_map']:.2f}; cores used: {cores}")
    info = _common.machine_info()
    info.update(threads_per_replica=args.threads, one_device_threads=args.one_device_threads or args.threads,
                dpmethods=dpmethods.__version__, loadavg_before=load_before,
                loadavg_after=os.getloadavg(), wall_s=time.perf_counter() - t0)
    title = (f"dpmethods DataParallel.map, {args.device} x{len(_devices(args.device))}, torch "
             f"{torch.__version__}, load {load_before[0]:.1f}")
    result = {"machine": info, "quick": args.quick, "title": title, "workloads": facts,
              "figures": [asdict(f) for f in figures]}
    json_path = args.out / f"map_{args.device}.json"
    _common.write_json(json_path, result)
    plot(figures, facts, json_path.with_suffix(".png"), title)
    print(f"wrote {json_path} and {json_path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
