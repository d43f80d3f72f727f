"""Warnings given once per process for each distinct message.

A gather runs on every call; a warning about the shape of an output (a per-item list,
a batch-coupled matrix, an object without a rule) is useful once, not on every step.
Python's own "default" filter would also repeat it whenever the message or the calling
line differs, and not at all under a caller's "ignore", so the messages given are kept here.
"""

from __future__ import annotations

import threading
import warnings

__all__ = ["first_time", "reset", "take_given", "warn_once"]

_seen: set[str] = set()
_lock = threading.Lock()
_LIMIT = 10_000  # a bound, so messages naming many distinct paths can't grow without end


def warn_once(message: str, stacklevel: int = 4, category: type[Warning] = UserWarning) -> bool:
    """Warn with ``message`` unless it was given before; True if it warned.

    Args:
        message: the full text; it is what is remembered.
        stacklevel: as for :func:`warnings.warn`.
        category: the warning's class (a former name says ``FutureWarning``).

    Example:
        >>> import warnings
        >>> reset()
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     warn_once("x"), warn_once("x")
        (True, False)
        >>> len(seen)
        1
    """
    if not first_time(message):
        return False
    warnings.warn(message, category, stacklevel=stacklevel)
    return True


def first_time(message: str) -> bool:
    """Record ``message`` as given; True unless it was given before.

    A worker process's warnings are given again in the caller through it, so the
    caller keeps one set of the messages given.

    Example:
        >>> reset()
        >>> first_time("y"), first_time("y")
        (True, False)
    """
    with _lock:
        if message in _seen:
            return False
        if len(_seen) < _LIMIT:
            _seen.add(message)
    return True


def take_given() -> set[str]:
    """The messages given so far, forgotten (a worker process hands them to its caller).

    Example:
        >>> reset(); _ = first_time("z")
        >>> take_given()
        {'z'}
    """
    with _lock:
        given = set(_seen)
        _seen.clear()
    return given


def reset() -> None:
    """Forget which warnings were given (for tests).

    Example:
        >>> reset()
    """
    with _lock:
        _seen.clear()
