"""One lazy rule for everything that waits on an import.

Integrations, the rules of ``"module:Class"`` names and torch's distribution rules can
only be registered once their module is imported, which dpmethods never does itself.
Each adds a loader here, and every lookup that may need them (a class's methods, a
type's rule, a gather mode's name) first calls :func:`load_pending`. Loaders are cheap
and idempotent: each does nothing once its work is done.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["add_loader", "load_pending"]

_LOADERS: list[Callable[[], object]] = []


def add_loader(load: Callable[[], object]) -> None:
    """Run ``load()`` before every lookup from now on, in the order loaders were added.

    Example:
        >>> calls = []
        >>> add_loader(lambda: calls.append(1))
        >>> load_pending(); calls
        [1]
        >>> _LOADERS.pop() and None
    """
    if not callable(load):
        raise TypeError(f"add_loader: load: expected a callable load(), got {type(load).__name__} {load!r}")
    _LOADERS.append(load)


def load_pending() -> None:
    """Register whatever waited for a module that is imported by now.

    Example:
        >>> load_pending()
    """
    for load in list(_LOADERS):  # a loader may add another
        load()
