"""Gather: join the outputs of the replicas onto one device.

The structure of every replica's output is walked once; the structures must
match. All tensor leaves that are concatenated (``cat``, and ``stack`` and ``pad``
after their per-tensor step) go to :func:`dpmethods.ops.gather_coalesced` in ONE
call, which is where the compiled kernel replaces L x N copies and autograd nodes.
"""

from __future__ import annotations

import itertools
import warnings
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _tree, ops
from .registry import GATHER_MODES, GatherOption
from .scatter import DeviceLike, _as_device

__all__ = ["gather"]

_TENSORS = itertools.repeat(Tensor)


def _pad(parts: Sequence[Tensor], dim: int, value: float, path: str) -> list[Tensor]:
    ndim = parts[0].dim()
    if any(p.dim() != ndim for p in parts):
        raise ValueError(
            f"gather: {path}: 'pad' needs the same number of dims on every replica, got "
            f"shapes {[list(p.shape) for p in parts]}"
        )
    d = dim % ndim
    target = [max(p.shape[k] for p in parts) for k in range(ndim)]
    out = []
    for p in parts:
        widths: list[int] = []
        for k in reversed(range(ndim)):
            widths += [0, 0 if k == d else target[k] - p.shape[k]]
        out.append(F.pad(p, widths, value=value) if any(widths) else p)
    return out


def _same(values: Sequence[Any]) -> bool:
    first = values[0]
    try:
        return all(v is first or bool(v == first) for v in values[1:])
    except Exception:  # values whose == is not a bool (arrays): treat as different
        return False


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


def _leaf_modes(spec: _tree.Spec, mode: GatherOption, n_leaves: int) -> list[str]:
    if isinstance(mode, str):
        return [mode] * n_leaves
    assert isinstance(mode, Mapping)
    counts = _tree.top_level_leaf_counts(spec)
    if counts is None:
        raise ValueError(
            f"gather: a mapping of modes {dict(mode)} needs outputs with keys or fields "
            f"(dict, dataclass, namedtuple), got {_tree._describe(spec)}"
        )
    unknown = sorted(set(mode) - {k for k, _ in counts})
    if unknown:
        warnings.warn(
            f"gather: mode keys {unknown} are not in the output, whose keys are "
            f"{[k for k, _ in counts]}; those keys are ignored",
            UserWarning,
            stacklevel=3,
        )
    modes: list[str] = []
    for key, count in counts:
        modes += [mode.get(key, "cat")] * count
    return modes


def _reduce(values: Sequence[Any], weights: Sequence[float], device: torch.device, mean: bool) -> Any:
    moved = [v.to(device) if isinstance(v, Tensor) else v for v in values]
    if mean:  # weighted by batch share, so uneven chunks give the full-batch mean
        moved = [w * v for w, v in zip(weights, moved)]
    total = moved[0]
    for v in moved[1:]:
        total = total + v
    return total


def gather(
    outputs: Sequence[Any],
    target_device: DeviceLike,
    dim: int = 0,
    *,
    mode: GatherOption = "cat",
    pad_value: float = 0,
    weights: Sequence[float] | None = None,
) -> Any:
    """Gather the outputs of several replicas into one output on ``target_device``.

    Nested tuples, lists, dicts, namedtuples, dataclasses and ``ModelOutput`` are
    rebuilt with their own type. ``None`` stays ``None``; equal non-tensor values come
    back once and differing ones as a list.

    Args:
        outputs: one output per replica.
        target_device: where the result goes (``"cpu"``, a CUDA index or device).
        dim: the dimension tensors are joined along.
        mode: ``"cat"``, ``"stack"``, ``"mean"``, ``"sum"``, ``"pad"``, ``"list"``, a
            mapping of top-level output keys to those (others use ``"cat"``), or a
            callable ``fn(outputs, target_device)``.
        pad_value: the fill value of ``"pad"``.
        weights: each replica's share of the batch, for ``"mean"`` (default: equal).

    Example:
        >>> import torch
        >>> outs = [{"y": torch.ones(2), "loss": torch.tensor(1.0)},
        ...         {"y": torch.zeros(1), "loss": torch.tensor(4.0)}]
        >>> g = gather(outs, "cpu", mode={"loss": "mean"}, weights=[2 / 3, 1 / 3])
        >>> g["y"].tolist(), g["loss"].item()
        ([1.0, 1.0, 0.0], 2.0)
    """
    outputs = list(outputs)
    n = len(outputs)
    if n == 0:
        raise ValueError("gather: outputs: expected at least one replica output, got none")
    device = _as_device(target_device)
    if callable(mode) and not isinstance(mode, (str, Mapping)):
        return mode(outputs, device)
    if isinstance(mode, str) and mode not in GATHER_MODES:
        raise ValueError(f"gather: mode: expected one of {list(GATHER_MODES)}, got {mode!r}")
    if mode == "generate" or (isinstance(mode, Mapping) and "generate" in mode.values()):
        raise ValueError(
            "gather: mode: 'generate' needs the generate call's pad and eos ids, which only "
            "a wrapper call has; here use dpmethods.generate.gather_generate(outputs, device, "
            f"fill_token_id=...), got mode={mode!r}"
        )
    if weights is None:
        weights = [1.0 / n] * n
    elif len(weights) != n:
        raise ValueError(f"gather: weights: expected {n} values (one per output), got {len(weights)}")

    if mode == "cat" and all(map(isinstance, outputs, _TENSORS)) and outputs[0].dim():
        return ops.gather_coalesced(outputs, n, dim, device)[0]  # one tensor per replica
    flat = [_tree.flatten(o) for o in outputs]
    spec = flat[0][0]
    if any(f[0] != spec for f in flat[1:]):
        # As torch, dicts are matched by key, not by order: put every replica's keys in
        # replica 0's order, then compare again.
        flat = [flat[0]] + [_tree.flatten(_align(outputs[0], o)) for o in outputs[1:]]
    for r in range(1, n):
        if flat[r][0] != spec:
            raise ValueError(
                f"gather: replica outputs differ in structure between replica 0 and replica {r}: "
                + _tree.describe_mismatch(spec, flat[r][0])
            )
    columns = list(zip(*[leaves for _, leaves in flat]))
    leaves0 = flat[0][1]
    # The common case, every leaf a tensor with a batch dim, in one call. Equal specs
    # already say the other replicas have tensors in the same places.
    if mode == "cat" and all(map(isinstance, leaves0, _TENSORS)) and all(map(Tensor.dim, leaves0)):
        tensors = list(itertools.chain.from_iterable(columns))
        return _tree.unflatten(spec, ops.gather_coalesced(tensors, n, dim, device))

    modes = _leaf_modes(spec, mode, len(columns))
    paths: list[str] | None = None

    def path(i: int) -> str:
        nonlocal paths
        if paths is None:
            paths = _tree.leaf_paths(spec)
        return paths[i]

    result: list[Any] = [None] * len(columns)
    joined: list[int] = []
    pieces: list[Tensor] = []
    for i, (col, m) in enumerate(zip(columns, modes)):
        if not isinstance(col[0], Tensor):  # equal specs: then no replica has a tensor here
            if m == "list":
                result[i] = list(col)
            elif m in ("mean", "sum") and all(isinstance(v, (int, float, complex)) for v in col):
                result[i] = _reduce(col, weights, device, m == "mean")
            else:
                result[i] = col[0] if _same(col) else list(col)
            continue
        if m == "list":
            result[i] = [t.to(device) for t in col]
        elif m in ("mean", "sum"):
            if any(t.shape != col[0].shape for t in col):
                raise ValueError(
                    f"gather: {path(i)}: {m!r} needs the same shape on every replica, got "
                    f"{[list(t.shape) for t in col]}; use 'cat' or 'pad' for batch outputs"
                )
            result[i] = _reduce(col, weights, device, m == "mean")
        else:
            parts: Sequence[Tensor] = col
            if m == "stack" or col[0].dim() == 0:
                if m != "stack":
                    warnings.warn(
                        f"gather: {path(i)} is 0-dim on every replica, so it was stacked into "
                        f"a vector of {n} values; use gather='mean' for a loss (weighted by "
                        "each replica's share of the batch) or 'stack' to silence this",
                        UserWarning,
                        stacklevel=2,
                    )
                parts = [t.unsqueeze(dim) for t in col]
            elif m == "pad":
                parts = _pad(col, dim, pad_value, path(i))
            joined.append(i)
            pieces.extend(parts)
    if pieces:
        for i, t in zip(joined, ops.gather_coalesced(pieces, n, dim, device)):
            result[i] = t
    return _tree.unflatten(spec, result)

