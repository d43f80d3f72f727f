"""Replicas kept between calls (``cache_replicas``), lent to one call at a time.

A replica is a shallow copy of the module made for one call: whatever a method
does to ``self`` (``self.count += 1``, ``self.buf.add_(1)`` on a replica's own copy)
is lost when the call ends. Kept replicas must behave the same, so before each
loan they are put back as :func:`dpmethods.core.replicate.replicate` made them: their
attribute dicts and hook dicts are restored, and if a tensor copy of their own (not the module's)
was changed in place, they are not lent at all and the caller builds new ones.
A call that finds them lent (to another thread, or to an outer call) builds its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from operator import is_
from typing import Any

import torch
from torch import Tensor, nn

from dpmethods.core.replicate import HOOK_DICTS

__all__ = ["CachedReplicas"]


def _tensors(m: nn.Module) -> Iterable[Tensor]:
    for group in (m._parameters, m._buffers):
        for t in group.values():
            if t is not None:
                yield t


def _unchanged(d: dict[str, Any], snapshot: dict[str, Any]) -> bool:
    # By identity, in C: ``d == snapshot`` would compare changed tensor values with ==.
    return (
        len(d) == len(snapshot)
        and all(map(is_, d.values(), snapshot.values()))
        and all(map(is_, d, snapshot))
    )


class _Loan(list):  # type: ignore[type-arg]
    """The replicas lent to one call; returning them (or dropping the list) ends the loan.

    Ended by ``__del__`` rather than a ``weakref.finalize``: a finalizer per call churns
    the global registry of finalizers, which every call would then pay for.
    """

    def __init__(self, replicas: list[nn.Module], lock: threading.Lock, key: object) -> None:
        super().__init__(replicas)
        self._lock: threading.Lock | None = lock
        self.key = key  # the cache's key: what they were built from

    def release(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def __del__(self) -> None:
        self.release()


class CachedReplicas:
    """Replicas built once under ``key`` and lent to one call at a time, reset on each loan.

    Args:
        key: the module's :func:`~dpmethods.core.replicate.fingerprint` when they were built.
        replicas: the replicas, one per device.
        module: the module they were made from (its own tensors need no version check:
            the fingerprint covers them).

    Example:
        >>> import torch
        >>> from dpmethods.core.replicate import replicate
        >>> m = torch.nn.Linear(2, 2)
        >>> cache = CachedReplicas("k", replicate(m, ["cpu", "cpu"], detach=True), m)
        >>> loan = cache.lend(2)
        >>> loan[1].extra = 1  # a method setting an attribute on its replica
        >>> cache.lend(2) is None  # lent already
        True
        >>> CachedReplicas.give_back(loan)
        >>> hasattr(cache.lend(2)[1], "extra")  # lost, as without the cache
        False
    """

    def __init__(self, key: object, replicas: list[nn.Module], module: nn.Module) -> None:
        self.key = key
        self.replicas = replicas
        self._lock = threading.Lock()
        own = {id(t) for t in module.parameters()} | {id(t) for t in module.buffers()}
        self._dicts: list[tuple[dict[str, Any], dict[str, Any]]] = []
        self._empty: list[dict[Any, Any]] = []  # hook dicts that were empty: the usual case
        copies: list[Tensor] = []
        for replica in replicas:
            for m in replica.modules():
                for d in (m.__dict__, m._parameters, m._buffers, m._modules):
                    self._dicts.append((d, dict(d)))
                # The replica's own hook dicts (replicate gives it every one): hooks a
                # call registered go with the call.
                for hooks in map(m.__dict__.__getitem__, HOOK_DICTS):
                    if hooks:
                        self._dicts.append((hooks, dict(hooks)))
                    else:
                        self._empty.append(hooks)
                copies.extend(t for t in _tensors(m) if id(t) not in own)
        self._copies = copies
        self._versions: list[int] | None
        try:
            self._versions = [t._version for t in copies]
        except RuntimeError:
            # Inference tensors have no version counter, so changes to them can't be
            # seen: such replicas are lent once (build them outside inference mode).
            self._versions = None
        self._lent_once = False

    def lent(self) -> bool:
        """Whether a call has them now."""
        return self._lock.locked()

    @staticmethod
    def give_back(replicas: object) -> None:
        """End the loan of ``replicas`` if they came from :meth:`lend` (else do nothing)."""
        if isinstance(replicas, _Loan):
            replicas.release()

    @staticmethod
    def key_of(replicas: object) -> object | None:
        """The key ``replicas`` were lent under if they came from :meth:`lend` (the
        module's fingerprint as the call that borrowed them took it), else None.

        Example:
            >>> import torch
            >>> from dpmethods.core.replicate import replicate
            >>> m = torch.nn.Linear(2, 2)
            >>> cache = CachedReplicas("k", replicate(m, ["cpu", "cpu"], detach=True), m)
            >>> CachedReplicas.key_of(cache.lend(2)), CachedReplicas.key_of([m])
            ('k', None)
        """
        return replicas.key if isinstance(replicas, _Loan) else None

    @staticmethod
    def lend_or_build(
        cached: CachedReplicas | None, key: object, module: nn.Module, devices: list[Any],
        n: int, build: Callable[[list[Any]], list[nn.Module]],
    ) -> tuple[CachedReplicas | None, list[nn.Module]]:
        """The cache to keep and ``n`` replicas for a call: lent from ``cached`` if its key
        is ``key`` and it is free, else from a new cache built for every device, else (the
        cache is lent to another call: a thread, or an outer call) built for this call.

        Example:
            >>> import torch
            >>> from dpmethods.core.replicate import replicate
            >>> m = torch.nn.Linear(2, 2)
            >>> build = lambda devs: replicate(m, devs, detach=True)
            >>> cache, loan = CachedReplicas.lend_or_build(None, "k", m, ["cpu"] * 2, 2, build)
            >>> cache.lent(), len(loan)
            (True, 2)
        """
        loan = cached.lend(n) if cached is not None and cached.key == key else None
        if loan is None and (cached is None or not cached.lent()):
            # Replicas for every device, so calls with smaller batches share them; built
            # outside inference mode, so their copies have version counters to check.
            with torch.inference_mode(False):
                cached = CachedReplicas(key, build(devices), module)
            loan = cached.lend(n)
        if loan is None:
            return cached, build(devices[:n])
        return cached, loan

    def __iter__(self) -> Any:
        return iter(self.replicas)

    def lend(self, n: int) -> list[nn.Module] | None:
        """The first ``n`` replicas, reset, or None if lent already or a copy was changed."""
        if not self._lock.acquire(blocking=False):
            return None
        if (
            self._lent_once
            if self._versions is None
            else [t._version for t in self._copies] != self._versions
        ):
            self._lock.release()
            return None  # a method changed a copy in place: rebuild, as a fresh call would
        self._lent_once = True
        for d, snapshot in self._dicts:
            if not _unchanged(d, snapshot):
                d.clear()
                d.update(snapshot)
        if any(self._empty):  # in C: a call left a hook behind
            for d in self._empty:
                d.clear()
        loan = _Loan(self.replicas[:n], self._lock, self.key)
        return loan
