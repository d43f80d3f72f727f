"""assert_close_to_reference: the bound follows the arithmetic, catches real bugs, and
compares integers exactly."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dpmethods import DataParallel
from dpmethods.testing import assert_close_to_reference


def _bound(terms: int, magnitude: float, dtype: torch.dtype = torch.float32) -> float:
    u = torch.finfo(dtype).eps / 2
    return 4 * 2 * terms * u / (1 - terms * u) * magnitude


def test_passes_within_the_bound_and_fails_beyond_it_with_the_differences() -> None:
    expected = torch.tensor([[3.0, -1.5], [0.25, 0.0]])
    bound = _bound(10, 3.0)  # atol, at the magnitude 3.0 of the reference
    inside = expected.clone()
    inside[1, 1] += 0.9 * bound  # |expected| = 0: atol alone
    assert_close_to_reference(inside, expected, terms=10)
    outside = expected.clone()
    outside[1, 0] += 1.5 * bound
    with pytest.raises(AssertionError) as info:
        assert_close_to_reference(outside, expected, terms=10, msg="loss")
    text = str(info.value)
    assert text.startswith("loss: value: 1 of 4 elements differ by more than the bound")
    assert f"max absolute difference {1.5 * bound:.3g} at [1, 0]" in text
    assert f"max relative difference {1.5 * bound / 0.25:.3g}" in text
    assert f"atol = rtol * magnitude 3 = {bound:.3g}" in text


def test_the_bound_grows_with_the_terms_and_the_precision() -> None:
    expected = torch.ones(3)
    actual = expected + 50 * torch.finfo(torch.float32).eps
    with pytest.raises(AssertionError):
        assert_close_to_reference(actual, expected, terms=1)
    assert_close_to_reference(actual, expected, terms=10)
    with pytest.raises(AssertionError):  # the same error in float64 arithmetic is a bug
        assert_close_to_reference(actual.double(), expected.double(), terms=10)
    assert_close_to_reference(actual, expected, terms=1, dtype=torch.bfloat16)


def test_integers_bools_and_terms_zero_are_exact() -> None:
    with pytest.raises(AssertionError, match=r"1 of 3 elements differ, and torch.int64 must be exact; "
                                             r"first at \[2\]: actual 4, expected 5"):
        assert_close_to_reference(torch.tensor([1, 2, 4]), torch.tensor([1, 2, 5]), terms=1000)
    with pytest.raises(AssertionError, match="torch.bool must be exact"):
        assert_close_to_reference(torch.tensor([True]), torch.tensor([False]), terms=1000)
    x = torch.randn(5)
    assert_close_to_reference(x.clone(), x, terms=0)
    with pytest.raises(AssertionError):
        assert_close_to_reference(x + torch.finfo(x.dtype).eps * x.abs().max(), x, terms=0)


def test_pytrees_numpy_nans_shapes_and_dtypes() -> None:
    x = torch.randn(4, 3)
    tree = {"y": x, "ids": torch.arange(4), "n": 3, "name": "a", "mean": 0.5}
    assert_close_to_reference({**tree, "mean": 0.5 + 1e-7}, tree, terms=4)
    with pytest.raises(AssertionError, match=r"\['ids'\]: 1 of 4"):
        assert_close_to_reference({**tree, "ids": torch.tensor([0, 1, 2, 4])}, tree, terms=4)
    with pytest.raises(AssertionError, match=r"\['name'\]: 'b' != expected 'a'"):
        assert_close_to_reference({**tree, "name": "b"}, tree, terms=4)
    with pytest.raises(AssertionError, match="structure"):
        assert_close_to_reference({"y": x}, tree, terms=4)
    assert_close_to_reference(x.numpy() * 1, x.numpy(), terms=1)
    with pytest.raises(AssertionError, match=r"shape \(4, 3\) and torch.float64, expected \(4, 3\) and torch.float32"):
        assert_close_to_reference(x.double(), x, terms=1)
    with pytest.raises(AssertionError, match=r"shape \(3, 4\)"):
        assert_close_to_reference(x.T.contiguous(), x, terms=1)
    nan = torch.tensor([math.nan, 1.0, math.inf])
    assert_close_to_reference(nan.clone(), nan, terms=1)
    with pytest.raises(AssertionError):
        assert_close_to_reference(torch.tensor([0.0, 1.0, math.inf]), nan, terms=1)
    with pytest.raises(AssertionError):
        assert_close_to_reference(torch.tensor([math.nan, 1.0, 1e30]), nan, terms=1)
    assert_close_to_reference(np.float32(1.0), np.float32(1.0), terms=1)


def test_the_bound_of_a_wide_linear_still_catches_real_bugs() -> None:
    # 784 products and a bias per output: the bound is about 785 * 4 eps * magnitude,
    # far above what another summation order does and far below what a bug does.
    torch.manual_seed(0)
    model = torch.nn.Linear(784, 32)
    x = torch.randn(7, 784)
    ref = model(x).detach()
    dp = DataParallel(model, device_ids=["cpu"] * 2)
    assert_close_to_reference(dp(x), ref, terms=785)
    with pytest.raises(AssertionError):  # two rows swapped
        assert_close_to_reference(ref[[1, 0, 2, 3, 4, 5, 6]], ref, terms=785)
    with pytest.raises(AssertionError):  # one product term missing
        missing = x.clone()
        missing[:, -1] = 0
        assert_close_to_reference(model(missing).detach(), ref, terms=785)
    # A mean of the per-replica means (4 and 3 rows) instead of the mean of all 7 rows.
    full = ref.pow(2).mean()
    per_replica = (ref[:4].pow(2).mean() + ref[4:].pow(2).mean()) / 2
    assert_close_to_reference(full, full.clone(), terms=785 + 7 * 32)
    with pytest.raises(AssertionError):
        assert_close_to_reference(per_replica, full, terms=785 + 7 * 32)


def test_too_many_terms_for_the_dtype_is_an_error() -> None:
    with pytest.raises(ValueError, match="terms=300 is too many for torch.bfloat16"):
        assert_close_to_reference(torch.ones(1), torch.ones(1), terms=300, dtype=torch.bfloat16)
