"""Gather: join the outputs of the replicas onto one device.

The structure of every replica's output is walked once; the structures must
match. All tensor leaves that are concatenated (``cat``, and ``stack`` and ``pad``
after their per-tensor step) go to :func:`dpmethods.ops.gather_coalesced` in ONE
call, which is where the compiled kernel replaces L x N copies and autograd nodes.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from dpmethods.core.devices import DeviceLike, as_device
from dpmethods.core.gather.coupled import check_shares
from dpmethods.core.gather.join import coalesced, joinable
from dpmethods.core.gather.keys import leaf_dims, leaf_modes, named_leaves, option_for_leaf
from dpmethods.core.gather.modes import join_tensor_leaf, join_value_leaf
from dpmethods.types import per_item
from dpmethods.types import tree as _tree
from dpmethods.vocab.call_hooks import Call
from dpmethods.vocab.gather_modes import BUILTIN_MODES, Mode, named_mode
from dpmethods.vocab.options import GatherOption, positional_modes

__all__ = ["gather", "join_outputs"]

# `all(map(isinstance, xs, itertools.repeat(Tensor)))` checks a list in C. The repeat is
# made per call, not kept in a global: torch.compile models an itertools.repeat built
# while tracing, but not one it finds (a global one breaks fullgraph=True on the gather).


def _check_dim(dim: Any) -> None:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"gather: dim: expected an int, got {type(dim).__name__} {dim!r}")
    if not -(2**63) <= dim < 2**63:
        raise ValueError(f"gather: dim: expected an int that fits in 64 bits, got {dim}")


def _align(ref: Any, obj: Any) -> Any:
    """``obj`` with its dicts' keys in ``ref``'s order, where both have the same keys."""
    if type(obj) is not type(ref):
        return obj
    if isinstance(obj, dict) and type(obj) in (dict, OrderedDict):
        if obj.keys() != ref.keys():
            return obj
        return type(obj)((k, _align(ref[k], obj[k])) for k in ref)
    if type(obj) in (list, tuple) and len(obj) == len(ref):
        return type(obj)(_align(a, b) for a, b in zip(ref, obj))
    return obj


class _Plan(NamedTuple):
    """What one gather call joins, and how, once its arguments are checked."""

    n: int
    device: torch.device
    dim: int
    mode: Any  # a mode or a mapping of keys/positions to modes
    pad_value: float
    weights: list[float]
    sizes: list[int] | None
    key_dims: Mapping[Any, int] | None
    gather_dim: Any
    check: bool  # per-item and batch-coupled checks (the shares are known)
    check_dims: bool  # the batch-dim check too (no int gather_dim overrode it)
    halves: bool  # the parts of one share that ran out of memory, not replicas' outputs


class _Paths:
    """Leaf paths for messages, computed on first use (most gathers need none)."""

    def __init__(self, spec: _tree.Spec, mode: Any) -> None:
        self._spec, self._mode = spec, mode
        self._paths: list[str] | None = None

    def __call__(self, i: int) -> str:
        if self._paths is None:
            self._paths = _tree.leaf_paths(self._spec)
        return self._paths[i]

    def option(self, i: int, mode: str) -> str | None:
        """The ``gather=`` option that gives leaf ``i`` alone ``mode``, if one can."""
        return option_for_leaf(self._spec, i, self._mode, mode)


class _Leaf:
    """One leaf's path, called for messages, and the option that gives it its own mode."""

    def __init__(self, paths: _Paths, i: int) -> None:
        self._paths, self._i = paths, i

    def __call__(self) -> str:
        return self._paths(self._i)

    def option(self, mode: str) -> str | None:
        return self._paths.option(self._i, mode)


def gather(
    outputs: Sequence[Any],
    target_device: DeviceLike,
    dim: int = 0,
    *,
    mode: GatherOption = "cat",
    pad_value: float = 0,
    weights: Sequence[float] | None = None,
    sizes: Sequence[int] | None = None,
    gather_dim: int | Mapping[str | int, int] | None = None,
    call: Call | None = None,
) -> Any:
    """Gather the outputs of several replicas into one output on ``target_device``.

    Nested tuples, lists, dicts, namedtuples, dataclasses, ``ModelOutput`` and types
    with a rule (:func:`dpmethods.register_type`, ``torch.utils._pytree``) are rebuilt
    with their own type. ``None`` stays ``None``; equal non-tensor values come back
    once, numpy arrays are concatenated, and other differing values come back as a
    list (with a warning).

    Args:
        outputs: one output per replica.
        target_device: where the result goes (``"cpu"``, a CUDA index or device).
        dim: the dimension tensors are joined along.
        mode: ``"cat"``, ``"stack"``, ``"mean"``, ``"sum"``, ``"pad"``, ``"list"``,
            ``"extend"``, ``"same"``, a named mode (``dpmethods.extending``), a mapping
            of top-level output keys or tuple positions to built-in modes (others use
            ``"cat"``), a tuple of modes (one per position), or a callable
            ``fn(outputs, target_device)``.
        pad_value: the fill value of ``"pad"``.
        weights: each replica's share of the batch, for ``"mean"`` (default: from
            ``sizes``, else equal).
        sizes: the number of batch items each replica got. With it, per-item lists are
            recognised (see :mod:`dpmethods.types.per_item`) and batch-coupled outputs warned
            about (see :mod:`dpmethods.core.gather.coupled`).
        gather_dim: the join dim when it is not ``dim``: an int, or a mapping of
            top-level output keys to ints (others use ``dim``).
        call: the :class:`~dpmethods.extending.Call` a named mode sees (None outside a
            wrapper's call).

    Example:
        >>> import torch
        >>> outs = [{"y": torch.ones(2), "loss": torch.tensor(1.0)},
        ...         {"y": torch.zeros(1), "loss": torch.tensor(4.0)}]
        >>> g = gather(outs, "cpu", mode={"loss": "mean"}, weights=[2 / 3, 1 / 3])
        >>> g["y"].tolist(), g["loss"].item()
        ([1.0, 1.0, 0.0], 2.0)
        >>> gather([["a", "b"], ["c"]], "cpu", sizes=[2, 1])
        ['a', 'b', 'c']
    """
    return _joined(outputs, target_device, dim, mode, pad_value, weights, sizes, gather_dim, call, False)


def join_outputs(
    outputs: Sequence[Any],
    target_device: DeviceLike,
    dim: int = 0,
    *,
    mode: GatherOption = "cat",
    pad_value: float = 0,
    weights: Sequence[float] | None = None,
    sizes: Sequence[int] | None = None,
    gather_dim: int | Mapping[str | int, int] | None = None,
    call: Call | None = None,
    halves: bool = False,
) -> Any:
    """:func:`gather`; with ``halves``, the outputs are the parts of one share that ran
    out of memory (``on_oom="split"``), whose join must be the whole share's output: a
    0-dim leaf that a concatenating mode would stack into a vector is an error.

    Example:
        >>> join_outputs([torch.ones(2), torch.zeros(1)], "cpu", halves=True).tolist()
        [1.0, 1.0, 0.0]
    """
    return _joined(outputs, target_device, dim, mode, pad_value, weights, sizes, gather_dim, call, halves)


def _joined(
    outputs: Sequence[Any], target_device: DeviceLike, dim: int, mode: GatherOption, pad_value: float,
    weights: Sequence[float] | None, sizes: Sequence[int] | None, gather_dim: Any, call: Call | None,
    halves: bool,
) -> Any:
    outputs = list(outputs)
    if not outputs:
        raise ValueError("gather: outputs: expected at least one replica output, got none")
    device = as_device(target_device)
    _check_dim(dim)
    mode = positional_modes(mode)
    if callable(mode) and not isinstance(mode, (str, Mapping)):
        return mode(outputs, device)
    if isinstance(mode, str) and mode not in BUILTIN_MODES:
        # A library's mode joins the whole output (the one place named modes are looked
        # up); an unknown name raises, listing the modes.
        named = named_mode(mode, "gather: mode")
        return named(outputs, device, call)  # type: ignore[misc]
    plan = _plan(outputs, device, dim, mode, pad_value, weights, sizes, gather_dim, halves)
    if _all_batch_tensors(outputs, plan):
        return _gather_tensors(outputs, plan)
    spec, columns = _flatten(outputs, plan)
    paths = _Paths(spec, plan.mode)
    coupled: set[int] | None = None
    if _cat_only(spec, columns, plan):
        coupled = _coupled(spec, columns, plan, paths, None)
        if not coupled:
            joined = _cat_all(spec, columns, plan, paths)
            if joined is not None:
                return joined
    modes = leaf_modes(spec, plan.mode, len(columns))
    dims = [plan.dim] * len(columns) if plan.key_dims is None else leaf_dims(spec, plan.key_dims, plan.dim)
    if coupled is None:  # not checked above (the same checks, once)
        coupled = _coupled(spec, columns, plan, paths, (modes, dims))
    return _tree.unflatten(spec, _join(spec, columns, modes, dims, coupled, paths, plan))


def _plan(
    outputs: list[Any], device: torch.device, dim: int, mode: Any, pad_value: float,
    weights: Sequence[float] | None, sizes: Sequence[int] | None, gather_dim: Any, halves: bool,
) -> _Plan:
    """Check the arguments that depend on the number of outputs, and settle the dims."""
    n = len(outputs)
    if sizes is not None:
        sizes = list(sizes)
        if len(sizes) != n:
            raise ValueError(
                f"gather: sizes: expected {n} values (one per output), got {len(sizes)}"
            )
    if weights is None:
        total = sum(sizes) if sizes else 0
        weights = [s / total for s in sizes] if sizes and total else [1.0 / n] * n
    elif len(weights) != n:
        raise ValueError(f"gather: weights: expected {n} values (one per output), got {len(weights)}")
    key_dims = gather_dim if isinstance(gather_dim, Mapping) else None
    if gather_dim is not None and key_dims is None:
        dim = gather_dim
    check = sizes is not None and n > 1
    # An int gather_dim is the caller's word on where every output's batch is.
    check_dims = check and (gather_dim is None or key_dims is not None)
    return _Plan(
        n, device, dim, mode, pad_value, list(weights), sizes, key_dims, gather_dim,
        check, check_dims, halves,
    )


def _all_batch_tensors(outputs: list[Any], plan: _Plan) -> bool:
    return (
        plan.mode == Mode.CAT
        and plan.key_dims is None
        and all(map(isinstance, outputs, itertools.repeat(Tensor)))
        and bool(outputs[0].dim())
    )


def _gather_tensors(outputs: list[Tensor], plan: _Plan) -> Any:
    """One tensor per replica, the most common output: no structure to walk."""
    if plan.check:
        coupled = check_shares(
            [outputs], plan.sizes, [plan.dim], None, lambda i: "output", batch_dim=plan.check_dims,  # type: ignore[arg-type]
        )
        if coupled and not joinable(outputs, plan.dim):  # warned: the pieces, not an error
            return [t.to(plan.device) for t in outputs]
    return coalesced(outputs, plan.n, plan.dim, plan.device, lambda i: "output")[0]


def _flatten(outputs: list[Any], plan: _Plan) -> tuple[_tree.Spec, list[tuple[Any, ...]]]:
    """Every replica's output flattened, dict keys aligned, per-item lists marked, and
    the structures checked: replica 0's spec and the leaves as columns (one per leaf)."""
    flat = [_tree.flatten(o) for o in outputs]
    spec = flat[0][0]
    if any(f[0] != spec for f in flat[1:]):
        # As torch, dicts are matched by key, not by order: put every replica's keys in
        # replica 0's order, then compare again.
        flat = [flat[0]] + [_tree.flatten(_align(outputs[0], o)) for o in outputs[1:]]
    sizes = plan.sizes
    if plan.n > 1 and (
        per_item.wants_extend(plan.mode)
        or (plan.check and any(f[0] != spec for f in flat[1:]))
        or (plan.check and per_item.needs_marking(spec, sizes[0]))  # type: ignore[index]
    ):
        flat = per_item.mark_items(flat, sizes, plan.mode, plan.dim)
        spec = flat[0][0]
    for r in range(1, plan.n):
        if flat[r][0] != spec:
            raise ValueError(
                f"gather: replica outputs differ in structure between replica 0 and replica {r}: "
                + _tree.describe_mismatch(spec, flat[r][0])
            )
    return spec, list(zip(*[leaves for _, leaves in flat]))


def _cat_only(spec: _tree.Spec, columns: list[tuple[Any, ...]], plan: _Plan) -> bool:
    """Every leaf a tensor with a batch dim, joined with ``"cat"``: one coalesced call.
    Equal specs already say the other replicas have tensors in the same places."""
    leaves0 = [c[0] for c in columns]
    return (
        plan.mode == Mode.CAT
        and plan.key_dims is None
        and all(map(isinstance, leaves0, itertools.repeat(Tensor)))
        and all(map(Tensor.dim, leaves0))
    )


def _coupled(
    spec: _tree.Spec, columns: list[tuple[Any, ...]], plan: _Plan, paths: _Paths,
    modes_dims: tuple[list[str], list[int]] | None,
) -> set[int]:
    """The batch-coupled leaves (warned about by ``check_shares``), if the shares are known."""
    if not plan.check:
        return set()
    if modes_dims is None:
        return check_shares(
            columns, plan.sizes, [plan.dim] * len(columns), None, paths,  # type: ignore[arg-type]
            lambda: _tree.per_item_leaves(spec), batch_dim=plan.check_dims,
        )
    modes, dims = modes_dims
    return check_shares(
        columns, plan.sizes, dims, modes, paths,  # type: ignore[arg-type]
        lambda: named_leaves(spec, plan.mode, plan.gather_dim) | _tree.per_item_leaves(spec),
        batch_dim=plan.check_dims,
    )


def _cat_all(spec: _tree.Spec, columns: list[tuple[Any, ...]], plan: _Plan, paths: _Paths) -> Any | None:
    tensors = list(itertools.chain.from_iterable(columns))
    try:
        return _tree.unflatten(spec, coalesced(tensors, plan.n, plan.dim, plan.device, paths))
    except ValueError:
        if not _tree.ragged_leaves(spec):
            raise
        return None  # ragged children of a rule (packed sequences): joined padded


def _among(paths: _Paths, indices: list[int]) -> Callable[[int], str]:
    """The path of the ``k``-th leaf of ``indices``, computed on use as ``paths``'."""
    return lambda k: paths(indices[k])


# Modes that keep one entry per replica: a share's parts are not replicas, and one
# device returns the share's output unwrapped, so their entries have no join into it.
_PER_REPLICA = (Mode.STACK.value, Mode.LIST.value)


def _per_replica_halves(path: str, mode: str) -> str:
    return (
        f"on_oom='split': {path} is gathered with {mode!r}, one entry per replica, so the "
        f"parts of a share that ran out of memory would come back as {mode!r} entries of their "
        "own, not as the share's output; a gather mode that joins the batch's items ('cat', "
        "'pad', 'extend', or 'mean'/'sum'/'same' for a value over them) joins them as the "
        "share, else run this method with on_oom='raise'"
    )


def _join(
    spec: _tree.Spec, columns: list[tuple[Any, ...]], modes: list[str], dims: list[int],
    coupled: set[int], paths: _Paths, plan: _Plan,
) -> list[Any]:
    """Each leaf by its mode; the concatenated ones in one coalesced call per join dim."""
    result: list[Any] = [None] * len(columns)
    joined: dict[int, tuple[list[int], list[Tensor]]] = {}  # by join dim
    ragged = _tree.ragged_leaves(spec) if plan.n > 1 else set()
    for i, (col, m, d) in enumerate(zip(columns, modes, dims)):
        if plan.halves and m in _PER_REPLICA:
            raise ValueError(_per_replica_halves(paths(i), m))
        if not isinstance(col[0], Tensor):  # equal specs: then no replica has a tensor here
            result[i] = join_value_leaf(col, m, d, paths(i), plan.device, plan.weights)
            continue
        done, parts = join_tensor_leaf(col, m, d, i in coupled, i in ragged, _Leaf(paths, i), plan)
        if parts is None:
            result[i] = done
        else:
            indices, pieces = joined.setdefault(d, ([], []))
            indices.append(i)
            pieces.extend(parts)
    for d, (indices, pieces) in joined.items():
        for i, t in zip(indices, coalesced(pieces, plan.n, d, plan.device, _among(paths, indices))):
            result[i] = t
    return result


