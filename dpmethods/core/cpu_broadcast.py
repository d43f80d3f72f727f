"""Broadcast for CPU "devices": the autograd structure torch gives distinct GPUs, on CPU.

On GPUs, ``torch.nn.parallel.replicate`` copies the parameters with
``torch.nn.parallel._functions.Broadcast``: the source device's outputs alias the
inputs, the other devices get copies, and the backward sums each copy's gradient
back into the input (``ReduceAddCoalesced``). :class:`CpuBroadcast` is the same
function for ``n`` CPU replicas, so ``cpu_replicas="distinct"`` exercises, on a
machine without GPUs, the code path and gradient flow that several GPUs take.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx

__all__ = ["CpuBroadcast", "broadcast_copies"]


class CpuBroadcast(torch.autograd.Function):
    """``n`` copies of each input: copy 0 aliases the input, the others are clones.

    The outputs are flat, copy by copy (``n * len(inputs)`` tensors), as torch's
    ``Broadcast``. The backward adds up the gradients of each input's copies; it is
    made of differentiable ops, so double backward works too. Outputs of inputs that
    don't require grad are marked non-differentiable, as in torch.

    Example:
        >>> import torch
        >>> w = torch.ones(2, requires_grad=True)
        >>> a, b = CpuBroadcast.apply(2, w)
        >>> (a * 1 + b * 2).sum().backward()
        >>> w.grad
        tensor([3., 3.])
        >>> b.data_ptr() != w.data_ptr() and a.data_ptr() == w.data_ptr()
        True
    """

    @staticmethod
    def forward(ctx: FunctionCtx, n: int, *inputs: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.num_inputs = len(inputs)  # type: ignore[attr-defined]
        outputs = [*inputs]
        for _ in range(1, n):
            outputs.extend(map(_clone, inputs))
        needs = ctx.needs_input_grad[1:]  # type: ignore[attr-defined]
        ctx.mark_non_differentiable(
            *(t for j, t in enumerate(outputs) if not needs[j % len(inputs)])
        )
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        k = ctx.num_inputs
        sums: list[Tensor | None] = []
        for i in range(k):
            parts = [g for g in grads[i::k] if g is not None]
            sums.append(functools.reduce(operator.add, parts) if parts else None)
        return (None, *sums)


def _clone(t: Tensor) -> Tensor:
    """A copy of ``t`` in its own memory; a strided one keeps its memory format (a
    sparse one has none: torch refuses the option for its compressed layouts)."""
    return t.clone(memory_format=torch.preserve_format) if t.layout == torch.strided else t.clone()


def broadcast_copies(tensors: list[Tensor], n: int, detach: bool) -> list[list[Tensor]]:
    """``n`` lists of copies of ``tensors``, the first aliasing them, through :class:`CpuBroadcast`.

    With ``detach`` (replicas for ``no_grad``) the copies are cut from autograd:
    the first list is the tensors themselves (detached), the others are clones.

    Example:
        >>> import torch
        >>> first, second = broadcast_copies([torch.zeros(3)], 2, detach=True)
        >>> first[0].data_ptr() == second[0].data_ptr()
        False
    """
    if not tensors:
        return [[] for _ in range(n)]
    k = len(tensors)
    if detach:
        own = [t.detach() if t.requires_grad else t for t in tensors]
        return [own] + [
            [_clone(t) for t in own] for _ in range(1, n)
        ]
    flat = CpuBroadcast.apply(n, *tensors)
    return [list(flat[j * k : (j + 1) * k]) for j in range(n)]
