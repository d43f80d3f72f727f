"""What of a module's state crosses to a worker process, and how its changes are seen.

- :func:`state_digest`: what :func:`~dpmethods.core.replicate.fingerprint` sees only by
  identity (attribute objects edited in place, ``requires_grad`` flags), so a worker's
  copy is sent again when it changed;
- :func:`register_process_rule`: what a library keeps per process. Some hooks belong to
  the process (and the call) that installed them, such as transformers' output-capturing
  hooks: they are never sent, and a worker's model installs its own. Some state a
  library's constructor registers per process, which unpickling a model skips: a rule's
  ``rebuilt`` registers it again in the worker.
"""

from __future__ import annotations

import hashlib
import io
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from dpmethods.core.replicate import HOOK_DICTS

__all__ = ["per_call", "rebuilt", "register_process_rule", "state_digest", "without_per_call_hooks"]


@dataclass(frozen=True)
class _Rule:
    per_call_hook: Callable[[Any], bool] | None
    attributes: tuple[str, ...]
    rebuilt: Callable[[nn.Module], None] | None


_RULES: list[_Rule] = []


def register_process_rule(
    per_call_hook: Callable[[Any], bool] | None = None,
    *,
    attributes: tuple[str, ...] = (),
    rebuilt: Callable[[nn.Module], None] | None = None,
) -> None:
    """Tell ``workers="processes"`` what a library keeps per process.

    Args:
        per_call_hook: ``per_call_hook(hook)`` is True for a hook function (in any of a
            module's forward or backward hook dicts) that belongs to the process that
            installed it: it is never sent to a worker process.
        attributes: module attributes that go with those hooks (a flag saying they are
            installed): never sent either.
        rebuilt: called in a worker process on each submodule of a model it received,
            to register again what the library's constructor registers per process.

    Example:
        >>> register_process_rule(lambda hook: getattr(hook, "__name__", "") == "_mine")
        >>> _ = _RULES.pop()
    """
    for name, fn in (("per_call_hook", per_call_hook), ("rebuilt", rebuilt)):
        if fn is not None and not callable(fn):
            raise TypeError(
                f"register_process_rule: {name}: expected a callable or None, got "
                f"{type(fn).__name__} {fn!r}"
            )
    if not (isinstance(attributes, tuple) and all(isinstance(a, str) for a in attributes)):
        raise TypeError(
            f"register_process_rule: attributes: expected a tuple of str, got "
            f"{type(attributes).__name__} {attributes!r}"
        )
    _RULES.append(_Rule(per_call_hook, attributes, rebuilt))


def per_call(hook: Any) -> bool:
    """Whether a rule says ``hook`` stays in its process.

    Example:
        >>> per_call(print)
        False
    """
    return any(r.per_call_hook is not None and r.per_call_hook(hook) for r in _RULES)


def without_per_call_hooks(module: nn.Module) -> Any:
    """``module``'s pickle reduction without its per-process hooks and attributes, or
    NotImplemented when it has none (the usual case: a look at each hook dict).

    Example:
        >>> without_per_call_hooks(nn.Linear(2, 2))
        NotImplemented
    """
    if not _RULES:
        return NotImplemented
    d = module.__dict__
    drop = {k for name in HOOK_DICTS for k, h in d.get(name, {}).items() if per_call(h)}
    attributes = {a for r in _RULES for a in r.attributes if a in d}
    if not drop and not attributes:
        return NotImplemented
    rv = list(module.__reduce_ex__(pickle.HIGHEST_PROTOCOL))
    state = {k: v for k, v in rv[2].items() if k not in attributes}
    for name, value in d.items():
        if isinstance(value, dict) and "hook" in name and drop & value.keys():
            state[name] = type(value)((k, v) for k, v in value.items() if k not in drop)
    rv[2] = state
    return tuple(rv)


def rebuilt(model: nn.Module) -> None:
    """In a worker: run every rule's ``rebuilt`` on each submodule of ``model``.

    Example:
        >>> rebuilt(nn.Linear(2, 2))
    """
    hooks = [r.rebuilt for r in _RULES if r.rebuilt is not None]
    for m in model.modules() if hooks else ():
        for hook in hooks:
            hook(m)


def _stub(*_: Any) -> None:
    """What a tensor pickles to in :func:`state_digest` (never called)."""


class _StatePickler(pickle.Pickler):
    """Attribute objects: tensors as stubs holding their grad flag and version."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Tensor):
            try:
                return (_stub, (obj.requires_grad, obj._version))
            except RuntimeError:  # an inference tensor has no version counter
                return (_stub, (obj.requires_grad,))
        if isinstance(obj, (torch.UntypedStorage, torch.TypedStorage)):
            return (_stub, ())
        if isinstance(obj, nn.Module):
            return (_stub, ())  # a module held as an attribute: its own walk covers it
        return NotImplemented


# Values that cannot change in place: the fingerprint's identities cover them.
_IMMUTABLE = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)
# nn.Module's own attributes: parameters, buffers, children and call hooks are in the
# fingerprint; the other hook dicts (state-dict hooks) do not change what a call does.
_COVERED = frozenset(vars(nn.Module()))


def state_digest(module: nn.Module) -> Any:
    """A digest of what :func:`~dpmethods.core.replicate.fingerprint` sees only by
    identity: attribute objects edited in place (a config, a generation config, a
    dict of options) and the ``requires_grad`` flags.

    Each distinct mutable attribute object of every submodule is pickled once, with
    tensors stubbed (no tensor data): a config shared by every layer costs one pickle.
    A module whose attributes cannot be pickled gets a digest equal to no other
    (sending it then names what fails).

    Example:
        >>> m = torch.nn.Linear(2, 2)
        >>> before = state_digest(m)
        >>> _ = m.requires_grad_(False)
        >>> state_digest(m) == before
        False
    """
    values: dict[int, Any] = {}
    flags: list[bool] = []
    attributes = {a for r in _RULES for a in r.attributes}
    for m in module.modules():
        for name, value in m.__dict__.items():
            if name not in _COVERED and name not in attributes and not isinstance(value, _IMMUTABLE):
                values.setdefault(id(value), value)
        flags.extend(p is not None and p.requires_grad for p in m._parameters.values())
    buf = io.BytesIO()
    try:
        _StatePickler(buf, pickle.HIGHEST_PROTOCOL).dump((flags, list(values.values())))
    except Exception:
        return object()
    return hashlib.blake2b(buf.getbuffer(), digest_size=16).digest()
