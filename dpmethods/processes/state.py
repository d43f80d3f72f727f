"""What of a module's state crosses to a worker process, and how its changes are seen.

- :func:`state_digest`: what :func:`~dpmethods.core.replicate.fingerprint` sees only by
  identity (attribute objects edited in place, ``requires_grad`` flags), so a worker's
  copy is sent again when it changed;
- :class:`Watch`: what one look at a module saw, so that the next look costs no walk of
  the module when nothing changed (before each batch of a map, on worker processes and
  on replica threads alike);
- :func:`register_process_rule`: what a library keeps per process. Some hooks belong to
  the process (and the call) that installed them, such as transformers' output-capturing
  hooks: they are never sent, and a worker's model installs its own. Some state a
  library's constructor registers per process, which unpickling a model skips: a rule's
  ``rebuilt`` registers it again in the worker.
"""

from __future__ import annotations

import functools
import hashlib
import io
import operator
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from dpmethods.core.replicate import HOOK_DICTS, optimizer_steps
from dpmethods.ops import extension
from dpmethods.processes.classes import class_dicts, classes_of

_dict_version: Callable[[dict[Any, Any]], int] | None
try:  # a dict's version: new at every change to the dict (its tag, or a dict watcher)
    from torch._C._dynamo.guards import dict_version as _dict_version
except ImportError:  # pragma: no cover - a torch without it: every look walks the module
    _dict_version = None

__all__ = [
    "ProcessRule", "Watch", "compiled_readers", "per_call", "rebuilt", "register_process_rule", "sent_state",
    "state_digest", "versions_change", "without_per_call_hooks",
]


@dataclass(frozen=True, eq=False)
class ProcessRule:
    """A rule :func:`register_process_rule` registered; :meth:`remove` takes it back.

    Example:
        >>> rule = register_process_rule(attributes=("installed",))
        >>> rule.attributes
        ('installed',)
        >>> rule.remove()
    """

    per_call_hook: Callable[[Any], bool] | None
    attributes: tuple[str, ...]
    rebuilt: Callable[[nn.Module], None] | None

    def remove(self) -> None:
        """Take the rule back, for the models sent from now on (a second call does nothing)."""
        _RULES[:] = [r for r in _RULES if r is not self]


_RULES: list[ProcessRule] = []


def _torch_weight_norm_hook(hook: Any) -> bool:
    """torch's ``parametrizations.weight_norm`` load-state-dict hook (Wav2Vec2's, HuBERT's
    and Encodec's convolutions have one): a local function, which cannot be pickled, that
    reads legacy ``weight_g``/``weight_v`` keys. A worker's copy is sent whole by its
    parent and never loads a state dict, so it goes without it."""
    return (getattr(hook, "__module__", None) == "torch.nn.utils.parametrizations"
            and getattr(hook, "__qualname__", "") == "weight_norm.<locals>._weight_norm_compat_hook")


def register_process_rule(
    per_call_hook: Callable[[Any], bool] | None = None,
    *,
    attributes: tuple[str, ...] = (),
    rebuilt: Callable[[nn.Module], None] | None = None,
) -> ProcessRule:
    """Tell ``workers="processes"`` what a library keeps per process.

    Args:
        per_call_hook: ``per_call_hook(hook)`` is True for a hook function (in any of a
            module's forward or backward hook dicts) that belongs to the process that
            installed it: it is never sent to a worker process.
        attributes: module attributes that go with those hooks (a flag saying they are
            installed): never sent either.
        rebuilt: called in a worker process on each submodule of a model it received,
            to register again what the library's constructor registers per process.

    Returns:
        The rule, whose ``remove()`` takes it back.

    Example:
        >>> rule = register_process_rule(lambda hook: getattr(hook, "__name__", "") == "_mine")
        >>> rule.remove()
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
    rule = ProcessRule(per_call_hook, attributes, rebuilt)
    _RULES.append(rule)
    return rule


register_process_rule(_torch_weight_norm_hook)


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
    rv: list[Any] = []

    def pickled() -> dict[str, Any]:
        rv.extend(module.__reduce_ex__(pickle.HIGHEST_PROTOCOL))
        return dict(rv[2])

    state = sent_state(module, pickled)
    if state is None:
        return NotImplemented
    rv[2] = state
    return tuple(rv)


def sent_state(module: nn.Module, pickled: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
    """The state ``pickled()`` gives for ``module``, without its per-process hooks and
    attributes; None when it has none (and ``pickled`` is not called).

    Example:
        >>> sent_state(nn.Linear(2, 2), lambda: {}) is None
        True
    """
    d = module.__dict__
    # Every hook dict (state-dict hooks too), as the search for what fails to pickle sees them.
    drop = {k for name, value in d.items() if isinstance(value, dict) and "hook" in name
            for k, h in value.items() if per_call(h)}
    attributes = {a for r in _RULES for a in r.attributes if a in d}
    if not drop and not attributes:
        return None
    state = {k: v for k, v in pickled().items() if k not in attributes}
    for name, value in d.items():
        if isinstance(value, dict) and "hook" in name and drop & value.keys():
            state[name] = type(value)((k, v) for k, v in value.items() if k not in drop)
    return state


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


def _tensor_state(t: Tensor, versionless: bool = False) -> tuple[Any, ...]:
    """What shows that ``t`` changed or was replaced, without its data: its identity,
    version counter, ``requires_grad``, dtype, device, shape, and where it has a
    storage its data pointer, strides and offset (``.data =``). Raises ``RuntimeError``
    for an inference tensor, which has no version counter, unless ``versionless``
    (then its state leaves the version out)."""
    version = None if versionless and t.is_inference() else t._version
    state = (id(t), version, t.requires_grad, t.dtype, t.device, t.shape)
    try:
        return (*state, t.data_ptr(), t.stride(), t.storage_offset())
    except (RuntimeError, NotImplementedError):  # no strided storage (sparse, nested)
        return state


def _storage_state(s: Any) -> tuple[Any, ...]:
    try:
        return (id(s), s.data_ptr(), s.nbytes())
    except (RuntimeError, NotImplementedError):
        return (id(s),)


class _StatePickler(pickle.Pickler):
    """Attribute objects, with each tensor and storage a stub: its identity and what
    shows a change to it (:func:`_tensor_state`), never its data. An inference tensor
    raises (its in-place changes cannot be seen), unless ``versionless``. A module of the walk (``walked``, by
    id: the walk covers it) is a stub of its identity; any other module (one held in a
    list, or set with ``object.__setattr__``) is pickled whole, as it is sent, its
    tensors stubbed. Each stubbed object goes into ``kept`` where one is given: the
    caller keeps them alive while it compares digests, so no new object can take an old
    one's id unnoticed."""

    def __init__(self, file: Any, walked: frozenset[int], kept: list[Any] | None, versionless: bool = False) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self._walked = walked
        self._kept = kept
        self._versionless = versionless

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Tensor):
            if self._kept is not None:
                self._kept.append(obj)
            return (_stub, _tensor_state(obj, self._versionless))
        if isinstance(obj, (torch.UntypedStorage, torch.TypedStorage)):
            if self._kept is not None:
                self._kept.append(obj)
            return (_stub, _storage_state(obj))
        if isinstance(obj, nn.Module):
            if id(obj) in self._walked:
                if self._kept is not None:
                    self._kept.append(obj)
                return (_stub, (id(obj),))
            return without_per_call_hooks(obj)  # NotImplemented: as pickle reduces it
        return NotImplemented


# Values that cannot change in place: the fingerprint's identities cover them.
_IMMUTABLE = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)
# nn.Module's own attributes: parameters, buffers, children and which call hooks there
# are are in the fingerprint (each hook object is pickled: _attribute_objects); the other
# hook dicts (state-dict hooks) do not change what a call does.
_COVERED = frozenset(vars(nn.Module()))


def _frozen(value: Any) -> bool:
    """Whether ``value`` cannot change in place: an immutable scalar, or a tuple or
    frozenset of them (a convolution's ``kernel_size``)."""
    if isinstance(value, _IMMUTABLE):
        return True
    return type(value) in (tuple, frozenset) and all(map(_frozen, value))


def _sent_attributes(m: nn.Module) -> dict[str, Any]:
    """``m``'s attributes as it is pickled: its ``__dict__``, or what a ``__getstate__``
    of its class gives (one that leaves out a lock or a client: those never cross)."""
    if type(m).__getstate__ is _MODULE_GETSTATE:
        return m.__dict__
    try:
        state = m.__getstate__()
    except Exception:  # sending it names what fails
        return m.__dict__
    return state if isinstance(state, dict) else m.__dict__


_MODULE_GETSTATE = nn.Module.__getstate__


def _attribute_objects(m: nn.Module, into: dict[int, Any], skip: set[str]) -> None:
    """Add each of ``m``'s attribute objects that can change in place to ``into`` (by id),
    and each call hook that is sent (a hook object's settings, a partial's arguments)."""
    d = m.__dict__
    for name, value in _sent_attributes(m).items():
        if name not in _COVERED and name not in skip and not _frozen(value):
            into.setdefault(id(value), value)
    for name in HOOK_DICTS:
        hooks = d.get(name)
        for hook in hooks.values() if hooks else ():
            if not _frozen(hook) and not per_call(hook):  # a per-call hook is never sent
                into.setdefault(id(hook), hook)


def _pickled(values: list[Any], walked: frozenset[int], kept: list[Any] | None = None,
             versionless: bool = False) -> bytes:
    """``values`` pickled with their tensors and the modules in ``walked`` (by id)
    stubbed, each stubbed object put in ``kept`` (raises what pickling raises)."""
    buf = io.BytesIO()
    _StatePickler(buf, walked, kept, versionless).dump(values)
    return buf.getvalue()


def state_digest(module: nn.Module, kept: list[Any] | None = None) -> Any:
    """A digest of what :func:`~dpmethods.core.replicate.fingerprint` sees only by
    identity: attribute objects edited in place (a config, a generation config, a
    dict of options, a tensor in a dict replaced or updated, a module held outside the
    submodules, in a list or set with ``object.__setattr__``), the call hooks sent (a
    hook object's settings) and the ``requires_grad`` flags.

    Each distinct mutable attribute object and call hook of every submodule is pickled
    once (a function by its name), with each tensor a stub of its identity, version
    counter and layout (no tensor data): a config shared by every layer costs one
    pickle; a module in one that is not a submodule is pickled whole (as it is sent),
    its tensors stubbed too. The digest holds ids: keep the tensors and submodules it
    saw, which it appends to ``kept``, alive while you compare it with a later one. A
    module whose attributes cannot be pickled, or that holds an inference tensor in one
    (it has no version counter), gets a digest equal to no other (sending it then names
    what fails).

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
    modules = list(module.modules())
    for m in modules:
        _attribute_objects(m, values, attributes)
        flags.extend(p is not None and p.requires_grad for p in m._parameters.values())
    try:
        pickled = _pickled([flags, *values.values()], frozenset(map(id, modules)), kept)
    except Exception:
        return object()
    return hashlib.blake2b(pickled, digest_size=16).digest()


def _probe(version: Callable[[dict[Any, Any]], Any]) -> bool:
    """Whether ``version(d)`` changes with every way a module's attributes change."""
    m = nn.Module()
    d = m.__dict__
    changes: list[Callable[[], Any]] = [
        lambda: setattr(m, "probe", [1]), lambda: setattr(m, "probe", [2]),
        lambda: object.__setattr__(m, "probe", 3), lambda: d.__setitem__("probe", 4),
        lambda: d.update(probe=5), lambda: m.train(False), lambda: delattr(m, "probe"),
        lambda: d.setdefault("probe", 6), lambda: d.pop("probe"),
    ]
    try:
        for change in changes:
            before = version(d)
            change()
            if before is None or version(d) == before:
                return False
    except Exception:
        return False
    return True


@functools.cache
def versions_change() -> bool:
    """Whether a dict's version changes with every way a module's attributes change,
    on this interpreter and this torch (else :class:`Watch` never says unchanged, and
    every look walks the module).

    Example:
        >>> versions_change() == Watch(nn.Linear(2, 2)).unchanged()
        True
    """
    return _dict_version is not None and _probe(_dict_version)


_Read = Callable[..., "bytes | bool | None"]  # (items[, record])


def compiled_readers() -> dict[str, _Read]:
    """The extension's readers where it is in use: ``tensor_states``, ``identities``
    (classes and ``__dict__``), and ``dict_versions`` where this interpreter's dict
    versions pass the probe. Each is one pass over a list: ``read(items)`` packs what it
    reads into bytes (a record), ``read(items, record)`` tells whether what it reads now
    equals the record (comparing as it reads); None where an item cannot be read there.

    Example:
        >>> read = compiled_readers().get("tensor_states")
        >>> ts = [torch.zeros(2)]
        >>> read is None or read(ts, read(ts)) is True
        True
    """
    return _readers(extension.module())


@functools.cache
def _readers(lib: Any) -> dict[str, _Read]:
    reads = {n: getattr(lib, f"_{n}") for n in ("tensor_states", "dict_versions", "identities")
             if hasattr(lib, f"_{n}")}
    if "dict_versions" in reads and not _probe(lambda d: reads["dict_versions"]([d])):
        del reads["dict_versions"]
    return reads


# What a look reads of each tensor without the extension.
_TENSOR_READS = (
    operator.attrgetter("_version"), operator.attrgetter("requires_grad"), Tensor.data_ptr,
    operator.attrgetter("shape"), Tensor.stride, operator.attrgetter("dtype"),
)
# The dicts of a submodule's ``__dict__`` whose contents a call depends on; the others
# (state-dict hooks) only by identity, which the ``__dict__``'s version covers, and an
# attribute that is a dict of the user's is pickled whole.
_WATCHED_DICTS = frozenset((*HOOK_DICTS, "_parameters", "_buffers", "_modules"))


class Watch:
    """What one look at ``module`` saw, to tell at little cost that none of it changed.

    The look walks the module once; :meth:`unchanged` walks nothing. It reads the
    version of each dict of every submodule that a call depends on (its ``__dict__``,
    parameters, buffers, children and forward and backward hook dicts: an assignment, a
    parameter, buffer, child or hook added, replaced or removed each make a new one)
    and of the dict of each of their classes and bases (a method patched), each
    submodule's class and ``__dict__`` (the object), each parameter's and buffer's
    version counter (in-place updates), storage, data pointer, shape, strides and dtype
    (``.data =``) and ``requires_grad``, and the optimizer steps taken (fused steps bump
    no version counter); and it pickles again the attribute objects
    :func:`state_digest` pickles (a config edited in place). So it sees whatever
    :func:`~dpmethods.core.replicate.fingerprint` and :func:`state_digest` see. The
    compiled extension, where it is built, reads each of those lists in one pass
    (nanoseconds an item, against a Python call each). Where dict versions cannot be
    read, or miss a change (a torch without ``torch._C._dynamo.guards.dict_version``,
    or whose versions fail a probe at first use), or a tensor has no version counter
    (an inference tensor), it never says unchanged: every look walks the module; with
    ``versionless``, it watches an inference tensor for all but its in-place updates
    (what a thread map's replicas need: :mod:`dpmethods.streaming.threads`).

    Example:
        >>> m = torch.nn.Linear(2, 2)
        >>> watch = Watch(m)
        >>> watch.unchanged()
        True
        >>> m.weight.data = m.weight.data.t()
        >>> watch.unchanged()
        False
    """

    def __init__(self, module: nn.Module, *, versionless: bool = False) -> None:
        self.module = module
        self._versionless = versionless
        self._rules = list(_RULES)
        reads = compiled_readers()
        self._tensor_states = reads.get("tensor_states")
        self._dict_versions = reads.get("dict_versions")
        self._identities = reads.get("identities")
        self._modules: list[nn.Module] = []
        self._own: list[dict[str, Any]] = []  # each submodule's __dict__, the object itself
        self._dicts: list[dict[Any, Any]] = []  # non-empty ones; every one with the extension
        self._empty: list[dict[Any, Any]] = []
        self._tensors: list[Tensor] = []
        self._objects: list[Any] = []
        self._walked: frozenset[int] = frozenset()
        self._kept: list[Any] = []  # the tensors the pickled objects held: their ids stay theirs
        self._seen: tuple[Any, ...] | None = None
        if versions_change():
            try:
                steps = optimizer_steps()
                versions = self._walk(module)
                self._seen = (steps, versions, self._ids(), self._states(),
                              _pickled(self._objects, self._walked, self._kept, versionless))
            except Exception:  # a tensor without a version counter, a module half built
                self._seen = None
        self.classes = frozenset(map(type, self._modules))

    def _walk(self, module: nn.Module) -> Any:
        """Collect what :meth:`unchanged` reads; each dict's version is read before what
        it holds, so a change made after the read shows."""
        assert _dict_version is not None
        fast = self._dict_versions
        parts: list[Any] = []
        objects: dict[int, Any] = {}
        skip = {a for r in self._rules for a in r.attributes}
        for m in module.modules():  # lazily: a module's children are read after it
            self._modules.append(m)
            d = m.__dict__
            self._own.append(d)
            mine = [d, *[v for k, v in d.items() if k in _WATCHED_DICTS and isinstance(v, dict)]]
            if fast is not None:
                parts.append(fast(mine))
                self._dicts += mine
            else:
                for x in mine:
                    if x:
                        parts.append(_dict_version(x))
                        self._dicts.append(x)
                    else:
                        self._empty.append(x)
            for group in (d["_parameters"], d["_buffers"]):
                self._tensors.extend(t for t in group.values()
                                     if t is not None and not (self._versionless and t.is_inference()))
            _attribute_objects(m, objects, skip)
        # The model's classes: one changed here (a method patched) is set on the workers'.
        for d in class_dicts(classes_of(self._modules)):
            if fast is not None:
                parts.append(fast([d]))
            else:
                parts.append(_dict_version(d))
            self._dicts.append(d)
        self._objects = list(objects.values())
        self._walked = frozenset(map(id, self._modules))
        return b"".join(parts) if fast is not None else parts

    def _versions(self) -> Any:
        if self._dict_versions is not None:
            return self._dict_versions(self._dicts)
        assert _dict_version is not None
        return None if any(self._empty) else list(map(_dict_version, self._dicts))

    def _states(self) -> Any:
        ts = self._tensors
        states = self._tensor_states(ts) if self._tensor_states is not None else None
        return [list(map(read, ts)) for read in _TENSOR_READS] if states is None else states

    def _ids(self) -> Any:
        mods = self._modules
        ids = self._identities(mods) if self._identities is not None else None
        # (Without the extension, a __dict__ replaced: the old one is kept here, so never equal.)
        return (list(map(type, mods)), list(map(id, map(vars, mods)))) if ids is None else ids

    def _same(self, read: _Read | None, items: list[Any], record: Any, python: Callable[[], Any]) -> bool:
        """Whether what ``read`` (an extension's reader, given ``record``: it compares in
        place) or else ``python()`` reads of ``items`` now equals ``record``."""
        if read is not None and isinstance(record, bytes):
            return read(items, record) is True  # None: no longer readable there, so changed
        return python() == record

    def unchanged(self) -> bool:
        """Whether nothing the look saw changed since (False when it cannot tell)."""
        seen = self._seen
        if seen is None or self._rules != _RULES:
            return False
        steps, versions, ids, states, objects = seen
        try:
            return (
                optimizer_steps() == steps
                and self._same(self._dict_versions, self._dicts, versions, self._versions)
                and self._same(self._identities, self._modules, ids, self._ids)
                and self._same(self._tensor_states, self._tensors, states, self._states)
                and _pickled(self._objects, self._walked, None, self._versionless) == objects
            )
        except Exception:
            return False
