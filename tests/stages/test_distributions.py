"""torch.distributions outputs joined through the parameters they were built from.

Each case is compared with the one-device call on random data: log_prob, entropy and
samples of the joined distribution must equal one device's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributions as D
from torch import nn

from dpmethods import DataParallel, parallel_method
from dpmethods.testing import assert_close_to_reference as close


class _Heads(nn.Module):
    """Policy heads whose distributions are built from logits, as RL code does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)

    @parallel_method
    def act(self, x: torch.Tensor, kind: str, read_probs: str) -> Any:
        h = self.lin(x) * 20  # large logit gaps: probs clamp to eps, logits don't
        dist = {
            "categorical": lambda: D.Categorical(logits=h),
            "bernoulli": lambda: D.Bernoulli(logits=h),
            "binomial": lambda: D.Binomial(total_count=5, logits=h),
        }[kind]()
        # Sampling reads .probs; on some replicas only, with "first".
        if read_probs == "all" or (read_probs == "first" and float(x[0, 0]) > 0):
            dist.sample()
        return dist


@pytest.mark.parametrize("kind", ["categorical", "bernoulli", "binomial"])
@pytest.mark.parametrize("read_probs", ["all", "first", "none"])
def test_logits_built_distributions_join_through_logits(kind: str, read_probs: str) -> None:
    torch.manual_seed(0)
    model = _Heads()
    x = torch.randn(8, 4)
    x[::2, 0] = x[::2, 0].abs()  # some replicas' first rows read probs, others don't
    x[1::2, 0] = -x[1::2, 0].abs()
    x[4:6, 0] = -1.0
    got = DataParallel(model, device_ids=["cpu"] * 4).act(x, kind, read_probs)
    ref = model.act(x, kind, read_probs)
    assert type(got) is type(ref) and got.batch_shape == ref.batch_shape
    # Linear(4, 6) (its error grows with the logits' magnitude, 20x), normalised by a
    # log-sum-exp over 6, then at most 4 more roundings of a log_prob (lgamma, softplus).
    terms = 5 + 6 + 4
    close(got.logits, ref.logits, terms=terms)
    value = ref.sample()
    # A likely sample's log_prob is near 0: a difference of logits of up to 20x, which
    # are the magnitude its error follows.
    with torch.no_grad():
        scale = float((model.lin(x) * 20).abs().max())
    close(got.log_prob(value), ref.log_prob(value), terms=terms, scale=scale)


def test_categorical_log_prob_with_a_large_logit_gap_matches_one_device() -> None:
    class M(nn.Module):
        @parallel_method
        def act(self, logits: torch.Tensor) -> Any:
            d = D.Categorical(logits=logits)
            d.sample()
            return d

    logits = torch.zeros(6, 2)
    logits[:, 1] = 35.0
    got = DataParallel(M(), device_ids=["cpu"] * 3).act(logits)
    ref = M().act(logits)
    action = torch.zeros(6, dtype=torch.long)
    close(got.log_prob(action), ref.log_prob(action), terms=2)  # a log-sum-exp of 2
    assert float(got.log_prob(action)[0]) < -30  # not rebuilt from probs clamped to eps


class _Squashed(nn.Module):
    """SAC's actor: a tanh-squashed Normal, and an Independent over it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)

    @parallel_method
    def act(self, x: torch.Tensor, kind: str) -> Any:
        h = self.lin(x)
        base = D.Normal(h[:, :3], h[:, 3:].exp())
        squashed = D.TransformedDistribution(base, [D.TanhTransform(cache_size=1)])
        return {
            "transformed": lambda: squashed,
            "independent": lambda: D.Independent(squashed, 1),
            "binomial": lambda: D.Independent(D.Binomial(4, logits=h), 1),
        }[kind]()


@pytest.mark.parametrize("kind", ["transformed", "independent", "binomial"])
def test_transformed_and_independent_distributions_match_one_device(kind: str) -> None:
    torch.manual_seed(0)
    model = _Squashed()
    x = torch.randn(7, 4)
    got = DataParallel(model, device_ids=["cpu"] * 3).act(x, kind)
    ref = model.act(x, kind)
    assert type(got) is type(ref) and got.batch_shape == ref.batch_shape
    value = ref.sample()
    # Linear(4, 6): 5 terms. The densities square (value - loc) / exp(h): that multiplies
    # h's error by up to about 2 |log_prob| |h|, here < 16.
    terms = 16 * 5
    close(got.log_prob(value), ref.log_prob(value), terms=terms)
    torch.manual_seed(1)
    drawn = got.sample()
    torch.manual_seed(1)
    close(drawn, ref.sample(), terms=terms)


def test_independent_over_a_base_without_a_rule_is_a_list_with_the_warning() -> None:
    class M(nn.Module):
        @parallel_method
        def act(self, x: torch.Tensor) -> Any:
            return D.Independent(D.Weibull(x.exp(), x.exp()), 1)  # Weibull: no rule

    with pytest.warns(UserWarning, match="register_type"):
        got = DataParallel(M(), device_ids=["cpu"] * 2).act(torch.randn(4, 3))
    assert isinstance(got, list) and len(got) == 2
    assert all(type(d) is D.Independent and d.batch_shape == (2,) for d in got)
