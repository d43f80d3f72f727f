"""Cheap digests of values and modules, stable from one process to the next: what a
resumable map records to know its input, its arguments and its model again.

:func:`digest` is a CRC-32 of a value's structure (types, lengths, mapping keys, a
tensor's dtype and shape) and of a bounded sample of its content: a tensor's bytes whole
up to 4 KiB, else about 1,024 of them spread evenly over it and its last; a string's
characters likewise; the items of a list, tuple or mapping, or 64 of them spread evenly
over it and its last when it has more. Numbers, ``None``, bytes and other buffers,
dataclasses, named tuples and the types with a rule (:func:`dpmethods.register_type`,
torch's pytree) are walked; an object whose class offers a dict form both ways,
``to_dict()`` and ``from_dict()`` (a configuration: transformers' ``PretrainedConfig``
and ``GenerationConfig``), counts by that dict, its keys sorted and whole, less its bookkeeping (private keys
such as ``_name_or_path``, a library's version); an object of any other class counts by its class only, never
by its ``repr``, which may hold a memory address that differs on every run, nor by the
pointers of an array of Python objects. A tensor on an accelerator is sampled there and
its sample copied to the host.

:func:`module_identity` tells models apart where that is cheap: the class, the names,
shapes and dtypes of the parameters and persistent buffers, and a digest of the
parameters' sampled values; and the settings it holds: a digest of each attribute of it
or of a submodule that has a dict form (a transformers model's ``config`` and
``generation_config``), by the attribute's name, and the mapping a module is built from
(a diffusers model's ``config``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from dpmethods.types import tree
from dpmethods.types.owners import unwrap_compiled

__all__ = ["digest", "module_identity"]

WHOLE = 4096  # a tensor with at most this many bytes is digested whole
ELEMENTS = 1024  # bytes of a larger tensor (characters of a longer string) sampled, about
ITEMS = 64  # items of a larger container sampled
_DEPTH = 32  # nesting digested; deeper values count by their class
_crc32 = zlib.crc32
_heads: dict[tuple[torch.dtype, tuple[int, ...]], bytes] = {}
_buffers: dict[int, Any] = {}
_names: dict[type, bytes] = {}


def digest(value: Any, crc: int = 0) -> int:
    """A 32-bit digest of ``value``'s structure and a bounded sample of its content,
    continuing ``crc``; equal on every run for equal values (see the module's docs).

    Args:
        value: a batch, an argument: tensors, strings, numbers, containers of them.
        crc: the digest to continue (0 to start).

    Example:
        >>> import torch
        >>> a = [torch.arange(6.0).reshape(2, 3), "text"]
        >>> digest(a) == digest([torch.arange(6.0).reshape(2, 3), "text"])
        True
        >>> digest(a) == digest([torch.arange(6.0).reshape(3, 2), "text"])
        False
    """
    return _walk(value, crc, 0)


def _walk(value: Any, crc: int, depth: int) -> int:
    if isinstance(value, Tensor):
        return _tensor(value, crc)
    kind = type(value)
    if kind is str:
        return _text(value, crc)
    if kind is int or kind is float or kind is bool or value is None:
        return _crc32(repr(value).encode(), _name(kind, crc))
    if depth >= _DEPTH:
        return _name(kind, crc)
    if kind is list or kind is tuple:
        return _items(value, _name(kind, crc), depth)
    if kind is dict or (isinstance(value, Mapping) and tree.rule_for(kind) is None):
        crc = _items(list(value), _name(kind, crc), depth)
        return _items(list(value.values()), crc, depth)
    return _other(value, kind, crc, depth)


def _other(value: Any, kind: type, crc: int, depth: int) -> int:
    crc = _name(kind, crc)
    if isinstance(value, (int, float, complex)):  # their subclasses: an enum, a numpy scalar
        return _crc32(repr(value).encode(), crc)
    if isinstance(value, str):
        return _text(value, crc)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _items([getattr(value, f.name) for f in dataclasses.fields(value)], crc, depth)
    try:  # a registered rule or a pytree node, else the value itself as its one leaf
        spec, leaves = tree.flatten(value)
    except Exception:  # a rule that fails here fails in the method too, with its own error
        return crc
    if spec != tree.OTHER:
        return _items(leaves, crc, depth)
    if isinstance(value, (list, tuple)):
        return _items(value, crc, depth)
    form = _dict_form(value)
    if form is not None:
        return _crc32(form, crc)
    try:  # bytes, and arrays of numpy or of the standard library
        view = memoryview(value)
    except (TypeError, ValueError, BufferError):
        return crc
    with view:
        # Not pointers (an array of Python objects): their values differ on every run.
        if not view.c_contiguous or any(c in view.format for c in "OP&"):
            return crc
        crc = _crc32(repr((view.format, view.shape)).encode(), crc)
        with view.cast("B") as flat:
            n = len(flat)
            return _crc32(flat if n <= WHOLE else flat[:: n // ELEMENTS].tobytes(), crc)


def _dict_form(value: Any) -> bytes | None:
    """``value.to_dict()`` as JSON with sorted keys, whole (one changed setting among many
    must show, and the order its attributes were set in must not); None where its class
    offers no dict form both ways (``to_dict`` and ``from_dict``) or the form fails. A value in it that JSON lacks counts by its
    class, as elsewhere."""
    kind = type(value)
    # Both ways: a form that rebuilds the object is its whole state, and read without side
    # effects (a one-way to_dict may be a report, computed from and changing its owner).
    if not (callable(getattr(kind, "to_dict", None)) and callable(getattr(kind, "from_dict", None))):
        return None
    try:
        form = value.to_dict()
    except Exception:  # a to_dict that needs arguments
        return None
    return _settings_json(form)


def _settings_json(form: Any) -> bytes | None:
    """A mapping of settings as JSON with sorted keys, less its bookkeeping; None for
    anything else, or where the form fails (keys that do not sort, a cycle)."""
    if not isinstance(form, Mapping):
        return None
    try:
        return json.dumps(_settings_only(form), sort_keys=True, default=_class_of).encode()
    except Exception:
        return None


def _settings_only(form: Any) -> Any:
    """``form`` without its bookkeeping, at any depth: private keys (``_name_or_path``,
    where a model was loaded from) and the library version that wrote it
    (``transformers_version``), neither of which changes what the object does."""
    if isinstance(form, Mapping):
        return {k: _settings_only(v) for k, v in form.items()
                if not (isinstance(k, str) and (k.startswith("_") or k.endswith("_version")))}
    if isinstance(form, (list, tuple)):
        return [_settings_only(v) for v in form]
    return form


def _class_of(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _name(kind: type, crc: int) -> int:
    name = _names.get(kind)
    if name is None:
        name = f"{kind.__module__}.{kind.__qualname__}:".encode()
        if len(_names) < 4096:
            _names[kind] = name
    return _crc32(name, crc)


def _items(values: Any, crc: int, depth: int) -> int:
    n = len(values)
    crc = _crc32(b"%d" % n, crc)
    if n > ITEMS:
        values = [*values[:: n // ITEMS], values[-1]]
    if n and set(map(type, values)) == {str} and sum(map(len, values)) <= 16 * WHOLE:
        return _text("\x1f".join(values), crc)  # texts (a batch of sentences): one CRC
    for v in values:
        crc = _tensor(v, crc) if isinstance(v, Tensor) else _walk(v, crc, depth + 1)
    return crc


def _text(text: str, crc: int) -> int:
    n = len(text)
    if n > ELEMENTS:
        text = text[:: (n // ELEMENTS) | 1] + text[-1]
    return _crc32(text.encode("utf-8", "surrogatepass"), _crc32(b"%d" % n, crc))


def _tensor(t: Tensor, crc: int) -> int:
    key = (t.dtype, t.shape)
    head = _heads.get(key)
    if head is None:
        head = f"{t.dtype}{tuple(t.shape)}".encode()
        if len(_heads) < 4096:
            _heads[key] = head
    crc = _crc32(head, crc)
    try:
        if t.is_cpu and t.is_contiguous():
            n, address = t.nbytes, t.data_ptr()
            if not address:
                return crc
            region = _region(address, n)
            return _crc32(region if n <= WHOLE else region[:: (n // ELEMENTS) | 1] + region[n - 1:], crc)
        if t.numel() == 0 or t.layout is not torch.strided or t.is_meta:
            return crc
        return _crc32(_sample(t), crc)
    except (RuntimeError, NotImplementedError, TypeError):  # a tensor without storage, sparse
        return crc


def _region(address: int, n: int) -> Any:
    """The ``n`` bytes at ``address`` as a ctypes array, without a copy (valid while their
    tensor lives); a slice of it is a ``bytes``."""
    kind = _buffers.get(n)
    if kind is None:
        kind = ctypes.c_char * n
        if len(_buffers) < 4096:
            _buffers[n] = kind
    return kind.from_address(address)


def _sample(t: Tensor) -> bytes:
    """The bytes the host path digests, of a tensor elsewhere or not contiguous: its
    bytes in row-major order, whole or sampled alike."""
    flat = t.detach().contiguous().view(-1).view(torch.uint8)
    n = flat.numel()
    if n > WHOLE:
        flat = torch.cat([flat[:: (n // ELEMENTS) | 1], flat[n - 1:]])
    host = flat.cpu().contiguous()
    return bytes(_region(host.data_ptr(), host.nbytes))


def module_identity(module: nn.Module) -> dict[str, str]:
    """What tells ``module`` from another model cheaply: its class; ``"tensors"``, a
    digest of the names, shapes and dtypes of its parameters and persistent buffers;
    ``"values"``, one of its parameters' sampled values; ``"settings"``, ``name=digest``
    of each attribute with a dict form (see :func:`digest`) of it or
    of a submodule, joined by ``;``. Only the class (and settings) for a module with
    parameters not yet materialized (lazy modules).

    Args:
        module: the model (through ``torch.compile``'s wrapper).

    Example:
        >>> import torch
        >>> a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        >>> sorted(module_identity(a))
        ['class', 'settings', 'tensors', 'values']
        >>> [module_identity(a)[k] == module_identity(b)[k] for k in ("class", "tensors", "values")]
        [True, True, False]
    """
    module = unwrap_compiled(module)
    identity = {"class": f"{type(module).__module__}.{type(module).__qualname__}"}
    identity["settings"] = _settings(module)
    params = list(module.named_parameters())
    if any(nn.parameter.is_lazy(p) for _, p in params):
        return identity
    tensors = params + [
        (f"{prefix}.{name}" if prefix else name, b)
        for prefix, m in module.named_modules() for name, b in m._buffers.items()
        if b is not None and name not in m._non_persistent_buffers_set
    ]
    layout = 0
    for name, t in tensors:
        layout = _crc32(f"{name}:{t.dtype}{tuple(t.shape)};".encode(), layout)
    values = 0
    for _, p in params:
        values = _tensor(p, values)
    identity.update(tensors=f"{layout:08x}", values=f"{values:08x}")
    return identity


def _settings(module: nn.Module) -> str:
    """``name=digest;...`` of the attributes with a dict form of ``module`` and its
    submodules, and of the mapping a module is built from (:func:`_config_of`), each
    object once (a transformers model's ``config``, held by its layers, at its first
    name), in ``named_modules`` order."""
    seen: set[int] = set()
    found = []
    for prefix, m in module.named_modules():
        held: list[tuple[str, Any, Callable[[Any], bytes | None]]] = [
            (name, value, _dict_form) for name, value in list(vars(m).items())
            if not (name.startswith("_") or isinstance(value, (nn.Module, Tensor)))]
        config = _config_of(m)
        if config is not None:
            held.append(("config", config, _settings_json))
        for name, value, form_of in held:
            if id(value) in seen:
                continue
            form = form_of(value)
            if form is None:
                continue
            seen.add(id(value))
            found.append(f"{prefix}.{name}" if prefix else name)
            found[-1] += f"={_crc32(form, _name(type(value), 0)):08x}"
    return ";".join(found)


def _config_of(module: nn.Module) -> Any:
    """The settings a module is built from, ``cls.from_config(module.config)`` (a diffusers
    model's ``config``, a ``FrozenDict`` it keeps privately: ``flip_sin_to_cos`` and others
    change its output and no parameter's shape); None for a class without ``from_config``."""
    if not callable(getattr(type(module), "from_config", None)):
        return None
    try:
        return module.config
    except Exception:  # a property that raises
        return None
