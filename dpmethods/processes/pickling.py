"""What crosses the process boundary of ``workers="processes"``, and how it is pickled.

Everything is pickled once per message with torch's multiprocessing reductions
(``ForkingPickler``), with two changes for CPU tensors:

- a batch or an output: a small tensor (under :data:`INLINE_BYTES`) travels inline, in
  the message, which is cheaper than passing a file descriptor; a larger one is copied
  into a fresh shared-memory block (one copy, the caller's tensor is left as it is),
  whose descriptor crosses instead of the bytes;
- the model: every parameter and buffer storage is copied once into one block of
  shared memory (each storage once, so tied weights and views stay tied), which
  crosses as one file descriptor, and every worker maps the same copy; the module
  itself is never moved or changed. CUDA tensors of the model
  are copied to shared CPU memory too, and each worker moves its model to its device.

Other CUDA tensors go through torch's CUDA IPC. A module that cannot be pickled is
searched for the attribute, hook or value that fails (:func:`unpicklable`).
"""

from __future__ import annotations

import copyreg
import dataclasses
import io
import pickle
import types
import warnings
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any, ClassVar

import torch
import torch.multiprocessing  # registers torch's reductions with ForkingPickler
from torch import Tensor, nn
from torch.multiprocessing.reductions import reduce_tensor
from torch.nn.utils import parametrize

from dpmethods.core.gather.sparse import unchecked
from dpmethods.processes.state import per_call, sent_state, without_per_call_hooks

__all__: list[str] = []

INLINE_BYTES = 256 << 10  # CPU tensors below this travel in the message itself
_GRAD, _PARAMETER = 1, 2  # the flags of an inline tensor
_PLAIN = (Tensor, nn.Parameter)


def _rebuild_inline(data: bytes, dtype: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...],
                    flags: int) -> Tensor:
    """A tensor sent inline by :func:`_inline`; ``flags``: its requires-grad bit, and
    :data:`_PARAMETER` for an ``nn.Parameter``."""
    if data:
        t = torch.frombuffer(bytearray(data), dtype=dtype).as_strided(shape, stride)
    else:
        t = torch.empty_strided(shape, stride, dtype=dtype)
    grad = bool(flags & _GRAD)
    if flags & _PARAMETER:
        return nn.Parameter(t, requires_grad=grad)
    return t.requires_grad_(True) if grad else t


def _dense(t: Tensor) -> Tensor:
    """``t`` (detached) in a storage of its own that holds exactly its elements.

    Its strides are kept where they describe a dense layout (``channels_last``, a
    transpose), else it is made contiguous: the memory format survives the trip.
    """
    t = t.detach()
    if (
        not t.is_conj() and not t.is_neg()  # else its storage holds other values than it shows
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        and t.stride() == _dense_stride(t)
    ):
        return t
    return torch.empty_like(t, memory_format=torch.preserve_format).copy_(t)


def _dense_stride(t: Tensor) -> tuple[int, ...]:
    """The strides ``t``'s copy gets: its own if they are dense, else contiguous ones."""
    return torch.empty_like(t, memory_format=torch.preserve_format, device="meta").stride()


def _inline(t: Tensor) -> tuple[Any, ...]:
    flags = (_GRAD if t.requires_grad and t.is_leaf else 0) | (_PARAMETER if type(t) is nn.Parameter else 0)
    if t.is_contiguous():  # its elements in order: read as they are, no copy first
        try:
            data = t.detach().numpy().tobytes()
        except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16), a conj or neg bit
            pass
        else:
            return (_rebuild_inline, (data, t.dtype, tuple(t.shape), t.stride(), flags))
    dense = _dense(t)
    data = b""
    if dense.numel():
        data = torch.empty(0, dtype=torch.uint8).set_(dense.untyped_storage()).numpy().tobytes()
    return (_rebuild_inline, (data, t.dtype, tuple(t.shape), dense.stride(), flags))


def _shared_storage(nbytes: int) -> torch.UntypedStorage:
    return torch.UntypedStorage._new_shared(nbytes)


def _in_shared_memory(t: Tensor) -> Tensor:
    """A copy of ``t`` (its view only, in its memory format) in a fresh shared-memory block."""
    stride = _dense_stride(t)
    storage = _shared_storage(t.numel() * t.element_size())
    copy = torch.empty(0, dtype=t.dtype).set_(storage, 0, t.shape, stride)
    copy.copy_(t.detach())
    if type(t) is nn.Parameter:
        return nn.Parameter(copy, requires_grad=t.requires_grad)
    return copy.requires_grad_(True) if t.requires_grad and t.is_leaf else copy


def _plain_cpu(obj: Any) -> bool:
    return (
        type(obj) in _PLAIN
        and obj.device.type == "cpu"
        and obj.layout == torch.strided
        and not obj.is_quantized
        and not obj.is_nested  # strided, but without strides of its own
    )


_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def _rebuild_sparse(layout: torch.layout, parts: tuple[Tensor, ...], size: tuple[int, ...],
                    coalesced: bool, flags: int = 0) -> Tensor:
    """A sparse tensor sent by :func:`_sparse` as its parts; ``flags`` as
    :func:`_rebuild_inline`'s. Invariant checks are off, as torch's own reduction leaves
    them, and quietly (:func:`~dpmethods.core.gather.sparse.unchecked`): the parts are a
    valid tensor's. Nor torch's note that compressed layouts are in beta: the tensor's
    maker had it (the caller, or the worker that made an output), and a worker rebuilding
    its model's would give it again where a replica thread gives none."""
    with unchecked(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")
        if layout == torch.sparse_coo:
            indices, values = parts
            t = torch.sparse_coo_tensor(indices, values, size, is_coalesced=coalesced, check_invariants=False)
        else:
            compressed, plain, values = parts
            t = torch.sparse_compressed_tensor(compressed, plain, values, size, layout=layout,
                                               check_invariants=False)
    grad = bool(flags & _GRAD)
    if flags & _PARAMETER:
        return nn.Parameter(t, requires_grad=grad)
    return t.requires_grad_(True) if grad else t


def _sparse(t: Tensor) -> tuple[Any, ...]:
    """A sparse tensor (COO, CSR, CSC, BSR, BSC) as its parts, each pickled as a tensor,
    and, as :func:`_inline` sends them, whether it is an ``nn.Parameter`` and a leaf that
    requires grad (torch's own reduction drops both: a model's sparse parameter would
    arrive as a plain tensor)."""
    flags = (_GRAD if t.requires_grad and t.is_leaf else 0) | (_PARAMETER if type(t) is nn.Parameter else 0)
    t = t.detach()
    if t.layout == torch.sparse_coo:
        parts: tuple[Tensor, ...] = (t._indices(), t._values())
    elif t.layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = (t.crow_indices(), t.col_indices(), t.values())
    else:
        parts = (t.ccol_indices(), t.row_indices(), t.values())
    coalesced = t.layout == torch.sparse_coo and t.is_coalesced()
    return (_rebuild_sparse, (t.layout, parts, tuple(t.shape), coalesced, flags))


def _io_reduce(obj: Any) -> Any:
    if not isinstance(obj, Tensor):
        return NotImplemented
    if type(obj) in _PLAIN and obj.layout in (torch.sparse_coo, *_COMPRESSED) and (
        obj.is_leaf or not obj.requires_grad  # else torch's reduction refuses it, saying why
    ):
        return _sparse(obj)
    if not _plain_cpu(obj):
        return NotImplemented
    if obj.numel() * obj.element_size() < INLINE_BYTES:
        return _inline(obj)
    return reduce_tensor(_in_shared_memory(obj))


def _refuse_generator(g: torch.Generator) -> Any:
    """A ``torch.Generator`` in a batch, a call's arguments or an output: refused. A
    copy would cross, so every worker would draw the same numbers from its own copy and
    the caller's generator would not advance."""
    raise TypeError(
        f"a torch.Generator (on {g.device}) cannot be shared with worker processes: each would "
        "draw the same numbers from its own copy, and the caller's would not advance"
    )


class OutputRequiresGrad(RuntimeError):
    """An output holds a tensor that requires grad: its graph cannot cross processes."""


def _shown(t: Tensor) -> Tensor:
    """``t``, or where its conjugate or negative bit makes it show other values than its
    storage holds, a copy holding the values it shows: torch's reductions and the model's
    block send a storage as it is, without the bits."""
    if not (t.is_conj() or t.is_neg()) or (t.requires_grad and not t.is_leaf):
        return t  # the latter: torch's reduction refuses it, saying why
    copy = t.detach().resolve_conj().resolve_neg()
    if type(t) is nn.Parameter:
        return nn.Parameter(copy, requires_grad=t.requires_grad)
    return copy.requires_grad_(t.requires_grad)


def _reduce_plain(t: Tensor) -> Any:
    """A ``Tensor`` or ``Parameter`` (exactly) in a batch, an output or a message."""
    reduced = _io_reduce(t)
    if reduced is not NotImplemented:
        return reduced
    if t.is_quantized:  # torch's reduction drops its quantizer; pickle's keeps it
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    return reduce_tensor(_shown(t))  # torch's own for the rest


class _IOPickler(pickle.Pickler):
    """Batches, outputs and messages: small CPU tensors inline, large ones in shared
    memory; every other object as ``ForkingPickler`` pickles it.

    Its dispatch table (copyreg's, ``ForkingPickler``'s reductions and the tensors') is
    made once, and again when a reduction is registered, where ``ForkingPickler`` copies
    it for each message.
    """

    dispatch_table: dict[Any, Any] = {}  # noqa: RUF012 - replaced whole, never changed in place
    _sources: ClassVar[tuple[int, int]] = (-1, -1)


class _OutputPickler(_IOPickler):
    """An output: as :class:`_IOPickler`, refusing any tensor that requires grad.

    Pickling reaches every tensor, inside any object (no type rule needed), so
    nothing is detached silently.
    """

    leaves_detached = False  # a leaf that requires grad goes detached (a job run with grad off)

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Tensor) and obj.requires_grad:
            if not (self.leaves_detached and obj.is_leaf):
                raise OutputRequiresGrad(f"a tensor of shape {tuple(obj.shape)} requires grad")
            obj = obj.detach()
        return _io_reduce(obj)


class _NoGradOutputPickler(_OutputPickler):
    """An output of a job run with grad off: a leaf that requires grad (a parameter
    returned as it is, open_clip's ``logit_bias``) has no graph to lose, and goes as a
    plain tensor, as a replica thread's detached replica returns it; a tensor with a
    graph (made under grad, outside the job) is still refused."""

    leaves_detached = True


def _io_pickler(output: bool, grad: bool = True) -> type[_IOPickler]:
    """The pickler for a batch or a message (``output``: for an output, of a job run with
    ``grad`` on or off), the dispatch table they read made again where a reduction was
    registered since the last message."""
    extra = ForkingPickler._extra_reducers  # type: ignore[attr-defined]
    sources = (len(copyreg.dispatch_table), len(extra))
    if _IOPickler._sources != sources:
        _IOPickler.dispatch_table = {**copyreg.dispatch_table, **extra, Tensor: _reduce_plain,
                                     nn.Parameter: _reduce_plain, torch.Generator: _refuse_generator}
        _IOPickler._sources = sources
    if not output:
        return _IOPickler
    return _OutputPickler if grad else _NoGradOutputPickler


_ALIGN = 64  # each storage's place in the model's block: a multiple of any element size


def _storage_key(t: Tensor) -> tuple[Any, ...]:
    s = t.untyped_storage()
    return (s.data_ptr(), s.nbytes(), s.device)


def _in_block(t: Tensor) -> bool:
    """Whether the model's block holds ``t``'s storage: not for a quantized tensor (its
    quantizer is not in its storage), nor for a conjugate or negative view (its storage
    holds other values than it shows); those cross on their own."""
    return (
        type(t) in _PLAIN and t.layout == torch.strided and t.device.type in ("cpu", "cuda")
        and not t.is_quantized and not t.is_conj() and not t.is_neg()
    )


def _model_block(tensors: list[Tensor]) -> tuple[torch.UntypedStorage, dict[Any, int]]:
    """One shared-memory block holding the storage of each of a module's ``tensors``
    (its parameters and buffers) once (tied weights and views keep sharing theirs), and
    each one's byte offset in it.

    One block crosses as one file descriptor, fetched once per worker from this
    process: a descriptor per storage costs each worker a connection per tensor.
    """
    places: dict[Any, int] = {}
    sources = []
    size = 0
    for t in tensors:
        if _in_block(t) and (key := _storage_key(t)) not in places:
            places[key] = size
            sources.append((size, t.untyped_storage()))
            size += -(-t.untyped_storage().nbytes() // _ALIGN) * _ALIGN
    block = _shared_storage(size)
    raw = torch.empty(0, dtype=torch.uint8).set_(block)
    for at, source in sources:  # from any device: workers move their model themselves
        raw[at : at + source.nbytes()].copy_(torch.empty(0, dtype=torch.uint8, device=source.device).set_(source))
    return block, places


def _from_block(
    block: torch.UntypedStorage, offset: int, dtype: torch.dtype, shape: torch.Size,
    stride: tuple[int, ...], parameter: bool, grad: bool,
) -> Tensor:
    t = torch.empty(0, dtype=dtype).set_(block, offset, shape, stride)
    if parameter:
        return nn.Parameter(t, requires_grad=grad)
    return t.requires_grad_(True) if grad else t


def _parametrized_reduction(module: nn.Module) -> Any:
    """A parametrized module (``weight_norm``, ``orthogonal``: Wav2Vec2's, HuBERT's and
    Encodec's convolutions) for a worker. torch refuses to pickle one, its class being
    made per module (``ParametrizedConv1d``), so it goes as its original class and the
    state that class gives (its own ``__getstate__``, if it has one), and the worker makes
    the class and the parametrized properties again."""
    original = type(module).__bases__[0]
    getstate: Any = original.__getstate__  # unbound: the class's own, or object's (the __dict__)

    def pickled() -> Any:
        state = getstate(module)
        return dict(state) if isinstance(state, dict) else state

    state = sent_state(module, pickled)
    return (_new_module, (original,), pickled() if state is None else state, None, None, _parametrized_again)


def _new_module(cls: type[nn.Module]) -> nn.Module:
    """An empty ``cls`` (its state comes next: the module may be in a cycle)."""
    return cls.__new__(cls)


def _parametrized_again(module: nn.Module, state: dict[str, Any]) -> None:
    """``module``'s state set, and its parametrizations made again, as
    ``torch.nn.utils.parametrize.register_parametrization`` makes them."""
    module.__setstate__(state)
    parametrize._inject_new_class(module)
    for name in module.parametrizations:  # type: ignore[union-attr]
        parametrize._inject_property(module, name)


class _ModelPickler(ForkingPickler):
    """The module: its parameters and buffers as views of one shared block (pickled
    once per payload: the pickle's memo holds it), never moved or changed themselves."""

    def __init__(self, file: Any, block: torch.UntypedStorage, places: dict[Any, int], tensors: set[int]) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self._block, self._places, self._tensors = block, places, tensors

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, Tensor):
            if isinstance(obj, nn.Module) and parametrize.is_parametrized(obj):
                return _parametrized_reduction(obj)
            return without_per_call_hooks(obj) if isinstance(obj, nn.Module) else NotImplemented
        if id(obj) not in self._tensors or not _in_block(obj):
            return _reduce_plain(obj) if type(obj) in _PLAIN else NotImplemented
        offset = self._places[_storage_key(obj)] // obj.element_size() + obj.storage_offset()
        grad = obj.requires_grad and (type(obj) is nn.Parameter or obj.is_leaf)
        return (_from_block, (self._block, offset, obj.dtype, obj.shape, obj.stride(),
                              type(obj) is nn.Parameter, grad))


def dumps(obj: Any, *, output: bool = False, grad: bool = True) -> bytes:
    """``obj`` pickled for another process (see the module docstring).

    An ``output`` that holds a tensor requiring grad raises :class:`OutputRequiresGrad`,
    but for a leaf (a parameter) of a job run with ``grad`` off: it goes detached.
    """
    buf = io.BytesIO()
    _io_pickler(output, grad)(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


loads = pickle.loads


def model_payloads(module: nn.Module, n: int) -> list[bytes]:
    """``module`` pickled ``n`` times (a descriptor is fetched once), on one shared copy
    of its parameters and buffers.

    Raises ``TypeError`` naming what cannot be pickled (see :func:`unpicklable`).
    """
    tensors = [*module.parameters(), *module.buffers()]
    block, places = _model_block(tensors)
    ids = {id(t) for t in tensors}
    payloads = []
    for _ in range(n):
        buf = io.BytesIO()
        try:
            _ModelPickler(buf, block, places, ids).dump(module)
        except Exception as exc:
            raise TypeError(unpicklable(module, exc)) from exc
        payloads.append(buf.getvalue())
    return payloads  # the block may go: each payload holds a descriptor of its own


class _Probe(pickle.Pickler):
    """Pickles to nowhere, with tensors stubbed: cheap enough to try every attribute."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Tensor):
            return (tuple, ())
        return NotImplemented


def _fails(value: Any) -> BaseException | None:
    try:
        _Probe(io.BytesIO(), pickle.HIGHEST_PROTOCOL).dump(value)
    except Exception as exc:
        return exc
    return None


def _attributes(module: nn.Module) -> Iterator[tuple[str, Any]]:
    for prefix, m in module.named_modules(remove_duplicate=True):
        path = f"module.{prefix}" if prefix else "module"
        for name, value in vars(m).items():
            if name in ("_parameters", "_buffers", "_modules"):
                continue
            if isinstance(value, dict) and "hook" in name:
                for key, hook in dict(value).items():
                    if not per_call(hook):  # never sent
                        yield f"{path}.{name}[{key!r}]", hook
            else:
                yield f"{path}.{name}", value


def unpicklable(module: nn.Module, error: BaseException) -> str:
    """The message for a module that cannot be sent: what fails to pickle, and what to do.

    Example:
        >>> import torch
        >>> m = torch.nn.Linear(2, 2)
        >>> _ = m.register_forward_hook(lambda *a: None)
        >>> print(unpicklable(m, TypeError("x")).split(": ", 2)[2].split(" cannot")[0])  # doctest: +ELLIPSIS
        module._forward_hooks[...] (function <lambda>)
    """
    culprit = next(((p, v, e) for p, v in _attributes(module) if (e := _fails(v)) is not None), None)
    if culprit is None:
        what = f"pickling it raised {type(error).__name__}: {error}"
    else:
        path, value, exc = culprit
        kind = getattr(value, "__qualname__", None)
        described = f"{type(value).__name__} {kind}" if kind else type(value).__name__
        what = f"{path} ({described}) cannot be pickled"
        if exc is not None and str(exc):
            what += f"; pickle said: {type(exc).__name__}: {exc}"
    return (
        f"DataParallel(workers='processes'): the module cannot be sent to a worker process: "
        f"{what}. Use workers='threads', or pass factory=, a picklable zero-argument "
        f"callable (a module-level function) that builds the module in each worker"
    )


def _innermost(value: Any, exc: BaseException, depth: int = 3) -> tuple[Any, BaseException]:
    """The part of ``value`` that fails to pickle: an attribute of an object whose class
    pickles (hooks chained by ``CallHooks.then``), else ``value`` itself."""
    if depth and not isinstance(value, (types.FunctionType, types.MethodType, type)):
        for part in vars(value).values() if hasattr(value, "__dict__") else ():
            inner = _fails(part)
            if inner is not None:
                return _innermost(part, inner, depth - 1)
    return value, exc


def _described(value: Any) -> str:
    kind = getattr(value, "__qualname__", None)
    return f"{type(value).__name__} {kind}" if kind else type(value).__name__


def unsendable_options(options: Any) -> str | None:
    """What in a method's options cannot be pickled, or None.

    Example:
        >>> from dpmethods.vocab.call_hooks import CallHooks
        >>> from dpmethods.vocab.options import MethodOptions
        >>> unsendable_options(MethodOptions(hooks=CallHooks(prepare=lambda a, k, call: (a, k, None))))[:51]
        'hooks.prepare (function <lambda>) cannot be pickled'
    """
    error = _fails(options)
    if error is None:
        return None
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        parts = [(f.name, value)]
        if f.name == "hooks" and value is not None:
            parts = [("hooks.prepare", value.prepare), ("hooks.per_replica", value.per_replica)]
        for path, part in parts:
            exc = _fails(part)
            if exc is not None:
                culprit, exc = _innermost(part, exc)
                return f"{path} ({_described(culprit)}) cannot be pickled; pickle said: {type(exc).__name__}: {exc}"
    return f"pickling them raised {type(error).__name__}: {error}"


def check_factory(factory: Any) -> Any:
    """``factory`` if it is None or a picklable callable; else a ``TypeError`` naming it."""
    if factory is None:
        return None
    if not callable(factory):
        raise TypeError(
            f"factory: expected a picklable zero-argument callable that builds the module, "
            f"got {type(factory).__name__} {factory!r}"
        )
    exc = _fails(factory)
    if exc is not None:
        raise TypeError(
            f"factory: expected a picklable zero-argument callable (a module-level function "
            f"or class), got {factory!r}, which cannot be pickled: {type(exc).__name__}: {exc}"
        )
    return factory

