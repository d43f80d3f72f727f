"""Replicate: one shallow copy of the module per device, sharing or broadcasting tensors.

Replicas are made as torch makes them (``_replicate_for_data_parallel``), so
gradients flow back to the module's own parameters. Three things differ:

- Devices may repeat (``["cpu"] * 4``, ``[0, 0]``). Replicas on the source device
  use the module's parameters themselves; nothing is copied.
- Parameter copies stay in the replica's ``_parameters``, so ``replica.parameters()``
  is not empty and code such as ``next(self.parameters()).device`` (Hugging Face's
  ``model.device``) works inside a replica.
- A second replica on the same device gets its own copy of the buffers of modules
  in training mode, so in-place updates (BatchNorm's running stats) don't race; as
  in torch, only the first replica's updates reach the module.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .compiled import bound_attributes, rebind, shallow_replica

__all__ = ["fingerprint", "replicate"]


def _source_device(module: nn.Module, default: torch.device) -> torch.device:
    for p in module.parameters():
        return p.device
    for b in module.buffers():
        return b.device
    return default


def _copies(
    tensors: Sequence[Tensor], devices: list[torch.device], src: torch.device, detach: bool
) -> dict[torch.device, list[Tensor]]:
    """Per unique device, the tensors as seen there (autograd-connected unless ``detach``)."""
    out: dict[torch.device, list[Tensor]] = {}
    others = [d for d in dict.fromkeys(devices) if d != src]
    if not tensors:
        return {d: [] for d in [src, *others]}
    if others:
        if not (src.type == "cuda" and all(d.type == "cuda" for d in others)):
            raise ValueError(
                f"replicate: devices: expected all CUDA devices when the module is on {src}, "
                f"got {[str(d) for d in others]}"
            )
        targets = [src.index, *(d.index for d in others)]
        if detach:
            from torch.nn.parallel import comm

            per_device = comm.broadcast_coalesced(tensors, targets)
            for d, copies in zip([src, *others], per_device):
                out[d] = list(copies)
        else:
            from torch.nn.parallel._functions import Broadcast

            flat = Broadcast.apply(targets, *tensors)
            n = len(tensors)
            for j, d in enumerate([src, *others]):
                out[d] = list(flat[j * n : (j + 1) * n])
        return out
    out[src] = [t.detach() if detach and t.requires_grad else t for t in tensors]
    return out


def replicate(
    module: nn.Module, devices: Sequence[torch.device | str | int], detach: bool = False
) -> list[nn.Module]:
    """Make one replica of ``module`` per entry of ``devices`` (entries may repeat).

    Args:
        module: the module, with all parameters and buffers on one device.
        devices: where each replica runs; CPU devices or CUDA devices.
        detach: make replicas whose tensors are cut from autograd (for ``no_grad``).

    Example:
        >>> import torch
        >>> replicas = replicate(torch.nn.Linear(2, 2), ["cpu", "cpu"])
        >>> replicas[1].weight is replicas[0].weight
        True
    """
    targets = [
        torch.device("cuda", d) if isinstance(d, int) else torch.device(d) for d in devices
    ]
    if not targets:
        raise ValueError("replicate: devices: expected at least one device, got none")
    src = _source_device(module, targets[0])
    modules = list(module.modules())
    index = {id(m): i for i, m in enumerate(modules)}
    params = list(module.parameters())
    param_index = {id(p): i for i, p in enumerate(params)}
    param_copies = _copies(params, targets, src, detach)

    buffers = list(module.buffers())
    buffer_index = {id(b): i for i, b in enumerate(buffers)}
    buffer_copies: dict[torch.device, list[Tensor]] = {d: list(buffers) for d in param_copies}
    # Buffers that need grad broadcast like parameters; the rest never carry autograd.
    for wants_grad in (True, False):
        group = [b for b in buffers if b.requires_grad == wants_grad]
        for d, copies in _copies(group, targets, src, detach or not wants_grad).items():
            for b, c in zip(group, copies):
                buffer_copies[d][buffer_index[id(b)]] = c
    training = {
        id(b): m.training for m in modules for b in m._buffers.values() if b is not None
    }

    bound = bound_attributes(modules)
    seen: set[torch.device] = set()
    replicas: list[nn.Module] = []
    for device in targets:
        shared = device not in seen
        seen.add(device)
        clones = [shallow_replica(m) for m in modules]  # never writes to `m`
        pc, bc = param_copies[device], buffer_copies[device]
        for m, clone in zip(modules, clones):
            for key, child in m._modules.items():
                clone._modules[key] = None if child is None else clones[index[id(child)]]
            for key, p in m._parameters.items():
                # Plain tensors in _parameters keep replica.parameters() non-empty.
                clone._parameters[key] = None if p is None else pc[param_index[id(p)]]  # type: ignore[assignment]
            for key, buf in m._buffers.items():
                if buf is None:
                    clone._buffers[key] = None
                    continue
                c = bc[buffer_index[id(buf)]]
                clone._buffers[key] = c if shared or not training[id(buf)] else c.clone()
        rebind(modules, clones, bound)  # compiled and patched code runs on the replica
        replicas.append(clones[0])
    return replicas


# Fused optimizer kernels (``Adam(fused=True)``) update parameters in place without
# bumping their version counters, so fingerprint() also counts optimizer steps, through
# a global post-step hook registered the first time a fingerprint is taken.
_optimizer_steps = 0
_step_hook: object = None


def _count_step(*_: object) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


def fingerprint(module: nn.Module) -> tuple[object, ...]:
    """A cheap value that changes when anything a replica copied from ``module`` changes.

    It covers every module's class and attributes (by identity, so any assignment,
    ``train()`` and ``eval()`` show), each parameter's and buffer's identity, storage,
    device, dtype and version counter (so in-place updates, ``.to()`` and
    ``load_state_dict`` show), and the number of optimizer steps taken by any
    optimizer (fused steps don't bump version counters). Replicas keep the old
    attribute values alive, so an identity cannot be reused while a cached replica
    exists. In-place writes through ``.data`` are not seen (``.data`` has a version
    counter of its own); modules with inference tensors get a fingerprint equal to no
    other, so their replicas are never reused.

    Args:
        module: the module whose replicas may be cached.

    Example:
        >>> import torch
        >>> m = torch.nn.Linear(2, 2)
        >>> before = fingerprint(m)
        >>> with torch.no_grad():
        ...     _ = m.weight.mul_(2)
        >>> fingerprint(m) == before
        False
    """
    global _step_hook
    if _step_hook is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _step_hook = register_optimizer_step_post_hook(_count_step)
    parts: list[object] = [_optimizer_steps]
    append, extend = parts.append, parts.extend  # this runs on every cached call: keep it lean
    try:
        for m in module.modules():
            d = m.__dict__
            append(type(m))
            # Names and value identities of every attribute: any assignment, train()/eval().
            # Dicts (hooks) are shared with the replicas, so their contents need no entry.
            extend(d)
            extend(map(id, d.values()))
            for group in (d["_parameters"], d["_buffers"]):
                for t in group.values():
                    if t is None:
                        append(None)
                    else:
                        extend((id(t), t.data_ptr(), t.device, t.dtype, t._version))
            extend(map(id, d["_modules"].values()))
    except RuntimeError:
        # Inference tensors have no version counter, so their in-place updates can't be
        # seen: a fresh object makes this fingerprint equal to no other.
        return (object(),)
    return tuple(parts)
