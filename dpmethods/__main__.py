"""Command line: ``python -m dpmethods info [--json]`` and ``python -m dpmethods demo``.

``info`` reports what a bug report needs: versions, devices, GPU peer access and
which gather implementation (compiled extension or pure PyTorch) is in use.
``demo`` shows, on 4 CPU replicas, the problem dpmethods solves and its answer.

``python -m dpmethods`` imports the package first, which imports torch and loads the
extension (so that ``torch.ops.dpmethods.gather_coalesced`` exists once ``import
dpmethods`` returns); ``--help`` therefore pays for the torch import too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

import dpmethods
from dpmethods.integrations import registrations

__all__ = ["collect_info", "main", "run_demo"]


def _devices() -> dict[str, Any]:

    gpus: list[dict[str, Any]] = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append({
                "index": i,
                "name": props.name,
                "capability": f"{props.major}.{props.minor}",
                "memory_gib": round(props.total_memory / 2**30, 1),
            })
    return {"cpu_count": os.cpu_count(), "cuda_available": torch.cuda.is_available(), "gpus": gpus}


def _peer_access(n_gpus: int) -> list[list[bool]] | str:
    if n_gpus == 0:
        return "n/a: no GPU"

    return [
        [i == j or bool(torch.cuda.can_device_access_peer(i, j)) for j in range(n_gpus)]
        for i in range(n_gpus)
    ]


def _extension() -> dict[str, Any]:

    info_fn = getattr(dpmethods, "extension_info", None)
    if info_fn is None:
        return {"available": False, "in_use": "pure PyTorch",
                "reason": "dpmethods.extension_info is not provided by this build"}
    try:
        info = dict(info_fn())
    except Exception as exc:  # a broken build must not hide the rest of the report
        return {"available": False, "in_use": "unknown",
                "reason": f"extension_info() raised {type(exc).__name__}: {exc}"}
    return {k: v if isinstance(v, (str, int, float, bool, type(None))) else _jsonable(v)
            for k, v in info.items()}


def _jsonable(value: Any) -> Any:
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    return str(value)


def collect_info() -> dict[str, Any]:
    """Versions, devices, GPU peer access and the extension build, as a JSON-ready dict.

    Example:
        >>> sorted(collect_info())[:3]
        ['devices', 'dpmethods', 'extension']
    """


    devices = _devices()
    return {
        "dpmethods": dpmethods.__version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "devices": devices,
        "peer_access": _peer_access(len(devices["gpus"])),
        "extension": _extension(),
        "registrations": _registrations(),
    }


def _registrations() -> list[dict[str, Any]]:
    return registrations()


def _print_info(info: dict[str, Any]) -> None:
    cuda = info["torch_cuda"] or "none (CPU-only build)"
    print(f"dpmethods {info['dpmethods']}")
    print(f"torch {info['torch']} (built with CUDA {cuda})")
    print(f"Python {info['python']} on {info['platform']}")
    devices = info["devices"]
    print(f"CPU count: {devices['cpu_count']}")
    if devices["gpus"]:
        for g in devices["gpus"]:
            print(f"GPU {g['index']}: {g['name']}, capability {g['capability']}, "
                  f"{g['memory_gib']} GiB")
    else:
        print("GPUs: none (use device_ids=['cpu'] * N for CPU replicas)")
    peer = info["peer_access"]
    if isinstance(peer, str):
        print(f"peer access: {peer}")
    else:
        print("peer access (row can access column):")
        n = len(peer)
        print("      " + " ".join(f"{j:>5}" for j in range(n)))
        for i, row in enumerate(peer):
            cells = ("-" if i == j else "yes" if v else "no" for j, v in enumerate(row))
            print(f"{i:>5} " + " ".join(f"{c:>5}" for c in cells))
    ext = info["extension"]
    print(f"extension: in use: {ext.get('in_use', 'unknown')}")
    if ext.get("reason"):  # why the fallback (another torch, a failed import) and the fix, first
        print(f"  reason: {ext['reason']}")
    for key in sorted(ext):
        value = ext[key]
        # Only what is there: no "reason: None" when nothing is wrong.
        if key in ("in_use", "reason") or value is None:
            continue
        if isinstance(value, list):
            value = ", ".join(map(str, value)) or "none"
        print(f"  {key}: {value}")
    # A library's methods become parallel as soon as the user's program imports it.
    print("built-in parallel methods (active once the library is imported):")
    for row in info.get("registrations", []):
        state = "installed" if row["installed"] else "not installed"
        print(f"  {row['library']} ({state}): {row['applies_to']}: {row['methods']}")


def _demo_model() -> Any:
    """An encoder with a ragged ``generate``: each row yields a data-dependent number of ids."""


    class DemoModel(nn.Module):
        def __init__(self, features: int = 8, latent: int = 4, max_len: int = 6) -> None:
            super().__init__()
            self.enc = nn.Linear(features, latent)
            self.max_len = max_len

        def forward(self, x: Tensor) -> Tensor:
            return self.enc(x)

        @dpmethods.parallel_method
        def encode(self, x: Tensor) -> Tensor:
            return torch.tanh(self.enc(x))

        @dpmethods.parallel_method(gather="pad", pad_value=-1)
        def generate(self, x: Tensor) -> Tensor:
            # Like an LM's generate: each row stops at its own length, and a call returns
            # only as many columns as its longest row, so replicas return different widths.
            z = self.encode(x)
            lengths = (z.abs().sum(-1) * 10).long() % self.max_len + 1
            width = int(lengths.max())
            ids = (z.argmax(-1, keepdim=True) + torch.arange(width)).clone()
            ids[torch.arange(width) >= lengths[:, None]] = -1
            return ids

    return DemoModel()


def run_demo(replicas: int = 4, batch: int = 10) -> dict[str, Any]:
    """The demo of ``python -m dpmethods demo``; prints a few lines and returns the results.

    Args:
        replicas: the number of CPU replicas.
        batch: the number of items.

    Example:
        >>> run_demo(replicas=2, batch=4)["generate_equal"]  # doctest: +ELLIPSIS
        torch.nn.DataParallel(model).encode -> AttributeError: ...
        True
    """


    torch.manual_seed(0)
    model = _demo_model().eval()
    x = torch.randn(batch, 8)
    try:
        torch.nn.DataParallel(model).encode(x)  # type: ignore[operator]  # fails: the point
        torch_error = "no error"
    except AttributeError as exc:
        torch_error = f"AttributeError: {exc}"
    print(f"torch.nn.DataParallel(model).encode -> {torch_error}")

    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * replicas)
    with torch.no_grad():
        got, ref = dp.encode(x), model.encode(x)
        ids, ref_ids = dp.generate(x), model.generate(x)
    # tanh(Linear(8, 4)): up to rounding of 9 terms summed in another order per share.
    encode_equal = bool(torch.allclose(got, ref, rtol=0, atol=4 * 9 * torch.finfo(ref.dtype).eps))
    generate_equal = ids.shape == ref_ids.shape and bool(torch.equal(ids, ref_ids))
    lengths = (ids != -1).sum(-1).tolist()
    with torch.no_grad():
        sizes = dpmethods.parallel.chunk_sizes(batch, replicas)
        widths = [int(model.generate(share).shape[1]) for share in x.split(sizes)]
    print(f"dpmethods.DataParallel(model, device_ids=['cpu'] * {replicas}).encode(x): "
          f"shape {list(got.shape)}, equal to model.encode(x): {encode_equal}")
    print(f"dp.generate(x) (gather='pad', pad_value=-1): shape {list(ids.shape)}, "
          f"row lengths {lengths}, equal to model.generate(x): {generate_equal}")
    print(f"  the {len(sizes)} replicas returned widths {widths}; gather padded them to "
          f"{ids.shape[1]}")
    return {"torch_error": torch_error, "encode_equal": encode_equal,
            "generate_equal": generate_equal, "lengths": lengths, "widths": widths}


def _positive(value: str) -> int:
    """An argparse type: a count of at least 1, or a usage error (exit 2) saying so."""
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {value!r}")
    return n


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m dpmethods``.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Example:
        >>> main(["demo", "--replicas", "2", "--batch", "4"])  # doctest: +ELLIPSIS
        torch.nn.DataParallel(model).encode -> AttributeError: ...
        demo: OK
        0
    """
    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(
        prog="python -m dpmethods",
        description="dpmethods: data parallelism for model methods other than forward.",
        formatter_class=formatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="{info,demo}")
    info_p = sub.add_parser(
        "info", help="versions, devices, GPU peer access, extension build",
        description="Print what a bug report needs: versions, devices, GPU peer access "
        "and which gather implementation (compiled extension or pure PyTorch) is in use.",
        formatter_class=formatter,
    )
    info_p.add_argument("--json", action="store_true", help="print the report as JSON")
    demo_p = sub.add_parser(
        "demo", help="parallel encode/generate on CPU replicas",
        description="Show, on CPU replicas, that torch.nn.DataParallel cannot run "
        "model.encode, and that dpmethods.DataParallel runs encode and a ragged generate "
        "in parallel with the same result as one device.",
        formatter_class=formatter,
    )
    demo_p.add_argument("--replicas", type=_positive, default=4, help="the number of CPU replicas")
    demo_p.add_argument("--batch", type=_positive, default=10, help="the number of input rows")
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "info":
        info = collect_info()
        if args.json:
            print(json.dumps(info, indent=2))
        else:
            _print_info(info)
        return 0
    result = run_demo(args.replicas, args.batch)
    ok = result["encode_equal"] and result["generate_equal"]
    print("demo: OK" if ok else "demo: MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
