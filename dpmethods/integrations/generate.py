"""The ``"generate"`` gather: Hugging Face ``generate`` outputs joined as one device returns them.

Each replica's ``generate`` loop stops when *its own* rows are finished, so replicas
return sequences of different lengths, per-step tuples (``scores``, ``logits``,
attentions, hidden states) with different numbers of steps, and ``beam_indices`` that
index their own rows. On one device the loop runs until every row is finished, and
transformers fills the finished rows with a token that depends on the decoding:

- greedy search and sampling fill with ``pad_token_id`` (``eos_token_id[0]`` when no pad
  id is set): ``next_tokens * unfinished + pad_token_id * (1 - unfinished)``;
- beam search fills with ``pad_token_id or eos_token_id[0]`` (so a pad id of 0 gives
  eos), and with -1 when there is no eos id. Whisper's own ``generate`` keeps that fill.

:func:`gather_generate` pads each replica's output exactly so, offsets ``beam_indices``
to the full batch and pads the per-step tuples, so that ``sequences`` equal one
device's token for token and ``model.compute_transition_scores`` works on the result.
Padded steps of ``scores`` and ``logits`` are those of a forced fill token (0 for it,
``-inf`` for every other token, as transformers' forced-token processors write them), so
their transition scores are 0; padded attentions and hidden states are zeros. A cache
returned with the output is joined by dpmethods' type rules when the replicas' caches
have the same length; otherwise it comes back as a list of per-replica caches, with a
one-time warning.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from dpmethods.core.scatter import DeviceLike, _as_device
from dpmethods.types import rules as _type_rules  # noqa: F401  (installs the shipped Cache rules)
from dpmethods.types import tree as _tree

__all__ = ["gather_generate"]

# Fields of transformers' GenerateOutput types that hold one entry per generated step.
_STEP_FIELDS = (
    "scores", "logits", "attentions", "hidden_states",
    "decoder_attentions", "cross_attentions", "decoder_hidden_states",
)
_SCORE_FIELDS = ("scores", "logits")
_CACHE_FIELDS = ("cache", "past_key_values")
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=4)


def _fields(out: Any) -> dict[str, Any] | None:
    """The fields of a generate output (a ModelOutput dataclass or a dict), or None."""
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}
    if isinstance(out, Mapping):
        return dict(out)
    return None


def _rebuild(template: Any, fields: dict[str, Any]) -> Any:
    cls: Any = type(template)
    if isinstance(template, Mapping) and not dataclasses.is_dataclass(template):
        return fields if cls is dict else cls(fields)
    return cls(**fields)


def _pad_width(t: Tensor, width: int, value: int | None, what: str) -> Tensor:
    if t.shape[-1] == width:
        return t
    if value is None:
        raise ValueError(
            f"gather_generate: {what}: replicas returned lengths that differ, but the fill "
            "token is unknown (no pad_token_id and no eos_token_id); pass fill_token_id="
        )
    pad = t.new_full((*t.shape[:-1], width - t.shape[-1]), value)
    return torch.cat([t, pad], dim=-1)


def _filler_step(template: Any, rows: int, field: str, fill: int | None) -> Any:
    spec, leaves = _tree.flatten(template)
    made = []
    for leaf in leaves:
        if not isinstance(leaf, Tensor):
            made.append(leaf)
            continue
        shape = (rows, *leaf.shape[1:])
        if field in _SCORE_FIELDS:
            # A forced fill token: 0 for it, -inf for the others (its log-prob is 0).
            t = torch.full(shape, float("-inf"), dtype=leaf.dtype, device=leaf.device)
            if fill is not None and 0 <= fill < shape[-1]:
                t[..., fill] = 0
        else:
            t = torch.zeros(shape, dtype=leaf.dtype, device=leaf.device)
        made.append(t)
    return _tree.unflatten(spec, made)


def _rows(step: Any) -> int:
    for leaf in _tree.flatten(step)[1]:
        if isinstance(leaf, Tensor) and leaf.dim():
            return int(leaf.shape[0])
    return 0  # a step without tensors (attentions a fused kernel does not return)


def _seq_length(cache: Any) -> Any:
    get = getattr(cache, "get_seq_length", None)
    return get() if callable(get) else None


def gather_generate(
    outputs: Sequence[Any],
    target_device: DeviceLike,
    *,
    fill_token_id: int | None,
    num_beams: int = 1,
    num_return_sequences: int = 1,
    trimmed_pad_id: int | None = None,
    max_new_tokens: int | None = None,
) -> Any:
    """Join the replicas' ``generate`` outputs as one call on the whole batch returns them.

    Used by the gather mode ``"generate"``, which finds ``fill_token_id`` and
    ``num_beams`` from the call (its kwargs, its ``generation_config`` and the model's).

    Args:
        outputs: one ``generate`` output per replica: a tensor of token ids, or a
            ``GenerateOutput`` (``GenerateDecoderOnlyOutput``, ``GenerateBeam*Output``...)
            or a dict with ``sequences``.
        target_device: where the result goes.
        fill_token_id: the token that fills finished sequences (see the module doc).
        num_beams: the beams per batch item, to offset ``beam_indices``.
        num_return_sequences: the sequences returned per batch item.
        trimmed_pad_id: set when the model trimmed each finished row's last
            ``fill_token_id`` (eos) and right-padded its rows with this id (Whisper's
            beam search with one eos id): shorter outputs are filled with eos up to the
            length of the longest output's finished rows, then with this id.
        max_new_tokens: the most tokens a row may generate, with ``trimmed_pad_id``.

    Example:
        >>> import torch
        >>> a, b = torch.tensor([[5, 6, 2]]), torch.tensor([[7, 2]])
        >>> gather_generate([a, b], "cpu", fill_token_id=0).tolist()
        [[5, 6, 2], [7, 2, 0]]
    """
    outputs = list(outputs)
    if not outputs:
        raise ValueError("gather_generate: outputs: expected at least one replica output, got none")
    device = _as_device(target_device)
    if all(isinstance(o, Tensor) for o in outputs):
        width = max(o.shape[-1] for o in outputs)
        if trimmed_pad_id is not None and fill_token_id is not None:
            outputs = _pad_trimmed(outputs, width, fill_token_id, trimmed_pad_id, max_new_tokens)
        padded = [_pad_width(o, width, fill_token_id, "sequences") for o in outputs]
        return torch.cat([p.to(device) for p in padded], dim=0)
    per = [_fields(o) for o in outputs]
    if any(f is None or "sequences" not in f for f in per):
        raise TypeError(
            "gather_generate: outputs: expected tensors or generate outputs with `sequences`, "
            f"got {[type(o).__name__ for o in outputs]}"
        )
    fields: list[dict[str, Any]] = per  # type: ignore[assignment]
    joined: dict[str, Any] = {}
    width = max(f["sequences"].shape[-1] for f in fields)
    seqs = [_pad_width(f["sequences"], width, fill_token_id, "sequences") for f in fields]
    joined["sequences"] = torch.cat([s.to(device) for s in seqs], dim=0)

    if fields[0].get("beam_indices") is not None:
        offset, parts = 0, []
        bwidth = max(f["beam_indices"].shape[-1] for f in fields)
        for f in fields:
            bi = f["beam_indices"]
            # The rows beam search ran for this replica: its batch items times the beams.
            rows = f["sequences"].shape[0] // num_return_sequences * num_beams
            shifted = torch.where(bi >= 0, bi + offset, bi)
            parts.append(_pad_width(shifted, bwidth, -1, "beam_indices").to(device))
            offset += rows
        joined["beam_indices"] = torch.cat(parts, dim=0)

    for name in _STEP_FIELDS:
        steps = [f.get(name) for f in fields]
        if all(s is None for s in steps):
            continue
        if any(s is None for s in steps):
            raise ValueError(f"gather_generate: {name}: present on some replicas only")
        total = max(len(s) for s in steps)  # type: ignore[arg-type]
        longest = max(steps, key=len)  # type: ignore[arg-type]
        filled = []
        for s in steps:
            s = tuple(s)  # type: ignore[arg-type]
            if len(s) < total:
                rows = _rows(s[0]) if s else 0
                s = s + tuple(
                    _filler_step(longest[t], rows, name, fill_token_id)  # type: ignore[index]
                    for t in range(len(s), total)
                )
            filled.append(s)
        joined[name] = tuple(_gather_cat([s[t] for s in filled], device) for t in range(total))

    for name in _CACHE_FIELDS:
        caches = [f.get(name) for f in fields]
        if all(c is None for c in caches):
            continue
        lengths = [_seq_length(c) for c in caches]
        if len(set(map(repr, lengths))) > 1:
            _warn_once(
                name,
                f"gather_generate: {name}: the replicas stopped at different steps, so their "
                f"caches hold {lengths} positions; {name} is returned as a list of "
                "per-replica caches (a joined cache would not be the one-device cache)",
            )
            joined[name] = list(caches)
        else:
            joined[name] = _gather_cat(caches, device)

    rest = [{k: v for k, v in f.items() if k not in joined} for f in fields]
    joined.update(_gather_cat(rest, device))
    first = fields[0]
    return _rebuild(outputs[0], {k: joined.get(k) for k in first})


def _pad_trimmed(
    outputs: list[Tensor], width: int, eos: int, pad: int, steps: int | None
) -> list[Tensor]:
    """Shorter outputs filled as a model that trims one eos per row and pads with ``pad``.

    On one device every finished row runs to the batch's last step with eos fill, loses
    its last eos, and is padded with ``pad`` to the longest row. A replica that stopped
    earlier has only finished rows, one eos short each: they get eos up to the length of
    the longest output's finished rows, then ``pad``. ``steps`` is the most tokens a row
    may generate (``max_new_tokens``), if known.
    """
    longest = next(o for o in outputs if o.shape[-1] == width)
    if bool((longest[..., -1] == pad).any()) or (steps is not None and width >= steps):
        # Some row ran to the last step untrimmed (the others are padded after it), or
        # every row did (the longest output used all the steps): finished rows are one short.
        finished = width - 1
    else:  # every row of the longest output finished and was trimmed
        finished = width
    filled = [_pad_width(o, max(finished, o.shape[-1]), eos, "sequences") for o in outputs]
    return [_pad_width(o, width, pad, "sequences") for o in filled]


def _gather_cat(values: list[Any], device: torch.device) -> Any:
    from dpmethods.core.gather import gather

    return gather(values, device, 0, mode="cat")


# --- the fill token of a call ------------------------------------------------------


def _first(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, Tensor):
        value = value.flatten().tolist()
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return int(value)


def _generation_config(model: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """The generation config one ``model.generate(*args, **kwargs)`` call runs with."""
    given = dict(kwargs)
    try:
        bound = inspect.signature(model.generate).bind_partial(*args, **kwargs)
        given = dict(bound.arguments)
        given.update(given.pop("kwargs", {}) or {})
    except (TypeError, ValueError):
        pass
    config = given.pop("generation_config", None)
    prepare = getattr(model, "_prepare_generation_config", None)
    if callable(prepare):
        # transformers' own merge: kwargs > generation_config > model.generation_config.
        tensors = {k: v for k, v in given.items() if not isinstance(v, Tensor)}
        return prepare(config, **tensors)[0]
    import copy

    if config is None and getattr(model, "generation_config", None) is None:
        raise ValueError(
            f"gather: mode 'generate' joins the outputs of transformers' generate, but "
            f"{type(model).__name__} has no generation_config to read the pad and eos ids "
            "from; use gather='pad' with pad_value= for another generate"
        )
    config = copy.deepcopy(config if config is not None else model.generation_config)
    config.update(**given)
    return config


def _is_whisper(model: nn.Module) -> bool:
    module = sys.modules.get("transformers.models.whisper.generation_whisper")
    mixin = getattr(module, "WhisperGenerationMixin", None)
    return isinstance(mixin, type) and isinstance(model, mixin)


def _call_fill(
    model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """The keyword arguments of :func:`gather_generate` for one ``model.generate`` call."""
    config = _generation_config(model, args, kwargs)
    pad, eos = _first(config.pad_token_id), _first(config.eos_token_id)
    beams = int(getattr(config, "num_beams", 1) or 1)
    returns = int(config.num_return_sequences or 1)
    # Whisper repeats each item num_return_sequences times before its beam search, so
    # every returned sequence has num_beams rows of scores.
    whisper = _is_whisper(model)
    found: dict[str, Any] = {"num_beams": beams, "num_return_sequences": 1 if whisper else returns}
    if whisper and beams > 1 and isinstance(config.eos_token_id, int) and pad is not None:
        # Whisper's short-form output drops each row's last token when it is the (one)
        # eos id, then pads the rows with the pad id (generation_whisper: "remove eos
        # token", _pad_to_max_length).
        found["trimmed_pad_id"] = pad
        found["max_new_tokens"] = config.max_new_tokens
    fill: int | None
    if beams > 1:
        # transformers: `pad_token_id or eos_token_id[0] if eos_token_id is not None else -1`,
        # where an unset pad id has already become eos_token_id[0].
        fill = -1 if eos is None else (pad or eos)
    else:
        fill = pad if pad is not None else eos
    return {"fill_token_id": fill, **found}


def _gather_call(outputs: Sequence[Any], target_device: DeviceLike, call: Any) -> Any:
    """The gather mode ``"generate"`` inside a wrapper call (``call`` is its ``_Call``)."""
    fn = getattr(call, "fn", None)
    model = getattr(fn, "__self__", None)
    if not isinstance(model, nn.Module):
        raise ValueError(
            "gather: mode 'generate' needs the model and the arguments of the generate call; "
            "outside a DataParallel call use dpmethods.gather_generate(outputs, device, "
            "fill_token_id=...)"
        )
    return gather_generate(outputs, target_device, **_call_fill(model, call.args, call.kwargs))
