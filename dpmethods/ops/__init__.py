"""Coalesced gather: every gathered output of a DataParallel step in one op call.

``torch.ops.dpmethods.gather_coalesced`` (compiled in ``dpmethods._C``, CPU and
CUDA kernels) concatenates the pieces of every leaf in one pass instead of one
``torch.cat`` and one autograd node per leaf. Without the extension the same
function runs a per-leaf ``torch.cat`` of ``.to(device)`` pieces.

Dispatch: the dispatcher picks a kernel from the *inputs* (CUDA wins over CPU);
each kernel then acts on the *target*: the CPU kernel hands a CUDA target to the
CUDA kernel (which uploads host pieces in one pinned copy) where that is built,
and otherwise gathers on the host and moves the finished leaves; the CUDA kernel
brings each GPU's pieces to the host in one pinned copy when the target is the CPU.

Autograd: ``gather_coalesced`` has a Python formula (``torch.library.register_autograd``;
its backward splits each leaf's gradient and sends every slice to its piece's device,
as a view when it is already there) and a fake kernel (``register_fake``), which is
what ``torch.compile``, ``opcheck`` and direct ``torch.ops`` callers get. In eager mode
:func:`gather_coalesced` takes a faster route with the same backward: the graph node is
built in C++, because a Python ``autograd.Function`` costs about a microsecond per input
tensor, more than the gather itself with hundreds of leaves. Plain tensors enter through
``dpmethods._C._gather_coalesced``, which borrows them from the Python list instead of
boxing each one for a ``torch.ops`` call; tensor subclasses and ``__torch_function__``
modes take ``torch.ops.dpmethods._gather_coalesced_autograd``, the same kernel behind
the dispatcher. Without any input requiring grad (or with grad mode off) no node is
built at all.

:func:`without_extension` runs a block of code on the pure-PyTorch path.

Environment variables (read at call time):
    DPMETHODS_DISABLE_EXTENSION=1  use the pure-PyTorch path (read once, at import)
    DPMETHODS_FORCE_STAGED=1       CUDA: always use the pack / peer copy / unpack path
    DPMETHODS_POISON=1             fill outputs with 0xFF bytes before copying (tests)
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from dpmethods.ops import extension as _extension

__all__ = ["extension_info", "gather_coalesced", "without_extension"]

_OP_NAME = "dpmethods::gather_coalesced"

_op: Any = None  # torch.ops.dpmethods.gather_coalesced.default when compiled
_op_autograd: Any = None  # its C++-autograd twin, for inputs the eager entry refuses
_eager: Any = None  # dpmethods._C._gather_coalesced: plain tensors, no torch.ops boxing

# Skips the Python autograd kernel when no graph is needed; private, so guarded.
_below_autograd: Any = getattr(torch._C, "_AutoDispatchBelowAutograd", torch.no_grad)
_any_requires_grad: Any = getattr(
    torch._C, "_any_requires_grad", lambda *ts: any(t.requires_grad for t in ts)
)


def extension_info() -> dict[str, Any]:
    """Describe the compiled extension and whether the gather uses it.

    Returns:
        A dict with ``available`` (``dpmethods._C`` imported), ``cuda`` (built with
        CUDA kernels), ``cuda_archs`` (targets compiled, e.g. ``["sm_80", "sm_90",
        "compute_90"]``), ``torch_built_against``, ``torch_runtime``, ``torch_cuda_built_against``
        and ``torch_cuda_runtime`` (the CUDA versions of both torches), ``in_use``
        (``"compiled"`` or ``"pytorch fallback"``), ``reason`` (why the fallback,
        else None) and ``path`` (the loaded library).

    Example:
        >>> extension_info()["in_use"] in ("compiled", "pytorch fallback")
        True
    """
    return _extension.info()


def _normalize_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _check_ints(num_replicas: Any, dim: Any) -> None:
    """Raise for an argument the kernels cannot take as a 64-bit int (off the hot path)."""
    for name, value in (("num_replicas", num_replicas), ("dim", dim)):
        try:
            value = operator.index(value)  # as the C++ entry: ints and numpy integers
        except TypeError:
            raise TypeError(
                f"gather_coalesced(): {name}: expected an int, got {type(value).__name__} {value!r}"
            ) from None
        if not -(2**63) <= value < 2**63:
            raise ValueError(
                f"gather_coalesced(): {name}: expected an int that fits in 64 bits, got {value}"
            )


def _check_tensors(tensors: Sequence[Any]) -> None:
    """Raise naming the first piece that is not a tensor (off the hot path)."""
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"gather_coalesced(): tensors[{i}]: expected a Tensor, got {type(t).__name__} {t!r}"[:300]
            )


def _check_counts(n: int, num_replicas: int) -> None:
    if num_replicas < 1:
        raise ValueError(f"gather_coalesced(): num_replicas must be >= 1, got {num_replicas}")
    if n % num_replicas:
        raise ValueError(
            "gather_coalesced(): len(tensors) must be a multiple of num_replicas "
            f"({num_replicas}), got {n} tensors"
        )


def _scalar_type(dtype: torch.dtype) -> str:
    """The dtype as the kernels' messages name it (C++ ``ScalarType``: ``Float``, ``Long``)."""
    try:
        return torch.empty(0, dtype=dtype).type().removeprefix("torch.").removesuffix("Tensor")
    except (RuntimeError, TypeError):
        return str(dtype).removeprefix("torch.")


def _shape(sizes: Sequence[int], star: int | None = None) -> str:
    return "[" + ", ".join("*" if d == star else str(s) for d, s in enumerate(sizes)) + "]"


def _check_meta(tensors: Sequence[torch.Tensor], device: torch.device) -> None:
    # Real meta tensors dispatch to the fake kernel too (it is the Meta kernel): as with
    # torch.cat(...).to(device), there is no data to copy onto a real device.
    if device.type == "meta":
        return
    for t in tensors:
        if t.is_meta:
            raise NotImplementedError(
                f"gather_coalesced(): Cannot copy out of meta tensor; no data! Expected pieces "
                f"with data to gather onto {device}, got meta tensors"
            )


def _check_pieces(tensors: Sequence[torch.Tensor], num_replicas: int, dim: int, device: torch.device) -> None:
    """Refuse what the compiled kernels refuse, with their errors (csrc/dpmethods.cpp's
    plan_gather): ``torch.cat`` would promote mixed dtypes, and raise other errors than theirs."""
    _check_meta(tensors, device)
    for first_i in range(0, len(tensors), num_replicas):
        leaf, first = first_i // num_replicas, tensors[first_i]
        ndim = first.dim()
        if ndim == 0:
            raise ValueError(
                f"gather_coalesced(): tensors[{first_i}] (leaf {leaf}, replica 0) is 0-dimensional; "
                f"expected a tensor with at least 1 dimension to concatenate along dim {dim}"
            )
        if not -ndim <= dim < ndim:
            raise IndexError(
                f"gather_coalesced(): dim {dim} is out of range for leaf {leaf} with {ndim} "
                f"dimensions (expected -{ndim} <= dim < {ndim})"
            )
        d = _normalize_dim(dim, ndim)
        for r in range(num_replicas):
            t, where = tensors[first_i + r], f"tensors[{first_i + r}] (leaf {leaf}, replica {r})"
            if t.dtype != first.dtype:
                raise TypeError(
                    f"gather_coalesced(): {where} has dtype {_scalar_type(t.dtype)} but expected "
                    f"{_scalar_type(first.dtype)} (the dtype of replica 0 of this leaf)"
                )
            same = t.dim() == ndim
            for k in range(ndim):  # (plain loops: torch.compile traces this without the extension)
                same = same and (k == d or t.shape[k] == first.shape[k])
            if not same:
                raise ValueError(
                    f"gather_coalesced(): {where} has shape {_shape(t.shape)} but expected "
                    f"{_shape(first.shape, d)} (the shape of replica 0 of this leaf, any size "
                    f"along dim {d})"
                )


def _fallback(
    tensors: Sequence[torch.Tensor], num_replicas: int, dim: int, device: torch.device
) -> list[torch.Tensor]:
    _check_pieces(tensors, num_replicas, dim, device)
    out = []
    for i in range(0, len(tensors), num_replicas):
        parts = [t.to(device) for t in tensors[i : i + num_replicas]]
        out.append(torch.cat(parts, dim))
    return out


def _fake(
    tensors: list[torch.Tensor], num_replicas: int, dim: int, device: torch.device
) -> list[torch.Tensor]:
    _check_counts(len(tensors), num_replicas)
    _check_meta(tensors, device)
    out = []
    for i in range(0, len(tensors), num_replicas):
        pieces = tensors[i : i + num_replicas]
        d = _normalize_dim(dim, pieces[0].dim())
        shape = list(pieces[0].shape)
        shape[d] = sum(p.shape[d] for p in pieces)
        out.append(pieces[0].new_empty(shape, device=device))
    return out


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    tensors, num_replicas, dim, _ = inputs
    ctx.num_replicas = num_replicas
    ctx.dims = [_normalize_dim(dim, tensors[i].dim()) for i in range(0, len(tensors), num_replicas)]
    ctx.sizes = [t.shape[ctx.dims[i // num_replicas]] for i, t in enumerate(tensors)]
    ctx.devices = [t.device for t in tensors]


def _backward(ctx: Any, grads: list[torch.Tensor | None]) -> tuple[Any, ...]:
    """Split each leaf's gradient along dim and send every slice to its piece's device.

    Slices that are already on their piece's device are views of the gradient.
    """
    r_count = ctx.num_replicas
    out: list[torch.Tensor | None] = []
    for leaf, g in enumerate(grads):
        first = leaf * r_count
        if g is None:
            out.extend([None] * r_count)
            continue
        parts = torch.split(g, ctx.sizes[first : first + r_count], dim=ctx.dims[leaf])
        for r, part in enumerate(parts):
            dev = ctx.devices[first + r]
            out.append(part if part.device == dev else part.to(dev))
    return out, None, None, None


def _register() -> None:
    """Bind the compiled ops and give gather_coalesced its fake and autograd kernels."""
    global _op, _op_autograd, _eager
    mod = _extension.module()
    if mod is None:
        return
    torch.library.register_fake(_OP_NAME)(_fake)
    torch.library.register_autograd(_OP_NAME, _backward, setup_context=_setup_context)
    _op = torch.ops.dpmethods.gather_coalesced.default
    _op_autograd = torch.ops.dpmethods._gather_coalesced_autograd.default
    _eager = mod._gather_coalesced


_register()


@contextlib.contextmanager
def without_extension() -> Iterator[None]:
    """Run the block as without ``dpmethods._C``, as ``DPMETHODS_DISABLE_EXTENSION=1``
    does for a whole process: the gather takes its pure-PyTorch path, the module
    checks of ``workers="processes"`` read in Python, and :func:`extension_info` says
    so. To compare the two paths, or rule the extension out; it holds for the whole
    process (every thread) until the block ends.

    Example:
        >>> with without_extension():
        ...     extension_info()["in_use"]
        'pytorch fallback'
    """
    global _op
    saved = _op, _extension.LOADER
    _op = None
    _extension.LOADER = _extension.Loader(saved[1].record, disabled="disabled by dpmethods.ops.without_extension()")
    try:
        yield
    finally:
        _op, _extension.LOADER = saved


def gather_coalesced(
    tensors: Sequence[torch.Tensor], num_replicas: int, dim: int, device: torch.device
) -> list[torch.Tensor]:
    """Concatenate the pieces of every leaf along ``dim`` onto ``device`` in one call.

    Args:
        tensors: leaf-major pieces, ``tensors[l * num_replicas + r]`` is leaf ``l`` of
            replica ``r``. Pieces of a leaf share dtype and shape except along ``dim``;
            they may live on any devices and need not be contiguous.
        num_replicas: number of replicas (pieces per leaf), >= 1.
        dim: concatenation dim; negative values count from the end of each leaf.
        device: where the gathered leaves go.

    Returns:
        One tensor per leaf, ``torch.cat(pieces, dim)`` on ``device``. Gradients flow
        back to every piece.

    Example:
        >>> a, b = torch.ones(2, 3), torch.zeros(1, 3)
        >>> [t.shape for t in gather_coalesced([a, b], 2, 0, torch.device("cpu"))]
        [torch.Size([3, 3])]
    """
    # Cheap checks first: this runs once per gather and small gathers are
    # dominated by per-call overhead.
    if type(device) is not torch.device:
        device = torch.device(device)
    if type(tensors) is not list and type(tensors) is not tuple:
        tensors = list(tensors)
    if not tensors:
        _check_counts(0, num_replicas)
        return []
    if _op is None or (device.type != "cpu" and _extension.unsupported_reason(device) is not None):
        _check_ints(num_replicas, dim)
        _check_counts(len(tensors), num_replicas)
        _check_tensors(tensors)
        return _fallback(tensors, num_replicas, dim, device)
    if torch.compiler.is_compiling():
        # Traced through the fake kernel and the Python autograd formula.
        return _op(tensors, num_replicas, dim, device)
    try:
        out = _eager(tensors, num_replicas, dim, device)
    except TypeError:
        # The C++ entry says only "dim must be an int, got int" for an int over 64 bits.
        _check_ints(num_replicas, dim)
        raise
    if out is not None:
        return out
    _check_ints(num_replicas, dim)  # torch.ops' own message names no value
    _check_tensors(tensors)  # nor does it name a piece that is no tensor (the fast path declined it)
    # Tensor subclasses and __torch_function__ modes need the torch.ops call.
    if torch.is_grad_enabled() and _any_requires_grad(*tensors):
        return _op_autograd(tensors, num_replicas, dim, device)
    with _below_autograd():
        return _op(tensors, num_replicas, dim, device)
