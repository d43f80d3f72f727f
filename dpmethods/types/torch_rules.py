"""Rules for torch's own types that are not plain containers of batch tensors.

- ``torch.nn.utils.rnn.PackedSequence`` (an RNN's packed input or output): split and
  joined item by item through its padded, batch-first form and lengths, and packed
  again (``enforce_sorted=False``). The replicas' outputs, padded to each replica's
  longest sequence, are joined padded, so ``pad_packed_sequence`` of the result equals
  one device's. It needs the batch on dim 0 (``dim=0``, the default).
- ``torch.distributions``: the common distributions (``Normal``, ``Categorical``,
  ``Bernoulli``, ``Binomial``, ``MultivariateNormal``, ``Independent``,
  ``TransformedDistribution``, ...) are split and joined through the parameters they
  were built from (``logits`` for ``Categorical(logits=...)``, even after ``.probs`` was read), so ``dp.encode(x)`` of a VAE or a policy returns one
  distribution over the whole batch whose ``sample``, ``log_prob`` and ``entropy`` equal
  one device's. Installed once ``torch.distributions`` is imported. Other distribution
  classes come back as a list of the replicas' objects, with the one-time warning that
  names :func:`dpmethods.register_type`.

- ``torch.ao``'s dynamically quantized layers (``quantize_dynamic``'s ``Linear``,
  ``LSTM``, ``GRU``, the cells, ``LinearReLU``) quantize their input with one scale
  computed over the whole batch at each call: they are marked batch-coupled
  (:mod:`dpmethods.types.coupled_modules`), so a call that splits a batch warns once.

The rules are registered through :mod:`dpmethods.types.rules`; torch's pytree registry
is not touched.
"""

from __future__ import annotations

import sys
from typing import Any

from dpmethods.types import tree as _tree
from dpmethods.types.coupled_modules import mark_batch_coupled

__all__ = ["install_distributions", "install_packed_sequence", "mark_dynamic_quantization"]


# --- PackedSequence -------------------------------------------------------------------


def _flatten_packed(packed: Any) -> tuple[list[Any], Any]:
    # Batch-major padded form and lengths: both split along dim 0, item by item.
    from torch.nn.utils.rnn import pad_packed_sequence

    padded, lengths = pad_packed_sequence(packed, batch_first=True)
    return [padded, lengths], None


def _unflatten_packed(children: list[Any], _: Any) -> Any:
    from torch.nn.utils.rnn import pack_padded_sequence

    padded, lengths = children
    return pack_padded_sequence(padded, lengths.cpu(), batch_first=True, enforce_sorted=False)


def install_packed_sequence() -> None:
    """Register the ``PackedSequence`` rule (torch.nn is always imported with torch).

    Example:
        >>> install_packed_sequence()
    """
    from torch.nn.utils.rnn import PackedSequence

    rule = _tree.TypeRule(_flatten_packed, _unflatten_packed, per_item=True, ragged=True)
    _tree.set_rule(PackedSequence, rule)


# --- torch.distributions --------------------------------------------------------------

# Per class, the constructor's parameters, each a group of alternatives of which one is
# passed (the one the object was made with, when it has it itself). Each is read as the
# distribution exposes it, expanded to its batch shape, so it splits along dim 0.
_PARAMS: dict[str, tuple[tuple[str, ...], ...]] = {
    "Normal": (("loc",), ("scale",)),
    "Laplace": (("loc",), ("scale",)),
    "Cauchy": (("loc",), ("scale",)),
    "LogNormal": (("loc",), ("scale",)),
    "Gumbel": (("loc",), ("scale",)),
    "StudentT": (("df",), ("loc",), ("scale",)),
    "Uniform": (("low",), ("high",)),
    "Beta": (("concentration1",), ("concentration0",)),
    "Gamma": (("concentration",), ("rate",)),
    "Dirichlet": (("concentration",),),
    "Exponential": (("rate",),),
    "Poisson": (("rate",),),
    "Bernoulli": (("probs", "logits"),),
    "ContinuousBernoulli": (("probs", "logits"),),
    "Geometric": (("probs", "logits"),),
    "Categorical": (("probs", "logits"),),
    "OneHotCategorical": (("probs", "logits"),),
    "Binomial": (("total_count",), ("probs", "logits")),
    "NegativeBinomial": (("total_count",), ("probs", "logits")),
    # The Cholesky factor expanded to the batch: the same distribution however it was made.
    "MultivariateNormal": (("loc",), ("scale_tril",)),
    "LowRankMultivariateNormal": (("loc",), ("cov_factor",), ("cov_diag",)),
}


def _chosen(dist: Any, groups: tuple[tuple[str, ...], ...]) -> tuple[str, ...]:
    own = vars(dist)
    # torch keeps the tensor a distribution was built from as ``_param`` (probs or
    # logits); the other is derived lazily on first read (``d.sample()`` reads probs).
    # Joining through the derived one would lose precision (probs clamped to eps) and
    # would differ between replicas that did and did not read it.
    made_from = own.get("_param")
    return tuple(
        next((n for n in group if made_from is not None and own.get(n) is made_from), None)
        or next((n for n in group if n in own), group[0])
        for group in groups
    )


def _flatten_distribution(dist: Any) -> tuple[list[Any], Any]:
    names = _chosen(dist, _PARAMS[type(dist).__name__])
    return [getattr(dist, n) for n in names], (type(dist), names, dist._validate_args)


def _unflatten_distribution(children: list[Any], context: Any) -> Any:
    cls, names, validate = context
    return cls(**dict(zip(names, children)), validate_args=validate)


def _flatten_independent(dist: Any) -> tuple[list[Any], Any]:
    return [dist.base_dist], (dist.reinterpreted_batch_ndims, dist._validate_args)


def _unflatten_independent(children: list[Any], context: Any) -> Any:
    from torch.distributions import Independent

    ndims, validate = context
    base = children[0]
    if isinstance(base, list):
        # The base has no rule, so the gather returned the replicas' bases as a list
        # (with the warning naming register_type): the result is a list too, one
        # Independent per replica, as for any distribution without a rule.
        return [Independent(b, ndims, validate_args=validate) for b in base]
    return Independent(base, ndims, validate_args=validate)


class _Transforms:
    """A TransformedDistribution's transforms, equal when torch says they are equal
    (``TanhTransform() == TanhTransform()``), so the replicas' structures match."""

    def __init__(self, transforms: list[Any]) -> None:
        self.transforms = transforms

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Transforms) or len(other.transforms) != len(self.transforms):
            return False
        try:
            return all(bool(a == b) for a, b in zip(self.transforms, other.transforms))
        except (RuntimeError, TypeError, ValueError):  # tensor parameters of other shapes
            return False

    def __hash__(self) -> int:
        return hash(tuple(type(t) for t in self.transforms))


def _flatten_transformed(dist: Any) -> tuple[list[Any], Any]:
    return [dist.base_dist], (_Transforms(list(dist.transforms)), dist._validate_args)


def _unflatten_transformed(children: list[Any], context: Any) -> Any:
    from torch.distributions import TransformedDistribution

    transforms, validate = context
    base = children[0]
    if isinstance(base, list):  # the base has no rule: one object per replica
        return [TransformedDistribution(b, transforms.transforms, validate) for b in base]
    return TransformedDistribution(base, transforms.transforms, validate_args=validate)


def install_distributions() -> None:
    """Register the ``torch.distributions`` rules (a step that waits for that module:
    :func:`dpmethods.vocab.loading.when_imported`).

    Example:
        >>> import torch.distributions
        >>> install_distributions()
    """
    module = sys.modules["torch.distributions"]
    # Exact classes: a subclass's constructor may take other arguments.
    rule = _tree.TypeRule(_flatten_distribution, _unflatten_distribution, per_item=True, exact=True)
    for name in _PARAMS:
        cls = getattr(module, name, None)
        if isinstance(cls, type):
            _tree.set_rule(cls, rule)
    _tree.set_rule(
        module.Independent,
        _tree.TypeRule(_flatten_independent, _unflatten_independent, per_item=True, exact=True),
    )
    # Exact too: its subclasses (Weibull, Kumaraswamy, ...) build their own transforms.
    _tree.set_rule(
        module.TransformedDistribution,
        _tree.TypeRule(_flatten_transformed, _unflatten_transformed, per_item=True, exact=True),
    )


# --- dynamically quantized layers ------------------------------------------------------

_DYNAMIC = "torch.ao.nn.quantized.dynamic.modules"
_DYNAMIC_LAYERS = (
    f"{_DYNAMIC}.linear:Linear", f"{_DYNAMIC}.rnn:LSTM", f"{_DYNAMIC}.rnn:GRU", f"{_DYNAMIC}.rnn:LSTMCell",
    f"{_DYNAMIC}.rnn:GRUCell", f"{_DYNAMIC}.rnn:RNNCell",
    "torch.ao.nn.intrinsic.quantized.dynamic.modules.linear_relu:LinearReLU",
)


def mark_dynamic_quantization() -> None:
    """Mark torch's dynamically quantized layers batch-coupled (see the module docstring),
    each once its module is imported; a layer this torch lacks is skipped.

    Example:
        >>> mark_dynamic_quantization()
    """
    for path in _DYNAMIC_LAYERS:
        mark_batch_coupled(
            path, what="dynamic quantization: one scale quantizes the input of the whole batch",
            advice="Each item's result depends on the items batched with it, on one device too; "
            "DataParallel.map runs each batch whole on one replica, which gives each batch's own result.",
            missing_ok=True,
        )
