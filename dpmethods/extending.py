"""The extension API: what a library integration (built in or your own) plugs in with.

Everything dpmethods knows about a third-party library is written with these functions,
the same ones you have for your own library:

- :func:`register_method_finder`: which methods of a library's classes are parallel
  methods, with what options (the lowest precedence: decorations, ``register`` and
  ``methods=`` win);
- :func:`dpmethods.register_type`: how a library's class comes apart into tensors;
- :func:`register_gather_mode`: a named gather mode that joins a whole output and sees
  the :class:`Call` (the model, the arguments, each replica's share);
- :class:`CallHooks`, as the ``hooks`` option: adapt a call's arguments, each replica's
  share and the gathered output;
- :func:`mark_batch_coupled`: a module class whose result couples the batch (an
  in-batch-negatives loss), warned about when it runs on a replica's share;
- :func:`register_process_rule`: what a library keeps per process with
  ``workers="processes"`` (hooks that are never sent, state registered again in a worker);
- :func:`register_item_state`: which registered types are batch state (a cache), each
  item's kept as a batch of its rows in item maps, and which of their positions are its
  own (:class:`ItemState`).

and what an integration builds with: :class:`MethodOptions`, :func:`gather` (the stage
function, for a gather mode that joins parts of an output itself), :func:`warn_once`
(one warning per distinct message) and :func:`unwrap_compiled` (the model under
``torch.compile``'s wrapper).

Example:
    >>> import torch
    >>> from dpmethods import DataParallel, MethodOptions
    >>> from dpmethods.extending import register_method_finder, register_gather_mode
    >>> class Scorer(torch.nn.Module):  # a class of "your library"
    ...     def score(self, x):
    ...         return x.sum(1)
    >>> register_gather_mode("total", lambda outs, device, call: sum(o.sum() for o in outs))
    >>> register_method_finder(
    ...     lambda cls, own=Scorer: {"score": MethodOptions(gather="total")} if issubclass(cls, own) else {})
    >>> DataParallel(Scorer(), device_ids=["cpu"] * 2).score(torch.ones(4, 3)).item()
    12.0
"""

from __future__ import annotations

from dpmethods.parallel import gather
from dpmethods.processes.state import register_process_rule
from dpmethods.types.coupled_modules import is_batch_coupled, mark_batch_coupled
from dpmethods.types.cut import ItemState, register_item_state
from dpmethods.types.owners import unwrap_compiled
from dpmethods.types.rules import register_type
from dpmethods.vocab.call_hooks import Call, CallHooks
from dpmethods.vocab.gather_modes import Mode, known_modes, register_gather_mode
from dpmethods.vocab.options import MethodOptions
from dpmethods.vocab.warn_once import warn_once
from dpmethods.wrapper.registry import register_method_finder

# The one door of an integration: it imports these names from here and nothing else of
# dpmethods (tests/docs/test_architecture.py checks it), so the modules behind them can move.
__all__ = [
    "CallHooks",
    "Call",
    "ItemState",
    "MethodOptions",
    "Mode",
    "gather",
    "is_batch_coupled",
    "known_modes",
    "mark_batch_coupled",
    "register_gather_mode",
    "register_item_state",
    "register_method_finder",
    "register_process_rule",
    "register_type",
    "unwrap_compiled",
    "warn_once",
]
