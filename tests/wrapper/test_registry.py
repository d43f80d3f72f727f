"""@parallel_method, register() and method options."""

from __future__ import annotations

import abc
import dataclasses
import inspect
import typing

import pytest
import torch
from torch import nn

import dpmethods
from dpmethods import MethodOptions, get_options, parallel_method, parallel_methods
from dpmethods.extending import CallHooks
from dpmethods.testing import assert_close_to_reference


class Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    @parallel_method
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Encode a batch."""
        return self.lin(x)

    @parallel_method(dim=1, broadcast=("mask",), gather="pad", pad_value=-1)
    def decode(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x * mask


def test_bare_and_called_forms_record_options() -> None:
    assert get_options(Base, "encode") == MethodOptions()
    opts = get_options(Base, "decode")
    assert opts == MethodOptions(dim=1, broadcast=("mask",), gather="pad", pad_value=-1)
    assert sorted(parallel_methods(Base)) == ["decode", "encode"]


def test_lookups_take_an_instance_for_its_class() -> None:
    model = Base()
    assert parallel_methods(model) == parallel_methods(Base)
    assert parallel_methods(torch.compile(model)) == parallel_methods(Base)  # the model's class
    assert get_options(model, "decode") == get_options(Base, "decode")
    assert get_options(model, "forward") is None
    with pytest.raises(TypeError, match=r"^parallel_methods: cls: expected an nn.Module subclass or a module, got int 3$"):
        parallel_methods(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^get_options: cls: expected an nn.Module subclass or a module, got str 'Base'$"):
        get_options("Base", "encode")  # type: ignore[arg-type]


def test_unwrapped_method_is_the_plain_function() -> None:
    m = Base()
    x = torch.randn(5, 4)
    assert Base.__dict__["encode"].__name__ == "encode"
    assert inspect.isfunction(Base.__dict__["encode"])
    assert torch.equal(m.encode(x), m.lin(x))
    assert Base.encode.__doc__ == "Encode a batch."


def test_inherited_override_stays_parallel_and_runs_subclass_code() -> None:
    class Child(Base):
        def encode(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * 2

    assert get_options(Child, "encode") == MethodOptions()
    dp = dpmethods.DataParallel(Child(), device_ids=["cpu", "cpu"])
    x = torch.randn(5, 4)
    assert_close_to_reference(dp.encode(x), dp.module.lin(x) * 2, terms=5)  # Linear(4, 3), times 2


def test_any_metaclass() -> None:
    class Meta(type(nn.Module)):  # type: ignore[misc]
        pass

    class WithMeta(nn.Module, metaclass=Meta):
        @parallel_method
        def encode(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    class Abstract(nn.Module, abc.ABC):
        @parallel_method(gather="sum")
        def encode(self, x: torch.Tensor) -> torch.Tensor:
            return x.sum()

        @abc.abstractmethod
        def other(self) -> None: ...

    assert get_options(WithMeta, "encode") == MethodOptions()
    assert get_options(Abstract, "encode") == MethodOptions(gather="sum")


def test_forward_itself() -> None:
    class Net(nn.Module):
        @parallel_method(gather="stack")
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sum(0)

    dp = dpmethods.DataParallel(Net(), device_ids=["cpu"] * 2)
    out = dp(torch.ones(4, 3))
    assert out.shape == (2, 3)
    assert torch.equal(out, torch.full((2, 3), 2.0))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: staticmethod(lambda x: x), "cannot mark a staticmethod.*regular method"),
        (lambda: classmethod(lambda cls: cls), "cannot mark a classmethod.*takes `self`"),
        (lambda: property(lambda self: 1), "cannot mark a property.*regular method"),
        (lambda: 42, "expected a method or keyword options, got int"),
    ],
)
def test_wrong_use_says_what_to_do(make: object, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        parallel_method(make())  # type: ignore[operator]


def test_callable_object_is_not_a_function() -> None:
    class Callable_:
        def __call__(self) -> None: ...

    with pytest.raises(TypeError, match="expects a function defined with `def`"):
        parallel_method(Callable_())


def test_class_that_is_not_a_module() -> None:
    # Python 3.11 wraps errors from __set_name__ in a RuntimeError; 3.12+ raises them as is.
    with pytest.raises((TypeError, RuntimeError)) as info:

        class NotModule:
            @parallel_method
            def encode(self, x: int) -> int:
                return x

    error = info.value if isinstance(info.value, TypeError) else info.value.__cause__
    assert isinstance(error, TypeError)
    assert "NotModule is not an nn.Module. Derive the class from torch.nn.Module" in str(error)


def test_option_validation_names_argument() -> None:
    with pytest.raises(ValueError, match=r"gather: expected one of \['cat'.*or a named mode, got 'Cat': did you mean 'cat'\?"):
        parallel_method(gather="Cat")
    with pytest.raises(ValueError, match=r"gather\['loss'\]: expected one of"):
        parallel_method(gather={"loss": "avg"})
    with pytest.raises(TypeError, match="dim: expected an int, got str"):
        parallel_method(dim="0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="pad_value: expected an int or float, got str"):
        parallel_method(pad_value="x")  # type: ignore[arg-type]


def test_the_decorator_takes_every_option_of_method_options() -> None:
    names = [f.name for f in dataclasses.fields(MethodOptions)]
    assert list(inspect.signature(parallel_method).parameters) == ["fn", *names]
    get_overloads = getattr(typing, "get_overloads", None)  # Python 3.11+
    if get_overloads is not None:  # the typed overload lists them too
        typed = inspect.signature(get_overloads(parallel_method)[-1]).parameters
        assert [n for n in typed if n != "fn"] == names

    class Codes(nn.Module):
        @parallel_method(scatter_dim={"codes": 1}, gather_dim=1, hooks=CallHooks())
        def decode(self, codes: torch.Tensor) -> torch.Tensor:
            return codes * 2

    assert get_options(Codes, "decode") == MethodOptions(scatter_dim={"codes": 1}, gather_dim=1, hooks=CallHooks())
    codes = torch.randn(2, 6, 3)  # the batch in dim 1
    assert_close_to_reference(dpmethods.DataParallel(Codes(), device_ids=["cpu"] * 3).decode(codes), codes * 2, terms=1)
    with pytest.raises(TypeError, match=r"^parallel_method: unknown option\(s\) \['scater_dim'\] \(did you mean "
                       r"'scatter_dim'\?\); expected any of \['dim', 'broadcast', 'gather', 'pad_value', 'split', "
                       r"'gather_dim', 'scatter_dim', 'hooks'\]$"):
        parallel_method(scater_dim={"codes": 1})
    with pytest.raises(TypeError, match=r"^methods\['decode'\]: unknown option\(s\) \['gathr'\] \(did you mean 'gather'\?\)"):
        dpmethods.DataParallel(Codes(), device_ids=["cpu"] * 2, methods={"decode": {"gathr": "cat"}})


def test_register_for_classes_you_dont_own() -> None:
    class Library(nn.Module):
        def generate(self, x: torch.Tensor) -> torch.Tensor:
            return x

    dpmethods.register(Library, "generate", gather="pad", pad_value=3)
    assert get_options(Library, "generate") == MethodOptions(gather="pad", pad_value=3)
    with pytest.raises(AttributeError, match="has no method 'nope'"):
        dpmethods.register(Library, "nope")
    with pytest.raises(TypeError, match="cls: expected an nn.Module subclass"):
        dpmethods.register(int, "bit_length")
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['gathr'\]"):
        dpmethods.register(Library, "generate", gathr="pad")


def test_methods_argument_adds_and_overrides() -> None:
    m = Base()
    dp = dpmethods.DataParallel(
        m, device_ids=["cpu"] * 2, methods={"encode": {"gather": "list"}, "forward": {}}
    )
    out = dp.encode(torch.randn(4, 4))
    assert isinstance(out, list) and len(out) == 2  # gather="list": one output per replica
    with pytest.raises(AttributeError, match="Base has no method or submodule 'missing'"):
        dpmethods.DataParallel(m, device_ids=["cpu"] * 2, methods=["missing"])
    with pytest.raises(TypeError, match="methods: expected a list of names or a dict"):
        dpmethods.DataParallel(m, device_ids=["cpu"] * 2, methods="encode")
