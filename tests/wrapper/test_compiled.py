"""Compiled and patched models: every replica runs compiled code on its own parameters,
and the original model is never damaged. The backends are eager ones (a counting
backend): the default inductor took over 60 s on the 2-core CI-like machine here.

Replicas share the module's hook dicts, so a forward pre-hook sees which module
instance each call ran on; a counting dynamo backend sees each run of compiled code.
"""

from __future__ import annotations

import collections
import contextlib
import gc
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

import dpmethods
from dpmethods import DataParallel
from dpmethods.testing import assert_close_to_reference as close
from tests.helpers import SPLITS
from tests.helpers.terms import mlp_terms

TERMS = mlp_terms(4, 6)  # Net: Linear(4, 6), then Linear(6, 3)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.lin(x)))

    @dpmethods.parallel_method
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class Counter:
    """A dynamo backend that runs the graph eagerly and counts the runs."""

    def __init__(self) -> None:
        self.runs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        def run(*args: Any) -> Any:
            self.runs += 1
            return gm.forward(*args)

        return run


def _instances(module: nn.Module) -> list[nn.Module]:
    seen: list[nn.Module] = []
    module.register_forward_pre_hook(lambda m, args: seen.append(m))
    return seen


def _count_calls(module: nn.Module) -> None:
    """Count calls on each module object (source or replica) in its own attribute.

    Compiled code replays a hook's side effects after the graph; appending to a list
    shared by the replicas' threads would be rebuilt by each thread and lose updates,
    while each replica's own attribute is written by its thread alone.
    """
    module.register_forward_pre_hook(
        lambda m, args: setattr(m, "_calls", getattr(m, "_calls", 0) + 1)
    )


def _calls(module: nn.Module) -> int:
    return module.__dict__.get("_calls", 0)


class _Recording(DataParallel):
    """Keeps the replicas of the last call (through torch's replicate seam)."""

    def replicate(self, module: nn.Module, device_ids: Any) -> list[nn.Module]:  # type: ignore[override]
        replicas = super().replicate(module, device_ids)
        self.__dict__["last_replicas"] = list(replicas)
        return replicas


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _unharmed(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    assert len(list(model.parameters())) == 4


@pytest.fixture(scope="module", autouse=True)
def _collected_after() -> Iterator[None]:
    yield
    # Dynamo's compile state of these tests (fake tensors, guards) is freed here, not in
    # whatever module runs next, whose own garbage checks must see only their own objects.
    torch._dynamo.reset()
    gc.collect()


@pytest.fixture(autouse=True)
def _fresh_dynamo(_collected_after: None) -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class _Run(NamedTuple):
    model: Net
    wrapped: Any  # what the wrapper wraps
    dp: _Recording
    x: torch.Tensor
    want: torch.Tensor  # the eager model's output
    got: torch.Tensor
    before: dict[str, torch.Tensor]  # the model's state before


def _compiled_run(n: int, devices: int, compile_: Any) -> _Run:
    """A seeded Net compiled by ``compile_(model, backend)``, which returns what the wrapper
    wraps, run on ``devices`` replicas over ``n`` rows: it equals the eager model's output,
    and every replica ran compiled code."""
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(n, 4)
    want = model(x)
    before = _snapshot(model)
    backend = Counter()
    wrapped = compile_(model, backend)
    dp = _Recording(wrapped, device_ids=["cpu"] * devices)
    got = dp(x)
    close(got, want, terms=TERMS)
    assert backend.runs == devices  # every replica ran compiled code
    return _Run(model, wrapped, dp, x, want, got, before)


def _around(model: Net, backend: Counter) -> Any:
    compiled = torch.compile(model, backend=backend)
    _count_calls(model.out)
    return compiled


def _in_place(model: Net, backend: Counter) -> Net:
    model.compile(backend=backend)
    _count_calls(model)
    return model


def _inside(model: Net, backend: Counter) -> Net:
    inner = model.out
    model.out = torch.compile(inner, backend=backend)  # type: ignore[assignment]
    _count_calls(inner)
    return model


@pytest.mark.parametrize("n,devices", SPLITS)
def test_compile_around(n: int, devices: int) -> None:
    model, compiled, dp, x, want, got, before = _compiled_run(n, devices, _around)
    # Once on each replica's own modules, never on the source's.
    replicas = dp.last_replicas
    assert len(replicas) == devices and len({id(dpmethods.unwrap(r).out) for r in replicas}) == devices
    assert [_calls(dpmethods.unwrap(r).out) for r in replicas] == [1] * devices
    assert _calls(model.out) == 0
    # Decorated methods are found through the OptimizedModule.
    close(dp.encode(x), model.encode(x), terms=TERMS)
    # Gradients reach the original parameters, which are intact.
    got.sum().backward()
    assert model.lin.weight.grad is not None
    model.zero_grad()
    _unharmed(model, before)
    close(compiled(x), want, terms=TERMS)


@pytest.mark.parametrize("n,devices", SPLITS)
def test_compile_in_place(n: int, devices: int) -> None:
    model, _, dp, _, _, _, before = _compiled_run(n, devices, _in_place)
    # Each replica's compiled _call_impl ran on that replica, not on the source.
    replicas = dp.last_replicas
    assert len({id(r) for r in replicas}) == devices and model not in replicas
    assert [_calls(r) for r in replicas] == [1] * devices and _calls(model) == 0
    _unharmed(model, before)


@pytest.mark.parametrize("n,devices", SPLITS)
def test_compile_inside(n: int, devices: int) -> None:
    model, _, dp, _, _, _, before = _compiled_run(n, devices, _inside)
    inner = dpmethods.unwrap(model.out)
    inners = [dpmethods.unwrap(r.out) for r in dp.last_replicas]
    assert len({id(m) for m in inners}) == devices and inner not in inners
    assert [_calls(m) for m in inners] == [1] * devices and _calls(inner) == 0
    model.out = inner
    _unharmed(model, before)


@pytest.mark.parametrize("n,devices", SPLITS)
def test_patched_forward_is_bound_to_each_replica(n: int, devices: int) -> None:
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(n, 4)
    want = model(x) * 2
    calls: list[nn.Module] = []
    original = model.forward

    def patched(self: Net, x: torch.Tensor) -> torch.Tensor:
        calls.append(self)
        return type(self).forward(self, x) * 2

    model.forward = patched.__get__(model)  # type: ignore[method-assign]
    got = DataParallel(model, device_ids=["cpu"] * devices)(x)
    close(got, want, terms=TERMS)
    assert len({id(m) for m in calls}) == devices and model not in calls
    assert model.forward.__self__ is model  # the source keeps its own patch
    del original


def _accelerate_model() -> tuple[Any, nn.Module]:
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="no")
    return accelerator, accelerator.prepare(Net())


@pytest.mark.parametrize("n,devices", SPLITS)
def test_accelerate_prepared_model(n: int, devices: int) -> None:
    _, model = _accelerate_model()
    x = torch.randn(n, 4)
    want, want_enc = model(x), model.encode(x)
    seen = _instances(model)
    dp = DataParallel(model, device_ids=["cpu"] * devices)
    close((dp(x), dp.encode(x)), (want, want_enc), terms=TERMS)
    assert len({id(m) for m in seen}) == devices


def test_accelerate_mixed_precision_forward_runs_on_replicas() -> None:
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    # Accelerate keeps one global state; its own tests reset it the same way.
    AcceleratorState._reset_state(True)
    try:
        accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
        torch.manual_seed(0)
        model = accelerator.prepare(Net())
        assert "forward" in model.__dict__  # the instance's forward is Accelerate's wrapper
        seen = _instances(model.out)
        x = torch.randn(7, 4)
        want = model(x)
        seen.clear()
        got = DataParallel(model, device_ids=["cpu"] * 3)(x)
    finally:
        AcceleratorState._reset_state(True)
    assert got.dtype == want.dtype == torch.float32  # the wrapper's fp32 conversion ran
    # Both run the same bf16 roundings under autocast; only the fp32 accumulation order
    # differs, so a rounding of the hidden layer and of the output can each land on the
    # neighbouring bf16 value.
    close(got, want, terms=2, dtype=torch.bfloat16)
    # The wrapper ran on each replica's own modules, not on the source's.
    assert len({id(m) for m in seen}) == 3 and model.out not in seen[1:]


def test_route_on_a_model_without_module() -> None:
    _, model = _accelerate_model()
    seen: list[str] = []
    model.register_forward_pre_hook(lambda m, args: seen.append("hook"))
    x = torch.randn(5, 4)
    got = dpmethods.route(model).encode(x)
    close(got, model.lin(x), terms=mlp_terms(4))
    assert seen == ["hook"]  # routed through the model's own __call__
    assert "forward" not in model.__dict__  # restored


def test_route_warns_about_a_patched_forward() -> None:
    model = Net()
    model.forward = model.forward  # type: ignore[method-assign]
    dpmethods.vocab.warn_once.reset()
    with pytest.warns(UserWarning, match="instance-level forward"):
        dpmethods.route(model)


def test_unknown_compiled_wrapper_raises_before_running_and_leaves_the_model() -> None:
    torch.manual_seed(0)
    model = Net()
    before = _snapshot(model)

    def opaque(*args: Any, **kwargs: Any) -> Any:  # a wrapper whose options can't be read
        return model._call_impl(*args, **kwargs)

    opaque._torchdynamo_orig_callable = model._call_impl  # type: ignore[attr-defined]
    model._compiled_call_impl = opaque  # type: ignore[assignment]
    ran = _instances(model)
    with pytest.raises(RuntimeError, match=r"Net._compiled_call_impl is code compiled for the source module"):
        DataParallel(model, device_ids=["cpu"] * 3)(torch.randn(7, 4))
    assert ran == []
    _unharmed(model, before)


def test_replicas_take_turns_in_the_callers_thread_where_torch_cannot_compile_in_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading

    from dpmethods.core import compiled as compiled_module
    from dpmethods.vocab import warn_once as warn_once

    monkeypatch.setattr(compiled_module, "CONCURRENT_COMPILE", False)  # as on torch 2.11
    warn_once.reset()
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(7, 4)
    want = model(x)
    threads: list[int] = []
    model.out.register_forward_pre_hook(torch.compiler.disable(lambda m, a: threads.append(threading.get_ident())))
    backend = Counter()
    with pytest.warns(UserWarning, match="replicas that run compiled code take turns"):
        got = DataParallel(torch.compile(model, backend=backend), device_ids=["cpu"] * 3)(x)
    close(got, want, terms=TERMS)
    assert threads == [threading.get_ident()] * 3  # every replica ran in this thread


# --- torch.compile over the public gather ------------------------

needs_dynamo = pytest.mark.skipif(
    not torch._dynamo.is_dynamo_supported(), reason="torch.compile is not supported here"
)


def _outputs(kind: str) -> tuple[list[Any], dict[str, Any]]:
    gen = torch.Generator().manual_seed(3)
    a = [torch.randn(n, 4, generator=gen) for n in (3, 2, 2)]
    b = [torch.randn(n, generator=gen) for n in (3, 2, 2)]
    if kind == "tensor":
        return a, {}
    if kind == "tuple":
        return [(x, [y]) for x, y in zip(a, b)], {}
    if kind == "dict":
        return [{"h": x, "loss": y.sum(), "y": y} for x, y in zip(a, b)], {"mode": {"loss": "mean"}}
    if kind == "namedtuple":  # a class first seen while tracing: its rule lookup is traced
        pair = collections.namedtuple("Pair", "h y")  # type: ignore[misc]
        return [pair(x, y) for x, y in zip(a, b)], {}
    if kind == "model_output":  # a type with a shipped rule lookup (transformers)
        outputs = pytest.importorskip("transformers.modeling_outputs")
        return [outputs.BaseModelOutput(last_hidden_state=x) for x in a], {}
    assert kind == "dim1"
    return [x.T for x in a], {"dim": 1, "sizes": [3, 2, 2]}


@needs_dynamo
@pytest.mark.parametrize("extension", [True, False], ids=["extension", "fallback"])
@pytest.mark.parametrize("kind", ["tensor", "tuple", "dict", "namedtuple", "model_output", "dim1"])
def test_public_gather_compiles_with_fullgraph(kind: str, extension: bool) -> None:
    from dpmethods import ops

    if extension and ops.extension_info()["in_use"] != "compiled":
        pytest.skip("dpmethods._C is not built")
    with contextlib.nullcontext() if extension else ops.without_extension():  # the pure-PyTorch torch.cat path
        _compiles_with_fullgraph(kind)


def _compiles_with_fullgraph(kind: str) -> None:
    torch._dynamo.reset()
    outputs, kwargs = _outputs(kind)
    backend = Counter()
    compiled = torch.compile(
        lambda outs: dpmethods.gather(outs, "cpu", **kwargs), backend=backend, fullgraph=True
    )
    got = compiled(outputs)
    want = dpmethods.gather(outputs, "cpu", **kwargs)
    assert backend.runs == 1  # one graph, no break (fullgraph=True would have raised)
    assert type(got) is type(want)
    got_leaves, got_spec = torch.utils._pytree.tree_flatten(got)
    want_leaves, want_spec = torch.utils._pytree.tree_flatten(want)
    assert got_spec == want_spec and len(got_leaves) >= 1
    for g, w in zip(got_leaves, want_leaves, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@needs_dynamo
def test_compiled_gather_backward_matches_eager() -> None:
    # aot_eager traces the op's fake kernel and its autograd formula.
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(4)
    pieces = [torch.randn(n, 3, generator=gen, requires_grad=True) for n in (2, 3)]
    compiled = torch.compile(
        lambda ps: dpmethods.gather([{"y": p * 2} for p in ps], "cpu")["y"],
        backend="aot_eager", fullgraph=True,
    )
    weight = torch.randn(5, 3, generator=gen)
    (compiled(pieces) * weight).sum().backward()
    for p, w in zip(pieces, torch.split(weight, [2, 3]), strict=True):
        close(p.grad, 2 * w, terms=0)  # a copy times 2: exact
