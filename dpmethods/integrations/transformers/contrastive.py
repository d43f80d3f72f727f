"""Contrastive models: ``logits_per_*`` and their loss over the whole batch, as one device.

A contrastive model (CLIP, SigLIP, ALIGN, CLAP, BLIP's ITC and their kin) scores every
item of one side of its batch against every item of the other: ``logits_per_text`` is
``[texts, images]``, ``logits_per_image`` the other way round, and its loss is computed
over that matrix. A replica sees its share only: its logits are ``[n_r, n_r]`` and its
loss is another loss. :func:`join_contrastive` tells the family from the output's fields
(``logits_per_A`` and ``logits_per_B`` beside ``A_embeds`` and ``B_embeds``) and the
model's attributes, joins the replicas' embeddings along the batch (under autograd, so
gradients reach every replica) and computes the logits and the loss from them as one
device does:

- the logits: ``A_embeds @ B_embeds.T`` times the model's ``exp(logit_scale)`` (clamped
  to ``[0, max_log_logit_scale]`` where the model has that; per side,
  ``exp(logit_scale_a)``, where the model has one per tower, as CLAP's audio and text),
  or divided by its ``temperature`` (ALIGN), plus its ``logit_bias`` (SigLIP); with
  3-dim embeddings ``[n, queries, d]`` on one side, each item's best query (BLIP-2's
  image-text contrast);
- the loss: the statements of the model's ``forward`` under ``if return_loss:``, run on
  the joined logits: the model's own arithmetic (CLIP's symmetric cross-entropy,
  ALIGN's with label smoothing, SigLIP's sigmoid loss).

GroupViT's ``segmentation_logits`` ``[images, texts, h, w]`` (each image's pixels
against every text) are computed again the same way, from the images' group tokens and
grouping attentions, joined, and the joined text embeddings.

In item mode (``DataParallel.map`` with ``batch_size=``), a batch runs whole on one
replica, and its ``logits_per_*`` (and ``segmentation_logits``) score its items against
each other only: :func:`paired_fields`, the ``pairs`` of the forward's gather mode,
names them, and the cut refuses them (the embeddings are per item, and fine).

Both are checked on every replica first: from the replica's own embeddings they must
give back the logits and the loss it returned. Where there are no embeddings to join,
or a check fails, a one-time warning says so, whatever the shares, and the logits and
the loss stay each replica's own (one loss per replica).
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import inspect
import math
import sys
import textwrap
import types
import typing
import weakref
from collections.abc import Mapping, Sequence
from types import CodeType
from typing import Any

import torch
from torch import Tensor

from dpmethods.extending import Call, gather, warn_once
from dpmethods.integrations.transformers.arguments import forward_call

__all__ = ["check_pairs", "join_contrastive", "paired_fields", "pairs_items", "returns_pairs"]

_PER = "logits_per_"
_SEGMENTATION = "segmentation_logits"  # GroupViT's: each image's pixels against every text


def pairs_items(out: Any) -> bool:
    """Whether ``out`` has a ``logits_per_*`` field: scores of items against items.

    Example:
        >>> pairs_items({"logits_per_text": None}), pairs_items({"logits": 1})
        (True, False)
    """
    return isinstance(out, Mapping) and any(isinstance(k, str) and _PER in k for k in out)


def paired_fields(out: Any) -> dict[str, str]:
    """The ``logits_per_*`` fields of one batch's output that score its items against each
    other, each with what to do instead in item mode; ``{}`` where there are none, or
    where they are per pair (an image-text matching head's ``[n, 2]``, both sides'
    embeddings ``[n, queries, d]``).

    Example:
        >>> out = {"logits_per_text": torch.ones(2, 2), "logits_per_image": torch.ones(2, 2),
        ...        "text_embeds": torch.ones(2, 4), "image_embeds": torch.ones(2, 4)}
        >>> print(paired_fields(out)["logits_per_text"])
        map get_text_features and get_image_features instead (one embedding per item) and compute the scores over all the items from those embeddings, as the model's forward computes them from its text_embeds and image_embeds
    """
    if not pairs_items(out):
        return {}
    fields = [k for k in out if _PER in k]
    sides = [k[len(_PER):] for k in fields if k.startswith(_PER)]
    embeds = [f"{s}_embeds" for s in sides if isinstance(out.get(f"{s}_embeds"), Tensor)]
    if len(embeds) == len(sides) == 2 and all(out[e].dim() == 3 for e in embeds):
        return {}
    advice = (
        f"map {' and '.join(f'get_{s}_features' for s in sides)} instead (one embedding per item) "
        "and compute the scores over all the items from those embeddings, as the model's forward "
        f"computes them from its {' and '.join(embeds) or 'embeddings'}"
    )
    paired = {k: advice for k in fields}
    if isinstance(out.get(_SEGMENTATION), Tensor):  # GroupViT: [images, texts, h, w]
        paired[_SEGMENTATION] = (
            "call forward on the images with the texts to segment them by, in one batch "
            "(DataParallel's forward computes segmentation_logits over the whole batch of a "
            "call, as one device does)"
        )
    return paired


@dataclasses.dataclass(frozen=True)
class _Scale:
    """How one side's similarities become its logits: ``exp(scale)`` or ``/ scale``."""

    value: Tensor | None  # None: the similarities are the logits
    divide: bool = False
    clamp: float | None = None

    def apply(self, sim: Tensor, bias: Tensor | None) -> Tensor:
        if self.value is not None:
            value = self.value.to(sim.device)
            if self.divide:
                sim = sim / value
            else:
                sim = sim * (value.exp() if self.clamp is None else value.clamp(0.0, self.clamp).exp())
        return sim if bias is None else sim + bias.to(sim.device)

    def factor(self) -> float:
        """How much the scale multiplies by."""
        if self.value is None:
            return 1.0
        value = float(self.value.detach().float().clamp(0.0, self.clamp) if self.clamp is not None else self.value)
        return abs(1 / value) if self.divide and value else math.exp(min(value, 80.0))


def _one(model: Any, name: str) -> Tensor | str | None:
    """The model's one-value tensor ``name``; None if it has none, why not if it is another thing."""
    value = getattr(model, name, None)
    if value is None or (isinstance(value, Tensor) and value.numel() == 1):
        return value
    return f"its {name} is not one value"


def _scale(model: Any, side: str) -> _Scale | str:
    """The scale of ``logits_per_<side>``, from the model's attributes, or why it is unknown."""
    for end in range(1, len(side) + 1):  # one per tower: CLAP's logit_scale_a, logit_scale_t
        own = _one(model, f"logit_scale_{side[:end]}")
        if own is not None:
            return own if isinstance(own, str) else _Scale(own)
    shared = _one(model, "logit_scale")
    if shared is not None:
        limit = getattr(model, "max_log_logit_scale", None)
        clamp = float(limit) if isinstance(limit, (int, float)) else None
        return shared if isinstance(shared, str) else _Scale(shared, clamp=clamp)
    temperature = _one(model, "temperature")
    if temperature is not None:
        return temperature if isinstance(temperature, str) else _Scale(temperature, divide=True)
    return _Scale(None)


def _logits(model: Any, sides: Sequence[str], embeds: Sequence[Tensor]) -> dict[str, Tensor] | str:
    """``logits_per_<side>`` of both sides from their embeddings, or why they can't be had."""
    bias, sa, sb = _one(model, "logit_bias"), _scale(model, sides[0]), _scale(model, sides[1])
    for why in (bias, sa, sb):
        if isinstance(why, str):
            return why
    assert not isinstance(bias, str) and isinstance(sa, _Scale) and isinstance(sb, _Scale)
    a, b = embeds
    if a.dim() == 3 and b.dim() == 3:
        return "neither side's embeddings are one vector per item"
    if a.dim() == 3 or b.dim() == 3:  # one side's best query (BLIP-2): one matrix, transposed
        first = 0 if a.dim() == 3 else 1
        many, single, scale = embeds[first], embeds[1 - first], (sa, sb)[first]
        per = scale.apply(torch.matmul(many, single.t()).max(dim=1).values, bias)
        return {sides[first]: per, sides[1 - first]: per.t()}
    if sa.value is sb.value:  # one scale: one matrix and its transpose, as the models do
        per = sa.apply(torch.matmul(a, b.t()), bias)
        return {sides[0]: per, sides[1]: per.t()}
    return {sides[0]: sa.apply(torch.matmul(a, b.t()), bias), sides[1]: sb.apply(torch.matmul(b, a.t()), bias)}


_LOSSES: weakref.WeakKeyDictionary[type, tuple[CodeType, dict[str, Any]] | None] = weakref.WeakKeyDictionary()


def _names(nodes: Sequence[ast.AST], ctx: type) -> set[str]:
    return {n.id for node in nodes for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ctx)}


def _loss_code(cls: type) -> tuple[CodeType, dict[str, Any]] | None:
    """The statements of ``cls.forward`` under ``if return_loss:``, compiled, and the
    globals they run with; None unless they read nothing but ``logits_per_*`` (as the
    forward returns them) and the module's own names, and set ``loss``."""
    if cls in _LOSSES:
        return _LOSSES[cls]
    found = None
    try:
        fn = inspect.unwrap(cls.forward)  # type: ignore[attr-defined]
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (AttributeError, OSError, SyntaxError, TypeError, ValueError):
        tree = None
    if tree is not None and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
        forward = tree.body[0]
        blocks = [n for n in ast.walk(forward) if isinstance(n, ast.If)
                  and isinstance(n.test, ast.Name) and n.test.id == "return_loss"]
        returned = {k.arg for n in ast.walk(forward) if isinstance(n, ast.Return)
                    for c in ast.walk(n) if isinstance(c, ast.Call) for k in c.keywords
                    if isinstance(k.value, ast.Name) and k.arg == k.value.id}
        if len(blocks) == 1:
            body = blocks[0].body
            read = _names(body, ast.Load) - _names(body, ast.Store)
            local = _names([forward], ast.Store) | {a.arg for a in ast.walk(forward.args) if isinstance(a, ast.arg)}
            known = fn.__globals__.keys() | vars(builtins).keys()
            ok = "loss" in _names(body, ast.Store) and all(
                (name.startswith(_PER) and name in returned) or (name in known and name not in local)
                for name in read
            )
            if ok:
                code = compile(ast.Module(body=body, type_ignores=[]), inspect.getsourcefile(fn) or "<forward>", "exec")
                found = (code, fn.__globals__)
    _LOSSES[cls] = found
    return found


def _run_loss(found: tuple[CodeType, dict[str, Any]], logits: Mapping[str, Tensor]) -> Any:
    code, scope = found
    names = {_PER + side: value for side, value in logits.items()}
    exec(code, scope, names)  # the model's own statements; they set `loss` in `names`
    return names.get("loss")


def _near(got: Any, want: Tensor, magnitude: float = 1.0, width: int = 0) -> Tensor | bool:
    """Whether ``got`` (computed in float32 from what gave ``want``) is ``want`` up to
    rounding: a 0-dim bool tensor on ``want``'s device (read once for all replicas).

    ``want`` was rounded to its dtype a few times (after the products, after the scale):
    a few of its eps, against ``magnitude`` (at least its largest value); the float32
    products of ``width`` terms add theirs. A wrong recipe (another scale, no bias) is
    off by far more.
    """
    if not isinstance(got, Tensor) or got.shape != want.shape:
        return False
    if got.numel() == 0:
        return True
    eps = torch.finfo(want.dtype).eps if want.is_floating_point() else 0.0
    rel = 4 * eps + 4 * torch.finfo(torch.float32).eps * (4 + math.sqrt(width))
    bound = rel * want.detach().float().abs().max().clamp(min=max(magnitude, 1.0))
    return (got.float() - want.float()).abs().max() <= bound


def _all(checks: list[Tensor | bool]) -> bool:
    return all(c if isinstance(c, bool) else bool(c.cpu()) for c in checks)


def _check(model: Any, outputs: Sequence[Any], call: Call, sides: list[str]) -> str | None:
    """Why the replicas' outputs can't be computed again from their embeddings, or None."""
    keys = [f"{side}_embeds" for side in sides]
    sizes = list(call.sizes)
    if len(sizes) != len(outputs):
        return "the replicas' shares of the batch are not known"
    for o, size in zip(outputs, sizes):
        if not all(isinstance(o.get(k), Tensor) and o[k].dim() in (2, 3) and len(o[k]) == size for k in keys):
            return (f"{' and '.join(keys)} do not hold each replica's share of the batch "
                    f"({sizes}), one row per item")
    loss = _loss_code(type(model)) if isinstance(outputs[0].get("loss"), Tensor) else None
    if isinstance(outputs[0].get("loss"), Tensor) and loss is None:
        return "its loss is not computed from the logits alone under `if return_loss:` in forward"
    scales = [_scale(model, side) for side in sides]
    factor = max((s.factor() for s in scales if isinstance(s, _Scale)), default=1.0)
    same_logits: list[Tensor | bool] = []
    same_loss: list[Tensor | bool] = []
    with torch.no_grad():
        for o in outputs:
            logits = _logits(model, sides, [o[k].float() for k in keys])
            if isinstance(logits, str):
                return logits
            width = o[keys[0]].shape[-1]
            same_logits += [_near(logits[s], o[_PER + s], factor, width) for s in sides]
            if loss is not None:  # the model's own statements on the logits it gave them
                same_loss.append(_near(_run_loss(loss, {s: o[_PER + s] for s in sides}), o["loss"]))
    if not _all(same_logits):
        return "its logits are not its embeddings' products scaled by its logit_scale or temperature"
    if not _all(same_loss):
        return "its loss is not what the statements under `if return_loss:` give"
    return None


_DECLARED: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


def returns_pairs(cls: type) -> bool:
    """Whether ``cls.forward`` is declared to return an output with ``logits_per_*`` fields.

    Example:
        >>> import torch
        >>> returns_pairs(torch.nn.Linear)
        False
    """
    found = _DECLARED.get(cls)
    if found is None:
        try:
            declared = inspect.signature(inspect.unwrap(cls.forward)).return_annotation  # type: ignore[attr-defined]
        except (AttributeError, TypeError, ValueError):
            declared = None
        kinds = typing.get_args(declared) or (declared,)
        found = _DECLARED[cls] = any(
            dataclasses.is_dataclass(k) and any(f.name.startswith(_PER) for f in dataclasses.fields(k))
            for k in kinds
        )
    return found


def check_pairs(out: Any, name: str) -> Any:
    """``out``, after a warning where its ``logits_per_*`` are not one device's shape.

    The check of a ``gather=`` the caller gave for a contrastive model's ``forward``:
    ``logits_per_A`` must be ``[rows of A_embeds, rows of B_embeds]``, as one device
    returns it; a replica's scores of its share alone, joined, are not.

    Example:
        >>> out = {"logits_per_a": torch.ones(4, 2), "logits_per_b": torch.ones(2, 4),
        ...        "a_embeds": torch.ones(4, 3), "b_embeds": torch.ones(4, 3)}
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     _ = check_pairs(out, "Model")
        >>> len(seen)
        1
    """
    if not pairs_items(out):
        return out
    fields = [k for k in out if _PER in k]
    sides = [k[len(_PER):] for k in fields if k.startswith(_PER)]
    rows = {s: len(out[f"{s}_embeds"]) for s in sides if isinstance(out.get(f"{s}_embeds"), Tensor)}
    if len(sides) == len(fields) == len(rows) == 2:
        a, b = sides
        want = {a: (rows[a], rows[b]), b: (rows[b], rows[a])}
        if all(isinstance(out[_PER + s], Tensor) and tuple(out[_PER + s].shape[:2]) == want[s] for s in sides):
            return out
    warn_once(
        f"DataParallel: {name}.forward: with the gather= given for it, {', '.join(fields)} are "
        "not what one device returns: each replica scored the items of its own share of the "
        "batch against each other only. Leave gather= out for forward (dpmethods then "
        "computes them, and the loss, over the whole batch, or says why it can't).",
        stacklevel=5,
    )
    return out


def _warn(model: Any, fields: Sequence[str], why: str) -> None:
    warn_once(
        f"DataParallel: {type(model).__name__}.forward returns {', '.join(fields)}, which "
        "score items of the batch against each other, and dpmethods can't compute them "
        f"over the whole batch ({why}): they come back as each replica's own, on its share "
        "of the batch only, and so does a loss computed from them (one per replica). For the "
        "whole batch's, compute them on one device from the whole batch (where they are "
        "made from one embedding per item, gather those with dpmethods first).",
        stacklevel=7,
    )


def _segmentation(model: Any, vision: Any, text_embeds: Tensor, hw: Sequence[int]) -> Tensor | str:
    """GroupViT's ``segmentation_logits`` ``[images, texts, h, w]`` from the images' group
    tokens and grouping attentions (``vision_model_output``) and the texts' embeddings, as
    its forward computes them under ``if output_segmentation:``; or why they can't be."""
    grouping_of = getattr(sys.modules.get(type(model).__module__), "get_grouping_from_attentions", None)
    projection = getattr(model, "visual_projection", None)
    scale = _scale(model, "image")
    hidden, attentions = getattr(vision, "last_hidden_state", None), getattr(vision, "attentions", None)
    if not callable(grouping_of) or not isinstance(projection, torch.nn.Module) or isinstance(scale, str):
        return "its module has no get_grouping_from_attentions, or the model no visual_projection"
    if not isinstance(hidden, Tensor) or not attentions or not all(isinstance(a, Tensor) for a in attentions):
        return "its vision_model_output holds no group tokens and grouping attentions"
    at = next(projection.parameters()).device  # the model's; the result goes to the texts'
    # In the texts' dtype: float32 for the check, the model's (bf16, fp16) for the join.
    groups = projection(hidden.reshape(-1, hidden.shape[-1]).to(at)).to(text_embeds.device, text_embeds.dtype)
    groups = groups / groups.norm(dim=-1, keepdim=True)
    grouping = grouping_of(tuple(a.to(text_embeds.device) for a in attentions), tuple(hw)).to(text_embeds.dtype)
    per_group = scale.apply(torch.matmul(groups, text_embeds.t()), None)
    per_group = per_group.reshape(hidden.shape[0], -1, text_embeds.shape[0]).permute(0, 2, 1)
    seg = scale.apply(torch.matmul(per_group, grouping.reshape(grouping.shape[0], grouping.shape[1], -1)), None)
    return seg.reshape(seg.shape[0], seg.shape[1], grouping.shape[2], grouping.shape[3])


def _join_segmentation(model: Any, outputs: Sequence[Any], device: torch.device, text_embeds: Tensor) -> Tensor | None:
    """GroupViT's ``segmentation_logits`` over the whole batch: each image's pixels scored
    against every text of the batch, where a replica scored its own share's texts only.
    Computed again from the replicas' per-image group tokens and grouping, joined, and the
    joined texts' embeddings, once checked on every replica against what it returned; None
    where there are none, or they can't be (then warned, as each replica's own)."""
    first = outputs[0]
    if not isinstance(first.get(_SEGMENTATION), Tensor):
        return None
    scale = _scale(model, "image")
    factor = scale.factor() if isinstance(scale, _Scale) else 1.0  # applied twice
    checks: list[Tensor | bool] = []
    with torch.no_grad():
        for o in outputs:
            want = o[_SEGMENTATION]
            again = _segmentation(model, o.get("vision_model_output"), o["text_embeds"].float(), want.shape[2:])
            if isinstance(again, str):
                return None
            checks.append(_near(again, want, factor * factor, o["text_embeds"].shape[-1]))
    if not _all(checks):
        return None
    visions = [o["vision_model_output"] for o in outputs]
    hidden = gather([v.last_hidden_state for v in visions], device, 0)
    attentions = [gather([v.attentions[k] for v in visions], device, 0) for k in range(len(visions[0].attentions))]
    joined = _segmentation(model, types.SimpleNamespace(last_hidden_state=hidden, attentions=attentions),
                           text_embeds, first[_SEGMENTATION].shape[2:])
    assert not isinstance(joined, str)  # checked on the replicas
    return joined


def _warn_pairs_left(model: Any, outputs: Sequence[Any], sizes: Sequence[int], done: set[str]) -> None:
    # Other scores of items against items, not made again (GroupViT's segmentation_logits
    # where its check failed): said, whatever the shares.
    for key in outputs[0]:
        if key in done or "logits" not in key:
            continue
        if all(isinstance(o.get(key), Tensor) and o[key].dim() >= 2 and o[key].shape[0] == s
               and o[key].shape[1] == s for o, s in zip(outputs, sizes)):
            warn_once(
                f"DataParallel: {type(model).__name__}.forward returns {key}, which pairs items "
                "of the batch with each other, and dpmethods can't compute it over the whole "
                "batch from the embeddings: it comes back as each replica's own, on its share of "
                "the batch only (its logits_per_* and loss are the whole batch's). Run the "
                "model on one device for it.",
                stacklevel=7,
            )


def _per_pair(outputs: Sequence[Any], device: torch.device, call: Call, sides: list[str]) -> dict[str, Any] | None:
    """Per-pair scores (an image-text matching head's ``[n, 2]``) and their transpose.

    Nothing couples the batch there: one side's logits hold a row per item, the other
    side's are their transpose, joined as such (not along dim 0). None when they are not.
    """
    sizes = list(call.sizes)
    for rows, other in (sides, sides[::-1]):
        per, turned = _PER + rows, _PER + other
        if len(sizes) == len(outputs) and all(
            isinstance(o[per], Tensor) and o[per].dim() == 2 and len(o[per]) == size
            and isinstance(o[turned], Tensor) and torch.equal(o[turned], o[per].t())
            for o, size in zip(outputs, sizes)
        ):
            joined = gather([o[per] for o in outputs], device, 0)
            return {per: joined, turned: joined.t()}
    return None


def join_contrastive(outputs: Sequence[Any], device: torch.device, call: Call) -> dict[str, Any] | None:
    """The fields of a contrastive model's output computed over the whole batch.

    ``{"<A>_embeds": joined, "<B>_embeds": joined, "logits_per_<A>": ..., "logits_per_<B>":
    ..., "loss": ...}`` (the loss where the replicas returned one); ``{}`` when the
    output has ``logits_per_*`` fields that can't be computed again (warned); None when
    it has none. Where neither side's embeddings are one vector per item, the logits
    are per pair, as an image-text matching head's (nothing couples the batch): one side's
    are joined along the batch and the other side's are their transpose.

    Example:
        >>> join_contrastive([{"logits": torch.ones(1)}], torch.device("cpu"), None) is None
        True
    """
    first = outputs[0]
    if not pairs_items(first):
        return None
    # The model that computes the logits and the loss (under a peft wrapper, its base).
    model = forward_call(call.module, call.args, call.kwargs)[0]
    fields = [k for k in first if _PER in k]
    sides = [k[len(_PER):] for k in fields if k.startswith(_PER)]
    pair = len(sides) == len(fields) == 2
    if pair and all(isinstance(first.get(f"{s}_embeds"), Tensor) and first[f"{s}_embeds"].dim() == 3 for s in sides):
        per_pair = _per_pair(outputs, device, call, sides)
        if per_pair is not None:
            return per_pair
    sides.sort(key=lambda s: s != "text")  # the models compute the text side first
    why = _check(model, outputs, call, sides) if pair else "they are not one logits_per_<side> for each of two sides"
    if why is not None:
        _warn(model, fields, why)
        return {}
    keys = [f"{side}_embeds" for side in sides]
    embeds = [gather([o[k] for o in outputs], device, 0) for k in keys]
    logits = _logits(model, sides, embeds)
    assert not isinstance(logits, str)  # checked on the replicas
    joined: dict[str, Any] = dict(zip(keys, embeds))
    joined.update({_PER + s: v for s, v in logits.items()})
    if isinstance(first.get("loss"), Tensor):
        found = _loss_code(type(model))
        assert found is not None
        joined["loss"] = _run_loss(found, logits)
    if "text" in sides and "image" in sides:
        segmentation = _join_segmentation(model, outputs, device, joined["text_embeds"])
        if segmentation is not None:
            joined[_SEGMENTATION] = segmentation
    _warn_pairs_left(model, outputs, list(call.sizes), set(joined))
    return joined
