"""A made-up library integrated through the public extension API alone, as a user would.

Its model has a method of its own that returns a type of its own and needs a gather mode
of its own, and a call convention the split can't express (a scale given once for the
whole batch, as the replicas must see it per row). Compared with one device.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dpmethods
from dpmethods import DataParallel, MethodOptions
from dpmethods.extending import (
    Call,
    CallHooks,
    is_batch_coupled,
    known_modes,
    mark_batch_coupled,
    register_gather_mode,
    register_method_finder,
    register_type,
)
from dpmethods.parallel import scatter
from dpmethods.testing import assert_close_to_reference


class Scores:
    """The library's result type: scores with a tag."""

    def __init__(self, values: torch.Tensor, tag: str) -> None:
        self.values, self.tag = values, tag


class Ranker(nn.Module):
    """The library's model: not decorated, not registered, knows nothing of dpmethods."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def rank(self, x: torch.Tensor, offset: int = 0) -> Scores:
        # offset: the index of x's first row in the whole batch (the library numbers rows).
        rows = torch.arange(offset, offset + len(x), dtype=x.dtype)
        return Scores(self.lin(x).squeeze(1) + rows, "ranked")


def _best(outputs: list[Any], device: Any, call: Call | None) -> Any:
    """The library's gather: the joined scores, and the index of the best row overall."""
    joined = dpmethods.parallel.gather(outputs, device, sizes=list(call.sizes) if call else None)
    return joined, int(joined.values.argmax())


def _offsets(args: tuple[Any, ...], kwargs: dict[str, Any], start: int, call: Call) -> Any:
    return args, {**kwargs, "offset": kwargs.get("offset", 0) + start}


@pytest.fixture(scope="module", autouse=True)
def _the_library_integrated() -> None:
    register_type(Scores, lambda s: ([s.values], s.tag), lambda c, tag: Scores(c[0], tag))
    register_gather_mode("ranker_best", _best)
    options = MethodOptions(gather="ranker_best", hooks=CallHooks(per_replica=_offsets))
    register_method_finder(lambda cls: {"rank": options} if issubclass(cls, Ranker) else {})


@pytest.mark.parametrize("batch,devices", [(7, 3), (8, 4), (2, 2)])
def test_a_made_up_library_through_the_public_api(batch: int, devices: int) -> None:
    torch.manual_seed(0)
    model = Ranker()
    x = torch.randn(batch, 4)
    assert "rank" in dpmethods.parallel_methods(Ranker) and "ranker_best" in known_modes()
    (got, best) = DataParallel(model, device_ids=["cpu"] * devices).rank(x)
    ref = model.rank(x)
    assert isinstance(got, Scores) and got.tag == "ranked"
    assert_close_to_reference(got.values, ref.values, terms=5 + 1)  # Linear(4, 1), plus the row index
    assert best == int(ref.values.argmax())
    # The user's options still win over the library's.
    dp = DataParallel(model, device_ids=["cpu"] * devices, methods={"rank": {"gather": "cat"}})
    assert_close_to_reference(dp.rank(x).values, ref.values, terms=5 + 1)


def test_extension_api_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match=r"register_gather_mode: name: expected a name other than the built-in modes"):
        register_gather_mode("cat", _best)
    with pytest.raises(TypeError, match=r"register_method_finder: find: expected a callable find\(cls\), got int 3"):
        register_method_finder(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"CallHooks: prepare: expected a callable or None, got int 1"):
        CallHooks(prepare=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"hooks: expected a dpmethods.extending.CallHooks or None, got dict"):
        MethodOptions(hooks={})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"gather: expected one of \['cat', .*\] or a named mode, got 'extnd': did you mean 'extend'\?$"):
        MethodOptions(gather="extnd")


def test_extension_functions_check_what_they_are_given_when_given() -> None:
    with pytest.raises(TypeError, match=r"^register_gather_mode: fn: expected a function called as "
                       r"fn\(outputs, device, call\), got <lambda>\(outputs, device\)$"):
        register_gather_mode("two_arguments", lambda outputs, device: outputs[0])
    assert "two_arguments" not in known_modes()
    with pytest.raises(TypeError, match=r"^CallHooks: per_replica: expected a function called as "
                       r"per_replica\(args, kwargs, start, call\), got <lambda>\(args, kwargs, call\)$"):
        CallHooks(per_replica=lambda args, kwargs, call: (args, kwargs))
    # An instance where the class belongs is named as such, before flatten and unflatten.
    with pytest.raises(TypeError, match=r"^register_type: cls: expected a class, got Scores <"):
        register_type(Scores(torch.ones(1), "x"), len, len)  # type: ignore[arg-type]


def test_a_named_modes_check_refuses_a_call_before_any_replica_runs() -> None:
    with pytest.raises(TypeError, match=r"^register_gather_mode: check: expected None or a callable check\(call\), got int 3$"):
        register_gather_mode("checked_first", _best, check=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^register_gather_mode: check: expected a function called as check\(call\)"):
        register_gather_mode("checked_first", _best, check=lambda call, extra: None)
    seen: list[str] = []

    def check(call: Any) -> None:
        seen.append(call.method)
        if call.kwargs.get("bad"):
            raise ValueError("checked_first: a bad call")

    ran: list[int] = []

    class Model(torch.nn.Module):
        @dpmethods.parallel_method(gather="checked_first")
        def score(self, x: torch.Tensor, bad: bool = False) -> torch.Tensor:
            ran.append(len(x))
            return x

    register_gather_mode("checked_first", lambda outputs, device, call: outputs[0], check=check)
    dp = DataParallel(Model(), device_ids=["cpu"] * 2)
    with pytest.raises(ValueError, match="checked_first: a bad call"):
        dp.score(torch.ones(3, 1), bad=True)
    assert ran == []
    assert dp.score(torch.ones(3, 1)).shape == (2, 1) and sorted(ran) == [1, 2] and seen == ["score", "score"]
    register_gather_mode("checked_first", lambda outputs, device, call: outputs[0])  # the check goes too
    dp.score(torch.ones(3, 1), bad=True)


def test_a_named_modes_pairs_are_refused_by_item_mode_and_the_rest_is_cut() -> None:
    with pytest.raises(TypeError, match=r"^register_gather_mode: pairs: expected None or a callable pairs\(output\), got int 3$"):
        register_gather_mode("paired_first", _best, pairs=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^register_gather_mode: pairs: expected a function called as pairs\(output\)"):
        register_gather_mode("paired_first", _best, pairs=lambda out, call: {})

    class Model(torch.nn.Module):
        @dpmethods.parallel_method(gather="paired_first")
        def score(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"embeds": x, "scores": x @ x.T}

    register_gather_mode("paired_first", lambda outputs, device, call: outputs[0],
                         pairs=lambda out: {"scores": "compute them from all the embeds"} if "scores" in out else {})
    dp = DataParallel(Model(), device_ids=["cpu"] * 2)
    items = [torch.full((2,), float(i)) for i in range(4)]
    with torch.no_grad(), pytest.raises(ValueError, match=re.escape(
            "map: output['scores'] of the output of a batch of 2 items is a tensor of shape [2, 2], which "
            "pairs each item with the batch's other items: an item's row would hold its scores against "
            "whichever items were batched with it, so the output cannot be cut into one per item. "
            "Compute them from all the embeds; or map batches of your own")):
        list(dp.map("score", items, batch_size=2))
    # A batch's own output without the field is cut as any other.
    register_gather_mode("paired_first", lambda outputs, device, call: outputs[0],
                         pairs=lambda out: {"absent": ""})
    outs = list(dp.map("score", items, batch_size=2))
    assert [o["embeds"].tolist() for o in outs] == [i.tolist() for i in items]


def test_a_named_class_that_its_imported_module_lacks_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^mark_batch_coupled: cls: expected a class of torch.nn \(imported\), got "
                       r"'torch.nn:CrossEntropyLosss', which it lacks: did you mean 'torch.nn:CrossEntropyLoss'\?$"):
        mark_batch_coupled("torch.nn:CrossEntropyLosss")
    with pytest.raises(ValueError, match=r"^register_type: cls: expected a class of collections \(imported\), got "
                       r"'collections:OrderedDictt', which it lacks: did you mean 'collections:OrderedDict'\?$"):
        register_type("collections:OrderedDictt", lambda d: (list(d.values()), list(d)), lambda c, k: dict(zip(k, c)))
    # A class only some versions of a library have: skipped when asked (the integrations do).
    mark_batch_coupled("torch.nn:NoSuchLossInThisVersion", missing_ok=True)
    # A module not imported yet: the name waits for it, as before.
    mark_batch_coupled("a_module_never_imported_here:Loss")


def test_names_of_a_library_imported_later_apply_at_the_next_lookup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A rule and a mark named before their module is imported wait in the one table of
    # what waits on an import; the first lookup after the import applies both.
    name = "dpm_library_imported_later"
    (tmp_path / f"{name}.py").write_text(
        "import torch\n"
        "class Box:\n    def __init__(self, t):\n        self.t = t\n"
        "class PairLoss(torch.nn.Module):\n    def forward(self, a):\n        return a.sum()\n"
    )
    register_type(f"{name}:Box", lambda b: ([b.t], None), lambda c, _: sys.modules[name].Box(c[0]))
    mark_batch_coupled(f"{name}:PairLoss", what="pairs")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    library = importlib.import_module(name)
    parts = scatter(library.Box(torch.arange(7)), ["cpu"] * 3)
    assert [p.t.tolist() for p in parts] == [[0, 1, 2], [3, 4], [5, 6]]
    assert is_batch_coupled(library.PairLoss)


class _Echo(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def test_call_hooks_returning_the_wrong_shape_name_the_hook_and_what_it_must_return() -> None:
    def no_result(args: tuple[Any, ...], kwargs: dict[str, Any], call: Call) -> Any:
        return None

    def two_of_three(args: tuple[Any, ...], kwargs: dict[str, Any], call: Call) -> Any:
        return args, kwargs

    def args_only(args: tuple[Any, ...], kwargs: dict[str, Any], start: int, call: Call) -> Any:
        return args

    x = torch.randn(4, 2)
    cases = [
        (CallHooks(prepare=no_result), r"CallHooks\.prepare \(.*\.no_result\) must return \(args, kwargs, finish\): "
         r"a tuple of positional arguments, a dict of keyword arguments and a function applied to the gathered "
         r"output or None; got NoneType None$"),
        (CallHooks(prepare=two_of_three), r"CallHooks\.prepare \(.*\.two_of_three\) must return \(args, kwargs, "
         r"finish\).*; got a tuple of length 2$"),
        (CallHooks(per_replica=args_only), r"CallHooks\.per_replica \(.*\.args_only\) must return \(args, kwargs\): "
         r"the replica's tuple of positional arguments and dict of keyword arguments; got a tuple of length 1$"),
        # Chained hooks name the one that failed.
        (CallHooks(per_replica=_offsets).then(CallHooks(per_replica=args_only)), r"CallHooks\.per_replica \(.*\.args_only\)"),
    ]
    for hooks, match in cases:
        dp = DataParallel(_Echo(), device_ids=["cpu"] * 2, methods={"forward": {"hooks": hooks}})
        with pytest.raises(TypeError, match=match):
            dp(x)
