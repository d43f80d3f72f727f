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

With ``cpu_replicas="distinct"`` (or the environment variable
``DPMETHODS_CPU_REPLICAS=distinct``) each CPU entry of ``devices`` is treated as a
device of its own, as distinct GPUs are: every replica but the first gets its own
parameter and buffer copies, through :class:`dpmethods.core.cpu_broadcast.CpuBroadcast`
(torch's ``Broadcast`` structure, whose backward sums the gradients back).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from itertools import chain
from typing import Any

import torch
from torch import Tensor, nn

from dpmethods.core.compiled import bound_attributes, rebind, shallow_replica
from dpmethods.core.cpu_broadcast import broadcast_copies
from dpmethods.core.devices import DeviceLike

__all__ = [
    "CPU_REPLICAS_ENV", "CPU_REPLICAS_MODES", "HOOK_DICTS", "cpu_replicas_mode", "fingerprint",
    "optimizer_steps", "replicate",
]

CPU_REPLICAS_ENV = "DPMETHODS_CPU_REPLICAS"
CPU_REPLICAS_MODES = ("shared", "distinct")


def cpu_replicas_mode(value: str | None = None) -> str:
    """The CPU replica mode: ``value`` if given, else ``$DPMETHODS_CPU_REPLICAS``, else ``"shared"``.

    ``"shared"``: replicas on CPU devices use the module's tensors (a CPU is one device).
    ``"distinct"``: each CPU entry of ``device_ids`` is a device of its own, and its
    replica gets copies, as a distinct GPU would.

    Example:
        >>> cpu_replicas_mode("distinct")
        'distinct'
        >>> cpu_replicas_mode("both")
        Traceback (most recent call last):
        ...
        ValueError: cpu_replicas: expected 'shared' or 'distinct', got str 'both'
    """
    if value is None:
        env = os.environ.get(CPU_REPLICAS_ENV, "").strip()
        if not env:
            return "shared"
        if env not in CPU_REPLICAS_MODES:
            raise ValueError(f"{CPU_REPLICAS_ENV}: expected 'shared' or 'distinct', got {env!r}")
        return env
    if value not in CPU_REPLICAS_MODES:
        raise ValueError(
            f"cpu_replicas: expected 'shared' or 'distinct', got {type(value).__name__} {value!r}"
        )
    return value


def _source_device(module: nn.Module, default: torch.device) -> torch.device:
    for p in module.parameters():
        return p.device
    for b in module.buffers():
        return b.device
    return default


def _copies(
    tensors: Sequence[Tensor], keys: list[object], devices: list[torch.device],
    src: torch.device, detach: bool,
) -> dict[object, list[Tensor]]:
    """Per unique key (a device, or a position for distinct CPU replicas), the tensors as
    seen there (autograd-connected unless ``detach``)."""
    out: dict[object, list[Tensor]] = {}
    places = dict(zip(keys, devices))  # first device of each key, in order
    if all(d.type == "cpu" for d in places.values()) and src.type == "cpu" and len(places) > 1:
        per_copy = broadcast_copies(list(tensors), len(places), detach)
        return dict(zip(places, per_copy))
    others = [k for k, d in places.items() if d != src]
    first = next((k for k, d in places.items() if d == src), keys[0])
    if not tensors:
        return {k: [] for k in places}
    if others:
        if not (src.type == "cuda" and all(places[k].type == "cuda" for k in others)):
            raise ValueError(
                f"replicate: devices: expected all CUDA devices when the module is on {src}, "
                f"got {[str(places[k]) for k in others]}"
            )
        targets = [src.index, *(places[k].index for k in others)]
        if detach:
            from torch.nn.parallel import comm

            per_device = comm.broadcast_coalesced(tensors, targets)
            for k, copies in zip([first, *others], per_device):
                out[k] = list(copies)
        else:
            from torch.nn.parallel._functions import Broadcast

            flat = Broadcast.apply(targets, *tensors)
            n = len(tensors)
            for j, k in enumerate([first, *others]):
                out[k] = list(flat[j * n : (j + 1) * n])
        return out
    out[first] = [t.detach() if detach and t.requires_grad else t for t in tensors]
    return out


def _buffer_copies(
    buffers: list[Tensor], keys: list[object], targets: list[torch.device],
    src: torch.device, detach: bool,
) -> dict[object, list[Tensor]]:
    """Each replica key's buffers, in ``buffers``' order."""
    result: dict[object, list[Tensor]] = {k: list(buffers) for k in dict.fromkeys(keys)}
    index = {id(b): i for i, b in enumerate(buffers)}
    # Buffers that need grad broadcast like parameters; the rest never carry autograd.
    for wants_grad in (True, False):
        group = [b for b in buffers if b.requires_grad == wants_grad]
        for k, copies in _copies(group, keys, targets, src, detach or not wants_grad).items():
            for b, c in zip(group, copies):
                result[k][index[id(b)]] = c
    return result


def replicate(
    module: nn.Module,
    devices: Sequence[DeviceLike],
    detach: bool = False,
    *,
    cpu_replicas: str | None = None,
) -> list[nn.Module]:
    """Make one replica of ``module`` per entry of ``devices`` (entries may repeat).

    Args:
        module: the module, with all parameters and buffers on one device.
        devices: where each replica runs; CPU devices or CUDA devices.
        detach: make replicas whose tensors are cut from autograd (for ``no_grad``).
        cpu_replicas: ``"shared"`` (replicas on CPU use the module's tensors) or
            ``"distinct"`` (each CPU entry is a device of its own and its replica
            gets copies, as distinct GPUs do); default ``$DPMETHODS_CPU_REPLICAS``,
            else ``"shared"``.

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(2, 2)
        >>> replicas = replicate(lin, ["cpu", "cpu"], cpu_replicas="shared")
        >>> replicas[1].weight is replicas[0].weight
        True
        >>> replicas = replicate(lin, ["cpu", "cpu"], cpu_replicas="distinct")
        >>> replicas[1].weight.data_ptr() == lin.weight.data_ptr()
        False
    """
    targets = [
        torch.device("cuda", d) if isinstance(d, int) else torch.device(d) for d in devices
    ]
    if not targets:
        raise ValueError("replicate: devices: expected at least one device, got none")
    distinct = cpu_replicas_mode(cpu_replicas) == "distinct"
    # Which replicas share copies: one per device, or one per position for distinct CPUs.
    keys: list[object] = [j if distinct and d.type == "cpu" else d for j, d in enumerate(targets)]
    src = _source_device(module, targets[0])
    modules = list(module.modules())
    index = {id(m): i for i, m in enumerate(modules)}
    params = list(module.parameters())
    param_index = {id(p): i for i, p in enumerate(params)}
    param_copies = _copies(params, keys, targets, src, detach)

    buffers = list(module.buffers())
    buffer_index = {id(b): i for i, b in enumerate(buffers)}
    buffer_copies = _buffer_copies(buffers, keys, targets, src, detach)
    training = {
        id(b): m.training for m in modules for b in m._buffers.values() if b is not None
    }

    bound = bound_attributes(modules)
    seen: set[object] = set()
    replicas: list[nn.Module] = []
    for key in keys:
        shared = key not in seen
        seen.add(key)
        clones = [shallow_replica(m) for m in modules]  # never writes to `m`
        pc, bc = param_copies[key], buffer_copies[key]
        for m, clone in zip(modules, clones):
            for name, child in m._modules.items():
                clone._modules[name] = None if child is None else clones[index[id(child)]]
            for name, p in m._parameters.items():
                # Plain tensors in _parameters keep replica.parameters() non-empty.
                clone._parameters[name] = None if p is None else pc[param_index[id(p)]]  # type: ignore[assignment]
            for name, buf in m._buffers.items():
                if buf is None:
                    clone._buffers[name] = None
                    continue
                c = bc[buffer_index[id(buf)]]
                clone._buffers[name] = c if shared or not training[id(buf)] else c.clone()
            if "_flat_weights_names" in clone.__dict__:
                _repoint_flat_weights(clone)
            _own_hooks(clone)
        rebind(modules, clones, bound)  # compiled and patched code runs on the replica
        replicas.append(clones[0])
    return replicas


# The dicts that hold a module's call hooks. torch's replicas share them with the
# module, so a hook a method registers on its replica while it runs (peft's per-call
# ``adapter_names`` hooks, transformers' output-capturing hooks, installed once per
# model object) would run in every other replica and stay on the module. Each replica
# gets its own copies: the module's hooks still run in it, and what a call adds stays
# in that call's replicas.
HOOK_DICTS: tuple[str, ...] = tuple(
    name for name, value in vars(nn.Module()).items()
    if isinstance(value, dict) and ("forward" in name or "backward" in name)
)


# The default of a module that lacks one (made by an older torch), per name of
# HOOK_DICTS; an OrderedDict, as torch's are, since hook handles hold their dict weakly.
_NO_HOOKS_EACH: list[OrderedDict[int, Any]] = [OrderedDict()] * len(HOOK_DICTS)


def _own_hooks(clone: nn.Module) -> None:
    d = clone.__dict__
    # One C-level pass per module: replicate runs on every uncached call.
    d.update(zip(HOOK_DICTS, [h.copy() for h in map(d.get, HOOK_DICTS, _NO_HOOKS_EACH)]))


def _repoint_flat_weights(rnn: nn.Module) -> None:
    # RNNBase keeps its weights in a list too, updated by its __setattr__, which writing
    # _parameters bypasses: without this the replica would run on the module's weights.
    # (torch's replicate sets them with setattr, which updates the list; the module's
    # _flat_weight_refs are only read by flatten_parameters, which replicas don't call.)
    names: list[str] = rnn.__dict__["_flat_weights_names"]
    rnn.__dict__["_flat_weights"] = [getattr(rnn, n, None) for n in names]


# Fused optimizer kernels (``Adam(fused=True)``) update parameters in place without
# bumping their version counters, so fingerprint() also counts optimizer steps, through
# a global post-step hook registered the first time they are asked for.
_optimizer_steps = 0
_step_hook: object = None


def _count_step(*_: object) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


def optimizer_steps() -> int:
    """The optimizer steps taken in this process by any optimizer since the first call.

    Example:
        >>> before = optimizer_steps()
        >>> p = torch.nn.Parameter(torch.ones(1))
        >>> p.grad = torch.ones(1)
        >>> torch.optim.SGD([p], lr=0.1).step()
        >>> optimizer_steps() - before
        1
    """
    global _step_hook
    if _step_hook is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _step_hook = register_optimizer_step_post_hook(_count_step)
    return _optimizer_steps


def fingerprint(module: nn.Module, *, versionless: bool = False) -> tuple[object, ...]:
    """A cheap value that changes when anything a replica copied from ``module`` changes.

    It covers every module's class and attributes (by identity, so any assignment,
    ``train()`` and ``eval()`` show), each parameter's and buffer's identity, storage,
    device, dtype, version counter, sizes, strides and storage offset (so in-place
    updates, ``.to()``, ``p.data = p.data.t()`` and
    ``load_state_dict`` show), and the number of optimizer steps taken by any
    optimizer (fused steps don't bump version counters). Replicas keep the old
    attribute values alive, so an identity cannot be reused while a cached replica
    exists. In-place writes through ``.data`` are not seen (``.data`` has a version
    counter of its own); modules with inference tensors get a fingerprint equal to no
    other, so their replicas are never reused, unless ``versionless``.

    Args:
        module: the module whose replicas may be cached.
        versionless: an inference tensor counts without its version (its in-place
            updates are not seen; a thread map's look, :mod:`dpmethods.streaming.threads`).

    Example:
        >>> import torch
        >>> m = torch.nn.Linear(2, 2)
        >>> before = fingerprint(m)
        >>> with torch.no_grad():
        ...     _ = m.weight.mul_(2)
        >>> fingerprint(m) == before
        False
    """
    try:
        return _fingerprint(module, False)
    except RuntimeError:
        pass
    if versionless:
        try:
            return _fingerprint(module, True)
        except RuntimeError:
            pass
    # Inference tensors have no version counter, so their in-place updates can't be
    # seen: a fresh object makes this fingerprint equal to no other.
    return (object(),)


def _fingerprint(module: nn.Module, versionless: bool) -> tuple[object, ...]:
    """:func:`fingerprint`; raises ``RuntimeError`` for an inference tensor unless ``versionless``."""
    parts: list[object] = [optimizer_steps()]
    append, extend = parts.append, parts.extend  # this runs on every cached call: keep it lean
    for m in module.modules():
        d = m.__dict__
        append(type(m))
        # Names and value identities of every attribute: any assignment, train()/eval().
        extend(d)
        extend(map(id, d.values()))
        # Replicas copy the hook dicts, so a hook added or removed here must show.
        extend(chain.from_iterable(map(d.get, HOOK_DICTS, _NO_HOOKS_EACH)))
        for group in (d["_parameters"], d["_buffers"]):
            for t in group.values():
                if t is None:
                    append(None)
                else:
                    extend((id(t), t.data_ptr(), t.device, t.dtype,
                            None if versionless and t.is_inference() else t._version))
                    # ``p.data = p.data.t()`` keeps the storage and the version.
                    extend((t.shape, t.stride(), t.storage_offset()))
        extend(map(id, d["_modules"].values()))
    return tuple(parts)
