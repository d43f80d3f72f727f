"""Throughput of ``dpmethods.ray.Predictor`` against a hand-written Ray Data predictor class.

Both run in the same Ray Data pipeline on the same local cluster (``ray.init(num_cpus=2)``),
with the same model, batch size and actor pool: a pass is
``ds.map_batches(cls, batch_size=..., compute=ActorPoolStrategy(size=...)).materialize()``
over a dataset materialized beforehand, timed from the call to the last block, actor
start-up included (each pass starts its actors, as every Ray Data execution does).

Workloads, sized so that the model's own compute is most of a pass (a pass that is
mostly Ray's scheduling and the actor's start-up cannot show what the Predictor itself
costs):

- ``mlp``: a decorated ``encode`` (16 x Linear(1024, 1024) with ReLU) returning a dict of
  two tensors, on a float column, an id column kept;
- ``text`` (needs sentence-transformers): ``SentenceTransformer.encode`` of a text
  column of 8-23 words per row with a random BERT (hidden 256, 2 layers; built
  locally, nothing downloaded).

The hand-written class does what Ray's users write by hand: load the model in
``__init__``, turn the numpy columns into arguments, call the method under
``torch.inference_mode()`` and turn the outputs into numpy columns.

Rounds interleave the two paths (``_common.interleave``: a balanced random order each
round), so drift of the shared host hits both alike; the ratio is paired per round
(Predictor's throughput / the hand-written class's), reported as its median and p10-p90. Then, in this process with one torch
thread, the first (up to) 8 batches as Ray hands them go through each class's
``__call__`` and through the model's method alone, in interleaved rounds: the
Predictor's cost per batch without Ray, and the model's share of a pass (its compute
for the pass's batches over the pass's time), which the script warns about below one
half. Writes ``ray_cpu.json`` and ``.png``.

Run: ``PYTHONPATH=. python benchmarks/bench_ray.py [--quick] [--rounds N] [--out DIR]``
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
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for _common, run as a script
import _common

import dpmethods
from dpmethods.ray import Predictor

_HERE = Path(__file__).resolve().parent

__all__ = ["HandWrittenEncode", "HandWrittenText", "main", "report", "table"]

FEATURES, LAYERS, TARGET = 1024, 16, 0.95
CALL_BATCHES = 8  # batches timed through each __call__ without Ray (fewer if a pass has fewer)
_WORDS = "the a cat dog sat on mat runs fast slow big small red blue".split()


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        for _ in range(LAYERS):
            layers += [torch.nn.Linear(FEATURES, FEATURES), torch.nn.ReLU()]
        self.net = torch.nn.Sequential(*layers)

    @dpmethods.parallel_method
    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.net(x)
        return {"embedding": h, "norm": h.norm(dim=1)}


def mlp() -> MLP:
    torch.manual_seed(0)
    return MLP().eval()


class HandWrittenEncode:
    """What a user writes for ``mlp`` without dpmethods."""

    def __init__(self, factory: Callable[[], MLP]) -> None:
        self.model = factory().eval()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = torch.from_numpy(batch["pixels"].copy())  # Ray's arrays are read-only
        with torch.inference_mode():
            out = self.model.encode(x)
        return {"id": batch["id"], "embedding": out["embedding"].numpy(), "norm": out["norm"].numpy()}


class HandWrittenText:
    """What a user writes for ``text`` without dpmethods."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self.model = factory().eval()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        with torch.inference_mode():
            out = self.model.encode(batch["text"].tolist())
        return {"id": batch["id"], "embedding": out}


def _sentence_model(path: str) -> Any:
    """A SentenceTransformer (random BERT, hidden 256, 2 layers, mean pooling), saved to
    ``path`` by the first call and loaded from it by the later ones (the actors)."""
    import transformers
    from sentence_transformers import SentenceTransformer, models

    folder = Path(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if not (folder / "config.json").exists():
            vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *_WORDS]
            (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
            config = transformers.BertConfig(
                vocab_size=len(vocab), hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=1024, max_position_embeddings=64,
            )
            torch.manual_seed(0)
            transformers.BertModel(config).save_pretrained(folder)
            transformers.BertTokenizer(str(folder / "vocab.txt")).save_pretrained(folder)
        transformer = models.Transformer(str(folder))
        pooling = models.Pooling(transformer.auto_model.config.hidden_size, "mean")
        return SentenceTransformer(modules=[transformer, pooling], device="cpu").eval()


def _pixels(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(int(batch["id"][0]))
    return {"id": batch["id"], "pixels": rng.standard_normal((len(batch["id"]), FEATURES), dtype=np.float32)}


def _texts(batch: dict[str, np.ndarray]) -> dict[str, Any]:
    return {"id": batch["id"], "text": [" ".join(_WORDS[(i * 7 + k) % len(_WORDS)] for k in range(8 + i % 16))
                                        for i in batch["id"].tolist()]}


def _encode_pixels(model: Any, batch: dict[str, np.ndarray]) -> Any:
    """The mlp model's work on one batch, and nothing else."""
    return model.encode(torch.from_numpy(batch["pixels"].copy()))


def _encode_texts(model: Any, batch: dict[str, np.ndarray]) -> Any:
    """The text model's work on one batch (tokenizing included), and nothing else."""
    return model.encode(batch["text"].tolist())


def _workloads(ray: Any, rows: int, sentences: int, tmp: str) -> dict[str, dict[str, Any]]:
    blocks = 16
    found: dict[str, dict[str, Any]] = {
        "mlp": {
            "describe": f"MLP.encode ({LAYERS} x Linear({FEATURES},{FEATURES})), dict output, {rows} rows",
            "data": ray.data.range(rows, override_num_blocks=blocks).map_batches(_pixels).materialize(),
            "ours": {"factory": mlp, "method": "encode", "columns": {"x": "pixels"}, "keep": ["id"]},
            "hand": (HandWrittenEncode, {"factory": mlp}),
            "model": (mlp, _encode_pixels),
        }
    }
    try:
        import sentence_transformers  # noqa: F401
    except ImportError:
        print("no sentence-transformers: the text workload is skipped", file=sys.stderr)
        return found
    factory = functools.partial(_sentence_model, tmp)
    factory()  # writes the model's files once; each actor loads them
    found["text"] = {
        "describe": f"SentenceTransformer.encode (random BERT, hidden 256, 2 layers), {sentences} "
        "sentences of 8-23 words",
        "data": ray.data.range(sentences, override_num_blocks=blocks).map_batches(_texts).materialize(),
        "ours": {"factory": factory, "method": "encode", "columns": {"inputs": "text"},
                 "keep": ["id"], "output": "embedding"},
        "hand": (HandWrittenText, {"factory": factory}),
        "model": (factory, _encode_texts),
    }
    return found


def _pass(ray: Any, data: Any, cls: Any, kwargs: dict[str, Any], batch: int, actors: int) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = data.map_batches(cls, fn_constructor_kwargs=kwargs, batch_size=batch,
                           compute=ray.data.ActorPoolStrategy(size=actors)).materialize()
    return time.perf_counter() - t0, out


def _column(ds: Any, name: str) -> np.ndarray:
    rows = sorted(ds.take_all(), key=lambda r: r["id"])
    return np.stack([np.asarray(r[name]) for r in rows])


def _calls(w: dict[str, Any], batch: int, rounds: int) -> dict[str, Any]:
    """Per-batch time, in this process with no Ray between, of the two classes'
    ``__call__`` and of the model's method alone, on the first (up to) ``CALL_BATCHES``
    batches as Ray hands them (read-only numpy): ``rounds`` interleaved rounds of one
    sweep each (``_common.interleave``), the ratio paired per round."""
    batches = list(w["data"].iter_batches(batch_size=batch, batch_format="numpy"))[:CALL_BATCHES]
    cls, kw = w["hand"]
    build, bare = w["model"]
    model = build().eval()
    callers: dict[str, Callable[[Any], Any]] = {
        "predictor": Predictor(**w["ours"]), "hand-written": cls(**kw),
        "model": functools.partial(bare, model),
    }
    for f in callers.values():
        for b in batches:
            f(b)
    sweeps = {p: functools.partial(_sweep, f, batches) for p, f in callers.items()}
    times, _ = _common.interleave(sweeps, rounds, label=f"calls of {len(batches)} batches")
    times = {p: [t / len(batches) for t in ts] for p, ts in times.items()}
    return {"batches": len(batches), "rounds": rounds,
            "per_batch_us": {p: _summary([t * 1e6 for t in ts]) for p, ts in times.items()},
            "ratio_predictor_over_hand": _summary(_common.ratios(times, "hand-written", "predictor"))}


def _sweep(call: Callable[[Any], Any], batches: list[Any]) -> None:
    for b in batches:
        call(b)


def _summary(xs: list[float]) -> dict[str, float]:
    s = _common.summarize(xs)
    return {"median": s["median"], "p10": s["p10"], "p90": s["p90"], "n": s["n"]}


def run(ray: Any, rounds: int, rows: int, sentences: int, batch: int, actors: int, tmp: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, w in _workloads(ray, rows, sentences, tmp).items():
        n = w["data"].count()
        paths = {"predictor": (Predictor, w["ours"]), "hand-written": w["hand"]}
        outputs: dict[str, Any] = {}
        for p, (cls, kw) in paths.items():  # warm-up: the workers import torch and dpmethods
            _, outputs[p] = _pass(ray, w["data"], cls, kw, batch, actors)
        diff = float(np.abs(_column(outputs["predictor"], "embedding")
                            - _column(outputs["hand-written"], "embedding")).max())
        passes = {p: functools.partial(_pass, ray, w["data"], cls, kw, batch, actors) for p, (cls, kw) in paths.items()}
        times, _ = _common.interleave(passes, rounds, label=f"{name} passes")
        ratios = _common.ratios(times, "hand-written", "predictor")  # = throughput ratio
        with torch.inference_mode():
            torch.set_num_threads(1)  # as Ray gives a 1-CPU actor (OMP_NUM_THREADS=1)
            calls = _calls(w, batch, 2 * rounds)
        batches = -(-n // batch)
        model_s = calls["per_batch_us"]["model"]["median"] * 1e-6 * batches
        share = {p: model_s / statistics.median(ts) for p, ts in times.items()}
        if min(share.values()) < 0.5:
            print(f"WARNING: {name}: the model's compute is {min(share.values()):.0%} of a pass: the "
                  "pass is mostly Ray's, and the ratio cannot show the Predictor's own cost", flush=True)
        results[name] = {
            "describe": w["describe"], "rows": n, "batches": batches, "max_abs_diff_embedding": diff,
            "calls": calls, "model_share_of_pass": share,
            "pass_s": {p: _summary(ts) for p, ts in times.items()},
            "rows_per_s": {p: _summary([n / t for t in ts]) for p, ts in times.items()},
            "ratio_predictor_over_hand": _summary(ratios), "ratios": ratios, "target": TARGET,
        }
    return results


def table(results: dict[str, Any]) -> str:
    lines = ["| workload | hand-written rows/s (p10-p90) | Predictor rows/s (p10-p90) | "
             "Predictor / hand-written, paired (p10-p90) | model's share of a pass | "
             "per batch, no Ray (batches): model us | hand-written us | Predictor us | "
             "ratio (p10-p90) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        h, p, q = r["rows_per_s"]["hand-written"], r["rows_per_s"]["predictor"], r["ratio_predictor_over_hand"]
        lines.append(f"| {name} | {h['median']:.0f} ({h['p10']:.0f}-{h['p90']:.0f}) | "
                     f"{p['median']:.0f} ({p['p10']:.0f}-{p['p90']:.0f}) | "
                     f"{q['median']:.3f} ({q['p10']:.3f}-{q['p90']:.3f}) | "
                     f"{100 * r['model_share_of_pass']['hand-written']:.0f}% | " + _calls_cells(r["calls"]))
    return "\n".join(lines)


def _calls_cells(c: dict[str, Any]) -> str:
    m, h, p = (c["per_batch_us"][k] for k in ("model", "hand-written", "predictor"))
    q = c["ratio_predictor_over_hand"]
    return (f"{m['median']:.0f} ({c['batches']}) | {h['median']:.0f} | {p['median']:.0f} | "
            f"{q['median']:.3f} ({q['p10']:.3f}-{q['p90']:.3f}) |")


def report(saved: dict[str, Any]) -> str:
    """The README's text of a saved run: what it was measured on, then its table."""
    return _common.provenance_line(saved["machine"]) + "\n\n" + table(saved["workloads"])


def plot(results: dict[str, Any], path: Path, title: str) -> None:
    names = list(results)
    q = [results[n]["ratio_predictor_over_hand"] for n in names]
    _common.plot_ratios(path, names, [x["median"] for x in q], lows=[x["p10"] for x in q],
                        highs=[x["p90"] for x in q], title=title,
                        ylabel="throughput: Predictor / hand-written")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds per workload (default: 6)")
    parser.add_argument("--rows", type=int, default=16384, help="rows of the mlp workload (default: 16384)")
    parser.add_argument("--sentences", type=int, default=16384, help="rows of the text workload (default: 16384)")
    parser.add_argument("--batch", type=int, default=64, help="map_batches batch_size (default: 64)")
    parser.add_argument("--actors", type=int, default=1, help="actors in the pool, 1 CPU each (default: 1)")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 2048 rows and 512 sentences (default: off)")
    parser.add_argument("--out", type=Path, default=_HERE / "results", help="where the JSON and PNG go (default: benchmarks/results)")
    parser.add_argument("--from-json", type=Path, help="redraw the table and plot of a saved run (default: none)")
    args = parser.parse_args(argv)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        print(report(saved))
        plot(saved["workloads"], args.from_json.with_suffix(".png"), saved["title"])
        return 0
    import ray

    if args.quick:
        args.rounds, args.rows, args.sentences = 2, 2048, 512
    path = os.pathsep.join(filter(None, [str(_HERE), str(_HERE.parent), os.environ.get("PYTHONPATH")]))
    clock = _common.started_run()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        with tempfile.TemporaryDirectory() as tmp:
            results = run(ray, args.rounds, args.rows, args.sentences, args.batch, args.actors, tmp)
    finally:
        ray.shutdown()
    title = f"dpmethods.ray.Predictor vs hand-written (Ray {ray.__version__}, CPU, {args.actors} actor)"
    data = {
        "title": title, "machine": {**_common.machine_info(), **_common.finished_run(clock)},
        "ray": ray.__version__, "dpmethods": dpmethods.__version__,
        "settings": {"rounds": args.rounds, "rows": args.rows, "sentences": args.sentences, "batch": args.batch,
                     "actors": args.actors, "num_cpus": 2},
        "workloads": results,
        "median_ratio_at_least_target": all(
            r["ratio_predictor_over_hand"]["median"] >= TARGET for r in results.values()),
    }
    out = _common.write_json(args.out / "ray_cpu.json", data)
    plot(results, out.with_suffix(".png"), title)
    print(table(results))
    m = data["machine"]
    print(f"wrote {out} ({m['wall_s']:.0f} s; load {m['loadavg_before'][0]:.1f} -> {m['loadavg_after'][0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
