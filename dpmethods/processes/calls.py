"""A call on the worker processes, and a finished job's output as the caller keeps it.

:func:`call_chunks` runs a scattered call of ``workers="processes"``: chunk i on
worker i. :func:`received` moves an output to ``output_device`` in the caller; a job
nobody waits for any more (a map stopped early, a call that failed) is drained when it
finishes (:func:`drain`), its shared memory fetched and freed.
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any

import torch
from torch import Tensor, nn

from dpmethods.core.parallel_apply import ThreadState
from dpmethods.core.seeding import draw_seed, replica_seed
from dpmethods.processes import worker as process_worker
from dpmethods.processes.pickling import dumps, loads, unsendable_options
from dpmethods.processes.pool import ProcessPool
from dpmethods.types import tree as _tree
from dpmethods.vocab.options import MethodOptions

__all__ = ["call_chunks", "check_sendable", "drain", "received"]


def received(obj: Any, device: torch.device | None) -> Any:
    """An output as the caller keeps it: on ``device``, and owning its CUDA memory."""
    spec, leaves = _tree.flatten(obj)
    if not any(isinstance(t, Tensor) for t in leaves):
        return obj
    out = []
    for t in leaves:
        if isinstance(t, Tensor):
            moved = t.to(device) if device is not None else t
            # A CUDA tensor from a worker holds the worker's memory (CUDA IPC): copy it.
            t = moved.clone() if moved is t and t.is_cuda else moved
        out.append(t)
    return _tree.unflatten(spec, out)


def drain(future: cf.Future[bytes]) -> None:
    """Fetch and drop the reply of a job nobody waits for (its shared memory is freed)."""
    if not future.cancelled() and future.exception() is None:
        try:
            loads(future.result())
        except Exception:  # pragma: no cover - the worker may be gone
            pass


def check_sendable(options: MethodOptions | None, where: str, method: str) -> None:
    """Refuse, naming the part, options that cannot be sent to a worker process (with
    ``on_oom="split"`` a worker runs the method's hooks and gather on its halves).

    Example:
        >>> check_sendable(MethodOptions(), "map", "encode")
    """
    problem = None if options is None else unsendable_options(options)
    if problem is not None:
        raise TypeError(
            f"{where}: the options of {method} cannot be sent to a worker process: {problem}. "
            "A worker splits a batch that runs out of memory with the method's hooks and "
            "gather: define them at module level (functions, or instances of module-level "
            "classes), or use workers='threads'"
        )


def call_chunks(
    pool: ProcessPool, module: nn.Module, name: str, inputs: Any, kwargs: Any, *,
    oom: MethodOptions | None = None,
) -> list[Any]:
    """Run one scattered call: chunk i on worker i, outputs in chunk order (for gather);
    ``oom``: the method's options, to split a chunk that runs out of memory."""
    pool.prepare(module)
    state, seed, split = ThreadState.capture(), draw_seed(), len(inputs) > 1
    futures = []
    try:
        for w, a, k in zip(pool.workers, inputs, kwargs):
            try:
                data = dumps((name, tuple(a), dict(k), state, replica_seed(seed, w.index), split,
                              None if oom is None else ("calls", oom, True)))
            except Exception as exc:
                check_sendable(oom, f"DataParallel.{name}(workers='processes', on_oom='split')", name)
                raise TypeError(
                    f"DataParallel.{name}(workers='processes'): its arguments cannot be sent "
                    f"to a worker process: {type(exc).__name__}: {exc}; use workers='threads'"
                ) from exc
            futures.append((w, w.submit(process_worker.run, data)))
        return [received(w.reply(f, f"DataParallel.{name}: raised in chunk {w.index}",
                                 f"chunk {w.index} of DataParallel.{name}"), None) for w, f in futures]
    finally:
        for _, f in futures:
            if not f.done():
                f.add_done_callback(drain)
