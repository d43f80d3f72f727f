"""Scatter: balanced chunks, nested structures, broadcast, and its errors."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch

from dpmethods import chunk_sizes, scatter, scatter_call
from dpmethods.testing import assert_close_to_reference


@pytest.mark.parametrize("batch", range(1, 20))
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8])
def test_chunk_sizes_are_balanced(batch: int, parts: int) -> None:
    sizes = chunk_sizes(batch, parts)
    assert sum(sizes) == batch
    assert len(sizes) == min(batch, parts)  # every device works when batch >= parts
    assert max(sizes) - min(sizes) <= 1


def test_torch_chunk_would_idle_devices_but_we_do_not() -> None:
    assert len(torch.arange(9).chunk(8)) == 5
    assert chunk_sizes(9, 8) == [2, 1, 1, 1, 1, 1, 1, 1]


class Pair(NamedTuple):
    a: torch.Tensor
    b: list[torch.Tensor]


@dataclass
class Batch:
    images: torch.Tensor
    meta: dict[str, torch.Tensor]
    name: str = "batch"


def test_nested_structures_split_with_types_kept() -> None:
    x = torch.randn(7, 3)
    inputs = (
        Pair(x, [x * 2, {"k": x + 1}]),
        Batch(x, OrderedDict(ids=torch.arange(7))),
        torch.tensor(5.0),
        "text",
    )
    parts = scatter(inputs, ["cpu"] * 3)
    assert [p[0].a.shape[0] for p in parts] == [3, 2, 2]
    for p in parts:
        assert isinstance(p[0], Pair) and isinstance(p[1], Batch)
        assert isinstance(p[1].meta, OrderedDict) and p[1].name == "batch"
        assert p[2].item() == 5.0 and p[3] == "text"  # 0-dim and non-tensors whole
    assert torch.equal(torch.cat([p[0].b[1]["k"] for p in parts]), x + 1)
    assert torch.equal(torch.cat([p[1].meta["ids"] for p in parts]), torch.arange(7))


def test_other_dim() -> None:
    x = torch.randn(2, 5, 3)
    parts = scatter(x, ["cpu"] * 2, dim=1)
    assert [p.shape for p in parts] == [(2, 3, 3), (2, 2, 3)]


def test_split_chunks_are_views_with_gradients() -> None:
    x = torch.randn(4, 2, requires_grad=True)
    parts = scatter(x, ["cpu"] * 2)
    (parts[0].sum() * 2 + parts[1].sum()).backward()
    assert torch.equal(x.grad, torch.tensor([[2.0] * 2] * 2 + [[1.0] * 2] * 2))


def _f(x: torch.Tensor, mask: torch.Tensor, *rest: torch.Tensor, scale: float = 1.0, **kw: torch.Tensor) -> None: ...


def test_broadcast_by_name_positional_keyword_star_and_kwargs() -> None:
    x, mask = torch.randn(6, 2), torch.randn(3)
    r = scatter_call((x, mask), {}, ["cpu"] * 2, broadcast=("mask",), fn=_f)
    assert r.sizes == [3, 3]
    assert all(torch.equal(a[1], mask) for a in r[0])
    r = scatter_call((x,), {"mask": mask, "table": torch.randn(9)}, ["cpu"] * 2,
                     broadcast=("mask", "table"), fn=_f)
    assert all(k["table"].shape == (9,) for k in r[1])
    r = scatter_call((x, mask, torch.randn(5)), {}, ["cpu"] * 2, broadcast=("mask", "rest"), fn=_f)
    assert all(a[2].shape == (5,) for a in r[0])


def test_size_mismatch_names_arguments_and_suggests_broadcast() -> None:
    with pytest.raises(ValueError) as info:
        scatter_call((torch.randn(6, 2), torch.randn(4)), {"kw": {"ids": torch.ones(5)}},
                     ["cpu"] * 2, fn=_f)
    text = str(info.value)
    assert "argument 'x' has 6" in text
    assert "argument 'mask' has 4" in text
    assert "argument 'kw' at kw['ids'] has 5" in text
    assert "broadcast=" in text


def test_an_empty_batch_goes_whole_to_the_first_device() -> None:
    # As one device runs it: once, with the empty batch (a split list empty too).
    x = torch.randn(0, 3)
    parts = scatter({"x": x, "scale": torch.tensor(2.0)}, ["cpu"] * 2)
    assert len(parts) == 1 and parts[0]["x"].shape == (0, 3)

    def label(x: torch.Tensor, names: list[str]) -> None: ...

    r = scatter_call((x, []), {}, ["cpu"] * 2, fn=label, split=("names",))
    assert r.sizes == [0] and len(r[0]) == 1 and r[0][0][0].shape == (0, 3) and r[0][0][1] == []


def test_tensor_without_the_split_dim_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"has shape \[4\], which has no dim 1 to split"):
        scatter(torch.randn(4), ["cpu"] * 2, dim=1)


def test_no_tensor_to_split_runs_one_replica() -> None:
    from dpmethods.vocab import warn_once as warn_once

    warn_once.reset()
    with pytest.warns(UserWarning, match=r"scatter: nothing in this call was split along dim 0"):
        r = scatter_call((3, torch.tensor(1.0)), {}, ["cpu"] * 4)
    assert len(r[0]) == 1 and r.sizes == [0]


def test_devices_required() -> None:
    with pytest.raises(ValueError, match="devices: expected at least one device, got none"):
        scatter(torch.ones(2), [])


def test_size_one_tensors_beside_a_batch_broadcast_as_on_one_device() -> None:
    from torch import nn

    import dpmethods

    class AddPositions(nn.Module):
        def forward(self, x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return (x + pos) * mask

    model = AddPositions()
    x = torch.randn(7, 5, requires_grad=True)
    pos = torch.arange(5.0)[None].requires_grad_()  # [1, t], as position_ids often are
    mask = torch.ones(7, 5)
    r = scatter_call((x, pos, mask), {}, ["cpu"] * 3)
    assert r.sizes == [3, 2, 2]
    assert all(args[1].shape == (1, 5) for args in r[0])  # whole to every replica
    got = dpmethods.DataParallel(model, device_ids=["cpu"] * 3)(x, pos, mask)
    assert_close_to_reference(got, model(x, pos, mask), terms=2)  # an addition, a product
    got.sum().backward()
    assert_close_to_reference(pos.grad, torch.full((1, 5), 7.0), terms=0)  # 7 rows' ones: exact
    # All of size 1: a batch of one item, not a broadcast.
    assert scatter_call((torch.ones(1, 2), torch.ones(1, 3)), {}, ["cpu"] * 2).sizes == [1]

    # ... unless split sequences give the batch: then a size-1 tensor broadcasts too.
    def score(images: list[str], scale: torch.Tensor) -> None: ...

    r = scatter_call((["a"] * 7, torch.ones(1)), {}, ["cpu"] * 3, fn=score, split=("images",))
    assert r.sizes == [3, 2, 2] and [len(a[0]) for a in r[0]] == [3, 2, 2]
    assert all(a[1].shape == (1,) for a in r[0])
    # Sizes other than 1 that disagree are still an error naming them.
    with pytest.raises(ValueError, match=r"must agree on its size, but argument 'x' has 7, argument 'y' has 2"):

        def f(x: torch.Tensor, y: torch.Tensor) -> None: ...

        scatter_call((x, torch.ones(2, 5)), {}, ["cpu"] * 3, fn=f)


def test_child_module_call_binds_arguments_by_its_forward_names() -> None:
    bilinear = torch.nn.Bilinear(4, 3, 2)  # forward(input1, input2)
    with pytest.raises(ValueError, match=r"argument 'input1' has 6, argument 'input2' has 4"):
        scatter_call((torch.randn(6, 4), torch.randn(4, 3)), {}, ["cpu"] * 2, fn=bilinear)
    r = scatter_call((torch.randn(6, 4), torch.randn(6, 3)), {}, ["cpu"] * 2, fn=bilinear, broadcast=("input2",))
    assert [(a[0].shape[0], a[1].shape[0]) for a in r[0]] == [(3, 6), (3, 6)]


def test_a_list_of_images_of_different_sizes_warns_naming_split() -> None:
    import warnings

    from dpmethods import DataParallel
    from dpmethods.vocab import warn_once as warn_once

    class Model(torch.nn.Module):
        def forward(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
            return [im.flatten(1).mean(1) for im in images]  # per row: not 0-dim, which warns

    warn_once.reset()
    images = [torch.rand(3, 8, 8 + i) for i in range(4)]
    with pytest.warns(UserWarning, match=r"argument 'images' is a list of 4 tensors of different shapes \(\[3, 8, 8\], \[3, 8, 9\], \[3, 8, 10\], \.\.\.\), and each one is split along dim 0.*pass split=\('images',\)"):
        DataParallel(Model(), device_ids=["cpu"] * 3)(images)
    with warnings.catch_warnings():  # equal shapes: a list of batch tensors, quietly split
        warnings.simplefilter("error")
        scatter_call(([torch.rand(6, 2), torch.rand(6, 2)],), {}, ["cpu"] * 2)


def test_a_size_mismatch_inside_a_list_suggests_split_not_broadcast() -> None:
    def forward(images: torch.Tensor, targets: list[dict[str, torch.Tensor]]) -> None: ...

    images = torch.rand(4, 3, 8, 8)
    targets = [{"boxes": torch.rand(1 + i, 4)} for i in range(4)]
    with pytest.raises(ValueError, match=r"'targets' is a list whose tensors were split as batches: if each entry belongs to one batch item \(an image, a target dict\), pass split=\('targets',\)") as info:
        scatter_call((images, targets), {}, ["cpu"] * 2, fn=forward)
    assert "broadcast" not in str(info.value)
    with pytest.raises(ValueError, match=r"Pass broadcast=\(name, \.\.\.\) for arguments that every replica needs whole"):
        scatter_call((torch.rand(4, 2), torch.rand(5, 2)), {}, ["cpu"] * 2)
