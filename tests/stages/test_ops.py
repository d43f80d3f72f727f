"""CPU tests of dpmethods.ops.gather_coalesced (compiled op and fallback)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from dpmethods import ops
from tests.helpers.gather_data import DTYPES
from tests.helpers.gather_data import pieces as _pieces
from tests.helpers.gather_data import rand as _rand

CPU = torch.device("cpu")
COMPILED = ops.extension_info()["in_use"] == "compiled"
needs_ext = pytest.mark.skipif(not COMPILED, reason="dpmethods._C not built")


def _on(path: str) -> contextlib.AbstractContextManager[None]:
    """The gather's path a test asks for: the pure-PyTorch one, or this process's."""
    return ops.without_extension() if path == "pure PyTorch" else contextlib.nullcontext()



def _reference(tensors: list[torch.Tensor], r: int, dim: int) -> list[torch.Tensor]:
    return [
        torch.cat([t.to(CPU) for t in tensors[i : i + r]], dim) for i in range(0, len(tensors), r)
    ]


def _check(tensors: list[torch.Tensor], r: int, dim: int) -> list[torch.Tensor]:
    out = ops.gather_coalesced(tensors, r, dim, CPU)
    ref = _reference(tensors, r, dim)
    assert len(out) == len(ref)
    for o, e in zip(out, ref, strict=True):
        assert o.dtype == e.dtype and o.device == CPU
        assert o.shape == e.shape
        assert torch.equal(o, e)
        assert o.is_contiguous()
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [0, 1, 2, 3, -1, -4])
def test_every_dtype_and_dim(dtype: torch.dtype, dim: int) -> None:
    gen = torch.Generator().manual_seed(hash((str(dtype), dim)) % 2**31)
    leaves = _pieces([3, 2, 5, 4], dim, [2, 1, 3], dtype, gen)
    leaves += _pieces([1, 3, 2, 7], dim, [1, 4, 2], dtype, gen)
    # leaf-major: 2 leaves x 3 replicas
    _check(leaves, 3, dim)


def test_mixed_dtypes_and_ranks_in_one_call() -> None:
    gen = torch.Generator().manual_seed(0)
    tensors: list[torch.Tensor] = []
    for i, dtype in enumerate(DTYPES):
        shape = [2 + i % 3, 3, 1 + i % 2][: 1 + i % 3]
        tensors += _pieces(shape, 0, [1 + i % 2, 2], dtype, gen)
    _check(tensors, 2, 0)


def test_non_contiguous_and_lazy_conj_inputs() -> None:
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(6, 4, generator=gen).t()  # transposed
    b = torch.randn(4, 12, generator=gen)[:, ::2]  # strided
    c = torch.randn(4, 3, dtype=torch.complex64, generator=gen).conj()
    d = torch.randn(3, 4, dtype=torch.complex64, generator=gen).t()
    e = torch.randn(4, 2, dtype=torch.complex64, generator=gen)._neg_view()
    assert not a.is_contiguous() and not b.is_contiguous() and c.is_conj() and e.is_neg()
    _check([a, b, c, d], 2, 1)
    _check([c, e], 2, 1)
    _check([a.expand(2, 4, 6)[1], b], 2, 1)  # stride-0 source


def test_empty_pieces_and_empty_leaves() -> None:
    gen = torch.Generator().manual_seed(2)
    tensors = _pieces([3, 4], 1, [0, 2, 0], torch.float32, gen)
    tensors += _pieces([3, 4], 1, [0, 0, 0], torch.float32, gen)
    tensors += _pieces([0, 4], 1, [1, 2, 3], torch.int32, gen)
    out = _check(tensors, 3, 1)
    assert out[1].shape == (3, 0) and out[2].shape == (0, 6)


def test_single_replica_and_no_tensors() -> None:
    gen = torch.Generator().manual_seed(3)
    tensors = [_rand([4, 5], torch.float32, gen), _rand([2], torch.int64, gen)]
    out = _check(tensors, 1, 0)
    assert out[0].data_ptr() != tensors[0].data_ptr()  # a copy, never an alias
    assert ops.gather_coalesced([], 2, 0, CPU) == []


def test_many_leaves() -> None:
    gen = torch.Generator().manual_seed(4)
    tensors = [_rand([2, 3], torch.float32, gen) for _ in range(1100 * 2)]
    _check(tensors, 2, 1)


def test_large_leaf_uses_parallel_path() -> None:
    # Several MiB, above the single-thread grain, with rows that do not align to 16 bytes.
    gen = torch.Generator().manual_seed(5)
    tensors = _pieces([1024, 3, 333], 1, [2, 5, 1], torch.float32, gen)
    tensors += _pieces([777, 1001], 0, [300, 1, 500], torch.int8, gen)
    _check(tensors[:3], 3, 1)
    _check(tensors[3:], 3, 0)


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_worker_boundaries_inside_rows_pieces_and_leaves(threads: int) -> None:
    # Workers split the gather by output bytes: with an odd thread count their
    # boundaries fall inside rows, inside one replica's columns and between leaves.
    gen = torch.Generator().manual_seed(50 + threads)
    by_dim1 = _pieces([300, 8, 331], 1, [3, 1, 4], torch.int16, gen)
    by_dim1 += _pieces([2, 2], 1, [1, 0, 1], torch.float64, gen)
    by_dim1 += _pieces([29, 1030, 13], 1, [250, 3, 777], torch.float32, gen)
    by_dim1 += _pieces([6000, 33], 1, [17, 5, 11], torch.uint8, gen)
    by_dim2 = _pieces([97, 5, 1030], 2, [250, 3, 777], torch.float32, gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check(by_dim1, 3, 1)
        _check(by_dim2, 3, 2)
    finally:
        torch.set_num_threads(before)


def test_gradients_flow_to_every_piece_as_views() -> None:
    gen = torch.Generator().manual_seed(6)
    tensors = [t.requires_grad_() for t in _pieces([3, 4], 1, [1, 2, 3], torch.float64, gen)]
    ints = _pieces([2, 1], 1, [1, 2, 1], torch.int64, gen)
    out = ops.gather_coalesced(tensors + ints, 3, 1, CPU)
    assert out[0].requires_grad and not out[1].requires_grad
    weight = torch.randn(out[0].shape, dtype=torch.float64, generator=gen)
    (out[0] * weight).sum().backward()
    for t, w in zip(tensors, torch.split(weight, [1, 2, 3], 1), strict=True):
        assert t.grad is not None and torch.equal(t.grad, w)


@needs_ext
@pytest.mark.parametrize("entry", ["wrapper", "torch.ops"])
def test_gradcheck(entry: str) -> None:
    gen = torch.Generator().manual_seed(7)
    tensors = _pieces([2, 3, 2], -2, [1, 3], torch.float64, gen)
    tensors += _pieces([2, 2], -2, [2, 1], torch.float64, gen)
    inputs = tuple(t.requires_grad_() for t in tensors)

    def fn(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if entry == "wrapper":
            return tuple(ops.gather_coalesced(list(ts), 2, -2, CPU))
        return tuple(torch.ops.dpmethods.gather_coalesced(list(ts), 2, -2, CPU))

    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradgradcheck(fn, inputs)


@needs_ext
@pytest.mark.parametrize("entry", ["wrapper", "torch.ops"])
def test_same_device_gradients_are_views(entry: str) -> None:
    t = [torch.randn(2, 3, requires_grad=True) for _ in range(2)]
    fn = ops.gather_coalesced if entry == "wrapper" else torch.ops.dpmethods.gather_coalesced
    out = fn(t, 2, 0, CPU)
    g = torch.randn(4, 3)
    grads = torch.autograd.grad(out[0], t, g)
    base = g.untyped_storage().data_ptr()
    assert [x.untyped_storage().data_ptr() for x in grads] == [base, base]
    assert torch.equal(grads[1], g[2:])


# The CUDA kernel's tiling (csrc/gather_tiles.h) run on the CPU by a test op:
# the same Piece tables, tile numbering, access widths and packing as on a GPU.
_TILE = 16384
_STAGED = pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])


def _tiles(tensors: list[torch.Tensor], r: int, dim: int, staged: bool) -> None:
    out = torch.ops.dpmethods._gather_tiles_on_host(tensors, r, dim, staged)
    ref = _reference(tensors, r, dim)
    assert len(out) == len(ref)
    for i, (o, e) in enumerate(zip(out, ref, strict=True)):
        assert o.dtype == e.dtype and o.shape == e.shape
        assert torch.equal(o, e), f"leaf {i}"


@needs_ext
@_STAGED
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_cuda_tiling_every_dtype_and_dim(dtype: torch.dtype, dim: int, staged: bool) -> None:
    gen = torch.Generator().manual_seed(hash((str(dtype), dim, staged)) % 2**31)
    leaves = _pieces([3, 5, 7], dim, [2, 1, 4], dtype, gen)
    leaves += _pieces([2, 9, 3], dim, [1, 3, 2], dtype, gen)
    _tiles(leaves, 3, dim, staged)


@needs_ext
@_STAGED
@pytest.mark.parametrize("width", [16, 8, 4, 2, 1])
def test_cuda_tiling_access_widths_and_tile_edges(width: int, staged: bool) -> None:
    # Sources at an offset of `width` bytes from 64-byte aligned memory, with
    # lengths that are multiples of it, allow accesses of exactly `width` bytes.
    # Pieces span full tiles, a partial last tile, and pieces smaller than a tile.
    gen = torch.Generator().manual_seed(width)
    u8 = torch.randint(0, 256, (8 * _TILE,), dtype=torch.uint8, generator=gen)
    lengths = [3 * _TILE + 5 * width, width, _TILE]
    starts = [width, 4 * _TILE + width, 5 * _TILE + width]
    flat = [u8[s : s + n] for s, n in zip(starts, lengths)]
    _tiles(flat, 3, 0, staged)  # one row per piece: the flat path
    cols = [width * 3, width * 70, width * 1]
    rows = [u8[width : width + 100 * c].view(100, c) for c in cols]
    _tiles(rows, 3, 1, staged)  # rows of different widths: the row-by-row path
    whole = u8[width : width + 2 * _TILE + 3 * width].view(-1, width)
    _tiles([whole], 1, 1, staged)  # one replica spanning whole rows


@needs_ext
@_STAGED
def test_cuda_tiling_views_empties_and_many_pieces(staged: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(4, 41, generator=gen)
    conj = torch.randn(4, 3, dtype=torch.complex64, generator=gen).conj()
    _tiles([base[:, 1:6], torch.randn(6, 4, generator=gen).t(), torch.randn(4, 0)], 3, 1, staged)
    _tiles([conj, torch.randn(4, 2, dtype=torch.complex64, generator=gen)._neg_view()], 2, 1, staged)
    _tiles([torch.randn(2, 3, generator=gen) for _ in range(1100 * 2)], 2, 1, staged)
    big = [torch.randn(64, 1000 + i, generator=gen) for i in range(3)]  # multi-tile rows
    _tiles(big, 3, 1, staged)


@needs_ext
def test_opcheck() -> None:
    gen = torch.Generator().manual_seed(8)
    tensors = [t.requires_grad_() for t in _pieces([2, 3], 1, [1, 2], torch.float32, gen)]
    tensors += _pieces([4, 2], 1, [2, 3], torch.int32, gen)
    torch.library.opcheck(torch.ops.dpmethods.gather_coalesced.default, (tensors, 2, 1, CPU))


@needs_ext
def test_torch_compile_traces_the_op() -> None:
    gen = torch.Generator().manual_seed(9)
    tensors = _pieces([2, 3], 0, [1, 2], torch.float32, gen)
    fn = torch.compile(
        lambda ts: ops.gather_coalesced(ts, 2, 0, CPU), backend="eager", fullgraph=True
    )
    assert torch.equal(fn(tensors)[0], torch.cat(tensors))


@needs_ext
def test_compiled_op_is_used() -> None:
    info = ops.extension_info()
    assert info["available"] and info["in_use"] == "compiled" and info["reason"] is None
    assert info["torch_built_against"] == torch.__version__
    assert torch._C._dispatch_has_kernel_for_dispatch_key("dpmethods::gather_coalesced", "CPU")
    tensors = [torch.randn(2, 2), torch.randn(2, 2)]
    grads = [t.clone().requires_grad_() for t in tensors]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ops.gather_coalesced(tensors, 2, 0, CPU)
        out = ops.gather_coalesced(grads, 2, 0, CPU)
    names = [e.name for e in prof.events()]
    assert names.count("dpmethods::gather_coalesced") == 2
    assert "aten::cat" not in names
    # The eager entry builds the C++ node, not the Python autograd.Function.
    assert out[0].grad_fn is not None and out[0].grad_fn.name() == "GatherCoalescedBackward"


@pytest.mark.parametrize("path", ["compiled", "pure PyTorch"])
@pytest.mark.parametrize(
    ("tensors", "r", "dim", "exc", "match"),
    [
        ([torch.ones(2)], 0, 0, ValueError, r"num_replicas must be >= 1, got 0"),
        (
            [torch.ones(2)] * 3,
            2,
            0,
            ValueError,
            r"len\(tensors\) must be a multiple of num_replicas \(2\), got 3 tensors",
        ),
        (
            [torch.ones(2, 3), torch.ones(2, 3, dtype=torch.float64)],
            2,
            0,
            TypeError,
            r"tensors\[1\] \(leaf 0, replica 1\) has dtype Double but expected Float",
        ),
        (
            [torch.ones(2, 3), torch.ones(2, 3), torch.ones(2, 3), torch.ones(3, 4)],
            2,
            1,
            ValueError,
            r"tensors\[3\] \(leaf 1, replica 1\) has shape \[3, 4\] but expected \[2, \*\]",
        ),
        (
            [torch.ones(2, 3), torch.ones(2, 3, 1)],
            2,
            0,
            ValueError,
            r"tensors\[1\] \(leaf 0, replica 1\) has shape \[2, 3, 1\] but expected \[\*, 3\]",
        ),
        (
            [torch.ones(2, 3), torch.ones(2, 3)],
            2,
            2,
            IndexError,
            r"dim 2 is out of range for leaf 0 with 2 dimensions \(expected -2 <= dim < 2\)",
        ),
        (
            [torch.tensor(1.0), torch.tensor(2.0)],
            2,
            0,
            ValueError,
            r"tensors\[0\] \(leaf 0, replica 0\) is 0-dimensional",
        ),
    ],
)
def test_error_messages(
    tensors: list[torch.Tensor], r: int, dim: int, exc: type[Exception], match: str, path: str,
) -> None:
    # The pure-PyTorch path refuses what the kernels refuse, with their errors: callers
    # (the gather's join of packed sequences, say) catch these types.
    if path == "compiled" and not COMPILED:
        pytest.skip("dpmethods._C is not in use")
    with _on(path), pytest.raises(exc, match=match):
        ops.gather_coalesced(tensors, r, dim, CPU)


@pytest.mark.parametrize("path", ["this process's", "pure PyTorch"])
def test_a_piece_that_is_no_tensor_is_named(path: str) -> None:
    t = torch.ones(2, 3)
    with _on(path):
        with pytest.raises(TypeError, match=r"^gather_coalesced\(\): tensors\[1\]: expected a Tensor, got NoneType None$"):
            ops.gather_coalesced([t, None], 2, 0, CPU)  # type: ignore[list-item]
        with pytest.raises(TypeError, match=r"^gather_coalesced\(\): tensors\[2\]: expected a Tensor, got str 'x'$"):
            ops.gather_coalesced([t, t, "x", t], 2, 0, CPU)  # type: ignore[list-item]


@needs_ext
def test_without_extension_gathers_in_pure_pytorch_for_the_block_only() -> None:
    pieces = [torch.randn(2, 3), torch.randn(1, 3)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with ops.without_extension():
            inside = ops.gather_coalesced(pieces, 2, 0, CPU)
            assert ops.extension_info()["in_use"] == "pytorch fallback"
    assert "dpmethods::gather_coalesced" not in [e.name for e in prof.events()]
    assert torch.equal(inside[0], torch.cat(pieces))
    assert ops.extension_info()["in_use"] == "compiled"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ops.gather_coalesced(pieces, 2, 0, CPU)
    assert "dpmethods::gather_coalesced" in [e.name for e in prof.events()]


def test_count_errors_without_extension_path() -> None:
    with pytest.raises(ValueError, match=r"num_replicas must be >= 1, got 0"):
        ops.gather_coalesced([], 0, 0, CPU)


_IMPORT_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import dpmethods, torch
    # Nothing but the import has run: no gather, no dpmethods.ops access.
    has_op = hasattr(torch.ops.dpmethods, "gather_coalesced")
    a, b = torch.ones(2, 3, requires_grad=True), torch.zeros(1, 3, requires_grad=True)
    out = torch.ops.dpmethods.gather_coalesced([a, b], 2, 0, torch.device("cpu"))[0] if has_op else None
    if out is not None:
        out.sum().backward()  # the autograd formula was registered at import too
    print(json.dumps({
        "has_op": has_op,
        "cat": out is not None and torch.equal(out, torch.cat([a, b])),
        "grad": a.grad is not None and torch.equal(a.grad, torch.ones(2, 3)),
        "data_parallel_loaded": "dpmethods.data_parallel" in sys.modules,
    }))
    """
)
# Then, in the same interpreter, the gathers of the fallback (the extension disabled).
_FALLBACK_SCRIPT = textwrap.dedent(
    """
    from dpmethods import ops
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(2, 3, generator=g), torch.randn(2, 1, generator=g),
          torch.randint(0, 9, (1, 4), generator=g), torch.randint(0, 9, (1, 2), generator=g)]
    outs = ops.gather_coalesced([ts[0], ts[1]], 2, 1, torch.device("cpu"))
    outs += ops.gather_coalesced([ts[2], ts[3]], 2, -1, torch.device("cpu"))
    ok = torch.equal(outs[0], torch.cat(ts[:2], 1)) and torch.equal(outs[1], torch.cat(ts[2:], 1))
    print(json.dumps({"info": ops.extension_info(), "ok": ok}))
    """
)


def _run(code: str, disabled: bool) -> subprocess.CompletedProcess[str]:
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ)
    env.pop("DPMETHODS_DISABLE_EXTENSION", None)
    if disabled:
        env["DPMETHODS_DISABLE_EXTENSION"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def disabled() -> tuple[dict[str, object], dict[str, object], str]:
    """One fresh interpreter with DPMETHODS_DISABLE_EXTENSION=1, logging at info level
    from the start: what the import alone gives, then what the fallback's gathers give,
    and its stderr."""
    logged = "import logging, sys\nlogging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
    proc = _run(logged + _IMPORT_SCRIPT + _FALLBACK_SCRIPT, disabled=True)
    imported, gathered = (json.loads(line) for line in proc.stdout.strip().splitlines()[-2:])
    return imported, gathered, proc.stderr


def test_fallback_when_disabled(disabled: tuple[dict[str, object], dict[str, object], str]) -> None:
    _, result, stderr = disabled
    assert result["ok"]
    info = result["info"]
    assert isinstance(info, dict)
    assert info["in_use"] == "pytorch fallback" and not info["available"]
    assert "DPMETHODS_DISABLE_EXTENSION=1" in info["reason"]
    # Logged once, at info level.
    assert stderr.count("using the pure-PyTorch gather") == 1


@needs_ext
def test_op_is_registered_once_import_dpmethods_returns(
    disabled: tuple[dict[str, object], dict[str, object], str],
) -> None:
    # As torchvision registers its ops on import: torch.export programs holding the op,
    # and direct torch.ops callers, must find it after `import dpmethods` alone.
    result = json.loads(_run(_IMPORT_SCRIPT, disabled=False).stdout.strip().splitlines()[-1])
    assert result == {"has_op": True, "cat": True, "grad": True, "data_parallel_loaded": False}
    # With the extension disabled, the import stays pure-Python: no op, no error.
    assert disabled[0] == {"has_op": False, "cat": False, "grad": False, "data_parallel_loaded": False}


# ------------------------------------------------- small outputs from shared blocks


@needs_ext
def test_small_outputs_own_their_storage() -> None:
    # Small leaves share one allocation, but each output has a storage of its own:
    # nothing aliases, saving one writes its bytes alone, and each lives on its own.
    gen = torch.Generator().manual_seed(10)
    dtypes = [torch.float32, torch.int8, torch.complex128, torch.bool, torch.float16]
    tensors: list[torch.Tensor] = []
    for i in range(40):
        tensors += _pieces([3 + i % 4, 5], 0, [1, 2, 3], dtypes[i % len(dtypes)], gen)
    outs = _check(tensors, 3, 0)
    storages = [o.untyped_storage() for o in outs]
    assert len({s.data_ptr() for s in storages}) == len(outs)
    for o, s in zip(outs, storages, strict=True):
        assert o.storage_offset() == 0 and s.nbytes() == o.numel() * o.element_size()
        assert s.data_ptr() % 64 == 0  # the CPU allocator's alignment
    ref = _reference(tensors, 3, 0)
    del tensors, storages
    outs[0].add_(1)  # in place on one output leaves the others alone
    assert torch.equal(outs[0], ref[0] + 1) and torch.equal(outs[1], ref[1])
    outs[1].resize_(100, 5)  # growing moves it to fresh memory with its values
    assert torch.equal(outs[1][: ref[1].shape[0]], ref[1])
    keep = outs[len(outs) // 2]
    del outs
    assert torch.equal(keep, ref[len(ref) // 2])  # outlives every sibling


@needs_ext
def test_shared_blocks_are_freed_with_their_last_output() -> None:
    # The CPU allocator reports every allocation and free to the profiler.
    gen = torch.Generator().manual_seed(11)
    tensors = [_rand([16, 8], torch.float32, gen) for _ in range(600 * 2)]  # 1 KiB outputs: 38 blocks
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        outs = ops.gather_coalesced(tensors, 2, 0, CPU)
        total = sum(o.numel() * o.element_size() for o in outs)
        first, rest = outs[0], outs[1:]
        del outs, rest
        del first
    # Allocations are charged to the op that made them, frees outside any op to "[memory]".
    events = prof.events()
    gathered = sum(e.self_cpu_memory_usage for e in events if e.name == "dpmethods::gather_coalesced")
    allocated = sum(e.self_cpu_memory_usage for e in events if e.self_cpu_memory_usage > 0)
    freed = -sum(e.self_cpu_memory_usage for e in events if e.self_cpu_memory_usage < 0)
    assert gathered >= total  # the outputs' bytes were allocated by the gather ...
    assert freed == allocated  # ... and all of them freed once the last output went,
    frees = [e for e in events if e.self_cpu_memory_usage < 0]
    assert 1 < len(frees) < 600  # a block at a time, not one free per output


# ------------------------------------------------------------- the eager entry point


class _Tagged(torch.Tensor):
    """A subclass whose __torch_function__ records the functions it sees."""

    seen: ClassVar[list[str]] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        cls.seen.append(str(func))
        return super().__torch_function__(func, types, args, kwargs or {})


@needs_ext
def test_subclasses_and_modes_take_the_torch_ops_route() -> None:
    gen = torch.Generator().manual_seed(12)
    plain = _pieces([2, 3], 0, [1, 2], torch.float32, gen)
    _Tagged.seen.clear()
    out = ops.gather_coalesced([plain[0].as_subclass(_Tagged), plain[1]], 2, 0, CPU)
    assert torch.equal(out[0], torch.cat(plain))
    assert any("gather_coalesced" in name for name in _Tagged.seen), _Tagged.seen

    class Mode(torch.overrides.TorchFunctionMode):
        seen: ClassVar[list[str]] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Mode() as mode:
        out = ops.gather_coalesced(plain, 2, 0, CPU)
    assert torch.equal(out[0], torch.cat(plain))
    assert any("gather_coalesced" in name for name in mode.seen), mode.seen


@needs_ext
def test_eager_entry_keeps_reference_counts() -> None:
    # It borrows the inputs without taking references: none may leak or be dropped.
    gen = torch.Generator().manual_seed(13)
    tensors = [t.requires_grad_() for t in _pieces([2, 3], 0, [1, 2, 3, 1], torch.float32, gen)]
    before = [sys.getrefcount(t) for t in tensors]
    for _ in range(5):
        out = ops.gather_coalesced(tensors, 4, 0, CPU)
        out[0].sum().backward()
        del out
    assert [sys.getrefcount(t) for t in tensors] == before
    ref = weakref.ref(tensors[0])
    out = ops.gather_coalesced(tuple(tensors), 4, 0, CPU)
    del tensors
    assert ref() is not None  # held by the graph through its grad accumulator
    del out
    assert ref() is None


@needs_ext
def test_eager_entry_argument_errors() -> None:
    t = [torch.ones(2), torch.ones(2)]
    with pytest.raises(TypeError, match=r"num_replicas: expected an int, got str '2'$"):
        ops.gather_coalesced(t, "2", 0, CPU)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"dim: expected an int, got float 0.0$"):
        ops.gather_coalesced(t, 2, 0.0, CPU)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"takes 4 arguments \(tensors, num_replicas, dim, device\), got 3"):
        ops.extension.module()._gather_coalesced(t, 2, 0)  # type: ignore[union-attr]
