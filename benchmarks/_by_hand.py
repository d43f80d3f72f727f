"""What a user would write instead of dpmethods' worker processes on the CPU: the batches
split by hand over plain processes, batch ``i`` on process ``i % n``, each process with
its own copy of the model (bench_map's ``by-hand`` path).

No scheduling, no model checks, no retries: what is left is what two processes running
the same loops cost on the host, the ceiling of any process map there.

Example:
    >>> import torch
    >>> by_hand = ByHand(torch.nn.Identity(), "forward", [{"input": torch.ones(1)}] * 3, {}, 2, 1)
    >>> [t.tolist() for t in by_hand()]
    [[1.0], [1.0], [1.0]]
    >>> by_hand.close()
"""

from __future__ import annotations

import copy
import multiprocessing
import warnings
from typing import Any

import torch
from torch import nn

__all__ = ["ByHand"]


class ByHand:
    """``n`` processes, each running its share of ``batches`` (dicts of keyword
    arguments) with ``method(**batch, **kwargs)`` on ``threads`` torch threads, on each
    call; the outputs in the batches' order."""

    def __init__(self, model: nn.Module, method: str, batches: list[dict[str, Any]], kwargs: dict[str, Any],
                 n: int, threads: int) -> None:
        context = multiprocessing.get_context("forkserver")
        self._n, self._count = n, len(batches)
        self._conns: list[Any] = []
        self._procs: list[Any] = []
        for k in range(n):
            ours, theirs = context.Pipe()
            proc = context.Process(target=_serve, args=(theirs, model, method, batches[k::n], kwargs, threads),
                                   name=f"by-hand-{k}", daemon=True)
            proc.start()
            theirs.close()
            self._conns.append(ours)
            self._procs.append(proc)

    def __call__(self) -> list[Any]:
        for conn in self._conns:
            conn.send(True)
        out: list[Any] = [None] * self._count
        for k, conn in enumerate(self._conns):
            out[k::self._n] = conn.recv()
        return out

    def close(self) -> None:
        for conn in self._conns:
            conn.send(False)
        for proc in self._procs:
            proc.join(10)


def _serve(conn: Any, model: nn.Module, method: str, batches: list[dict[str, Any]], kwargs: dict[str, Any],
           threads: int) -> None:
    torch.set_num_threads(threads)
    model = copy.deepcopy(model)  # its own memory, as a model built in the process has
    call = model if method == "forward" else getattr(model, method)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes on attention masks
        while conn.recv():
            conn.send([call(**b, **kwargs) for b in batches])
