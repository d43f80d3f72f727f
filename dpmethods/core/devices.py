"""Device arguments of ``DataParallel``: ``device_ids`` and ``output_device``, checked at
construction, as torch resolves them plus CPU devices.

Without GPUs, CUDA ``device_ids`` make the wrapper a plain call, as in torch, with one
warning that they were ignored. ``"cpu:0"`` is the CPU (tensors report ``cpu``).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import Any

import torch

from dpmethods.vocab.warn_once import warn_once

__all__ = ["DeviceLike", "as_device", "check_source_device", "resolve_devices", "resolve_output_device"]

# A device as the user gives it: an index (CUDA; negative for the CPU), a string or a device.
DeviceLike = int | str | torch.device


def as_device(device: DeviceLike) -> torch.device:
    """``device`` as a ``torch.device``: an int is a CUDA index (negative: the CPU).

    Example:
        >>> as_device(1), as_device("cpu")
        (device(type='cuda', index=1), device(type='cpu'))
    """
    if isinstance(device, int):
        return torch.device("cpu") if device < 0 else torch.device("cuda", device)
    return torch.device(device)


def _check_device(dev: torch.device, where: str, given: DeviceLike) -> torch.device:
    """``dev`` (parsed from ``given``) checked; errors echo ``given`` as the user wrote it."""
    if dev.type == "cpu":
        return torch.device("cpu")  # "cpu:0" is the one CPU device; tensors say "cpu"
    if dev.type != "cuda":
        raise ValueError(f"{where}: expected a CUDA or CPU device, got {given!r}")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if not count or dev.index >= count:  # type: ignore[operator]
        raise ValueError(
            f"{where}: expected a CUDA device index below {count} "
            f"(torch.cuda.device_count()), got {given!r}"
            + ("; no GPU is available, so use a CPU device" if not count else "")
        )
    return dev


def resolve_devices(device_ids: Sequence[DeviceLike] | None) -> list[torch.device]:
    """``device_ids`` checked, as devices (None: every GPU, or none without GPUs).

    Example:
        >>> resolve_devices(["cpu", "cpu:0"])
        [device(type='cpu'), device(type='cpu')]
    """
    if device_ids is None:
        if not torch.cuda.is_available():
            return []  # as torch: without GPUs the wrapper is a plain call
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    if isinstance(device_ids, (str, int, torch.device)):
        raise TypeError(
            f"device_ids: expected a list of devices, got {type(device_ids).__name__} {device_ids!r}"
        )
    parsed: list[torch.device] = []
    for i, d in enumerate(device_ids):
        if isinstance(d, bool) or not isinstance(d, (int, str, torch.device)):
            raise TypeError(
                f"device_ids[{i}]: expected an int, str or torch.device, got {type(d).__name__} {d!r}"
            )
        try:
            parsed.append(as_device(d))
        except RuntimeError as exc:
            raise ValueError(f"device_ids[{i}]: expected a device, got {d!r} ({exc})") from None
    if parsed and not torch.cuda.is_available() and all(d.type == "cuda" for d in parsed):
        # As torch: without GPUs the wrapper is a plain call, whatever the ids say.
        warn_once(
            f"DataParallel: device_ids {list(device_ids)} were ignored because no GPU is "
            "available; the module runs as a plain call, as in torch.nn.DataParallel"
        )
        return []
    devices = [
        _check_device(d, f"device_ids[{i}]", given)
        for i, (d, given) in enumerate(zip(parsed, device_ids))
    ]
    if not devices:
        raise ValueError("device_ids: expected at least one device, got []")
    kinds = sorted({d.type for d in devices})
    if len(kinds) > 1:
        raise ValueError(
            f"device_ids: expected devices of one type, got {kinds}: {[str(d) for d in devices]}"
        )
    return devices


def resolve_output_device(output_device: DeviceLike | None, devices: list[torch.device]) -> torch.device:
    """``output_device`` checked, as a device (None: the first of ``devices``).

    Example:
        >>> resolve_output_device(None, [torch.device("cpu")])
        device(type='cpu')
    """
    if output_device is None:
        return devices[0]
    if isinstance(output_device, bool) or not isinstance(output_device, (int, str, torch.device)):
        raise TypeError(
            f"output_device: expected an int, str or torch.device, got "
            f"{type(output_device).__name__} {output_device!r}"
        )
    try:
        dev = as_device(output_device)
    except RuntimeError as exc:
        raise ValueError(f"output_device: expected a device, got {output_device!r} ({exc})") from None
    return _check_device(dev, "output_device", output_device)


def check_source_device(module: torch.nn.Module, src: torch.device) -> None:
    """Refuse a module with a parameter or buffer off ``device_ids[0]``, naming it.

    Example:
        >>> check_source_device(torch.nn.Linear(2, 2), torch.device("cpu"))
    """
    tensors: Any = chain(module.parameters(), module.buffers())
    for t in tensors:
        if t.device != src:
            named = chain(module.named_parameters(), module.named_buffers())
            where = next(n for n, v in named if v.device != src)
            raise RuntimeError(
                f"DataParallel: module must have its parameters and buffers on device "
                f"{src} (device_ids[0]), but {where!r} is on {t.device}"
            )
