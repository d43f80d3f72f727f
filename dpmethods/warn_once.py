"""Warnings given once per process for each distinct message.

A gather runs on every call; a warning about the shape of an output (a per-item list,
a batch-coupled matrix, an object without a rule) is useful once, not on every step.
Python's own "default" filter would also repeat it whenever the message or the calling
line differs, and not at all under a caller's "ignore", so the record is kept here.
"""

from __future__ import annotations

import threading
import warnings

__all__ = ["reset", "warn_once"]

_seen: set[str] = set()
_lock = threading.Lock()
_LIMIT = 10_000  # a bound, so messages naming many distinct paths can't grow without end


def warn_once(message: str, stacklevel: int = 4) -> bool:
    """Warn with ``message`` (UserWarning) unless it was given before; True if it warned.

    Args:
        message: the full text; the record is keyed by it.
        stacklevel: as for :func:`warnings.warn`.

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
    with _lock:
        if message in _seen:
            return False
        if len(_seen) < _LIMIT:
            _seen.add(message)
    warnings.warn(message, UserWarning, stacklevel=stacklevel)
    return True


def reset() -> None:
    """Forget which warnings were given (for tests).

    Example:
        >>> reset()
    """
    with _lock:
        _seen.clear()
