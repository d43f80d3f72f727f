"""A transformers ``forward``'s loss, joined over the replicas as the full-batch loss.

:func:`~dpmethods.integrations.transformers.loss_plans.loss_plan` tells how the model
computes its loss; here the replicas' losses are joined by that plan: summed as shares
of the full-batch loss (:data:`LOSS_COUNT` gives every replica the full batch's
``num_items_in_batch`` once, before the scatter), or weighted by each replica's rows or
counted labels. Without a plan the loss stays one per replica, with a one-time warning.

The gather mode :data:`FORWARD_MODE` joins the rest of the output with ``"cat"`` and
the per-image outputs of vision towers in image order, and keeps the model's field
order (the loss first).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import torch
from torch import Tensor

from dpmethods.extending import (
    Call,
    CallHooks,
    gather,
    register_gather_mode,
    unwrap_compiled,
    warn_once,
)
from dpmethods.integrations.transformers.arguments import bound_arguments, forward_call
from dpmethods.integrations.transformers.contrastive import (
    check_pairs,
    join_contrastive,
    paired_fields,
    returns_pairs,
)
from dpmethods.integrations.transformers.loss_plans import COMPARE, LossPlan, loss_plan
from dpmethods.integrations.transformers.spans import span_weights, start_length
from dpmethods.integrations.transformers.vision import take_per_image

__all__ = ["BY_FIELD", "FORWARD_MODE", "LOSS_COUNT", "PAIRS", "in_field_order"]

FORWARD_MODE = "transformers_forward"


def _count_prepare(args: tuple[Any, ...], kwargs: dict[str, Any], call: Call) -> Any:
    if call.options.gather != FORWARD_MODE:
        return args, kwargs, None  # the user's gather= wins: nothing to rescale for it
    plan = loss_plan(call.module, args, kwargs)
    if plan is not None and plan.count is not None:
        # A 0-dim tensor: every replica gets it whole.
        kwargs = {**kwargs, "num_items_in_batch": plan.count}
    if plan is not None and plan.mask is not None and _wants_tuple(call, args, kwargs):
        model, inner_args, inner_kwargs = forward_call(call.module, args, kwargs)
        if not isinstance(bound_arguments(model.forward, inner_args, inner_kwargs).get(plan.mask), Tensor):
            # The mask is an output field, found by its name: the tuple is made after the gather.
            return args, {**kwargs, "return_dict": True}, _as_tuple
    return args, kwargs, None


LOSS_COUNT = CallHooks(prepare=_count_prepare)
"""The hooks that give every replica the full batch's ``num_items_in_batch``."""


def _as_tuple(out: Any) -> Any:
    return out.to_tuple() if hasattr(out, "to_tuple") else out


def _wants_tuple(call: Call, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the call asks for a tuple (``return_dict=False``, given as a keyword or in
    the config) that ``return_dict=True`` in ``kwargs`` can turn into fields."""
    model = forward_call(call.module, args, kwargs)[0]  # under a peft wrapper, its base
    wanted = kwargs.get("return_dict")
    wanted = getattr(getattr(model, "config", None), "return_dict", True) if wanted is None else wanted
    called = unwrap_compiled(call.module).forward  # the method the arguments are given to
    return wanted is False and "return_dict" not in bound_arguments(called, args, {})


def _pairs_prepare(args: tuple[Any, ...], kwargs: dict[str, Any], call: Call) -> Any:
    model = forward_call(call.module, args, kwargs)[0]  # under a peft wrapper, its base
    if not returns_pairs(type(model)):
        return args, kwargs, None  # a wrapper's base that returns no logits_per_*
    if call.options.gather != FORWARD_MODE:
        return args, kwargs, functools.partial(check_pairs, name=type(model).__name__)
    if _wants_tuple(call, args, kwargs):
        # The gather joins the pairs by their fields' names; the tuple is made after it.
        return args, {**kwargs, "return_dict": True}, _as_tuple
    return args, kwargs, None


PAIRS = CallHooks(prepare=_pairs_prepare)
"""The hooks of a ``forward`` that returns ``logits_per_*``: its output as fields (a
tuple made after the gather), or, with a ``gather=`` the caller gave, checked."""


def _fields_prepare(args: tuple[Any, ...], kwargs: dict[str, Any], call: Call) -> Any:
    if _wants_tuple(call, args, kwargs):
        # gather_dim names fields, whose positions in a tuple depend on which are None.
        return args, {**kwargs, "return_dict": True}, _as_tuple
    return args, kwargs, None


BY_FIELD = CallHooks(prepare=_fields_prepare)
"""The hooks of a ``forward`` whose ``gather_dim`` names fields: its output as fields,
the tuple the caller asked for made after the gather."""


def _given(call: Call) -> dict[str, Any]:
    # The arguments of the model that computes the loss (under a peft wrapper, its base).
    model, args, kwargs = forward_call(call.module, call.args, call.kwargs)
    return bound_arguments(model.forward, args, kwargs)


def _labels(call: Call) -> Any:
    return _given(call).get("labels")


def _weights(plan: LossPlan, call: Call, sizes: list[int] | None, outputs: list[Any]) -> list[float] | None:
    """Each replica's weight in the full-batch loss (None: no weights give it)."""
    n = len(outputs)
    if plan.mode == "spans":
        length = start_length(outputs)
        if sizes is None or length is None:
            return None
        return span_weights(_given(call), length, sizes)
    if plan.mode == "masked":
        given = _given(call).get(plan.mask)  # type: ignore[arg-type]
        if isinstance(given, Tensor):  # the argument: each replica's share of its rows
            masks: list[Any] = list(given.split(sizes, call.options.dim)) if sizes else []
        else:  # the mask each replica returned
            masks = [o.get(plan.mask) if isinstance(o, Mapping) else None for o in outputs]
        if len(masks) != n or not all(isinstance(m, Tensor) for m in masks):
            return None
        if plan.where is not None:  # the elements that compare so (attention_mask == 1)
            compare, number = COMPARE[plan.where[0]], plan.where[1]
            masks = [compare(m, number) for m in masks]
        counts = torch.stack([m.sum().double().cpu() for m in masks]).tolist()
    elif plan.mode == "sum" or sizes is None:
        return [1.0] * n if plan.mode == "sum" else [1.0 / n] * n
    elif plan.mode == "mean":
        return [s / sum(sizes) for s in sizes] if sum(sizes) else [1.0 / n] * n
    else:
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
        "adds another term to it, such as a router's auxiliary loss or a z-loss): it "
        "comes back as one value per replica. methods={'forward': {'gather': {'loss': "
        "'mean'}}} weights them by rows, which is the full-batch loss only when every row "
        "counts as many tokens (no padding, no -100 labels); for the exact value compute "
        "the loss from the gathered logits.",
        stacklevel=6,
    )


def _scalar_losses(outputs: list[Any]) -> bool:
    """Whether every replica returned a 0-dim ``loss`` (with fields: a tuple has no names)."""
    losses = [o.get("loss") if isinstance(o, Mapping) else None for o in outputs]
    return all(isinstance(x, Tensor) and x.dim() == 0 for x in losses)


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
    joined = join_contrastive(outputs, device, call)
    if joined:
        return _with_fields(outputs, device, opts.dim, joined, extra)
    plan = loss_plan(call.module, call.args, call.kwargs)
    # A loss without labels (one the forward computes from other arguments) needs a plan too.
    warned = plan is None and (isinstance(_labels(call), Tensor) or _scalar_losses(outputs))
    if warned:
        _warn_unknown(call)
    if joined is not None:  # logits_per_* that can't be computed again, warned: so is the loss
        warned = warned or "loss" in outputs[0]
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
        # The loss's terms the output holds too, each 0-dim on every replica, join as it does.
        terms = {key: _join_losses([o[key] for o in outputs], device, weights) for key in plan.terms  # type: ignore[union-attr]
                 if all(isinstance(o.get(key), Tensor) and o[key].dim() == 0 for o in outputs)}
        for o in outputs:
            o["loss"] = None
            for key in terms:
                o[key] = None
        out = gather(outputs, device, opts.dim, **extra)
        out["loss"] = loss
        for key, value in terms.items():
            out[key] = value
    for key, value in per_image.items():
        out[key] = value  # a ModelOutput: per-image outputs exist only with return_dict
    return in_field_order(out)


def _with_fields(
    outputs: list[Any], device: torch.device, dim: int, joined: dict[str, Any], extra: dict[str, Any]
) -> Any:
    """The replicas' outputs joined with ``"cat"``, the fields in ``joined`` set to its values."""
    for o in outputs:
        for key in joined:
            o[key] = None
    out = gather(outputs, device, dim, **extra)
    for key, value in joined.items():
        out[key] = value
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


register_gather_mode(FORWARD_MODE, gather_forward, pairs=paired_fields)
