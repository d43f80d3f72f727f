"""Errors that echo the value given and say what was expected."""

from __future__ import annotations

import contextlib
import io
import pickle

import pytest
import torch

import dpmethods
from dpmethods import ops

CPU = torch.device("cpu")


@pytest.mark.parametrize("compiled", [True, False], ids=["extension", "fallback"])
def test_gather_coalesced_dim_over_64_bits_echoes_the_value(compiled: bool) -> None:
    if compiled and ops.extension_info()["in_use"] != "compiled":
        pytest.skip("dpmethods._C is not built")
    pieces = [torch.ones(2, 3), torch.ones(1, 3)]
    with contextlib.nullcontext() if compiled else ops.without_extension():
        with pytest.raises(ValueError, match=r"^gather_coalesced\(\): dim: expected an int that fits in "
                           r"64 bits, got 1180591620717411303424$"):
            ops.gather_coalesced(pieces, 2, 2**70, CPU)
        with pytest.raises(ValueError, match=r"num_replicas: expected an int that fits in 64 bits, "
                           r"got 18446744073709551616$"):
            ops.gather_coalesced(pieces, 2**64, 0, CPU)
        with pytest.raises(TypeError, match=r"^gather_coalesced\(\): dim: expected an int, got float 1.5$"):
            ops.gather_coalesced(pieces, 2, 1.5, CPU)  # type: ignore[arg-type]


def test_gather_coalesced_takes_numpy_integers() -> None:
    np = pytest.importorskip("numpy")
    pieces = [torch.ones(2, 3), torch.zeros(1, 3)]
    out = ops.gather_coalesced(pieces, np.int64(2), np.int64(0), CPU)  # type: ignore[arg-type]
    assert torch.equal(out[0], torch.cat(pieces))


def test_missing_output_gpu_echoes_the_value_given() -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    given = f"cuda:{count + 3}"
    tail = "; no GPU is available, so use a CPU device" if not count else ""
    with pytest.raises(ValueError) as exc:
        dpmethods.DataParallel(torch.nn.Linear(2, 2), device_ids=["cpu"] * 2, output_device=given)
    assert str(exc.value) == (
        f"output_device: expected a CUDA device index below {count} "
        f"(torch.cuda.device_count()), got '{given}'{tail}"
    )
    if not count:  # "cuda" without an index asked torch for the current device, and crashed
        with pytest.raises(ValueError, match=r"got 'cuda'; no GPU is available, so use a CPU device$"):
            dpmethods.DataParallel(torch.nn.Linear(2, 2), device_ids=["cpu"] * 2, output_device="cuda")


class _Unsafe:
    pass


def _not_a_safe_state_dict() -> bytes:
    buf = io.BytesIO()
    torch.save({"weight": _Unsafe()}, buf)
    return buf.getvalue()


@pytest.mark.parametrize(
    ("data", "cause"),
    [
        (b"hello world", "KeyError: 101"),
        (b"PK\x03\x04garbage", "RuntimeError: PytorchStreamReader failed reading zip archive: "
         "not a ZIP archive."),
        (b"", "EOFError"),
        (pickle.dumps({"weight": 1}, protocol=2)[:-1], "EOFError"),
        (_not_a_safe_state_dict(), "UnpicklingError: Unsupported global: GLOBAL "
         f"{__name__}._Unsafe was not an allowed global by default."),
    ],
    ids=["text", "zip", "empty", "truncated", "unsafe"],
)
def test_bytes_that_are_not_a_saved_state_dict_say_they_were_taken_as_one(data: bytes, cause: str) -> None:
    with pytest.raises(ValueError) as exc:
        dpmethods.load_state_dict(torch.nn.Linear(2, 2), data)
    message = str(exc.value)
    assert message.startswith(
        f"state_dict: the {len(data)} bytes given were taken as a saved state dict (read with "
        "torch.load(..., weights_only=True)), and they could not be read: "
    ), message
    assert message.split(" It is a file")[0].endswith(": " + cause), message
    # One line, without torch's advice paragraphs or terminal escape codes; torch's own
    # error stays reachable as the cause.
    assert "\n" not in message and "\x1b" not in message and "weights_only` set to" not in message
    assert exc.value.__cause__ is not None


def test_a_saved_state_dict_that_needs_weights_only_false_says_so() -> None:
    with pytest.raises(ValueError) as exc:
        dpmethods.load_state_dict(torch.nn.Linear(2, 2), _not_a_safe_state_dict())
    assert str(exc.value).endswith(
        "was not an allowed global by default. It is a file that needs weights_only=False: "
        "if you trust its source, load it with torch.load(..., weights_only=False) and pass the "
        "state dict."
    ), str(exc.value)


def test_saved_state_dict_bytes_load() -> None:
    src, dst = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    dpmethods.load_state_dict(dst, buf.getvalue())
    assert torch.equal(src.weight, dst.weight)
