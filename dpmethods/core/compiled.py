"""Compiled and patched modules: replicas that run their own code on their own parameters.

Three kinds of module hold code bound to *their own instance*, which a shallow replica
(``_replicate_for_data_parallel`` copies ``__dict__``) would keep calling:

- ``torch.compile(model)`` returns an ``OptimizedModule`` whose ``__setattr__`` writes
  through to the wrapped ``_orig_mod``, so torch's replication empties the *original*
  model's ``_parameters``; its ``forward`` is compiled around ``_orig_mod.__call__``.
  Its replica is made at the ``__dict__`` level and its ``forward`` is compiled again
  (``_initialize``, with the same dynamo context) around the replica's own ``_orig_mod``.
- ``model.compile()`` stores ``_compiled_call_impl``, a compiled wrapper of the
  module's bound ``_call_impl``; each replica gets the same dynamo context around its
  own ``_call_impl``. Compiled graphs are cached by code, so replicas reuse them (with
  torch's default inlining of module parameters as graph inputs).
- An instance attribute that is a method bound to the module (a patched ``forward``,
  Accelerate's mixed-precision wrapper, its ``_original_forward``) is bound to the
  replica.

Decorated methods of a compiled model are looked up on the wrapped model's class
(``dpmethods.types.owners.method_owner``).

torch 2.11 crashes (a segfault in dynamo's tracing) when replicas' threads compile,
at once or one after another, unless the caller's thread compiled first; there,
replicas that run compiled code take turns (:func:`takes_turns`): ``parallel_apply``
runs them one after another in the caller's thread, ``map`` one at a time
(:func:`one_at_a_time`), with a one-time warning. :data:`CONCURRENT_COMPILE` says
whether the running torch runs them in threads:

    >>> CONCURRENT_COMPILE == (tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 14))
    True
"""

from __future__ import annotations

import threading
import types
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from dpmethods.types.owners import is_compiled_wrapper
from dpmethods.vocab.warn_once import warn_once

__all__ = ["CONCURRENT_COMPILE", "one_at_a_time", "takes_turns"]

# Compiled code called from several threads can crash the process (a segfault) on torch
# 2.11, even with the threads' calls serialized by a lock; the caller's thread running
# the replicas in turn is safe. 2.14 is the first version known to run them in threads.
CONCURRENT_COMPILE = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 14)
_COMPILE_LOCK = threading.RLock()  # re-entrant: a replica's method may call another replica
_TAKING_TURNS: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def shallow_replica(module: nn.Module) -> nn.Module:
    """A replica as torch's ``_replicate_for_data_parallel`` makes it, never writing to ``module``.

    Example:
        >>> import torch
        >>> m = torch.compile(torch.nn.Linear(1, 1))
        >>> _ = shallow_replica(m)
        >>> len(list(m.parameters()))
        2
    """
    if not is_compiled_wrapper(module):
        return module._replicate_for_data_parallel()
    # OptimizedModule.__setattr__ forwards to _orig_mod: torch's replication would
    # empty the original model's _parameters. Work on the replica's own __dict__.
    replica = object.__new__(type(module))
    state = dict(module.__dict__)
    state["_parameters"] = {}
    state["_buffers"] = dict(state["_buffers"])
    state["_modules"] = dict(state["_modules"])
    state["_is_replica"] = True
    object.__setattr__(replica, "__dict__", state)
    return replica


def _dynamo_context(fn: Any) -> Any:
    """The dynamo context (``torch.compile``'s options) that made the wrapper ``fn``."""
    names = getattr(getattr(fn, "__code__", None), "co_freevars", ())
    for name, cell in zip(names, getattr(fn, "__closure__", None) or ()):
        if name == "self" and callable(cell.cell_contents):
            return cell.cell_contents
    return None


def _rebound(value: Any, clone_of: Mapping[int, nn.Module], where: str) -> Any:
    """``value`` bound to the replica instead of the source module, or ``value`` itself."""
    if isinstance(value, types.MethodType):
        target = clone_of.get(id(value.__self__))
        return value if target is None else types.MethodType(value.__func__, target)
    orig = getattr(value, "_torchdynamo_orig_callable", None)
    if orig is None or not callable(value):
        return value
    inner = _rebound(orig, clone_of, where)
    if inner is orig:
        return value
    context = _dynamo_context(value)
    if context is None:
        raise RuntimeError(
            f"replicate: {where} is code compiled for the source module, and this torch "
            "does not say how it was compiled, so a replica cannot compile its own; use "
            "torch.compile(model) (an OptimizedModule) or compile inside forward"
        )
    return context(inner)


def bound_attributes(modules: list[nn.Module]) -> list[tuple[int, str]]:
    """``(index, name)`` of the instance attributes that may hold code bound to a module.

    Computed once per replication; :func:`rebind` then visits only these.

    Example:
        >>> import torch
        >>> m = torch.nn.Linear(1, 1)
        >>> m.forward = m.forward
        >>> bound_attributes([m])
        [(0, 'forward')]
    """
    kinds = (types.MethodType, types.FunctionType)  # compiled wrappers are functions
    found = []
    for i, m in enumerate(modules):
        if is_compiled_wrapper(m):
            found.append((i, ""))
            continue
        found += [(i, k) for k, v in m.__dict__.items() if type(v) in kinds]
    return found


def rebind(
    modules: list[nn.Module], clones: list[nn.Module], bound: list[tuple[int, str]]
) -> None:
    """Point each replica's instance-bound code at the replica (see the module doc).

    Args:
        modules: the source modules.
        clones: their replicas, in the same order.
        bound: :func:`bound_attributes` of ``modules``.

    Example:
        >>> import torch
        >>> src = torch.nn.Linear(1, 1)
        >>> src.forward = src.forward  # a method bound to the instance
        >>> copy = src._replicate_for_data_parallel()
        >>> rebind([src], [copy], bound_attributes([src]))
        >>> copy.__dict__["forward"].__self__ is copy
        True
    """
    if not bound:
        return
    clone_of = {id(m): clone for m, clone in zip(modules, clones)}
    compiled = False
    for i, key in bound:
        m, clone = modules[i], clones[i]
        if not key:
            clone._initialize()  # type: ignore[operator]  # compiles forward for clone._orig_mod
            compiled = True
            continue
        value = m.__dict__[key]
        new = _rebound(value, clone_of, f"{type(m).__name__}.{key}")
        if new is not value:
            clone.__dict__[key] = new
            compiled = compiled or hasattr(new, "_torchdynamo_orig_callable")
    if compiled and not CONCURRENT_COMPILE:
        _TAKING_TURNS.add(clones[0])
        warn_once(
            f"DataParallel: torch {torch.__version__} crashes when replicas' threads compile, "
            "so replicas that run compiled code take turns on this torch, one after another "
            "(torch >= 2.14 runs them in parallel)"
        )


def takes_turns(replica: nn.Module) -> bool:
    """Whether ``replica`` runs compiled code on a torch that can't compile in threads.

    Example:
        >>> import torch
        >>> takes_turns(torch.nn.Linear(1, 1))
        False
    """
    return replica in _TAKING_TURNS


def one_at_a_time(fn: Callable[..., Any], replica: nn.Module) -> Callable[..., Any]:
    """``fn`` (a call on ``replica``), holding a lock where ``replica`` must take turns.

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(1, 1)
        >>> one_at_a_time(lin, lin) is lin  # no compiled code: runs as it is
        True
    """
    if replica not in _TAKING_TURNS:
        return fn

    def call(*args: Any, **kwargs: Any) -> Any:
        with _COMPILE_LOCK:
            return fn(*args, **kwargs)

    return call
