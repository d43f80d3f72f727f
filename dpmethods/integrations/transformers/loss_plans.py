"""How a transformers ``forward`` computes its loss, and so how replicas' losses join.

A loss averaged over the tokens that count (labels other than -100, shifted by one for
causal LMs) weighs replicas by their counted tokens, not their rows. :func:`loss_plan`
tells, for one call, from the model's ``loss_function`` and its ``forward``'s source:

- a model that hands ``**kwargs`` to transformers' ``self.loss_function``, called once
  on its ``labels`` (a causal LM's ``shift_labels``: the caller's, or the forward's made
  from the labels, unshifted or ``labels[..., 1:]``): each replica
  is given the full batch's ``num_items_in_batch`` (transformers' own mechanism, the
  Trainer's), so its loss is its share of the full-batch loss, and the shares are
  summed (a ``num_items_in_batch`` the caller gives, the Trainer's, is handed on
  instead); one that calls ``self.loss_function`` without them (Llama's classification
  heads) gets each replica's mean, weighted by its counted labels as below, as does one
  that computes its loss itself, a ``num_items_in_batch`` given or not;
- semantic segmentation (``ForSemanticSegmentationLoss``, or one
  ``CrossEntropyLoss(ignore_index=self.config.semantic_loss_ignore_index)`` made in
  ``forward``): as above, its labels other than that index counted;
- CTC follows the model's ``ctc_loss_reduction`` (``"sum"`` adds, ``"mean"`` averages
  per row); regression and multi-label losses are means over rows;
- a model that computes one token-averaged cross-entropy itself (``CrossEntropyLoss()``
  over ``labels``, as ``BertForMaskedLM`` and ``T5ForConditionalGeneration`` do, or over
  ``labels[..., 1:]``; made in ``forward`` or held as a child, as DistilBERT's): the
  replicas' means are weighted by each replica's counted labels,
  ``sum_r count_r / total * mean_r``, a replica with none contributing 0;
- question answering: see :mod:`~dpmethods.integrations.transformers.spans`;
- a mean over a mask, ``(loss * mask).sum() / mask.sum()`` (masked image modelling:
  ViTMAE, whose forward returns the mask it drew, and ViT's, Swin's, DeiT's and
  FocalNet's, whose mask is ``bool_masked_pos`` made into pixels): the replicas' means
  are weighted by each replica's part of the mask, read from its output or from its
  share of the argument;
- a loss made of loss calls (the ``loss = ...`` that may run for this call, or the name
  returned as ``loss=``): terms each weighed by a constant, a term weighed 0 by the
  config left out, that all join alike (DPT's ``main + weight * auxiliary``), each a
  ``reduction="sum"`` loss (wav2vec 2.0's pretraining without its diversity term:
  summed, the terms the output holds too) or a mean loss module (cross-entropy, label
  smoothing allowed, binary cross-entropy, squared or absolute error, unweighted) over
  the labels (counted), over what a comparison of an argument selects
  (``labels[attention_mask == 1]``, ELECTRA's; the rows with ``labels >= 0``, DeBERTa's:
  weighted by each replica's selected elements), over every element of a batch-first
  argument or of one block per row (VideoMAE's masked patches: by rows), or over
  ``labels[:, 1:]`` made in the forward; or a child model's loss (``loss=outputs.loss``,
  BLIP's captioning) given the same labels: the child's plan;
- anything else, and a loss the forward changes once computed (``loss += ...``, or
  ``loss = ...`` of it and more) where this call's conditions on the way hold or can't
  be told (a router's auxiliary loss with ``output_router_logits``, Bamba's z-loss with
  ``z_loss_coefficient > 0``, VibeVoice's weighted diffusion loss): no plan, and the
  loss stays one per replica, with a one-time warning.
"""

from __future__ import annotations

import inspect
import io
import re
import sys
import textwrap
import tokenize
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dpmethods.integrations.transformers.arguments import bound_arguments, forward_call
from dpmethods.integrations.transformers.spans import is_span_loss

__all__ = ["COMPARE", "LossPlan", "loss_plan"]


@dataclass(frozen=True)
class LossPlan:
    """How the replicas' losses join into the full-batch loss.

    Attributes:
        mode: ``"sum"`` (shares of the full loss), ``"mean"`` (weighted by rows),
            ``"tokens"`` (weighted by counted labels), ``"spans"`` (question answering's
            start and end losses, weighted by counted positions), ``"masked"`` (weighted
            by each replica's part of a mask) or ``"cat"`` (one loss per row, joined
            along the batch).
        count: the ``num_items_in_batch`` every replica is given, if any.
        shift: with ``"tokens"``, the labels that count are ``labels[..., 1:]``.
        ignore: with ``"tokens"``, the label that does not count.
        mask: with ``"masked"``, the argument (its rows' share on each replica) or else
            the output field that holds the mask.
        terms: output fields that are terms of the loss, joined as it is (wav2vec 2.0's
            ``contrastive_loss``).
        where: with ``"masked"``, the mask's elements that count: those that compare so
            with the number (``("==", 1.0)``); None: its sum.

    Example:
        >>> LossPlan("tokens", shift=True)
        LossPlan(mode='tokens', count=None, shift=True, ignore=-100, mask=None, terms=(), where=None)
    """

    mode: str
    count: Tensor | None = None
    shift: bool = False
    ignore: int = -100
    mask: str | None = None
    terms: tuple[str, ...] = ()
    where: tuple[str, float] | None = None


_SOURCES: weakref.WeakKeyDictionary[type, str] = weakref.WeakKeyDictionary()
_LOSS_CALL = re.compile(r"self\.loss_function\((?:[^()]|\([^()]*\))*\*\*kwargs", re.S)
_MADE_CE = re.compile(r"(\w+)\s*=\s*(?:torch\.)?(?:nn\.)?CrossEntropyLoss\(([^()]*)\)")


# Calls that change a tensor's shape or type, not which elements it holds (each element
# becomes the same number of elements: labels.view(-1), a mask made into pixels).
_RESHAPES = frozenset({
    "repeat_interleave", "repeat", "unsqueeze", "reshape", "view", "contiguous", "expand",
    "flatten", "float", "to", "type_as", "bool", "long",
})


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


def _problem_type(config: Any, labels: Tensor) -> str:
    # As transformers' sequence-classification heads decide it.
    if config.problem_type is not None:
        return str(config.problem_type)
    if config.num_labels == 1:
        return "regression"
    if labels.dtype in (torch.long, torch.int):
        return "single_label_classification"
    return "multi_label_classification"


def _counted(counted: Tensor, ignore: int, shares: bool, shift: bool = False) -> LossPlan:
    """A loss averaged over ``counted`` labels other than ``ignore``.

    ``shares``: the model hands ``num_items_in_batch`` on to its loss, so each replica is
    given the full batch's count and returns its share; else each returns its own mean.
    """
    if shares:
        return LossPlan("sum", (counted != ignore).sum())
    return LossPlan("tokens", shift=shift, ignore=ignore)


def _loss_call(source: str) -> tuple[list[str], dict[str, str]] | None:
    """The positional and keyword arguments of the forward's one ``self.loss_function``
    call (None if it makes none or several: HiggsAudio's, one per codebook)."""
    calls = list(re.finditer(r"self\.loss_function\(", source))
    if len(calls) != 1:
        return None
    start = end = calls[0].end()
    depth = 1
    while depth and end < len(source):
        depth += (source[end] == "(") - (source[end] == ")")
        end += 1
    positional, keywords = [], {}
    for part in _arguments(source[start : end - 1]):
        named = re.match(r"(\w+)\s*=(?!=)(.*)", part, re.S)
        if named:
            keywords[named.group(1)] = " ".join(named.group(2).split())
        elif not part.startswith("*"):
            positional.append(part)
    return positional, keywords


def _causal_target(source: str, expr: str, given: Mapping[str, Any], labels: Tensor) -> tuple[Tensor, bool] | None:
    """What ``ForCausalLMLoss`` counts when the forward passes it ``shift_labels=expr``:
    the tensor, and whether it is ``labels[..., 1:]`` (None if not told)."""
    fallback = re.fullmatch(r"(\w+) if \1 is not None else (\w+)", expr)
    if fallback is not None:  # Moonshine's: the caller's shift_labels, else labels unshifted
        if isinstance(given.get(fallback.group(1)), Tensor):
            return given[fallback.group(1)], False
        expr = fallback.group(2)
    if expr == "labels":  # Florence-2's: the labels as they are, aligned with the logits
        return labels, False
    if not re.fullmatch(r"\w+", expr):
        return None
    if isinstance(given.get(expr), Tensor):
        return given[expr], False  # the caller's (GIT's shift_labels argument)
    # Its assignments (a line ending in a comma is a keyword argument, not one), less
    # the caller's shift_labels taken from **kwargs (not given: checked above).
    made = [m for m in re.findall(rf"^[ \t]*{expr}\s*=\s*(.+?)\s*$", source, re.M)
            if not m.endswith(",") and not re.fullmatch(r"kwargs\.pop\(\s*[\"']shift_labels[\"']\s*,\s*None\s*\)", m)]
    if len(made) != 1:
        return None
    if re.fullmatch(r"kwargs\.pop\(\s*[\"']shift_labels[\"']\s*,\s*labels\s*\)", made[0]):
        return labels, False  # Canary's: the caller's shift_labels (given above), else labels
    if re.fullmatch(r"labels\[(?:\.\.\.|:),\s*1:\](?:\.contiguous\(\))?", made[0]):
        return labels[..., 1:], True  # GIT's and CSM's depth decoder's
    return None


def _loss_function_plan(
    model: Any, given: Mapping[str, Any], labels: Tensor, ignore: int, shares: bool
) -> LossPlan | None:
    """The plan of a model whose loss is transformers' ``loss_function``, called once, on
    the forward's ``labels`` (or, for a causal LM, ``shift_labels`` made from them)."""
    losses = sys.modules.get("transformers.loss.loss_utils")
    fn = getattr(model, "loss_function", None)
    source = _source(type(model))
    call = _loss_call(source)
    if losses is None or call is None:
        return None
    positional, keywords = call
    if fn is getattr(losses, "ForCausalLMLoss", None):
        passed = keywords.get("labels", positional[1] if len(positional) > 1 else None)
        if "shift_labels" in keywords:
            target = _causal_target(source, keywords["shift_labels"], given, labels)
        elif passed == "labels":  # shifted by the loss, or the caller's shift_labels
            shift = given.get("shift_labels")
            target = (shift, False) if isinstance(shift, Tensor) else (labels[..., 1:], True)
        else:
            target = None  # labels made in the forward (CSM's first codebook)
        if target is None:
            return None
        if shares:
            return _counted(target[0], ignore, shares)
        return LossPlan("tokens", shift=target[1], ignore=ignore) if target[0] is labels or target[1] else None
    if "labels" not in positional and keywords.get("labels") != "labels":
        return None  # labels made in the forward: not what the given labels count
    if fn in (getattr(losses, "ForMaskedLMLoss", None), getattr(losses, "ForTokenClassification", None)):
        return _counted(labels, ignore, shares)
    if fn is getattr(losses, "ForSequenceClassificationLoss", None):
        # Single-label cross-entropy counts the rows whose label counts; regression and
        # multi-label losses are means over rows (and labels).
        if _problem_type(model.config, labels) == "single_label_classification":
            return _counted(labels, ignore, shares)
        return LossPlan("mean")
    if fn is getattr(losses, "ForSemanticSegmentationLoss", None):
        # A cross-entropy over the labels' pixels other than its ignore_index (255 unless
        # given), its auxiliary head's too, each divided by num_items_in_batch if given.
        named = keywords.get("ignore_index")
        pixels = _ignored(model, named) if named is not None else 255
        return None if pixels is None else _counted(labels, pixels, shares)
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


def _default_cross_entropy(module: Any) -> bool:
    """A ``CrossEntropyLoss`` that averages over labels other than -100, unweighted."""
    return (
        isinstance(module, torch.nn.CrossEntropyLoss) and module.reduction == "mean"
        and module.ignore_index == -100 and module.weight is None
        and module.label_smoothing == 0
    )


def _ignored(model: Any, expr: str) -> int | None:
    """The label an ``ignore_index=expr`` argument names: a number, or an attribute of
    the model or its config (``self.config.semantic_loss_ignore_index``); None if not told."""
    expr = expr.strip()
    if re.fullmatch(r"-?\d+", expr):
        return int(expr)
    value = _attribute(model, expr) if re.fullmatch(r"self(?:\.\w+)+", expr) else _MISSING
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _direct_plan(model: Any, labels: Tensor, given: Mapping[str, Any]) -> LossPlan | None:
    """The plan of a model that computes one token-averaged cross-entropy itself, or None.

    Identified from ``forward``'s source: one ``CrossEntropyLoss()`` (mean, ignoring -100
    or the ``ignore_index`` it is given: semantic segmentation's) made there where this
    call may run it, or a child module that is one, called once, on ``labels`` or on a
    ``labels[..., 1:]`` shift of them.
    """
    source = _source(type(model))
    if "problem_type" in source and hasattr(getattr(model, "config", None), "problem_type"):
        if _problem_type(model.config, labels) != "single_label_classification":
            return LossPlan("mean")  # mean squared error, binary cross-entropy: per row
    made = list(_MADE_CE.finditer(source))
    # Or a default CrossEntropyLoss made in __init__ and called in forward (DistilBERT).
    owned = [f"self.{name}" for name, m in model.named_children()
             if _default_cross_entropy(m) and f"self.{name}(" in source]
    if len(made) + len(owned) != 1:
        return None
    ignore = -100
    if owned:
        fn, scope = owned[0], source
    elif not _may_run(source, source.count("\n", 0, made[0].start()), model, given):
        return None  # another branch computes the loss (Segformer's one-label BCE)
    else:
        option = made[0].group(2).strip()
        if option:
            named = re.fullmatch(r"ignore_index\s*=\s*(.+)", option)
            found = _ignored(model, named.group(1)) if named else None
            if found is None:
                return None
            ignore = found
        # The calls of the name while it is bound to the cross-entropy: classification
        # heads bind one name (loss_fct) to MSELoss, CrossEntropyLoss and
        # BCEWithLogitsLoss in turn, one per problem type, and call it in each branch.
        fn, scope = made[0].group(1), source[made[0].end():]
        rebound = re.search(rf"(?<![\w.]){fn}\s*=[^=]", scope)
        scope = scope[: rebound.start()] if rebound else scope
    calls = re.findall(rf"(?<![\w.]){re.escape(fn)}\((.*)\)\s*$", scope, re.M)
    if len(calls) != 1 or len(_arguments(calls[0])) != 2:
        return None
    name = _reshaped(_arguments(calls[0])[1])
    if name == "labels":
        return LossPlan("tokens", ignore=ignore)
    shifted = re.findall(rf"^[ \t]*{name}\s*=\s*labels\[(?:\.\.\.|:),\s*1:\](.*)$", source, re.M) if name else []
    if len(shifted) == 1 and _reshaped(f"x{shifted[0]}") == "x":
        return LossPlan("tokens", shift=True, ignore=ignore)
    return None


def _reshaped(expr: str) -> str | None:
    """The name ``expr`` reshapes alone (``labels.view(-1)``), or None: indexed
    (``labels.view(-1)[mask]``, BROS's, keeps some of them) or computed."""
    found = re.fullmatch(r"(\w+)((?:\.\w+\([^()]*\))*)", re.sub(r"\s+", "", expr))
    if found is None:
        return None
    if any(call not in _RESHAPES for call in re.findall(r"\.(\w+)\(", found.group(2))):
        return None
    return found.group(1)


# `name = (... * mask).sum() / mask.sum()`, the divisor maybe `(mask.sum() + eps)` (an eps
# far below a mask's count, as 1e-5 is: the weights stay exact to float precision), then
# maybe divided by a constant of the config or a number (the same on every replica).
_MASKED_MEAN = re.compile(
    r"^[ \t]*(\w+)\s*=\s*\((?:[^()]|\([^()]*\))*\*\s*([\w.]+)\s*\)\.sum\(\)\s*/\s*"
    r"(?:\(\s*\2\.sum\(\)\s*\+\s*[\d.eE+-]+\s*\)|\2\.sum\(\))"
    r"(?:\s*/\s*(?:self\.config\.\w+|[\d.]+))*[ \t]*(?:#.*)?$",
    re.M,
)


def _mask_argument(source: str, mask: str, parameters: set[str]) -> str | None:
    """The argument ``mask`` is made from by reshaping alone (``bool_masked_pos`` made
    into pixels), or None."""
    made = re.search(rf"^[ \t]*{re.escape(mask)}\s*=\s*", source, re.M)
    if made is None:
        return None
    text, depth = source[made.end():], 0
    end = len(text)
    for i, ch in enumerate(text):  # the expression: to the end of its line, outside brackets
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "\n" and depth <= 0:
            end = i
            break
    expr = re.sub(r"\s+", "", text[:end])
    if expr.startswith("(") and expr.endswith(")"):
        expr = expr[1:-1]
    first = re.match(r"\w+", expr)
    if first is None or first.group(0) not in parameters:
        return None
    calls = re.sub(r"\((?:[^()]|\([^()]*\))*\)", "()", expr[first.end():])
    if not re.fullmatch(r"(?:\.\w+\(\))*", calls):
        return None  # an operator or an index: not the argument's elements alone
    if any(name not in _RESHAPES for name in re.findall(r"\.(\w+)\(\)", calls)):
        return None
    return first.group(0)


def _masked_mean_plan(model: Any, given: Mapping[str, Any]) -> LossPlan | None:
    """The plan of a loss that is a mean over a mask (see the module doc), or None."""
    source = _source(type(model))
    found = list(_MASKED_MEAN.finditer(source))
    if len(found) != 1:
        return None
    loss, mask = found[0].groups()
    if "." in mask:
        return None  # an attribute of another module's output (PatchTST's): not traced
    after = source[found[0].end():]
    # A statement (indented no deeper than the mean's; a keyword argument, loss=loss, is
    # inside a call) that changes the loss after (another term added).
    indent = len(found[0].group(0)) - len(found[0].group(0).lstrip(" \t"))
    changed = rf"^[ \t]{{0,{indent}}}{loss}\s*[-+*/]?=[^=]"
    if re.search(changed, after, re.M) or not re.search(rf"\bloss\s*=\s*{loss}\b", after):
        return None  # or not the loss returned
    try:
        parameters = set(inspect.signature(inspect.unwrap(type(model).forward)).parameters)
    except (TypeError, ValueError):
        return None
    argument = _mask_argument(source, mask, parameters)
    if argument is not None:
        return LossPlan("masked", mask=argument) if isinstance(given.get(argument), Tensor) else None
    # Or a mask the forward returns as one of its fields (ViTMAE draws it there).
    field = re.search(rf"(\w+)\s*=\s*{mask}\s*[,)]", after)
    if field is None or field.group(1) in parameters:
        return None
    # (With return_dict=False the call is made with return_dict=True, the tuple after.)
    return LossPlan("masked", mask=field.group(1))


# Losses whose reduction="sum" adds one term per element: a sum over rows.
_SUMMED = frozenset({
    "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
    "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div",
})


# Loss modules that average their elements (or, CrossEntropyLoss, their counted targets)
# with reduction "mean", and what a call of one counts.
_MEAN_LOSSES = {
    "CrossEntropyLoss": "tokens", "BCEWithLogitsLoss": "elements", "BCELoss": "elements",
    "MSELoss": "elements", "L1Loss": "elements", "SmoothL1Loss": "elements",
}
COMPARE = {"==": torch.eq, "!=": torch.ne, ">=": torch.ge, ">": torch.gt, "<=": torch.le, "<": torch.lt}


def _split_top(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` outside brackets."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += (ch in "([{") - (ch in ")]}")
        if ch == sep and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    return [*parts, current.strip()]


def _bindings(source: str, name: str, model: Any, given: Mapping[str, Any], before: int | None = None) -> list[tuple[int, str]]:
    """The statements that bind ``name`` to more than None and may run for this call
    (before line ``before``, if given): their line and value (``a = b = None`` and a
    keyword argument, ``loss=loss,``, are not ones)."""
    found = []
    for m in re.finditer(rf"^[ \t]*(?:\w+\s*=\s*)*{name}\s*=(?!=)\s*", source, re.M):
        row = source.count("\n", 0, m.start())
        value = " ".join(_expression(source[m.end():]).split())
        if re.fullmatch(r"(?:\w+\s*=\s*)*None", value) or value.endswith(",") or len(_split_top(value, ",")) > 1:
            continue  # (or keyword arguments on one line: loss=loss, logits=logits)
        if (before is None or row < before) and _may_run(source, row, model, given):
            found.append((row, value))
    return found


def _weight(model: Any, factors: list[str]) -> float | None:
    """The product of a term's constant factors: numbers and the model's attributes."""
    weight = 1.0
    for factor in factors:
        number: Any = None
        if re.fullmatch(r"self(?:\.\w+)+", factor):
            number = _attribute(model, factor)
        elif re.fullmatch(r"\d+(?:\.\d*)?(?:[eE][-+]?\d+)?", factor):
            number = float(factor)
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            return None
        weight *= number
    return weight


def _selection(source: str, name: str, row: int, model: Any, given: Mapping[str, Any], parameters: set[str]) -> tuple[str, str, float] | None:
    """What ``name`` selects, bound before line ``row`` to a comparison of an argument's
    elements with a number (``attention_mask.view(-1, n) == 1``, ``(labels >= 0).nonzero()``):
    the argument, the comparison and the number; None if not that."""
    bound = _bindings(source, name, model, given, row)
    if len(bound) != 1:
        return None
    value = re.sub(r"\.nonzero\(\)$", "", bound[0][1].replace(" ", ""))
    value = value[1:-1] if value.startswith("(") and value.endswith(")") else value
    found = re.fullmatch(r"(.+?)(==|!=|>=|<=|>|<)(-?\d+(?:\.\d*)?)", value)
    if found is None or _reshaped(found.group(1)) not in parameters:
        return None
    return _reshaped(found.group(1)), found.group(2), float(found.group(3))  # type: ignore[return-value]


def _target_plan(
    source: str, expr: str, row: int, counts: str, model: Any, given: Mapping[str, Any], ignore: int
) -> LossPlan | None:
    """The plan of a mean loss (``counts``: ``"tokens"`` its targets other than ``ignore``,
    ``"elements"`` all its elements) whose target is ``expr``, on line ``row``."""
    try:
        parameters = set(inspect.signature(inspect.unwrap(type(model).forward)).parameters)
    except (TypeError, ValueError):
        return None
    name = _reshaped(expr)
    if name is None:
        return None
    selected, indexed = None, name  # what is selected, and from which tensor
    # Not given (an argument, or one taken from **kwargs), made in the forward from the
    # labels: labels[:, 1:], shifted (BLIP's text decoder).
    made = [v for _, v in _bindings(source, name, model, given, row) if _reshaped(v) != name
            and not re.fullmatch(rf"kwargs\.pop\(\s*[\"']{name}[\"']\s*,\s*None\s*\)", v)]
    shifted = len(made) == 1 and re.fullmatch(r"labels\[(?:\.\.\.|:),1:\](?:\.contiguous\(\))?", made[0].replace(" ", ""))
    if shifted and not isinstance(given.get(name), Tensor):
        if counts != "tokens" or not isinstance(given.get("labels"), Tensor):
            return None
        return LossPlan("tokens", shift=True, ignore=ignore)
    if name in parameters and not isinstance(given.get(name), Tensor):
        return None
    if name in parameters:
        for _, value in _bindings(source, name, model, given, row):  # the forward changes it
            if _reshaped(value) == name:
                continue
            taken = re.fullmatch(rf"(?:torch\.gather\({name},\s*0,\s*|{name}\[)(\w+)(?:\.view\(-1\))?[)\]]",
                                 value.replace(" ", ""))
            if taken is None or selected is not None:
                return None
            selected = _selection(source, taken.group(1), row, model, given, parameters)
            if selected is None:
                return None
    else:
        bound = _bindings(source, name, model, given, row)
        if len(bound) != 1:
            return None
        value = bound[0][1].replace(" ", "")
        taken = re.fullmatch(r"(\w+)\[(\w+)\]", value)
        if taken is not None and taken.group(1) in parameters and isinstance(given.get(taken.group(1)), Tensor):
            indexed = taken.group(1)
            selected = _selection(source, taken.group(2), row, model, given, parameters)
            if selected is None:
                return None
        elif (counts == "elements" and re.fullmatch(r".+\.(?:reshape|view)\(batch_size,[^()]*\)", value)
              and re.search(r"^[ \t]*batch_size\s*(?:,\s*\w+\s*)*=\s*\w+\.shape\s*$", source, re.M)):
            # One equal block per row (VideoMAE's masked patches, as many in every row):
            # a mean over the rows.
            return LossPlan("mean")
        else:
            return None
    if selected is not None:
        argument, op, number = selected
        # A cross-entropy counts its targets other than ignore_index: the selection must be
        # of the targets themselves, with none of them ignored (labels >= 0).
        excludes = (op == ">=" and number > ignore) or (op == ">" and number >= ignore)
        if counts == "tokens" and not (argument == indexed and excludes):
            return None
        return LossPlan("masked", mask=argument, where=(op, number))
    if counts == "tokens":  # its targets other than ignore_index
        return LossPlan("tokens", ignore=ignore) if name == "labels" else LossPlan("masked", mask=name, where=("!=", ignore))
    return LossPlan("mean")  # a given argument, batch-first: as many elements per row


def _call_plan(source: str, call: str, row: int, model: Any, given: Mapping[str, Any]) -> LossPlan | None:
    """The plan of one loss call ``fn(input, target)`` on line ``row``."""
    called = re.fullmatch(r"([\w.]+)\((.*)\)", call)
    if called is None:
        return None
    fn, arguments = called.group(1), _arguments(called.group(2))
    functional = re.fullmatch(r"(?:torch\.)?(?:nn\.)?(?:functional\.|F\.)(\w+)", fn)
    if functional is not None:  # reduction="sum": one term per element, a sum over rows
        if functional.group(1) in _SUMMED and any(
                re.fullmatch(r"reduction\s*=\s*[\"']sum[\"']", a) for a in arguments):
            return LossPlan("sum")
        return None
    if len(arguments) != 2 or "=" in arguments[1]:
        return None
    if fn.startswith("self."):
        module = _attribute(model, fn)
        kind = type(module).__name__ if isinstance(module, torch.nn.Module) else None
        if kind not in _MEAN_LOSSES or getattr(module, "reduction", None) != "mean":
            return None
        if getattr(module, "weight", None) is not None or getattr(module, "pos_weight", None) is not None:
            return None
        return _target_plan(source, arguments[1], row, _MEAN_LOSSES[kind], model, given,  # type: ignore[index]
                            int(getattr(module, "ignore_index", -100)))
    made = _bindings(source, fn, model, given, row)
    if not made:
        return None
    value = made[-1][1]  # the binding in force at the call
    loss = re.fullmatch(r"(?:torch\.)?(?:nn\.)?(\w+)\((.*)\)", value)
    if loss is None or loss.group(1) not in _MEAN_LOSSES:
        return None
    ignore = -100
    for option in _arguments(loss.group(2)):
        key, _, text = (part.strip() for part in option.partition("="))
        if key == "ignore_index" and loss.group(1) == "CrossEntropyLoss":
            found = _ignored(model, text)
            if found is None:
                return None
            ignore = found
        elif key == "reduction":
            chosen = given.get(text, _default(model, text)) if re.fullmatch(r"\w+", text) else text.strip("\"'")
            if chosen != "mean":
                return None
        elif key != "label_smoothing" or loss.group(1) != "CrossEntropyLoss":
            return None  # weights: not a plain mean (label smoothing averages per target alike)
    return _target_plan(source, arguments[1], row, _MEAN_LOSSES[loss.group(1)], model, given, ignore)


def _child_plan(model: Any, given: Mapping[str, Any], source: str, output: str) -> LossPlan | None:
    """The plan of a loss that is a child model's (``loss=outputs.loss``, ``outputs =
    self.text_decoder(..., labels=labels, reduction="mean")``: BLIP's captioning): the
    child's plan for the arguments it is given, where it counts the same ``labels``."""
    bound = _bindings(source, output, model, given)
    if len(bound) != 1:
        return None
    called = re.fullmatch(r"(self\.\w+)\((.*)\)", bound[0][1])
    child = _attribute(model, called.group(1)) if called else _MISSING
    if called is None or not isinstance(child, torch.nn.Module):
        return None
    passed: dict[str, Any] = {}
    for argument in _arguments(called.group(2)):
        named = re.fullmatch(r"(\w+)\s*=\s*(.+)", argument)
        if named is None:
            continue  # positional (**kwargs, the caller's own): not told
        key, value = named.groups()
        if value in given:
            passed[key] = given[value]
        elif re.fullmatch(r"\"\w*\"|'\w*'", value):
            passed[key] = value[1:-1]
    if passed.get("labels") is None or passed["labels"] is not given.get("labels"):
        return None
    plan = loss_plan(child, (), passed)
    if plan is None or plan.count is not None or plan.mode not in ("tokens", "mean", "sum"):
        return None  # (a count would have to reach the child: not told)
    return LossPlan(plan.mode, shift=plan.shift, ignore=plan.ignore)


def _terms_plan(model: Any, given: Mapping[str, Any]) -> LossPlan | None:
    """The plan of a loss the forward computes from loss calls (see the module doc): one
    ``loss = ...`` that may run for this call, a sum of weighted terms, each a loss call
    or a name bound to one, all joined alike (a term weighed 0 left out)."""
    source = _source(type(model))
    name = "loss"
    if not _bindings(source, name, model, given):
        returned = re.findall(r"\bloss=(\w+(?:\.loss)?)\s*[,)]", source)  # loss=lm_loss, loss=outputs.loss
        if len(set(returned)) != 1:
            return None
        if returned[0].endswith(".loss"):
            return _child_plan(model, given, source, returned[0][: -len(".loss")])
        name = returned[0]
    changed = (m.start() for m in re.finditer(rf"^[ \t]*{name}\s*[-+*/]=", source, re.M))
    if _adds_terms(model, given) or any(_may_run(source, source.count("\n", 0, i), model, given) for i in changed):
        return None  # another term added to it
    bound = [b for b in _bindings(source, name, model, given)
             if not re.fullmatch(r"torch\.tensor\(0(?:\.0)?\)(?:\.to\(\w+\))?", b[1])]
    # (A zero tensor is the loss where nothing counts: DeBERTa's, with no labels >= 0; its
    # replica's weight is 0 in a plan that weighs by counts.)
    if len(bound) != 1:
        return None
    row, value = bound[0]
    plans, terms = set(), []
    for term in _split_top(value, "+"):
        factors = _split_top(term, "*")
        calls = [f for f in factors if re.fullmatch(r"[\w.]+(?:\(.*\))?", f) and not re.fullmatch(r"self\.[\w.]+|[\d.]+", f)]
        weight = _weight(model, [f for f in factors if f not in calls])
        if len(calls) != 1 or weight is None:
            return None
        if weight == 0:
            continue  # a term weighed 0 adds nothing
        call, at = calls[0], row
        if re.fullmatch(r"\w+", call):
            made = _bindings(source, call, model, given, row)
            if len(made) != 1:
                return None
            terms.append(call)
            at, call = made[0]
        plan = _call_plan(source, call, at, model, given)
        if plan is None:
            return None
        plans.add(plan)
    if len(plans) != 1:
        return None
    plan = plans.pop()
    return LossPlan(plan.mode, plan.count, plan.shift, plan.ignore, plan.mask, tuple(terms), plan.where)


def _expression(text: str) -> str:
    """The expression ``text`` starts with: to the end of its line, outside brackets."""
    depth = 0
    for i, ch in enumerate(text):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "\n" and depth <= 0:
            return text[:i]
    return text


def _updates(source: str) -> list[int]:
    """The lines where the forward changes the loss it computed: ``loss += ...``, or
    ``loss = ...`` of an expression of ``loss`` and more (``loss + aux_loss``,
    ``(1 - w) * loss + w * diffusion_loss``, ``router_loss if loss is None else loss +
    router_loss``); statements only, read with Python's tokenizer (not ``loss=loss``,
    a keyword argument, nor text in strings)."""
    text = textwrap.dedent(source)
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError):
        return []
    lines, found, depth = text.splitlines(keepends=True), [], 0
    starts = (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.COMMENT)
    for i, tok in enumerate(tokens[:-1]):
        if tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
        after = tokens[i + 1]
        if (depth or tok.string != "loss" or tok.type != tokenize.NAME or (i and tokens[i - 1].type not in starts)
                or after.type != tokenize.OP or after.string not in ("=", "+=", "-=", "*=", "/=")):
            continue
        row, col = after.end
        value = " ".join(_expression("".join(lines[row - 1 :])[col:]).split())
        if after.string != "=" or (re.search(r"(?<![\w.])loss(?!\w)", value) and _reshaped(value) != "loss"):
            found.append(tok.start[0] - 1)
    return found


_MISSING = object()


def _attribute(model: Any, path: str) -> Any:
    """``model``'s attribute at ``self.a.b`` (``_MISSING`` if it has none)."""
    value = model
    for part in path.split(".")[1:]:
        value = getattr(value, part, _MISSING)
        if value is _MISSING:
            break
    return value


def _default(model: Any, name: str) -> Any:
    """The value the forward takes for its argument ``name`` when not given: the
    signature's default, else its fallback (``x if x is not None else self.config.x``),
    else its config's ``name`` (filled in by a decorator), else the signature's None
    (``_MISSING`` if not told)."""
    try:
        parameter = inspect.signature(inspect.unwrap(type(model).forward)).parameters.get(name)
    except (TypeError, ValueError):
        parameter = None
    if parameter is not None and parameter.default not in (None, inspect.Parameter.empty):
        return parameter.default
    fallback = re.search(rf"\b{name}\s+if\s+{name}\s+is\s+not\s+None\s+else\s+(self\.[\w.]+)", _source(type(model)))
    if fallback is not None:
        return _attribute(model, fallback.group(1))
    value = getattr(getattr(model, "config", None), name, _MISSING)
    if value is _MISSING and parameter is not None and parameter.default is None:
        return None
    return value


def _truth(atom: str, model: Any, given: Mapping[str, Any]) -> bool | None:
    """The value of one condition of the forward (``labels is not None``,
    ``output_router_logits``, ``self.z_loss_coefficient > 0``), or None if unknown."""
    atom = atom.strip().strip("()").strip()
    if atom.startswith("not "):
        value = _truth(atom[4:], model, given)
        return None if value is None else not value
    compared = re.fullmatch(r"([\w.]+|\w+\.(?:dim\(\)|size\(-?\d+\)|shape\[-?\d+\]))\s*"
                            r"(is not|is|>=|<=|==|!=|>|<)\s*(None|-?\d+(?:\.\d+)?|\"\w+\"|'\w+')", atom)
    name = compared.group(1) if compared else atom
    shaped = re.fullmatch(r"(\w+)\.(?:(dim)\(\)|size\((-?\d+)\)|shape\[(-?\d+)\])", name)
    if shaped is not None and compared is not None:  # a given tensor's dims or size: labels.dim() == 1
        tensor = given.get(shaped.group(1))
        if not isinstance(tensor, Tensor):
            return None
        axis = shaped.group(3) or shaped.group(4)
        if axis is not None and (not -tensor.dim() <= int(axis) < tensor.dim() or int(axis) % tensor.dim() == 0):
            return None  # (the batch dim: a replica's share has another size)
        size = tensor.dim() if shaped.group(2) else tensor.shape[int(axis)]  # type: ignore[arg-type]
        return _truth(f"x {compared.group(2)} {compared.group(3)}", model, {"x": size})
    if not re.fullmatch(r"[\w.]+", name) or (re.match(r"\w+\.", name) and not name.startswith("self.")):
        return None
    if name.startswith("self."):
        value = _attribute(model, name)
    elif given.get(name) is not None or name == "labels":
        value = given.get(name)
    else:
        value = _default(model, name)
    if value is _MISSING:
        return None
    if compared is None:
        return None if isinstance(value, Tensor) else bool(value)
    op, other = compared.group(2), compared.group(3)
    if other == "None":
        if op in ("is", "is not", "==", "!="):
            return (value is None) == (op in ("is", "=="))
        return None
    if other[0] in "\"'":  # a string: problem_type == "regression"
        return (value == other[1:-1]) == (op == "==") if op in ("==", "!=") else None
    if op in ("is", "is not") or not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    number = float(other)
    return {">": value > number, "<": value < number, ">=": value >= number, "<=": value <= number,
            "==": value == number, "!=": value != number}[op]


def _holds(lines: list[str], k: int, model: Any, given: Mapping[str, Any]) -> bool | None:
    """The value of the condition of the ``if`` or ``elif`` on line ``k`` for this call
    (over several lines when bracketed: ``if (\n a\n and b\n):``), None if unknown."""
    head = re.match(r"(?:el)?if\b(.*)", lines[k].strip())
    if head is None:
        return None
    condition = " ".join(_expression("\n".join([head.group(1), *lines[k + 1 :]])).split())
    condition = re.sub(r":\s*(?:#.*)?$", "", condition).strip()
    if condition.startswith("(") and condition.endswith(")"):
        condition = condition[1:-1].strip()
    if re.search(r"\bor\b", condition):
        if re.search(r"\band\b", condition):
            return None
        values = [_truth(atom, model, given) for atom in re.split(r"\s+or\s+", condition)]
        return True if True in values else (False if all(v is False for v in values) else None)
    values = [_truth(atom, model, given) for atom in re.split(r"\s+and\s+", condition)]
    return False if False in values else (True if all(values) else None)


def _may_run(source: str, row: int, model: Any, given: Mapping[str, Any]) -> bool:
    """Whether the statement on line ``row`` (from 0) of ``source`` may run for this call:
    no ``if`` that encloses it is false, and no ``if`` or ``elif`` before the ``elif`` or
    ``else`` that encloses it is true (an unknown condition may go either way)."""
    lines = source.splitlines()
    indent = len(lines[row]) - len(lines[row].lstrip())
    for k in range(row - 1, -1, -1):
        line = lines[k]
        text = line.strip()
        depth = len(line) - len(line.lstrip())
        if not text or text[0] in "#)]}" or depth >= indent:
            continue  # inside the block, or a bracket closing a line above
        indent = depth  # the statement that encloses the block: if, for, with, ...
        kind = re.match(r"(if|elif|else|def)\b", text)
        if kind is None:
            continue  # for, with, try: no condition
        if kind.group(1) == "def":
            break
        if kind.group(1) in ("if", "elif") and _holds(lines, k, model, given) is False:
            return False
        if kind.group(1) == "if":
            continue
        # An elif or else runs only where every if and elif before it in the chain is false.
        for j in range(k - 1, -1, -1):
            above = lines[j]
            if not above.strip() or above.strip()[0] in "#)]}" or len(above) - len(above.lstrip()) != depth:
                continue  # a deeper line of a block of the chain, or a bracket closing a condition
            sibling = re.match(r"(if|elif)\b", above.strip())
            if sibling is None:
                break  # the chain's own blocks are deeper; another statement ends the search
            if _holds(lines, j, model, given) is True:
                return False
            if sibling.group(1) == "if":
                break
    return True


def _adds_terms(model: Any, given: Mapping[str, Any]) -> bool:
    """Whether this call's loss adds a term to the loss it computes (a router's
    auxiliary loss on each replica's tokens, a z-loss over its rows): a statement that
    does and may run for this call."""
    source = _source(type(model))
    return any(_may_run(source, row, model, given) for row in _updates(source))


def loss_plan(model: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> LossPlan | None:
    """How the losses of one ``model.forward(*args, **kwargs)`` call join, or None.

    None when the call has no ``labels`` (no plan needed) or its loss is not one
    dpmethods can identify (see the module doc). A wrapper that hands the call on to a
    transformers model (a peft ``PeftModel``) gets that model's plan.

    Example:
        >>> import torch
        >>> loss_plan(torch.nn.Linear(2, 2), (), {"labels": torch.zeros(2)}) is None
        True
        >>> loss_plan(torch.nn.Linear(2, 2), (), {"labels": torch.zeros(2), "num_items_in_batch": 5}) is None
        True
    """
    model, args, kwargs = forward_call(model, args, kwargs)
    given = bound_arguments(model.forward, args, kwargs)
    labels = given.get("labels")
    # The caller's num_items_in_batch (the Trainer's) reaches a loss only through the
    # **kwargs handed to transformers' loss_function: a loss the forward computes itself
    # (BertForMaskedLM's, T5's) ignores it and is a mean on each replica.
    counts = given.get("num_items_in_batch") is not None and _passes_kwargs_to_loss(type(model))
    if not isinstance(labels, Tensor):
        # Question answering: a mean of two means, weighted per call (see spans), or
        # with the caller's count, shares of the full loss.
        if is_span_loss(model, _source(type(model)), given):
            return LossPlan("sum") if counts else LossPlan("spans")
        return _masked_mean_plan(model, given) or _terms_plan(model, given)
    if _adds_terms(model, given):
        return None  # another term (a router's load-balancing loss): neither a sum nor a mean
    ignore = int(given.get("ignore_index", -100))
    plan = None
    if _passes_kwargs_to_loss(type(model)):
        plan = _loss_function_plan(model, given, labels, ignore, shares=True)
        if plan is not None and plan.mode == "sum" and counts:
            plan = LossPlan("sum")  # the caller's count, every replica given it: shares of its loss
    elif "self.loss_function(" in _source(type(model)):
        # Called without **kwargs (Llama's classification heads), so without
        # num_items_in_batch: each replica's loss is a mean over its counted labels.
        plan = _loss_function_plan(model, {}, labels, ignore, shares=False)
    plan = plan if plan is not None else _direct_plan(model, labels, given)
    return plan if plan is not None else _terms_plan(model, given)
