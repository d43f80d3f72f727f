"""transformers' calling conventions that a plain split and join would get wrong.

The built-in rule of :mod:`dpmethods.integrations.known_methods` gives every ``PreTrainedModel``'s
``forward`` (and ``generate``) these per-call steps:

- **Losses as transformers joins them.** A loss averaged over the tokens that count
  (labels other than -100, shifted by one for causal LMs) weights replicas by their
  tokens, not their rows. transformers' own mechanism is ``num_items_in_batch``: each
  replica is given the full batch's count, so its loss is its share of the full-batch
  loss, and the shares are summed. A model's configured reduction is followed (CTC's
  ``ctc_loss_reduction``). A model whose loss does not take ``num_items_in_batch``
  keeps the per-replica losses, with a one-time warning.
- **Caches passed in are updated in place**, as on one device (see
  :mod:`dpmethods.integrations.known_caches`).
- **Images given as patches of all images** (the Qwen2-VL family's ``pixel_values``
  ``[patches, d]`` beside ``image_grid_thw`` ``[images, 3]``): each replica gets the
  patches and grid rows of its rows' images.

Example:
    >>> takes_vision_grids(object)
    False
"""

from __future__ import annotations

import inspect
import re
import sys
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dpmethods.core import call as _call
from dpmethods.warn_once import warn_once

__all__ = ["takes_vision_grids"]


def _class_in(module: str, name: str) -> type | None:
    cls = getattr(sys.modules.get(module), name, None)
    return cls if isinstance(cls, type) else None


def _current_call() -> Any:
    """The wrapper call in progress in this thread (its options, sizes and arguments)."""
    return _call._CURRENT.get()


def _model_of(call: Any) -> Any:
    model = getattr(call.fn, "__self__", None)
    if model is None:
        model = getattr(call.owner, "module", None)
    return getattr(model, "_orig_mod", model)  # through torch.compile's wrapper


def chain_around(*arounds: Any) -> Any:
    """One ``_around`` hook running ``arounds`` in order; their finishes run in reverse."""

    def around(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
        finishes = []
        for a in arounds:
            args, kwargs, finish = a(args, kwargs)
            if finish is not None:
                finishes.append(finish)
        if not finishes:
            return args, kwargs, None

        def finish_all(out: Any) -> Any:
            for f in reversed(finishes):
                out = f(out)
            return out

        return args, kwargs, finish_all

    return around


def chain_per_replica(*steps: Any) -> Any:
    """One ``_per_replica`` hook running ``steps`` in order."""

    def per_replica(args: tuple[Any, ...], kwargs: dict[str, Any], start: int) -> tuple[Any, Any]:
        for step in steps:
            args, kwargs = step(args, kwargs, start)
        return args, kwargs

    return per_replica


# --- losses: num_items_in_batch and the model's reduction ---------------------------


@dataclass(frozen=True)
class _LossPlan:
    """How the replicas' losses join into the full-batch loss."""

    mode: str  # the gather mode of "loss": "sum" or "mean"
    count: Tensor | None = None  # num_items_in_batch to give every replica, if any


_NO_PLAN = object()
_SOURCES: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()
_LOSS_CALL = re.compile(r"self\.loss_function\((?:[^()]|\([^()]*\))*\*\*kwargs", re.S)


def _passes_kwargs_to_loss(cls: type) -> bool:
    """Whether ``cls.forward`` takes ``**kwargs`` and hands them to ``self.loss_function``."""
    found = _SOURCES.get(cls)
    if found is None:
        forward = inspect.unwrap(cls.forward)  # type: ignore[attr-defined]
        try:
            takes = any(p.kind == p.VAR_KEYWORD for p in inspect.signature(forward).parameters.values())
            found = takes and _LOSS_CALL.search(inspect.getsource(forward)) is not None
        except (OSError, TypeError, ValueError):  # no source (compiled, built at runtime)
            found = False
        _SOURCES[cls] = found
    return found


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


def _counted(labels: Tensor, ignore: int) -> Tensor:
    return (labels != ignore).sum()


def _loss_plan(model: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> _LossPlan | None:
    """The plan for one forward call with ``labels``, or None (no labels, or unknown loss)."""
    given = _bound(model, args, kwargs)
    labels = given.get("labels")
    if not isinstance(labels, Tensor):
        return None
    if given.get("num_items_in_batch") is not None:
        return _LossPlan("sum")  # the caller's count (the Trainer's): shares of the full loss
    losses = sys.modules.get("transformers.loss.loss_utils")
    fn = getattr(model, "loss_function", None)
    passes = losses is not None and _passes_kwargs_to_loss(type(model))
    ignore = int(given.get("ignore_index", -100))
    plan = None
    if passes and fn is getattr(losses, "ForCausalLMLoss", None):
        shift = given.get("shift_labels")
        counted = shift if isinstance(shift, Tensor) else labels[..., 1:]
        plan = _LossPlan("sum", _counted(counted, ignore))
    elif passes and fn in (getattr(losses, "ForMaskedLMLoss", None), getattr(losses, "ForTokenClassification", None)):
        plan = _LossPlan("sum", _counted(labels, ignore))
    elif passes and fn is getattr(losses, "ForSequenceClassificationLoss", None):
        plan = _classification_plan(model, labels, ignore)
    elif passes and fn is getattr(losses, "ForCTCLoss", None):
        # CTC's own reductions: "sum" adds the rows' losses, "mean" averages them per row
        # (each divided by its target length), so a row-weighted mean is exact.
        reduction = getattr(model.config, "ctc_loss_reduction", "mean")
        plan = _LossPlan(reduction) if reduction in ("sum", "mean") else None
        if plan is None:
            return None  # "none": one loss per row, joined along the batch
    if plan is None:
        warn_once(
            f"DataParallel: {type(model).__name__}.forward computes its loss without "
            "num_items_in_batch, so dpmethods can't join the replicas' losses as the "
            "full-batch loss: it comes back as one value per replica. "
            "methods={'forward': {'gather': {'loss': 'mean'}}} weights them by rows, which "
            "is the full-batch loss only when every row counts as many tokens (no padding, "
            "no -100 labels); for the exact value compute the loss from the gathered logits."
        )
    return plan


def _classification_plan(model: Any, labels: Tensor, ignore: int) -> _LossPlan:
    # Regression and multi-label losses are means over rows (and labels): row-weighted.
    # Single-label cross-entropy takes num_items_in_batch (rows whose label counts).
    config = model.config
    problem = config.problem_type
    if problem is None and config.num_labels > 1 and labels.dtype in (torch.long, torch.int):
        problem = "single_label_classification"
    if problem == "single_label_classification":
        return _LossPlan("sum", _counted(labels, ignore))
    return _LossPlan("mean")


def _plan_of(call: Any) -> _LossPlan | None:
    """The call's loss plan, made once per call (its warning too)."""
    plan = call.__dict__.get("_dpm_loss_plan", _NO_PLAN)
    if plan is _NO_PLAN:
        plan = _loss_plan(_model_of(call), call.args, call.kwargs)
        call.__dict__["_dpm_loss_plan"] = plan
    return plan  # type: ignore[return-value]


def loss_per_replica(args: tuple[Any, ...], kwargs: dict[str, Any], start: int) -> tuple[Any, Any]:
    """``_per_replica``: every replica gets the full batch's ``num_items_in_batch``."""
    call = _current_call()
    if call is None or call.options.gather is not forward_gather:
        return args, kwargs  # the user's gather= wins: nothing to rescale for it
    plan = _plan_of(call)
    if plan is None or plan.count is None:
        return args, kwargs
    return args, {**kwargs, "num_items_in_batch": plan.count}


def forward_gather(outputs: list[Any], device: torch.device) -> Any:
    """The gather of a transformers ``forward``: ``"cat"``, with ``loss`` joined by plan."""
    from dpmethods.core.gather import gather

    call = _current_call()
    n = len(outputs)
    opts, sizes, weights = None, None, None
    if call is not None:
        opts = call.options
        sizes = call.sizes if len(call.sizes) == n else None
        weights = call.weights(n)
    plan = _plan_of(call) if call is not None and n > 1 else None
    dim = opts.dim if opts is not None else 0
    extra: dict[str, Any] = dict(
        weights=weights, sizes=sizes, gather_dim=opts.gather_dim if opts is not None else None,
        pad_value=opts.pad_value if opts is not None else 0,
    )
    per_image = _take_per_image(outputs, device) if n > 1 else {}
    if plan is None:
        out = gather(outputs, device, dim, **extra)
    elif type(outputs[0]) is tuple:  # return_dict=False: the loss comes first
        loss = gather([o[0] for o in outputs], device, dim, mode=plan.mode, weights=weights)
        rest = gather([o[1:] for o in outputs], device, dim, **extra)
        return (loss, *rest)
    else:
        out = gather(outputs, device, dim, mode={"loss": plan.mode}, **extra)
    for key, value in per_image.items():
        out[key] = value  # a ModelOutput: per-image outputs exist only with return_dict
    return out


_PER_IMAGE = ("image_outputs", "video_outputs")


def _take_per_image(outputs: list[Any], device: torch.device) -> dict[str, Any]:
    """Per-image outputs (a vision tower's, one entry per image) joined in image order.

    A replica holds its rows' images only, none for rows without images: they are
    taken out of the outputs (left ``None``) and joined apart.
    """
    from dpmethods.core.gather import gather

    taken: dict[str, Any] = {}
    for key in _PER_IMAGE:
        if not all(isinstance(o, Mapping) for o in outputs):
            break
        present = [o.get(key) for o in outputs if o.get(key) is not None]
        if not present:
            continue
        for o in outputs:
            if o.get(key) is not None:
                o[key] = None
        taken[key] = gather(present, device, 0, mode="extend")
    return taken


# --- the Qwen2-VL family: all images' patches in one tensor --------------------------

# (patches, grid rows, per-grid extras, the config's token id): pixel_values is
# [sum of patches, d], image_grid_thw [images, 3] (t, h, w per image); each image
# stands in its row's text as prod(t, h, w) / merge**2 tokens.
_VISION = (
    ("pixel_values", "image_grid_thw", (), "image_token_id"),
    ("pixel_values_videos", "video_grid_thw", ("second_per_grid_ts",), "video_token_id"),
)
VISION_ARGUMENTS = tuple(
    name for patches, grid, extra, _ in _VISION for name in (patches, grid, *extra)
)


def takes_vision_grids(cls: type) -> bool:
    """Whether ``cls.forward`` takes images as patches beside per-image grids."""
    try:
        return "image_grid_thw" in inspect.signature(cls.forward).parameters  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError):
        return False


def _input_ids(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    ids = kwargs.get("input_ids")
    if ids is None and args and isinstance(args[0], Tensor):
        ids = args[0]
    return ids


def _images_per_row(ids: Tensor, grid: Tensor, token: int, merge: int, what: str) -> list[int]:
    tokens = (grid.prod(-1) // merge**2).tolist()
    counts, image = [], 0
    for row, have in enumerate((ids == token).sum(-1).tolist()):
        start = image
        while have > 0 and image < len(tokens):
            have -= tokens[image]
            image += 1
        if have != 0:
            raise ValueError(
                f"DataParallel: {what}: row {row} of input_ids has image tokens that match no "
                f"run of the {len(tokens)} grids ({tokens} tokens each, in order); expected "
                "each row's images, in order, with prod(t, h, w) / merge_size**2 tokens each"
            )
        counts.append(image - start)
    return counts


def vision_per_replica(args: tuple[Any, ...], kwargs: dict[str, Any], start: int) -> tuple[Any, Any]:
    """``_per_replica``: a replica gets the patches and grid rows of its rows' images.

    The patches and grids reach every replica whole (``broadcast``); each replica keeps
    the images whose tokens are in its rows of ``input_ids``.
    """
    call = _current_call()
    mine = _input_ids(args, kwargs)
    if call is None or not isinstance(mine, Tensor):
        return args, kwargs
    model = _model_of(call)
    config = getattr(model, "config", None)
    full = _input_ids(call.args, call.kwargs)
    merge = getattr(getattr(config, "vision_config", None), "spatial_merge_size", None)
    kwargs = dict(kwargs)
    for patches, grid_name, extra, token_attr in _VISION:
        grid, token = kwargs.get(grid_name), getattr(config, token_attr, None)
        if not isinstance(grid, Tensor) or token is None or merge is None:
            continue
        counts = _images_per_row(full.to(grid.device), grid, int(token), int(merge), grid_name)
        first = sum(counts[:start])
        last = first + sum(counts[start : start + mine.shape[0]])
        sizes = grid.prod(-1)
        offset = int(sizes[:first].sum())
        kwargs[grid_name] = grid[first:last]
        if isinstance(kwargs.get(patches), Tensor):
            kwargs[patches] = kwargs[patches][offset : offset + int(sizes[first:last].sum())]
        for name in extra:
            if kwargs.get(name) is not None:
                kwargs[name] = kwargs[name][first:last]
    return args, kwargs
