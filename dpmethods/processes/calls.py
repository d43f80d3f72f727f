"""A call on the worker processes.

:func:`call_shares` runs a scattered call of ``workers="processes"``: share i on
worker i, each a :class:`~dpmethods.processes.messages.Request`, each output read back
by :meth:`~dpmethods.processes.pool.Worker.reply`; a share nobody waits for any more
(a call that failed) is drained when it finishes (:func:`~dpmethods.processes.pool.drain`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from dpmethods.core.parallel_apply import ThreadState
from dpmethods.core.seeding import draw_seed, replica_seed
from dpmethods.processes.messages import Request, Split
from dpmethods.processes.pickling import unsendable_options
from dpmethods.processes.pool import ProcessPool, Unsendable, drain, logging_levels, received
from dpmethods.vocab.options import MethodOptions

__all__ = ["call_shares", "check_sendable"]


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


def call_shares(
    pool: ProcessPool, module: nn.Module, name: str, inputs: Any, kwargs: Any, *,
    oom: MethodOptions | None = None,
) -> list[Any]:
    """Run one scattered call: share i on worker i, outputs in share order (for gather);
    ``oom``: the method's options, to split a share that runs out of memory."""
    pool.prepare(module)
    state, seed, part = ThreadState.capture(), draw_seed(), len(inputs) > 1
    levels = logging_levels()  # the caller's, as its loggers judge the workers' records
    futures = []
    try:
        for w, a, k in zip(pool.workers, inputs, kwargs):
            request = Request(name, tuple(a), dict(k), state, replica_seed(seed, w.index), part,
                              None if oom is None else Split("calls", oom, prepared=True), levels)
            try:
                futures.append((w, pool.submit(w.index, request)))
            except Unsendable as exc:
                check_sendable(oom, f"DataParallel.{name}(workers='processes', on_oom='split')", name)
                raise exc.error(f"DataParallel.{name}(workers='processes')", "its arguments") from exc.__cause__
        # Every share is read, as threads wait for every replica: each gives its warnings,
        # and the first share's error is raised once all have answered.
        outputs, error = [], None
        for w, f in futures:
            try:
                outputs.append(received(w.reply(f, f"DataParallel.{name}: raised in share {w.index}",
                                                f"share {w.index} of DataParallel.{name}"), None))
            except Exception as exc:
                error = error or exc
        if error is not None:
            try:
                raise error
            finally:
                error = None  # this frame, in the error's traceback, holds no error: no cycle
        return outputs
    finally:
        for _, f in futures:
            if not f.done():
                f.add_done_callback(drain)
