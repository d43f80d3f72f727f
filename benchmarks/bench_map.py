"""Throughput of ``dp.map`` and of calls, on threads and on processes, against one device.

Workloads, each a list of batches run to the end by every path:

- ``gil``: greedy ``generate`` of a tiny random GPT-2 (Python-bound: the interpreter's
  loop over tokens and layers costs more than the matmuls), 16 batches of 4 prompts, 24
  new tokens;
- ``ragged``: ``generate`` of a small random GPT-2 (matmuls dominate a step), greedy,
  where every prompt stops at its own length (a StoppingCriteria reads each row's
  target length from its first token, so splitting a batch keeps it);
- ``uniform``: ``forward`` of a random BERT encoder on batches of one shape;
- ``encode`` (needs sentence-transformers): ``SentenceTransformer.encode`` of 2,048
  sentences with a tiny random BERT, against sentence-transformers' own
  ``start_multi_process_pool(["cpu", "cpu"])``;
- ``checkpoint``, ``sigkill``, ``oom-split``: what ``checkpoint=``, a SIGKILLed worker
  process and ``on_oom="split"`` cost a map (benchmarks/_map_long_runs.py, two CPU replicas
  whatever ``--device``; drawn in ``map_<device>_long_runs.png``);
- ``batch-cost`` (only when named in ``--only``): what one batch of a map costs on threads
  and on processes, for models of 2, 200 and 2,000 parameter tensors
  (benchmarks/_map_batch_cost.py, two CPU replicas whatever ``--device``);
- ``digest`` (only when named in ``--only``): what ``checkpoint=`` costs per batch to know
  its input again, the digest of a batch of four kinds and the record's bookkeeping, in
  CPU time (benchmarks/_map_digest.py).

Paths, interleaved round by round (``_common.interleave``: each round in a random order,
balanced so that every path runs in every position equally often, so drift of the
shared host hits them alike and no path always follows the same one):

- ``map``            ``list(dp.map(method, batches))`` on threads: each batch whole on the first free replica;
- ``map-processes``  the same with ``workers="processes"`` (one worker process per device, pool warm);
- ``calls``          ``[dp.method(**b) for b in batches]``: every batch split over every replica (threads);
- ``calls-processes`` the same on a ``workers="processes"`` wrapper;
- ``one-device``     ``[model.method(**b) for b in batches]`` on the first device, on the CPU
  with ``--one-device-threads`` torch threads (default: one replica's, ``--threads``);
- ``by-hand``        (CPU only) what a user would write instead: the batches split by hand over
  as many plain processes, each with its own copy of the model (benchmarks/_by_hand.py): the
  ceiling of any process map on the host.

It reports per path the median pass time and throughput with p10/p90, paired per-round
ratios against the targets, the pools' start-up times (measured apart, never in a pass),
whether every path's outputs equal the one-device loop's, and writes
``map_<device>.json`` and ``.png``.

Run: ``PYTHONPATH=. python benchmarks/bench_map.py [--quick] [--device cpu|cuda] [--only ...] [--out DIR]``;
``--compare-with REF`` runs it on REF's code and this checkout's in one sitting (benchmarks/_compare.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for _common, run as a script
import _common
import _compare
import _map_batch_cost
import _map_digest
import _map_long_runs
from _by_hand import ByHand

import dpmethods
from dpmethods import DataParallel

__all__ = ["Figure", "main", "report", "run", "speeds", "table", "target_rounds"]

PROMPT, PAD, VOCAB = 8, 1, 4096
WORKLOADS = ("gil", "ragged", "uniform", "encode", *_map_long_runs.NAMES, *_map_batch_cost.NAMES, *_map_digest.NAMES)
# (workload, faster path, slower path, at least): slower's time / faster's time, paired per round.
TARGETS = [
    ("gil", "map-processes", "map", 2.0),
    ("gil", "map-processes", "one-device", 1.5),
    ("gil", "map-processes", "by-hand", 0.95),  # at parity with plain processes: the host's ceiling
    ("gil", "calls-processes", "calls", 2.0),
    ("ragged", "map", "calls", 1.25),
    ("uniform", "map", "calls", 0.95),
    ("uniform", "map-processes", "map", 1.0),
    ("encode", "calls-processes", "st-pool", 1.0),
    # Start-up to the first output, fresh pools, paired per round (see _startups).
    ("encode", "processes start-up", "st-pool start-up", 1.0),
]


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
    cpu_rounds: list[float] = field(default_factory=list)  # this process's CPU seconds per pass


class _RowStop:
    """Stop each row at its own length, read from its first prompt token (so a split
    batch keeps every row's length): ``PROMPT + 4 + first_token % spread`` tokens.
    A plain module-level class, so worker processes can unpickle it."""

    def __init__(self, spread: int) -> None:
        self.spread = spread

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        target = PROMPT + 4 + input_ids[:, 0] % self.spread
        return input_ids.shape[1] >= target


def _gpt2(device: torch.device, n_embd: int, n_layer: int, vocab: int) -> Any:
    import transformers

    config = transformers.GPT2Config(
        vocab_size=vocab, n_positions=128, n_embd=n_embd, n_layer=n_layer, n_head=max(2, n_embd // 64),
        bos_token_id=0, eos_token_id=PAD, pad_token_id=PAD,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval().to(device)


def _gil(device: torch.device, quick: bool) -> dict[str, Any]:
    model = _gpt2(device, 64, 2, 256)
    g = torch.Generator().manual_seed(2)
    n, size, new = (8, 4, 24) if quick else (16, 4, 24)
    batches = [
        {"input_ids": torch.randint(2, 256, (size, PROMPT), generator=g).to(device)} for _ in range(n)
    ]
    # min_new_tokens: every row runs all 24 steps (nothing to balance: the GIL is the test).
    kwargs = {"do_sample": False, "pad_token_id": PAD, "max_new_tokens": new, "min_new_tokens": new}
    return {
        "model": model, "method": "generate", "batches": batches, "kwargs": kwargs,
        "items": n * size, "options": {"generate": {"gather": "pad", "pad_value": PAD}},
        "rounds": 3 if quick else 9,  # its passes are short, its ratios spread
        "describe": f"tiny GPT-2 (n_embd 64, 2 layers, vocab 256); {n} batches of {size} prompts "
        f"of {PROMPT} tokens, greedy, {new} new tokens",
    }


def _ragged(device: torch.device, quick: bool) -> dict[str, Any]:
    from transformers import StoppingCriteriaList

    stop = _RowStop(spread=44)
    model = _gpt2(device, 512, 4, VOCAB)
    g = torch.Generator().manual_seed(0)
    n, size = (4, 4) if quick else (6, 4)
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
        "rounds": 3 if quick else 6,
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
    n, size, seq = (4, 32, 64) if quick else (8, 32, 64)
    batches = [
        {
            "input_ids": torch.randint(0, VOCAB, (size, seq), generator=g).to(device),
            "attention_mask": torch.ones(size, seq, dtype=torch.long, device=device),
        }
        for _ in range(n)
    ]
    return {
        "model": model, "method": "forward", "batches": batches, "kwargs": {},
        "items": n * size, "options": None, "rounds": 4 if quick else 20,
        "describe": f"BERT hidden 256, 4 layers; {n} batches of {size} x {seq} tokens",
    }


_WORDS = "the a cat dog sat on mat runs fast slow big small red blue green old new".split()


def _sentence_model(tmp: Path) -> Any:
    import transformers
    from sentence_transformers import SentenceTransformer, models

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *_WORDS]
    (tmp / "vocab.txt").write_text("\n".join(vocab) + "\n")
    config = transformers.BertConfig(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(tmp)
    transformers.BertTokenizer(str(tmp / "vocab.txt")).save_pretrained(tmp)
    transformer = models.Transformer(str(tmp))
    pooling = models.Pooling(transformer.auto_model.config.hidden_size, "mean")
    return SentenceTransformer(modules=[transformer, pooling], device="cpu").eval()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    a = a.last_hidden_state if hasattr(a, "last_hidden_state") else a
    b = b.last_hidden_state if hasattr(b, "last_hidden_state") else b
    a, b = torch.as_tensor(a).cpu(), torch.as_tensor(b).cpu()
    if a.dtype.is_floating_point:
        return bool(torch.allclose(a, b, rtol=1e-4, atol=1e-5))
    return bool(torch.equal(a, b))


def _devices(kind: str) -> list[Any]:
    if kind == "cuda":
        count = torch.cuda.device_count()
        return list(range(count)) if count > 1 else [0, 0]  # repeated ids: two replicas, one GPU
    return ["cpu"] * 2


def _start(dp: DataParallel[Any], method: str) -> float:
    """Start a wrapper's worker processes (model sent): its pool's start-up, in seconds."""
    t0 = time.perf_counter()
    list(dp.map(method, []))  # a map of no batch starts the pool all the same
    return time.perf_counter() - t0


def _paths(
    w: dict[str, Any], ids: list[Any], device: str, per_replica: int, one_device_threads: int
) -> tuple[dict[str, Callable[[], Any]], dict[str, float], Callable[[], None]]:
    """Each path's pass, the pools' start-up seconds, and what stops them."""
    model, method, batches, kwargs = w["model"], w["method"], w["batches"], w["kwargs"]
    call = model if method == "forward" else getattr(model, method)
    dp = DataParallel(model, device_ids=ids, methods=w["options"], cache_replicas=True)
    dpp = DataParallel(model, device_ids=ids, methods=w["options"], workers="processes")
    startup = {"processes": _start(dpp, method)}
    dcall = dp if method == "forward" else getattr(dp, method)
    pcall = dpp if method == "forward" else getattr(dpp, method)

    def one_device() -> Any:
        if device == "cpu":
            torch.set_num_threads(one_device_threads)
        try:
            return [call(**b, **kwargs) for b in batches]
        finally:
            if device == "cpu":
                torch.set_num_threads(per_replica)

    paths = {
        "map": lambda: list(dp.map(method, batches, **kwargs)),
        "map-processes": lambda: list(dpp.map(method, batches, **kwargs)),
        "calls": lambda: [dcall(**b, **kwargs) for b in batches],
        "calls-processes": lambda: [pcall(**b, **kwargs) for b in batches],
        "one-device": one_device,
    }
    if device != "cpu":
        return paths, startup, dpp.close
    by_hand = ByHand(model, method, batches, kwargs, len(ids), per_replica)
    paths["by-hand"] = by_hand

    def stop() -> None:
        dpp.close()
        by_hand.close()

    return paths, startup, stop


def _st_pool(model: Any, n: int, per_replica: int) -> Any:
    """sentence-transformers' pool of ``n`` CPU workers. Its workers take torch's default
    thread count (every core each) unless told: they get one replica's threads, as
    dpmethods' workers do, so the two pools are alike."""
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(per_replica)
    try:
        return model.start_multi_process_pool(["cpu"] * n)
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved


def _startups(model: Any, ids: list[Any], per_replica: int, first: list[str], rounds: int) -> dict[str, list[float]]:
    """Each pool's start-up to its first output (``first`` encoded), a fresh pool each
    time, closed after: one pair per round, in :func:`_common.interleave`'s orders."""

    def ours() -> float:
        dpp = DataParallel(model, device_ids=ids, workers="processes")
        t0 = time.perf_counter()
        dpp.encode(first)
        t = time.perf_counter() - t0
        dpp.close()
        return t

    def theirs() -> float:
        t0 = time.perf_counter()
        pool = _st_pool(model, len(ids), per_replica)
        model.encode(first, pool=pool)
        t = time.perf_counter() - t0
        model.stop_multi_process_pool(pool)
        return t

    seconds: dict[str, list[float]] = {"processes start-up": [], "st-pool start-up": []}
    pools = {"processes start-up": ours, "st-pool start-up": theirs}
    _common.interleave({name: functools.partial(_append, seconds[name], fn) for name, fn in pools.items()},
                       rounds, label="start-ups")
    return seconds


def _append(to: list[float], fn: Callable[[], float]) -> None:
    to.append(fn())


def _encode_paths(
    w: dict[str, Any], ids: list[Any], device: str, per_replica: int, one_device_threads: int
) -> tuple[dict[str, Callable[[], Any]], dict[str, Any], Callable[[], None]]:
    model, sentences = w["model"], w["sentences"]
    startup: dict[str, Any] = _startups(model, ids, per_replica, sentences[:8], w["startup_rounds"])
    dp = DataParallel(model, device_ids=ids)
    dpp = DataParallel(model, device_ids=ids, workers="processes")
    _start(dpp, "encode")
    pool = _st_pool(model, len(ids), per_replica)
    model.encode(sentences[:8], pool=pool)  # its workers load the model on first use

    def stop() -> None:
        dpp.close()
        model.stop_multi_process_pool(pool)

    paths = {
        "one-device": lambda: model.encode(sentences),
        "st-pool": lambda: model.encode(sentences, pool=pool),
        "calls": lambda: dp.encode(sentences),
        "calls-processes": lambda: dpp.encode(sentences),
    }
    return paths, startup, stop


def _encode(device: torch.device, quick: bool) -> dict[str, Any] | None:
    try:
        import sentence_transformers  # noqa: F401
    except ImportError:
        print("no sentence-transformers: the encode workload is skipped", file=sys.stderr)
        return None
    tmp = Path(tempfile.mkdtemp(prefix="bench_map_st_"))
    g = torch.Generator().manual_seed(3)
    n = 512 if quick else 2048
    sentences = [
        " ".join(_WORDS[int(i)] for i in torch.randint(0, len(_WORDS), (3 + k % 9,), generator=g))
        for k in range(n)
    ]
    return {
        "model": _sentence_model(tmp), "sentences": sentences, "method": "encode", "items": n,
        "rounds": 3 if quick else 5, "paths": _encode_paths, "startup_rounds": 2 if quick else 6,
        "describe": f"SentenceTransformer (BERT hidden 32, 2 layers, mean pooling) encode of {n} "
        "sentences of 3-11 words, batch_size 32",
    }


def _measure(
    name: str, w: dict[str, Any], ids: list[Any], device: str, threads: tuple[int, int]
) -> tuple[list[Figure], dict[str, Any]]:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    per_replica = threads[0] if threads[0] > 0 else torch.get_num_threads()
    make = w.get("paths", _paths)
    paths, startup, stop = make(w, ids, device, per_replica, threads[1] if threads[1] > 0 else per_replica)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers' notes on attention masks
            reference = paths["one-device"]()
            outputs = {p: fn() for p, fn in paths.items() if p != "one-device"}  # and warm-up
            sync()
            times, cpu = _common.interleave(paths, w["rounds"], sync)
    finally:
        stop()
    figures = _figures(name, times, cpu, dict.fromkeys(times, w["items"]))
    rounds = {**times, **{p: s for p, s in startup.items() if isinstance(s, list)}}
    targets = []
    for wl, fast, slow, least in TARGETS:
        if wl == name and fast in rounds and slow in rounds:
            r = _common.paired(rounds, slow, fast)
            targets.append({"faster": fast, "slower": slow, "at_least": least, **r, "met": r["median"] >= least})
    facts = {
        "workload": w["describe"],
        "method": w["method"],
        "devices": [str(i) for i in ids],
        "rounds": w["rounds"],
        "startup_s": {p: statistics.median(s) if isinstance(s, list) else s for p, s in startup.items()},
        "startup_rounds_s": {p: s for p, s in startup.items() if isinstance(s, list)},
        "targets": targets,
        "speed_over_one_device": speeds(times),
        "outputs_match_one_device": {
            p: _same(outs if isinstance(outs, list) else [outs],
                     reference if isinstance(reference, list) else [reference])
            for p, outs in outputs.items()
        },
    }
    return figures, facts


def _figures(
    name: str, times: dict[str, list[float]], cpu: dict[str, list[float]], items: dict[str, int]
) -> list[Figure]:
    figures = []
    for p, ts in times.items():
        med = statistics.median(ts)
        figures.append(
            Figure(
                name, p, med, _common.quantile(ts, 0.1), _common.quantile(ts, 0.9),
                _common.quantile(ts, 0.75) - _common.quantile(ts, 0.25), items[p], items[p] / med,
                rounds=ts, cpu_rounds=cpu[p],
            )
        )
    return figures


def run(
    device: str, quick: bool, threads: tuple[int, int] = (1, 0), only: list[str] | None = None
) -> tuple[list[Figure], dict[str, Any]]:
    """Time every path on every workload; return the figures and facts per workload."""
    ids = _devices(device)
    dev = torch.device("cuda", ids[0]) if device == "cuda" else torch.device("cpu")
    figures: list[Figure] = []
    facts: dict[str, Any] = {}
    makers = {"gil": _gil, "ragged": _ragged, "uniform": _uniform, "encode": _encode}
    for name, make in makers.items():
        if only and name not in only:
            continue
        w = make(dev, quick)
        if w is None:
            continue
        print(f"{name}: {w['describe']}", file=sys.stderr, flush=True)
        figs, facts[name] = _measure(name, w, ids, device, threads)
        figures += figs
    cpu_ids = _devices("cpu")
    extra = (_map_long_runs.run(cpu_ids, quick, only), _map_batch_cost.run(cpu_ids, quick, only),
             _map_digest.run(cpu_ids, quick, only))
    for m in [m for ms in extra for m in ms]:
        m.facts["speed_over_one_device"] = speeds(m.times)
        figures += _figures(m.name, m.times, m.cpu, m.items)
        facts[m.name] = m.facts
    return figures, facts


def speeds(times: dict[str, list[float]]) -> dict[str, float]:
    """Each path's speed over the one-device loop: the median of the per-round ratios.

    Paired per round, as the targets are, so a figure quoted from the table and the same
    ratio in the targets' table are one number.
    """
    if "one-device" not in times:
        return {}
    return {p: _common.paired(times, "one-device", p)["median"] for p in times}


def table(figures: list[Figure], facts: dict[str, Any]) -> str:
    """Markdown: one row per workload and path, then one per target (paired ratios)."""
    rows = [
        "| workload | path | pass s (p10-p90) | items/s | x one device (paired) |",
        "|---|---|---:|---:|---:|",
    ]
    for f in figures:
        if f.workload in _map_digest.NAMES:  # microseconds, in its own rows
            continue
        speed = facts[f.workload]["speed_over_one_device"].get(f.path)
        rows.append(
            f"| {f.workload} | {f.path} | {f.median_s:.3f} ({f.p10_s:.3f}-{f.p90_s:.3f}) | "
            f"{f.items_per_s:.1f} | {'-' if speed is None else f'{speed:.2f}x'} |"
        )
    rows += ["", "| workload | target | paired ratio (p10-p90) | rounds | verdict |", "|---|---|---:|---:|---|"]
    for wl, x in facts.items():
        for t in x["targets"]:
            n = target_rounds(x, t)
            verdict = _common.verdict(t["met"], n)
            bound = f" >= {t['at_least']}" if "at_least" in t else f" <= {t['at_most']}" if "at_most" in t else ""
            rows.append(
                f"| {wl} | {t['slower']} time / {t['faster']} time{bound} | "
                f"**{t['median']:.2f}x** ({t['p10']:.2f}-{t['p90']:.2f}) | {n} | {verdict} |"
            )
    rows += ["", "| workload | pool | start-up s |", "|---|---|---:|"]
    for wl, x in facts.items():
        for pool, s in x["startup_s"].items():
            rs = x.get("startup_rounds_s", {}).get(pool)
            spread = f" ({_common.quantile(rs, 0.1):.2f}-{_common.quantile(rs, 0.9):.2f}, {len(rs)} rounds)" if rs else ""
            rows.append(f"| {wl} | {pool} | {s:.2f}{spread} |")
    return "\n".join(rows + _map_long_runs.rows(facts) + _map_batch_cost.rows(facts) + _map_digest.rows(facts))


def target_rounds(facts: dict[str, Any], target: dict[str, Any]) -> int:
    """How many paired rounds a target's ratio is the median of (a run saved before
    targets recorded it: the start-up rounds, or the workload's)."""
    if "rounds" in target:
        return int(target["rounds"])
    return len(facts.get("startup_rounds_s", {}).get(target["slower"], [])) or int(facts["rounds"])


def report(saved: dict[str, Any]) -> str:
    """The README's text of a saved run: what it was measured on, then its tables."""
    figures = [Figure(**f) for f in saved["figures"]]
    for wl, x in saved["workloads"].items():  # paired, also for a run saved unpaired
        x["speed_over_one_device"] = speeds({f.path: f.rounds for f in figures if f.workload == wl})
    return _common.provenance_line(saved["machine"]) + "\n\n" + table(figures, saved["workloads"])


def plot(figures: list[Figure], facts: dict[str, Any], path: Path, title: str) -> None:
    """Throughput bars (median, p10-p90 whiskers), one panel per workload."""
    try:
        import matplotlib
    except ImportError:
        print("no matplotlib (pip install matplotlib): no plot", file=sys.stderr)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = {wl: {f.path: f.rounds for f in figures if f.workload == wl} for wl in facts}
    _map_long_runs.plot(facts, times, path.with_name(f"{path.stem}_long_runs.png"), title)
    _map_batch_cost.plot(facts, path.with_name(f"{path.stem}_batch_cost.png"), title)
    apart = (*_map_long_runs.NAMES, *_map_batch_cost.NAMES, *_map_digest.NAMES)
    workloads = list(dict.fromkeys(f.workload for f in figures if f.workload not in apart))
    if not workloads:
        return
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.6 * len(workloads), 4.2), squeeze=False)
    for ax, wl in zip(axes[0], workloads, strict=True):
        sub = [f for f in figures if f.workload == wl]
        ys = [f.items_per_s for f in sub]
        lo = [f.items_per_s - f.items / f.p90_s for f in sub]
        hi = [f.items / f.p10_s - f.items_per_s for f in sub]
        colors = [
            "tab:blue" if "processes" in f.path else "tab:green" if f.path in ("map", "calls")
            else "tab:gray" for f in sub
        ]
        ax.bar(range(len(sub)), ys, yerr=[lo, hi], capsize=3, color=colors)
        ax.set_xticks(range(len(sub)))
        ax.set_xticklabels([f.path for f in sub], fontsize=7, rotation=25)
        ax.set_ylabel("items per second (median, p10-p90)", fontsize=8)
        best = max(facts[wl]["speed_over_one_device"].items(), key=lambda kv: kv[1])
        ax.set_title(f"{wl}: best {best[0]} {best[1]:.2f}x one device", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
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
    parser.add_argument("--only", nargs="*", choices=WORKLOADS, metavar="WORKLOAD",
                        help=f"these workloads only ({' '.join(WORKLOADS)}; batch-cost and digest run only when named)")
    parser.add_argument("--compare-with", metavar="REF", help="run on REF's code (before) and on this checkout's "
                        "(after) in one sitting, round by round in turns (benchmarks/_compare.py)")
    args = parser.parse_args(argv)
    if args.compare_with:
        return _compare.main(Path(__file__).resolve(), args.compare_with,
                             sys.argv[1:] if argv is None else argv, args.out)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        if "pairs" in saved:  # a --compare-with result
            print(_compare.report(saved))
            return 0
        print(report(saved))
        plot([Figure(**f) for f in saved["figures"]], saved["workloads"], args.from_json.with_suffix(".png"),
             saved["title"])
        return 0
    try:
        import transformers
    except ImportError:
        print("bench_map needs transformers (pip install transformers)", file=sys.stderr)
        return 2
    transformers.logging.set_verbosity_error()  # its notes on attention masks, once per call
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"  # and in the worker processes
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is available", file=sys.stderr)
        return 2
    if args.device == "cpu" and args.threads > 0:
        torch.set_num_threads(args.threads)
    clock = _common.started_run()
    figures, facts = run(args.device, args.quick, (args.threads, args.one_device_threads), args.only)
    print(table(figures, facts))
    for name, x in facts.items():
        print(f"{name}: outputs equal to the one-device loop: {x['outputs_match_one_device']}")
    info = _common.machine_info()
    info.update(threads_per_replica=args.threads, one_device_threads=args.one_device_threads or args.threads,
                dpmethods=dpmethods.__version__, **_common.finished_run(clock))
    title = (f"dpmethods map and calls, threads and processes, {args.device} x{len(_devices(args.device))}, torch "
             f"{torch.__version__}, load {info['loadavg_before'][0]:.1f}")
    result = {"machine": info, "quick": args.quick, "title": title, "workloads": facts,
              "figures": [asdict(f) for f in figures]}
    json_path = args.out / f"map_{args.device}.json"
    _common.write_json(json_path, result)
    plot(figures, facts, json_path.with_suffix(".png"), title)
    print(f"wrote {json_path} and its plot(s) beside it")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
