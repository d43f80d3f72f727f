"""The last module the tests' fork server imports (tests/conftest.py preloads the model
libraries there): what the server imported is collected once, then frozen.

A worker forked from the server runs one full collection before it freezes its first
model's objects (``dpmethods.processes.worker``); frozen here, the libraries' objects
are not scanned by it again in every worker, and their pages stay shared with the
server. Imported anywhere else (a doctest walk of the tests), it changes nothing.
"""

from __future__ import annotations

import gc
import os
import sys

__all__: list[str] = []


def _in_the_fork_server() -> bool:
    """Whether this import runs in ``multiprocessing.forkserver.main``'s preload."""
    server = os.path.join("multiprocessing", "forkserver.py")
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "main" and frame.f_code.co_filename.endswith(server):
            return True
        frame = frame.f_back
    return False


if _in_the_fork_server():
    gc.collect()
    gc.freeze()
