"""What crosses between the caller and a worker process: a few named records.

::

    caller (processes/pool.py)                       a worker process (processes/worker.py)

    Load(kind, what, marks,      -- pickled -->      load(): builds the model
         classes)
                                 <-- pickled --      Done(output=the worker's pid, warned, logged)
    Request(method, args, kwargs, state,
            seed, part_of_batch, oom,
            levels) ------------------------->     run(): one map batch or call share
                                 <--------------     Done(output, warned, logged)
                                                     or Failed(error, traceback, warned, logged)

Each record is pickled by :func:`~dpmethods.processes.pickling.dumps` (tensors inline
or in shared memory) as its class and the tuple of its fields, and is the whole
message: a failure is a reply, never an exception of the executor, so any exception
comes back with its type, notes and traceback text. :class:`Warned` is one warning a
job raised, and :class:`Logged` one record it logged, each given again in the caller
(:meth:`~dpmethods.processes.pool.Worker.reply`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dpmethods.types.coupled_modules import Mark

__all__ = ["Done", "Failed", "Load", "Logged", "Request", "Split", "Warned"]


class _Record:
    """Pickled as its class called with its fields, in order: a batch's two messages
    cost a fraction of the default reduction (a state dict set on a bare instance)."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return type(self), tuple(self.__dict__.values())  # a dataclass's fields, in order


@dataclasses.dataclass(frozen=True)
class Warned(_Record):
    """One warning a job raised, as the caller gives it again.

    Example:
        >>> Warned("slow", UserWarning, "m.py", 3, "m", once=False).category.__name__
        'UserWarning'
    """

    text: str
    category: type[Warning]
    filename: str
    lineno: int
    module: str | None  # the warning's module, whose registry the caller's filters use
    once: bool  # a dpmethods warn-once warning: given once per caller process


@dataclasses.dataclass(frozen=True)
class Logged(_Record):
    """One record a job logged (a library's ``logger.warning``), as the caller handles it
    again: its message formatted, its exception's traceback as text.

    Example:
        >>> Logged("lib", 30, "slow", "lib.py", 3, "run", None, None, once=False).levelno
        30
    """

    name: str
    levelno: int
    message: str
    pathname: str
    lineno: int
    func: str | None
    exc_text: str | None
    stack_info: str | None
    once: bool  # logged by a ``*_once`` function (transformers' ``warning_once``): once per caller


@dataclasses.dataclass(frozen=True)
class Load(_Record):
    """Build the worker's model: ``kind`` ``"model"`` (``what``: the pickled module) or
    ``"factory"`` (``what``: a callable that returns it); ``marks``: the batch-coupled
    classes to mark there too; ``classes``: the model's classes as the caller has them
    (a :class:`~dpmethods.processes.classes.ClassState`; None for a factory's model).

    Example:
        >>> Load("factory", dict, {}, None).kind
        'factory'
    """

    kind: str
    what: Any
    marks: dict[type, Mark]
    classes: Any  # dpmethods.processes.classes.ClassState | None


@dataclasses.dataclass(frozen=True)
class Split(_Record):
    """``on_oom="split"`` in a worker: a batch that runs out of memory is halved by the
    method's ``options``; ``key`` names the memory record kept (one per map, one for the
    calls); ``prepared``: a call's share, adapted by the method's hooks already.

    Example:
        >>> Split("calls", None, prepared=True).prepared
        True
    """

    key: Any
    options: Any  # MethodOptions
    prepared: bool


@dataclasses.dataclass(frozen=True)
class Request(_Record):
    """Run ``method(*args, **kwargs)`` on the worker's model under the caller's thread
    ``state``, seeded with ``seed`` (None: not seeded); ``part_of_batch``: a scattered
    call's share (batch-coupled modules warn); ``oom``: how to split a batch out of memory;
    ``levels``: the caller's logging levels (:func:`~dpmethods.processes.pool.logging_levels`).

    Example:
        >>> Request("forward", (1,), {}, None, None, False, None).method
        'forward'
    """

    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    state: Any  # dpmethods.core.parallel_apply.ThreadState
    seed: int | None
    part_of_batch: bool
    oom: Split | None
    levels: Any = None  # (logging.disable's level, the root's, ((name, level), ...))


@dataclasses.dataclass(frozen=True)
class Done(_Record):
    """A job's result: a batch's ``output`` (a load's: the worker's pid), what it warned
    and what it logged.

    Example:
        >>> Done(3, ()).output
        3
    """

    output: Any
    warned: tuple[Warned, ...]
    logged: tuple[Logged, ...] = ()


@dataclasses.dataclass(frozen=True)
class Failed(_Record):
    """A job's failure: its exception pickled on its own (``error``: as its own class, or
    where the caller cannot import it, a RuntimeError with its text), the worker's traceback, what it warned
    and logged.

    Example:
        >>> Failed(b"", "Traceback ...", ()).traceback
        'Traceback ...'
    """

    error: bytes
    traceback: str
    warned: tuple[Warned, ...]
    logged: tuple[Logged, ...] = ()
