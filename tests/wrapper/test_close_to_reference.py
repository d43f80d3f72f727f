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
    return 4 * 2 * math.sqrt(terms) * u * magnitude


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
    diff = float(outside[1, 0]) - 0.25  # 1.5 * bound, as float32 holds it
    assert text.startswith("loss: value: 1 of 4 elements differ by more than the bound")
    assert f"max absolute difference {diff:.3g} at [1, 0]" in text
    assert f"max relative difference {diff / 0.25:.3g}" in text
    assert f"rtol = 4 * 2 * sqrt(10) * u = {bound / 3:.3g} (torch.float32)" in text
    assert f"atol = rtol * magnitude 3 = {bound:.3g}" in text
    # At [1, 0] the bound is atol + rtol * 0.25.
    assert f"the largest difference is {diff / (bound + bound / 3 * 0.25):.3g} times its bound" in text


def test_the_bound_grows_with_the_terms_and_the_precision() -> None:
    expected = torch.ones(3)
    actual = expected + 50 * torch.finfo(torch.float32).eps
    with pytest.raises(AssertionError):  # 8 eps at terms=1: 4 * 2 * sqrt(1) * u * (1 + 1)
        assert_close_to_reference(actual, expected, terms=1)
    assert_close_to_reference(actual, expected, terms=100)  # 80 eps
    with pytest.raises(AssertionError):  # the same error in float64 arithmetic is a bug
        assert_close_to_reference(actual.double(), expected.double(), terms=100)
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


def test_the_magnitude_comes_from_the_values_not_a_floor() -> None:
    # Small outputs 1% off: a floor of 1.0 under the magnitude would let them pass.
    expected = 1e-3 * torch.randn(7, 5)
    with pytest.raises(AssertionError, match="atol = rtol \\* magnitude 0.00"):
        assert_close_to_reference(expected * 1.01, expected, terms=1000)
    assert_close_to_reference(expected * (1 + 1e-6), expected, terms=1000)
    # A larger magnitude is the caller's word on what the computation summed: the
    # log-sum-exp of logits of 20 has a result of about 1e-9 and errors of 20 * eps.
    logits = torch.tensor([[20.0, 0.0, -3.0]])
    assert_close_to_reference(logits.log_softmax(-1), logits.double().log_softmax(-1).float(),
                              terms=3, scale=20.0)


def test_a_box_a_pixel_off_fails_at_retinanets_terms() -> None:
    from tests.helpers.terms import RETINANET_TERMS

    boxes = torch.tensor([[5.0, 5.0, 30.0, 40.0], [10.0, 20.0, 50.0, 60.0], [0.0, 1.0, 95.0, 63.0]])
    off = boxes.clone()
    off[1, 2] += 1.0
    with pytest.raises(AssertionError, match=r"boxes'\]: 1 of 12 elements differ"):
        assert_close_to_reference({"boxes": off}, {"boxes": boxes}, terms=RETINANET_TERMS)
    assert_close_to_reference({"boxes": boxes + 1e-3}, {"boxes": boxes}, terms=RETINANET_TERMS)


def _rounded_twice(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A two-layer product rounded to ``dtype`` after each layer, with float32 sums in two
    orders (the whole batch, and shares of 3, 2 and 2 rows in reverse inner order)."""
    g = torch.Generator().manual_seed(0)
    # Wide enough that some of the float32 sums' differences cross a rounding boundary.
    x, w1, w2 = torch.randn(7, 256, generator=g), torch.randn(256, 4096, generator=g), torch.randn(4096, 64, generator=g)

    def two_layers(x: torch.Tensor, flip: bool) -> torch.Tensor:
        h = ((x.flip(1) @ w1.flip(0)) if flip else x @ w1).to(dtype).float()
        return ((h.flip(1) @ w2.flip(0)) if flip else h @ w2).to(dtype)

    ref = two_layers(x, False)
    got = torch.cat([two_layers(part, True) for part in x.split([3, 2, 2])])
    return got, ref


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_accepts_rounding_and_rejects_wrong_answers(dtype: torch.dtype) -> None:
    got, ref = _rounded_twice(dtype)
    assert not torch.equal(got, ref)  # the orders round differently somewhere
    assert_close_to_reference(got, ref, terms=2)  # two roundings in dtype on the path
    assert_close_to_reference(got.float(), ref.float(), terms=2, dtype=dtype)  # autocast's case
    for wrong in (-ref, torch.zeros_like(ref), ref[[1, 0, 2, 3, 4, 5, 6]], ref * 1.2):
        with pytest.raises(AssertionError):
            assert_close_to_reference(wrong, ref, terms=2)
    # The most terms dtype accepts: a tenth of the peak at most, so still no wrong answer passes.
    most = max(t for t in range(1, 400) if 2 * _bound(t, 1.0, dtype) <= 0.1)
    for wrong in (-ref, torch.zeros_like(ref), ref[[1, 0, 2, 3, 4, 5, 6]], ref * 1.2):
        with pytest.raises(AssertionError):
            assert_close_to_reference(wrong, ref, terms=most)
    with pytest.raises(ValueError, match=f"terms={most + 1} in {dtype}"):
        assert_close_to_reference(ref, ref, terms=most + 1)


def test_a_bound_not_small_against_the_values_is_refused() -> None:
    # fp16 with a wide layer's 785 terms: a bound of about a fifth of the values.
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"terms=785 in torch.float16 gives rtol 0.109 .* more than "
                                         r"0.1 of it, so zeros, a sign flip or swapped rows could pass"):
        assert_close_to_reference(x.half(), x.half(), terms=785)
    # bfloat16 autocast counted by inner sizes: count its roundings instead.
    with pytest.raises(ValueError, match=r"terms=785 in torch.bfloat16 .* count the layers"):
        assert_close_to_reference(x, x, terms=785, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"scale=1e\+06 is far above the values compared"):
        assert_close_to_reference(x, x, terms=10, scale=1e6)
    with pytest.raises(ValueError, match="all zero"):
        assert_close_to_reference(torch.zeros(3), torch.zeros(3), terms=10, scale=1.0)
    with pytest.raises(ValueError, match="terms: expected an int >= 0, got -1"):
        assert_close_to_reference(x, x, terms=-1)
    assert_close_to_reference(torch.zeros(3), torch.zeros(3), terms=10)  # zeros: exactly
