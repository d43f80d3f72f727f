"""CUDA tests of dpmethods.ops.gather_coalesced (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from dpmethods import ops
from tests.helpers.gather_data import DTYPES, pieces

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)


@pytest.fixture(params=["direct", "staged"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "staged":
        monkeypatch.setenv("DPMETHODS_FORCE_STAGED", "1")
    else:
        monkeypatch.delenv("DPMETHODS_FORCE_STAGED", raising=False)
    return str(request.param)


def _pieces(shape: list[int], dim: int, sizes: list[int], dtype: torch.dtype, seed: int) -> list:
    return pieces(shape, dim, sizes, dtype, torch.Generator().manual_seed(seed))


def _check(tensors: list[torch.Tensor], r: int, dim: int, device: torch.device) -> list:
    out = ops.gather_coalesced(tensors, r, dim, device)
    torch.cuda.synchronize()
    for i, o in enumerate(out):
        ref = torch.cat([t.to(device) for t in tensors[i * r : (i + 1) * r]], dim)
        assert o.device == ref.device and o.dtype == ref.dtype and o.shape == ref.shape
        assert torch.equal(o, ref), f"leaf {i}"
    return out


def test_compiled_with_cuda() -> None:
    info = ops.extension_info()
    assert info["in_use"] == "compiled" and info["cuda"], info
    assert torch._C._dispatch_has_kernel_for_dispatch_key("dpmethods::gather_coalesced", "CUDA")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_same_device_every_dtype(dtype: torch.dtype, dim: int, path: str) -> None:
    tensors = [t.to(CUDA) for t in _pieces([3, 5, 7], dim, [2, 1, 4], dtype, 0)]
    tensors += [t.to(CUDA) for t in _pieces([2, 9, 3], dim, [1, 3, 2], dtype, 1)]
    _check(tensors, 3, dim, CUDA)


def test_unaligned_non_contiguous_and_empty(path: str) -> None:
    base = torch.randn(4, 41, device=CUDA)
    a = base[:, 1:6]  # odd offset, strided
    b = torch.randn(6, 4, device=CUDA).t()
    c = torch.randn(4, 0, device=CUDA)
    d = torch.randn(4, 3, dtype=torch.complex64, device=CUDA).conj()
    e = torch.randn(4, 2, dtype=torch.complex64, device=CUDA)
    _check([a, b, c], 3, 1, CUDA)
    _check([d, e, d], 3, 1, CUDA)
    u8 = torch.randint(0, 255, (1000,), dtype=torch.uint8, device=CUDA)
    _check([u8[1:34], u8[3:500], u8[7:8]], 3, 0, CUDA)  # byte-aligned only


def test_many_leaves_and_large(path: str) -> None:
    many = [torch.randn(2, 3, device=CUDA) for _ in range(1500 * 2)]
    _check(many, 2, 1, CUDA)
    big = [torch.randn(512, 1000 + i, device=CUDA) for i in range(4)]
    _check(big, 4, 1, CUDA)
    _check([torch.randn(4000, 257, device=CUDA) for _ in range(3)], 3, 0, CUDA)


def test_single_replica_repeated_device_and_host_pieces(path: str) -> None:
    t = torch.randn(3, 4, device=CUDA)
    out = _check([t], 1, 0, CUDA)
    assert out[0].data_ptr() != t.data_ptr()
    _check([t, t, t], 3, 0, CUDA)  # one tensor repeated
    host = torch.randn(2, 4)
    _check([t, host], 2, 0, CUDA)  # mixed host/device sources, CUDA target
    _check([t, host], 2, 0, CPU)  # CUDA kernel, CPU target
    _check([host, host], 2, 0, CUDA)  # CPU kernel, redispatched to the CUDA kernel
    _check([t, t], 2, 0, torch.device("cuda"))  # index-less target


@pytest.mark.parametrize("target", [CPU, CUDA], ids=str)
def test_packed_host_transfers(target: torch.device, path: str) -> None:
    # A CPU target packs each device's CUDA pieces into one pinned copy; a CUDA
    # target uploads all host pieces in one copy. Mixed dtypes, views, empties.
    tensors: list[torch.Tensor] = []
    for i, dtype in enumerate(DTYPES):
        leaf = _pieces([3, 4 + i, 2], 1, [2, 0, 3, 1], dtype, 10 + i)
        tensors += [t.to(CUDA) if (i + r) % 2 else t for r, t in enumerate(leaf)]
    odd = torch.randn(5, 40, device=CUDA)[:, 3:8]  # unaligned, strided
    conj = torch.randn(5, 2, dtype=torch.complex64, device=CUDA).conj()
    tensors += [odd, torch.randn(5, 3), odd.t().contiguous().t(), torch.randn(5, 0)]
    tensors += [conj, conj.cpu(), conj, conj.cpu()._neg_view()]
    _check(tensors, 4, 1, target)
    _check([torch.randn(3, 7, device=CUDA) for _ in range(1200 * 2)], 2, 0, target)


def test_current_stream_is_used(path: str) -> None:
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x = torch.randn(1024, 1024, device=CUDA)
        y = x * 2
        out = ops.gather_coalesced([x, y], 2, 0, CUDA)
    s.synchronize()
    assert torch.equal(out[0], torch.cat([x, y]))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_across_devices(path: str) -> None:
    a = torch.randn(3, 5, device="cuda:0")
    b = torch.randn(2, 5, device="cuda:1")
    _check([a, b, b, a], 4, 0, CUDA)
    _check([a, b], 2, 0, torch.device("cuda:1"))


def test_gradients(path: str) -> None:
    ts = tuple(t.to(CUDA).requires_grad_() for t in _pieces([2, 3], 1, [1, 2, 2], torch.float64, 3))
    host = torch.randn(2, 2, dtype=torch.float64, requires_grad=True)

    def fn(*xs: torch.Tensor) -> tuple:
        return tuple(ops.gather_coalesced(list(xs), 4, 1, CUDA))

    assert torch.autograd.gradcheck(fn, (*ts, host))
    out = torch.ops.dpmethods.gather_coalesced([*ts, host], 4, 1, CUDA)
    g = torch.randn_like(out[0])
    grads = torch.autograd.grad(out[0], [*ts, host], g)
    assert grads[-1].device == CPU and torch.equal(grads[-1], g[:, 5:].cpu())
    assert grads[0].untyped_storage().data_ptr() == g.untyped_storage().data_ptr()


def test_opcheck() -> None:
    ts = [t.to(CUDA).requires_grad_() for t in _pieces([2, 3], 0, [1, 2], torch.float32, 4)]
    torch.library.opcheck(torch.ops.dpmethods.gather_coalesced.default, (ts, 2, 0, CUDA))
