"""One rule, and one table, for everything that waits on an import.

dpmethods never imports a library itself, so what it knows of one can only be
registered once the user has imported it: the integrations (``transformers``' methods
and rules), the rules of classes named ``"module:Class"`` (``register_type``,
``mark_batch_coupled``) and torch's distribution rules. Each is a step kept here under
the module it waits on (:func:`when_imported`); every lookup that may need one (a
class's methods, a type's rule, a gather mode's name, a worker's model) first calls
:func:`load_pending`, which runs, once, the steps of the modules imported by then.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import torch

__all__ = ["load_pending", "when_imported"]

# module name -> the steps that run once it is imported, in the order they were given.
_WAITING: dict[str, list[Callable[[], object]]] = {}
# Held while steps run: a lookup in another thread waits for them rather than going on
# without what they register. Reentrant: a step may itself look something up.
_lock = threading.RLock()


def when_imported(module: str, step: Callable[[], object]) -> None:
    """Run ``step()`` at the first :func:`load_pending` after ``module`` is imported.

    Example:
        >>> when_imported("sys", lambda: print("sys is here"))  # imported already
        >>> load_pending()
        sys is here
    """
    if not isinstance(module, str) or not module:
        raise TypeError(f"when_imported: module: expected a module name (str), got {module!r}")
    if not callable(step):
        raise TypeError(f"when_imported: step: expected a callable step(), got {type(step).__name__} {step!r}")
    with _lock:
        _WAITING.setdefault(module, []).append(step)


def load_pending() -> None:
    """Run the steps of every module imported by now, each once.

    Example:
        >>> load_pending()
    """
    if torch.compiler.is_compiling():
        # An import can't be traced: the next eager lookup runs them (a rule registered
        # then clears the tree's lookups, so nothing stale is kept).
        return
    if not any(module in sys.modules for module in list(_WAITING)):
        return
    with _lock:
        while True:  # a step may import a module, or wait on one, that is imported already
            ready = next((m for m in list(_WAITING) if m in sys.modules), None)
            if ready is None:
                return
            steps = _WAITING[ready]  # kept until its steps ran: other threads wait for them
            while steps:
                steps.pop(0)()
            if _WAITING.get(ready) is steps:  # (a step's own lookup may have ended it)
                del _WAITING[ready]
