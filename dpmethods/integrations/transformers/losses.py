"""A transformers ``forward``'s loss, joined over the replicas as the full-batch loss.

A loss averaged over the tokens that count (labels other than -100, shifted by one for
causal LMs) weighs replicas by their counted tokens, not their rows. How the replicas'
losses are joined depends on how the model computes its loss (:func:`loss_plan`):

- a model that hands ``**kwargs`` to transformers' ``self.loss_function``: each replica
  is given the full batch's ``num_items_in_batch`` (transformers' own mechanism, the
  Trainer's), so its loss is its share of the full-batch loss, and the shares are
  summed (:data:`LOSS_COUNT` injects the count once, before the scatter);
- CTC follows the model's ``ctc_loss_reduction`` (``"sum"`` adds, ``"mean"`` averages
  per row); regression and multi-label losses are means over rows;
- a model that computes one token-averaged cross-entropy itself (``CrossEntropyLoss()``
  over ``labels``, as ``BertForMaskedLM`` and ``T5ForConditionalGeneration`` do, or over
  ``labels[..., 1:]``): the replicas' means are weighted by each replica's counted
  labels, ``sum_r count_r / total * mean_r``, a replica with none contributing 0;
- anything else, a router's auxiliary loss added (``output_router_logits``) too, keeps
  one loss per replica, with a one-time warning.

The gather mode :data:`FORWARD_MODE` joins the rest of the output with ``"cat"`` and
the per-image outputs of vision towers in image order.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import weakref
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dpmethods.extending import Call, CallHooks, register_gather_mode
from dpmethods.integrations.transformers.spans import is_span_loss, span_weights, start_length
from dpmethods.integrations.transformers.vision import take_per_image
from dpmethods.parallel import gather
from dpmethods.warn_once import warn_once

__all__ = ["FORWARD_MODE", "LOSS_COUNT", "LossPlan", "in_field_order", "loss_plan"]

FORWARD_MODE = "transformers_forward"


@dataclass(frozen=True)
class LossPlan:
    """How the replicas' losses join into the full-batch loss.

    Attributes:
        mode: ``"sum"`` (shares of the full loss), ``"mean"`` (weighted by rows),
            ``"tokens"`` (weighted by counted labels), ``"spans"`` (question answering's
            start and end losses, weighted by counted positions) or ``"cat"`` (one loss
            per row, joined along the batch).
        count: the ``num_items_in_batch`` every replica is given, if any.
        shift: with ``"tokens"``, the labels that count are ``labels[..., 1:]``.
        ignore: with ``"tokens"``, the label that does not count.
    """

    mode: str
    count: Tensor | None = None
    shift: bool = False
    ignore: int = -100


_SOURCES: weakref.WeakKeyDictionary[type, str] = weakref.WeakKeyDictionary()
_LOSS_CALL = re.compile(r"self\.loss_function\((?:[^()]|\([^()]*\))*\*\*kwargs", re.S)
_MADE_CE = re.compile(r"(\w+)\s*=\s*(?:torch\.)?(?:nn\.)?CrossEntropyLoss\(([^()]*)\)")


def _source(cls: type) -> str:
    """The source of ``cls.forward`` ('' when it has none: compiled, built at runtime)."""
    found = _SOURCES.get(cls)
    if found is None:
        try:
            found = inspect.getsource(inspect.unwrap(cls.forward))  # type: ignore[attr-defined]
        except (AttributeError, OSError, TypeError, ValueError):
            found = ""
        _SOURCES[cls] = found
    return found


def _passes_kwargs_to_loss(cls: type) -> bool:
    """Whether ``cls.forward`` takes ``**kwargs`` and hands them to ``self.loss_function``."""
    try:
        params = inspect.signature(inspect.unwrap(cls.forward)).parameters  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError):
        return False
    takes = any(p.kind == p.VAR_KEYWORD for p in params.values())
    return takes and _LOSS_CALL.search(_source(cls)) is not None


def _bound(model: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    given = dict(kwargs)
    if args:
        try:
            bound = inspect.signature(model.forward).bind_partial(*args, **kwargs)
            given = dict(bound.arguments)
            given.update(given.pop("kwargs", {}) or {})
        except (TypeError, ValueError):
            pass
    return given


def _problem_type(config: Any, labels: Tensor) -> str:
    # As transformers' sequence-classification heads decide it.
    if config.problem_type is not None:
        return str(config.problem_type)
    if config.num_labels == 1:
        return "regression"
    if labels.dtype in (torch.long, torch.int):
        return "single_label_classification"
    return "multi_label_classification"


def _loss_function_plan(model: Any, given: dict[str, Any], labels: Tensor, ignore: int) -> LossPlan | None:
    """The plan of a model that hands ``**kwargs`` to transformers' ``loss_function``."""
    losses = sys.modules.get("transformers.loss.loss_utils")
    fn = getattr(model, "loss_function", None)
    if losses is None:
        return None
    if fn is getattr(losses, "ForCausalLMLoss", None):
        shift = given.get("shift_labels")
        counted = shift if isinstance(shift, Tensor) else labels[..., 1:]
        return LossPlan("sum", (counted != ignore).sum())
    if fn in (getattr(losses, "ForMaskedLMLoss", None), getattr(losses, "ForTokenClassification", None)):
        return LossPlan("sum", (labels != ignore).sum())
    if fn is getattr(losses, "ForSequenceClassificationLoss", None):
        # Single-label cross-entropy takes num_items_in_batch (rows whose label counts);
        # regression and multi-label losses are means over rows (and labels).
        if _problem_type(model.config, labels) == "single_label_classification":
            return LossPlan("sum", (labels != ignore).sum())
        return LossPlan("mean")
    if fn is getattr(losses, "ForCTCLoss", None):
        # CTC's own reductions: "sum" adds the rows' losses, "mean" averages them per row
        # (each divided by its target length), so a row-weighted mean is exact; "none"
        # gives one loss per row, joined along the batch.
        reduction = getattr(model.config, "ctc_loss_reduction", "mean")
        return LossPlan(reduction if reduction in ("sum", "mean") else "cat")
    return None


def _arguments(text: str) -> list[str]:
    """The top-level arguments of a call's argument text."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    return [*parts, current.strip()] if current.strip() else parts


def _direct_plan(model: Any, labels: Tensor) -> LossPlan | None:
    """The plan of a model that computes one token-averaged cross-entropy itself, or None.

    Identified from ``forward``'s source: one ``CrossEntropyLoss()`` (mean, ignoring
    -100), called once, on ``labels`` or on a ``labels[..., 1:]`` shift of them.
    """
    source = _source(type(model))
    if "problem_type" in source and hasattr(getattr(model, "config", None), "problem_type"):
        if _problem_type(model.config, labels) != "single_label_classification":
            return LossPlan("mean")  # mean squared error, binary cross-entropy: per row
    made = list(_MADE_CE.finditer(source))
    if len(made) != 1 or made[0].group(2).replace(" ", "") not in ("", "ignore_index=-100"):
        return None
    # The calls of the name while it is bound to the cross-entropy: sequence-classification
    # heads bind one name (loss_fct) to MSELoss, CrossEntropyLoss and BCEWithLogitsLoss in
    # turn, one per problem type, and call it in each branch.
    fn, scope = made[0].group(1), source[made[0].end():]
    rebound = re.search(rf"(?<![\w.]){fn}\s*=[^=]", scope)
    scope = scope[: rebound.start()] if rebound else scope
    calls = re.findall(rf"(?<![\w.]){fn}\((.*)\)\s*$", scope, re.M)
    if len(calls) != 1 or len(_arguments(calls[0])) != 2:
        return None
    name = re.match(r"\w*", _arguments(calls[0])[1]).group(0)  # type: ignore[union-attr]
    if name == "labels":
        return LossPlan("tokens")
    if name and re.search(rf"\b{name}\s*=\s*labels\[(?:\.\.\.|:),\s*1:\]", source):
        return LossPlan("tokens", shift=True)
    return None


def _adds_router_loss(model: Any, given: dict[str, Any]) -> bool:
    """Whether the loss adds a router's auxiliary loss, computed on each replica's tokens."""
    if "router_aux_loss_coef" not in _source(type(model)):
        return False
    wanted = given.get("output_router_logits")
    if wanted is None:
        wanted = getattr(getattr(model, "config", None), "output_router_logits", False)
    return bool(wanted)


def loss_plan(model: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> LossPlan | None:
    """How the losses of one ``model.forward(*args, **kwargs)`` call join, or None.

    None when the call has no ``labels`` (no plan needed) or its loss is not one
    dpmethods can identify (see the module doc).

    Example:
        >>> import torch
        >>> loss_plan(torch.nn.Linear(2, 2), (), {"labels": torch.zeros(2)}) is None
        True
        >>> loss_plan(torch.nn.Linear(2, 2), (), {"labels": torch.zeros(2), "num_items_in_batch": 5})
        LossPlan(mode='sum', count=None, shift=False, ignore=-100)
    """
    model = getattr(model, "_orig_mod", model)  # through torch.compile's wrapper
    given = _bound(model, args, kwargs)
    labels = given.get("labels")
    if not isinstance(labels, Tensor):
        # Question answering: a mean of two means, weighted per call (see spans).
        return LossPlan("spans") if is_span_loss(model, _source(type(model)), given) else None
    if _adds_router_loss(model, given):
        return None  # a mixture of experts' load-balancing term: neither a sum nor a mean
    if given.get("num_items_in_batch") is not None:
        return LossPlan("sum")  # the caller's count (the Trainer's): shares of the full loss
    if _passes_kwargs_to_loss(type(model)):
        plan = _loss_function_plan(model, given, labels, int(given.get("ignore_index", -100)))
        if plan is not None:
            return plan
    return _direct_plan(model, labels)


def _count_prepare(args: tuple[Any, ...], kwargs: dict[str, Any], call: Call) -> Any:
    if call.options.gather != FORWARD_MODE:
        return args, kwargs, None  # the user's gather= wins: nothing to rescale for it
    plan = loss_plan(call.module, args, kwargs)
    if plan is not None and plan.count is not None:
        # A 0-dim tensor: every replica gets it whole.
        kwargs = {**kwargs, "num_items_in_batch": plan.count}
    return args, kwargs, None


LOSS_COUNT = CallHooks(prepare=_count_prepare)
"""The hooks that give every replica the full batch's ``num_items_in_batch``."""


def _labels(call: Call) -> Any:
    return _bound(getattr(call.module, "_orig_mod", call.module), call.args, call.kwargs).get("labels")


def _weights(plan: LossPlan, call: Call, sizes: list[int] | None, outputs: list[Any]) -> list[float] | None:
    """Each replica's weight in the full-batch loss (None: no weights give it)."""
    n = len(outputs)
    if plan.mode == "spans":
        length = start_length(outputs)
        if sizes is None or length is None:
            return None
        return span_weights(_bound(getattr(call.module, "_orig_mod", call.module), call.args, call.kwargs), length, sizes)
    if plan.mode == "sum" or sizes is None:
        return [1.0] * n if plan.mode == "sum" else [1.0 / n] * n
    if plan.mode == "mean":
        return [s / sum(sizes) for s in sizes] if sum(sizes) else [1.0 / n] * n
    labels = _labels(call)
    counted = labels[..., 1:] if plan.shift else labels
    parts = counted.split(sizes, call.options.dim)
    counts = torch.stack([(part != plan.ignore).sum() for part in parts]).tolist()  # one sync
    total = sum(counts)
    return [c / total for c in counts] if total else [1.0 / n] * n


def _join_losses(losses: Sequence[Tensor], device: torch.device, weights: list[float]) -> Tensor:
    # A replica of weight 0 (no counted labels, a NaN mean) is left out, not multiplied.
    kept = [loss.to(device) * w for loss, w in zip(losses, weights) if w != 0]
    if not kept:
        return losses[0].to(device) * 0
    return torch.stack(kept).sum() if len(kept) > 1 else kept[0]


def _warn_spans(call: Call) -> None:
    warn_once(
        f"DataParallel: {type(call.module).__name__}.forward: some rows' start and end "
        "positions are not both inside the sequence (a position equal to or past its length "
        "is ignored by one loss and not the other), so no weight per replica gives the "
        "full-batch loss: it comes back as one value per replica. For the exact value, "
        "compute the loss from the gathered start_logits and end_logits.",
        stacklevel=6,
    )


def _warn_unknown(call: Call) -> None:
    warn_once(
        f"DataParallel: {type(call.module).__name__}.forward computes its loss in a way "
        "dpmethods can't join as the full-batch loss (neither transformers' loss_function "
        "with num_items_in_batch nor one token-averaged CrossEntropyLoss over labels, or it "
        "adds a router's auxiliary loss): it "
        "comes back as one value per replica. methods={'forward': {'gather': {'loss': "
        "'mean'}}} weights them by rows, which is the full-batch loss only when every row "
        "counts as many tokens (no padding, no -100 labels); for the exact value compute "
        "the loss from the gathered logits.",
        stacklevel=6,
    )


def gather_forward(outputs: list[Any], device: torch.device, call: Call | None) -> Any:
    """The gather mode :data:`FORWARD_MODE`: ``"cat"``, with ``loss`` joined by its plan.

    Example:
        >>> import torch
        >>> gather_forward([{"logits": torch.ones(1, 2)}, {"logits": torch.zeros(1, 2)}],
        ...                torch.device("cpu"), None)["logits"].tolist()
        [[1.0, 1.0], [0.0, 0.0]]
    """
    n = len(outputs)
    if call is None or n == 1:
        return gather(outputs, device, 0)
    opts = call.options
    sizes = list(call.sizes) if len(call.sizes) == n else None
    extra: dict[str, Any] = dict(sizes=sizes, gather_dim=opts.gather_dim, pad_value=opts.pad_value)
    plan = loss_plan(call.module, call.args, call.kwargs)
    warned = plan is None and isinstance(_labels(call), Tensor)
    if warned:
        _warn_unknown(call)
    per_image = take_per_image(outputs, device)
    tuples = type(outputs[0]) is tuple
    losses = [o[0] if tuples else o.get("loss") for o in outputs] if plan is not None else []
    weights = None
    if plan is not None and plan.mode != "cat" and all(isinstance(x, Tensor) for x in losses):
        weights = _weights(plan, call, sizes, outputs)
        if weights is None and plan.mode == "spans":
            _warn_spans(call)
            warned = True
    if weights is None:
        # Our warning says why the losses stay per replica; the gather's own note on 0-dim
        # outputs would suggest gather='mean', which is not the full-batch loss here.
        mode: Any = ({0: "stack"} if tuples else {"loss": "stack"}) if warned else "cat"
        out = gather(outputs, device, opts.dim, mode=mode, **extra)
    else:
        loss = _join_losses(losses, device, weights)
        if tuples:  # return_dict=False: the loss comes first
            return (loss, *gather([o[1:] for o in outputs], device, opts.dim, **extra))
        for o in outputs:
            o["loss"] = None
        out = gather(outputs, device, opts.dim, **extra)
        out["loss"] = loss
    for key, value in per_image.items():
        out[key] = value  # a ModelOutput: per-image outputs exist only with return_dict
    return in_field_order(out)


def in_field_order(out: Any) -> Any:
    """``out`` with its keys in its dataclass's field order, as the model builds it.

    A ModelOutput's ``out[0]`` and ``to_tuple()`` follow the order of its keys, and a key
    set after the gather (the joined loss, per-image outputs) would come last: ``out[0]``
    would be the logits, not the loss, as it is on one device.

    Example:
        >>> from transformers.modeling_outputs import SequenceClassifierOutput
        >>> out = SequenceClassifierOutput(logits=torch.ones(1))
        >>> out["loss"] = torch.zeros(())
        >>> list(out), list(in_field_order(out))
        (['logits', 'loss'], ['loss', 'logits'])
    """
    if not (dataclasses.is_dataclass(out) and isinstance(out, MutableMapping)):
        return out
    names = [f.name for f in dataclasses.fields(out) if f.init]
    keys = list(out)
    if keys == [k for k in names if k in out] + [k for k in keys if k not in names]:
        return out
    rebuilt = type(out)(**{k: out[k] for k in names if k in out})
    for k in keys:
        if k not in names:
            rebuilt[k] = out[k]
    return rebuilt


register_gather_mode(FORWARD_MODE, gather_forward)
