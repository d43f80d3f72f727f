"""Batch inference with Ray Data: a model's embed method on every actor of a pipeline.

    pip install "ray[data]"
    python examples/ray_batch_inference.py                  # a local cluster: ray.init(num_cpus=2)
    python examples/ray_batch_inference.py --replicas 2     # each actor splits its batches over 2 CPU replicas

``dpmethods.ray.Predictor`` is the callable class ``map_batches`` runs on each actor: it
builds the model once (``load_model`` here: a picklable zero-argument function), turns the
``features`` column into the ``x`` argument, runs ``embed`` through
``dpmethods.DataParallel`` over the actor's devices and returns the ``embedding`` and
``norm`` columns, with ``id`` kept. Ray schedules the actors, balances the batches
between them and restarts the ones that fail.

The same script on a multi-node cluster: connect to it instead of starting a local one
(``--address auto``, which is ``ray.init(address="auto")``), and give each actor GPUs:

    ray job submit --working-dir . -- \\
        python examples/ray_batch_inference.py --address auto --actors 8 --gpus-per-actor 2

Each actor then gets 2 GPUs, and each of its batches is split over them. For real data,
read and write storage instead of ``ray.data.range``: ``ray.data.read_parquet("s3://...")``
and ``ds.write_parquet("s3://...")`` (``--out`` writes Parquet files here).

The script checks the pipeline's rows against the model run on the whole dataset in
this process, and prints the result.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

import dpmethods

FEATURES, DIM = 32, 16


class Encoder(nn.Module):
    """A small MLP with an ``embed`` parallel method returning two per-row outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, DIM))

    @dpmethods.parallel_method
    def embed(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.net(x)
        return {"embedding": h, "norm": h.norm(dim=1)}


def load_model() -> Encoder:
    """Build the model (seeded, so every actor's equals this process's); in real use,
    load the weights here, e.g. ``Model.from_pretrained(...)``."""
    torch.manual_seed(0)
    return Encoder().eval()


def features(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Synthetic rows: an ``id`` and a ``features`` vector derived from it alone (so
    a row's features do not depend on which batch it is in)."""
    ids = batch["id"]
    angles = np.outer(ids + 1, np.arange(1, FEATURES + 1)) * 0.37
    return {"id": ids, "features": np.sin(angles).astype(np.float32)}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=512, help="rows of the dataset (default: 512)")
    p.add_argument("--batch-size", type=int, default=64, help="rows per batch (default: 64)")
    p.add_argument("--actors", type=int, default=1, help="actors in the pool (default: 1)")
    p.add_argument("--gpus-per-actor", type=float, default=0,
                   help="GPUs Ray gives each actor; its batches are split over them (default: 0, the CPU)")
    p.add_argument("--replicas", type=int, default=0,
                   help="CPU replicas per actor instead of its GPUs (default: 0, the actor's devices)")
    p.add_argument("--address", default=None,
                   help="a running cluster to connect to ('auto' under ray job submit) (default: none, a local cluster)")
    p.add_argument("--out", default=None, help="write the result as Parquet files to this folder (default: none)")
    return p


def _check(rows: dict[str, np.ndarray], n: int) -> bool:
    """The pipeline's rows equal the model's on the whole dataset, within fp32 rounding."""
    order = np.argsort(rows["id"])
    data = features({"id": np.arange(n)})
    model = load_model()
    x = torch.from_numpy(data["features"])
    with torch.no_grad():
        want = model.embed(x)["embedding"]
        # Each output sums 64 products (and a bias) after one sum of FEATURES: the order
        # of those sums (BLAS picks it per batch size) moves the result by at most
        # (64 + FEATURES + 2) * eps * the terms' magnitudes; the largest output bounds them.
        tol = (64 + FEATURES + 2) * torch.finfo(torch.float32).eps * float(want.abs().max() + 1)
    got = np.stack(list(rows["embedding"][order]))
    return bool(np.array_equal(rows["id"][order], np.arange(n))) and bool(
        np.abs(got - want.numpy()).max() <= tol)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    try:
        import ray
    except ImportError:
        sys.stderr.write('this example needs Ray Data: pip install "ray[data]"\n')
        raise SystemExit(1) from None
    from dpmethods.ray import Predictor

    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        ds = ray.data.range(args.rows).map_batches(features)
        ds = ds.map_batches(
            Predictor,
            fn_constructor_kwargs={
                "factory": load_model, "method": "embed", "columns": {"x": "features"},
                "keep": ["id"], "device_ids": ["cpu"] * args.replicas if args.replicas else None,
            },
            batch_size=args.batch_size,
            num_gpus=args.gpus_per_actor,
            compute=ray.data.ActorPoolStrategy(size=args.actors),
        )
        ds = ds.materialize()  # runs the pipeline once, for both uses below
        if args.out:
            ds.write_parquet(args.out)
        batches = list(ds.iter_batches(batch_size=None))
        rows = {k: np.concatenate([b[k] for b in batches]) for k in ("id", "embedding", "norm")}
    finally:
        ray.shutdown()
    summary = {"rows": len(rows["id"]), "columns": sorted(rows), "equal": _check(rows, args.rows)}
    print(f"rows: {summary['rows']}, columns: {summary['columns']}")
    print(f"equal to one device (within fp32 rounding): {summary['equal']}")
    return summary


if __name__ == "__main__":
    main()
