"""Items of mixed lengths: ``dp.map`` over items (``batch_size=``, ``max_tokens=``) against
batches in input order, as a ``DataLoader`` gives them, and against a hand-sorted ideal.

The items: 4,096 token sequences whose lengths follow benchmarks/_item_lengths.py
(lognormal, median 39, p90 112, a tail to 384, fixed seed), the same items as texts for
sentence-transformers. Two CPU replicas, one torch thread each. Workloads:

- ``bert``: a 4-layer BERT (hidden 256, 4 heads) forward, mean-pooled over the real
  tokens, on threads. Paths: ``input-order`` (batches of 32 in input order, each padded
  to its longest), ``batch_size`` (``batch_size=32``), ``max_tokens``
  (``max_tokens=2048``), ``hand-sorted`` (every item sorted by length by hand, longest
  first, cut into batches of 32: the ideal); every path pads its batches as it runs,
  as a ``DataLoader`` collates in the loop;
- ``encode`` (needs sentence-transformers): ``SentenceTransformer.encode`` of the texts
  (the same BERT, mean pooling): ``items-threads`` and ``items-processes``
  (``dp.map("encode", texts, batch_size=32)``) against sentence-transformers' own
  multi-process pool with the same two workers (``st-pool``);
- ``generate``: greedy ``generate`` of a random GPT-2 (n_embd 256, 4 layers) on 512 of
  the prompts, 16 new tokens, on worker processes: ``input-order`` batches of 16
  (left-padded) against ``batch_size=16``;
- ``ray`` (needs ray[data]): one Ray Data pipeline (``ray.init(num_cpus=2)``, one actor
  with two CPU replicas) of the BERT: ``dpmethods.ray.Predictor`` with ``max_tokens=``
  on the ragged rows, against the same Predictor without it after a step that pads each
  Ray batch to its longest.

Paths run in interleaved rounds (a balanced random order each round), and each target is
the median of the per-round paired ratios (slower's time / faster's), with p10-p90.
Padded positions (rows x longest token count, summed over the batches a path runs;
the prompts' for ``generate``) are counted from the batches each path builds (item
mode's by its own cut, ``dpmethods.items.batches``), beside the real tokens; Ray's
batches are taken as contiguous runs of rows, and the pool's are in its workers (n/a).
Every path's per-item outputs are checked against the ``input-order`` path's (the
``st-pool`` one for ``encode``). Writes ``items_cpu.json`` (with the commit and host);
``--from-json`` prints a saved run's README text.

Run: ``PYTHONPATH=. python benchmarks/bench_items.py [--quick] [--items N] [--rounds N]
[--only bert encode generate ray] [--out DIR]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for _common, run as a script
import _common
import _item_lengths

import dpmethods
from dpmethods import DataParallel
from dpmethods.items import ItemOptions
from dpmethods.items.batches import read_batches

__all__ = ["MeanPooled", "main", "mean_pooled_bert", "report", "table"]

VOCAB, HIDDEN, LAYERS = 1024, 256, 4
BATCH, MAX_TOKENS, GEN_BATCH, NEW_TOKENS, RAY_BATCH = 32, 2048, 16, 16, 256
# (workload, faster path, slower path, at least): slower's time / faster's time, paired per round.
TARGETS = [
    ("bert", "batch_size", "input-order", 3.0),
    ("bert", "max_tokens", "input-order", 3.0),
    ("bert", "batch_size", "hand-sorted", 0.95),
    ("bert", "max_tokens", "hand-sorted", 0.95),
    ("encode", "items-processes", "st-pool", 1.0),
    ("generate", "batch_size", "input-order", 1.3),
    ("ray", "max_tokens", "no-max_tokens", 1.0),
]


class MeanPooled(torch.nn.Module):
    """A BERT encoder whose forward returns the mean of its last hidden state over the real tokens."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                         num_attention_heads=4, intermediate_size=4 * HIDDEN,
                                         max_position_embeddings=512)
        self.bert = transformers.BertModel(config, add_pooling_layer=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask[..., None].to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1)


def mean_pooled_bert() -> MeanPooled:
    """The benchmark's BERT, seeded (a factory for the Ray actors)."""
    torch.manual_seed(0)
    return MeanPooled().eval()


def _padded(rows: list[torch.Tensor], left: bool = False) -> dict[str, torch.Tensor]:
    """A batch of 1-D id tensors padded with 0 to the longest, and its attention mask."""
    longest = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, r in enumerate(rows):
        where = slice(longest - len(r), longest) if left else slice(0, len(r))
        ids[i, where], mask[i, where] = r, 1
    return {"input_ids": ids, "attention_mask": mask}


def _chunks(xs: list[Any], size: int) -> list[list[Any]]:
    return [xs[k:k + size] for k in range(0, len(xs), size)]


def _planned(lengths: list[int], options: ItemOptions) -> list[list[int]]:
    """The items' batches (their indices) as item mode cuts them: the library's own cut."""
    import collections

    pairs = enumerate(dict(input_ids=torch.empty(n)) for n in lengths)
    return [b.indices for b in read_batches(pairs, options, collections.deque())]


def _positions(batches: list[list[int]], lengths: list[int]) -> int:
    return sum(len(b) * max(lengths[i] for i in b) for b in batches)


def _rows(outs: list[Any], batches: list[list[int]], n: int) -> list[Any]:
    """Per-item outputs of batch outputs, in input order."""
    rows: list[Any] = [None] * n
    for out, b in zip(outs, batches):
        for i, r in zip(b, out):
            rows[i] = r
    return rows


def _max_diff(a: list[Any], b: list[Any]) -> float:
    import numpy as np

    return float(max(np.abs(np.asarray(x, dtype=np.float64) - np.asarray(y, dtype=np.float64)).max() for x, y in zip(a, b)))


def _bert(ids: list[torch.Tensor], rounds: int) -> dict[str, Any]:
    lengths = [len(t) for t in ids]
    model = mean_pooled_bert()
    dp = DataParallel(model, device_ids=["cpu"] * 2)
    items = [{"input_ids": t} for t in ids]
    order = _chunks(list(range(len(ids))), BATCH)
    by_length = sorted(range(len(ids)), key=lambda i: -lengths[i])
    ideal = _chunks(by_length, BATCH)
    # Every path builds its batches while it runs, as a DataLoader collates in the loop.
    def collated(plan: list[list[int]]) -> Any:
        return (_padded([ids[i] for i in b]) for b in plan)

    paths: dict[str, Callable[[], Any]] = {
        "input-order": lambda: _rows(list(dp.map("forward", collated(order))), order, len(ids)),
        "batch_size": lambda: list(dp.map("forward", items, batch_size=BATCH)),
        "max_tokens": lambda: list(dp.map("forward", items, max_tokens=MAX_TOKENS)),
        "hand-sorted": lambda: _rows(list(dp.map("forward", collated(ideal))), ideal, len(ids)),
    }
    plans = {"input-order": order, "hand-sorted": ideal,
             "batch_size": _planned(lengths, ItemOptions(batch_size=BATCH)),
             "max_tokens": _planned(lengths, ItemOptions(max_tokens=MAX_TOKENS))}
    return {"paths": paths, "rounds": rounds, "reference": "input-order", "close": lambda: None,
            "positions": {p: _positions(b, lengths) for p, b in plans.items()}, "tokens": sum(lengths),
            "describe": f"BERT ({LAYERS} layers, hidden {HIDDEN}) forward, mean-pooled, of {len(ids)} items; "
                        f"batches of {BATCH}, max_tokens={MAX_TOKENS}; threads"}


def _sentence_model(tmp: Path) -> Any:
    import transformers
    from sentence_transformers import SentenceTransformer, models

    (tmp / "vocab.txt").write_text("\n".join(_item_lengths.vocabulary(VOCAB)) + "\n")
    transformers.BertTokenizer(str(tmp / "vocab.txt")).save_pretrained(tmp)
    mean_pooled_bert().bert.save_pretrained(tmp)
    transformer = models.Transformer(str(tmp), max_seq_length=512)
    return SentenceTransformer(modules=[transformer, models.Pooling(HIDDEN, "mean")], device="cpu").eval()


def _st_pool(model: Any) -> Any:
    """sentence-transformers' pool of two CPU workers, with one torch thread each, as ours."""
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        return model.start_multi_process_pool(["cpu", "cpu"])
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved


def _encode(ids: list[torch.Tensor], rounds: int) -> dict[str, Any] | None:
    try:
        import sentence_transformers  # noqa: F401
    except ImportError:
        print("no sentence-transformers: the encode workload is skipped", file=sys.stderr)
        return None
    texts = _item_lengths.texts(ids)
    model = _sentence_model(Path(tempfile.mkdtemp(prefix="bench_items_st_")))
    dp = DataParallel(model, device_ids=["cpu"] * 2)
    dpp = DataParallel(model, device_ids=["cpu"] * 2, workers="processes")
    pool = _st_pool(model)
    model.encode(texts[:8], pool=pool)  # its workers load the model on first use
    list(dpp.map("encode", texts[:8], batch_size=4))  # ours start too

    def close() -> None:
        dpp.close()
        model.stop_multi_process_pool(pool)

    lengths = [len(t) for t in ids]
    plan = _planned([len(t) for t in texts], ItemOptions(batch_size=BATCH))  # sorted by characters
    return {"paths": {
        "st-pool": lambda: list(model.encode(texts, pool=pool, batch_size=BATCH)),
        "items-threads": lambda: list(dp.map("encode", texts, batch_size=BATCH, length=len)),
        "items-processes": lambda: list(dpp.map("encode", texts, batch_size=BATCH, length=len)),
    }, "rounds": rounds, "reference": "st-pool", "close": close, "tokens": sum(lengths),
        "positions": {"items-threads": _positions(plan, lengths), "items-processes": _positions(plan, lengths)},
        "describe": f"SentenceTransformer (the BERT, mean pooling) encode of {len(texts)} texts, batch_size {BATCH} "
                    "(items sorted by characters, length=len), against its pool of 2 workers"}


def _generate(ids: list[torch.Tensor], rounds: int) -> dict[str, Any]:
    import transformers

    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=512, n_embd=256, n_layer=4, n_head=4,
                                     bos_token_id=1, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    dp = DataParallel(model, device_ids=["cpu"] * 2, methods=["generate"], workers="processes")
    kwargs = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0}
    prompts = [{"input_ids": t} for t in ids]
    order = _chunks(list(range(len(ids))), GEN_BATCH)
    list(dp.map("generate", prompts[:4], batch_size=2, **kwargs))  # the workers start

    def input_order() -> list[Any]:
        rows = []  # each prompt's tokens without its batch's left padding, as item mode gives them
        batches = (_padded([ids[i] for i in b], left=True) for b in order)  # collated in the loop
        for out, b in zip(dp.map("generate", batches, **kwargs), order):
            width = max(len(ids[i]) for i in b)
            rows += [r[width - len(ids[i]):] for i, r in zip(b, out)]
        return rows

    lengths = [len(t) for t in ids]
    return {"paths": {
        "input-order": input_order,
        "batch_size": lambda: list(dp.map("generate", prompts, batch_size=GEN_BATCH, **kwargs)),
    }, "rounds": rounds, "reference": "input-order", "close": dp.close, "tokens": sum(lengths),
        "positions": {"input-order": _positions(order, lengths),
                      "batch_size": _positions(_planned(lengths, ItemOptions(batch_size=GEN_BATCH)), lengths)},
        "describe": f"GPT-2 (n_embd 256, 4 layers) greedy generate of {len(ids)} prompts, {NEW_TOKENS} new "
                    f"tokens, batches of {GEN_BATCH}; worker processes (positions: the prompts')"}


def _pad_ray_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """The step a Ray user writes before a Predictor that takes padded batches."""
    padded = _padded([torch.as_tensor(r) for r in batch["input_ids"]])
    return {"id": batch["id"], **{k: v.numpy() for k, v in padded.items()}}


def _ray(ids: list[torch.Tensor], rounds: int) -> dict[str, Any] | None:
    try:
        import ray
        import ray.data
    except ImportError:
        print("no ray[data]: the ray workload is skipped", file=sys.stderr)
        return None
    from dpmethods.ray import Predictor

    here = str(Path(__file__).resolve().parent)
    path = os.pathsep.join(filter(None, [here, str(Path(here).parent), os.environ.get("PYTHONPATH")]))
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}})
    ray.data.DataContext.get_current().enable_progress_bars = False
    if len(ids) % RAY_BATCH:
        raise ValueError(f"the ray workload: --items: expected a multiple of {RAY_BATCH}, got {len(ids)}")
    # One block per Ray batch: each batch the padding step pads is then the batch the
    # Predictor takes (one spanning two padded blocks would mix their widths).
    ds = ray.data.from_items([{"id": i, "input_ids": t.numpy()} for i, t in enumerate(ids)],
                             override_num_blocks=len(ids) // RAY_BATCH).materialize()
    common = dict(factory=mean_pooled_bert, method="forward", keep=["id"], output="embedding",
                  device_ids=["cpu"] * 2)

    def run(pad: bool) -> list[Any]:
        source = ds.map_batches(_pad_ray_batch, batch_size=RAY_BATCH) if pad else ds
        kwargs = {**common, "columns": ["input_ids", "attention_mask"]} if pad else \
            {**common, "columns": ["input_ids"], "max_tokens": MAX_TOKENS}
        # One CPU of Ray's two reserved for the actor (it still runs its two replicas), so
        # the padding step has the other.
        out = source.map_batches(Predictor, fn_constructor_kwargs=kwargs, batch_size=RAY_BATCH, num_cpus=1,
                                 compute=ray.data.ActorPoolStrategy(size=1)).take_all()
        return [r["embedding"] for r in sorted(out, key=lambda r: r["id"])]

    lengths = [len(t) for t in ids]
    chunks = _chunks(list(range(len(ids))), RAY_BATCH)  # Ray's batches, taken as contiguous runs of rows
    sorted_in_chunks = 0
    for c in chunks:
        for b in _planned([lengths[i] for i in c], ItemOptions(max_tokens=MAX_TOKENS, window=None)):
            sorted_in_chunks += len(b) * max(lengths[c[i]] for i in b)
    return {"paths": {"no-max_tokens": lambda: run(True), "max_tokens": lambda: run(False)}, "rounds": rounds,
            "reference": "no-max_tokens", "close": ray.shutdown, "tokens": sum(lengths),
            "positions": {"no-max_tokens": _positions(chunks, lengths), "max_tokens": sorted_in_chunks},
            "describe": f"Ray Data pipeline of the BERT, batches of {RAY_BATCH} rows, one actor of 2 CPU replicas: "
                        f"Predictor(max_tokens={MAX_TOKENS}) on ragged rows against a padding step and the Predictor "
                        "(actor start-up in every pass)"}


def _measure(name: str, w: dict[str, Any]) -> dict[str, Any]:
    paths = w["paths"]
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers' notes on attention masks
            outputs = {p: fn() for p, fn in paths.items()}  # a warm-up pass, and the outputs compared
            times, cpu = _common.interleave(paths, w["rounds"])
    finally:
        w["close"]()
    reference = outputs[w["reference"]]
    targets = []
    for wl, fast, slow, least in TARGETS:
        if wl == name and fast in times and slow in times:
            r = _common.paired(times, slow, fast)
            targets.append({"faster": fast, "slower": slow, "at_least": least, **r, "met": r["median"] >= least})
    return {
        "workload": w["describe"], "rounds": w["rounds"], "real_tokens": w["tokens"],
        "paths": {p: {**{k: v for k, v in _common.summarize(ts).items() if k != "n"}, "rounds_s": ts,
                      "cpu_rounds_s": cpu[p], "padded_positions": w["positions"].get(p),
                      "max_abs_diff_from_reference": _max_diff(outputs[p], reference)} for p, ts in times.items()},
        "targets": targets,
    }


def table(facts: dict[str, Any]) -> str:
    """Markdown: one row per workload and path, then one per target (paired ratios)."""
    rows = ["| workload | path | pass s (p10-p90) | padded positions / real tokens | max diff |", "|---|---|---:|---:|---:|"]
    for wl, x in facts.items():
        for p, f in x["paths"].items():
            pos = f["padded_positions"]
            share = "n/a (in its workers)" if pos is None else f"{pos:,} / {x['real_tokens']:,}"
            rows.append(f"| {wl} | {p} | {f['median']:.2f} ({f['p10']:.2f}-{f['p90']:.2f}) | {share} | "
                        f"{f['max_abs_diff_from_reference']:.1e} |")
    rows += ["", "| workload | target | paired ratio (p10-p90) | rounds | verdict |", "|---|---|---:|---:|---|"]
    for wl, x in facts.items():
        for t in x["targets"]:
            n = t.get("rounds", x["rounds"])
            rows.append(f"| {wl} | {t['faster']} vs {t['slower']} >= {t['at_least']}x | {t['median']:.2f}x "
                        f"({t['p10']:.2f}-{t['p90']:.2f}) | {n} | {_common.verdict(t['met'], n)} |")
    return "\n".join(rows)


def report(saved: dict[str, Any]) -> str:
    """The README's text of a saved run: what it was measured on, the length mix, then its tables."""
    mix = saved["lengths"]
    return (_common.provenance_line(saved["machine"]) + f" {mix['n']:,} items: median {mix['median']:g} tokens, "
            f"p90 {mix['p90']:g}, p99 {mix['p99']:g}, longest {mix['max']}.\n\n" + table(saved["workloads"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="512 items, 128 prompts, 2 rounds")
    parser.add_argument("--items", type=int, help="items (default 4096; --quick 512)")
    parser.add_argument("--prompts", type=int, help="generate prompts (default 512; --quick 128)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 5; --quick 2)")
    parser.add_argument("--only", nargs="*", choices=("bert", "encode", "generate", "ray"),
                        default=["bert", "encode", "generate", "ray"])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--from-json", type=Path, help="print the README text of a saved run")
    args = parser.parse_args(argv)
    if args.from_json:
        print(report(json.loads(args.from_json.read_text())))
        return 0
    n = args.items or (512 if args.quick else 4096)
    prompts = args.prompts or (128 if args.quick else 512)
    rounds = args.rounds or (2 if args.quick else 5)
    import transformers

    transformers.logging.set_verbosity_error()  # its notes on attention masks, once per call
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"  # and in the worker processes
    torch.set_num_threads(1)
    ids = _item_lengths.token_ids(_item_lengths.lengths(n), VOCAB)
    start = _common.started_run()
    builders = {"bert": lambda: _bert(ids, rounds), "encode": lambda: _encode(ids, rounds),
                "generate": lambda: _generate(ids[:prompts], rounds), "ray": lambda: _ray(ids, rounds)}
    facts = {}
    for name in args.only:
        w = builders[name]()
        if w is not None:
            facts[name] = _measure(name, w)
            print(table({name: facts[name]}), flush=True)
    info = {**_common.machine_info(), **_common.finished_run(start), "dpmethods": dpmethods.__version__,
            "threads_per_replica": 1}
    result = {"machine": info, "items": n, "prompts": prompts, "lengths": _item_lengths.describe([len(t) for t in ids]),
              "workloads": facts}
    path = _common.write_json(args.out / "items_cpu.json", result)
    print(report(result))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
