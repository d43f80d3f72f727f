"""The ``"generate"`` gather: ``generate`` outputs joined as one device returns them.

Each replica's ``generate`` loop stops when *its own* rows are finished, so replicas
return sequences of different lengths, per-step tuples (``scores``, ``logits``,
attentions, hidden states) with different numbers of steps, and ``beam_indices`` that
index their own rows. On one device the loop runs until every row is finished, and
transformers fills the finished rows with a token that depends on the decoding:

- greedy search and sampling fill with ``pad_token_id`` (``eos_token_id[0]`` when no pad
  id is set);
- beam search fills with ``pad_token_id or eos_token_id[0]`` (so a pad id of 0 gives
  eos), and with -1 when there is no eos id. Whisper's own ``generate`` keeps that fill.

:func:`gather_generate` pads each replica's output exactly so, offsets ``beam_indices``
to the full batch and pads the per-step tuples, so that ``sequences`` equal one
device's token for token and ``model.compute_transition_scores`` works on the result.
Padded steps of ``scores`` and ``logits`` are those of a forced fill token (0 for it,
``-inf`` for every other token), so their transition scores are 0; padded attentions
and hidden states are zeros. A cache returned with the output is joined when the
replicas' caches have the same length; otherwise it comes back as a list of
per-replica caches, with a one-time warning.

The gather mode ``"generate"`` (registered here) finds the fill token from the call:
its keyword arguments, its ``generation_config`` and the model's (:mod:`.fill`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from dpmethods.extending import Call, gather, register_gather_mode, warn_once
from dpmethods.integrations.transformers.fill import call_fill, check_generate_call

__all__ = ["gather_generate"]

# Fields of transformers' GenerateOutput types that hold one entry per generated step.
_STEP_FIELDS = (
    "scores", "logits", "attentions", "hidden_states",
    "decoder_attentions", "cross_attentions", "decoder_hidden_states",
)
_SCORE_FIELDS = ("scores", "logits")
_CACHE_FIELDS = ("cache", "past_key_values")


def _device(target: Any) -> torch.device:
    return target if isinstance(target, torch.device) else torch.device(target)


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


def _map_tensors(obj: Any, fn: Callable[[Tensor], Any]) -> Any:
    """``obj`` (a tensor, or tuples and lists of them) with ``fn`` applied to each tensor."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_tensors(item, fn) for item in obj)
    return obj


def _tensors(obj: Any) -> list[Tensor]:
    found: list[Tensor] = []
    _map_tensors(obj, found.append)
    return found


def _filler_step(template: Any, rows: int, field: str, fill: int | None) -> Any:
    def make(leaf: Tensor) -> Tensor:
        shape = (rows, *leaf.shape[1:])
        if field not in _SCORE_FIELDS:
            return torch.zeros(shape, dtype=leaf.dtype, device=leaf.device)
        # A forced fill token: 0 for it, -inf for the others (its log-prob is 0).
        t = torch.full(shape, float("-inf"), dtype=leaf.dtype, device=leaf.device)
        if fill is not None and 0 <= fill < shape[-1]:
            t[..., fill] = 0
        return t

    return _map_tensors(template, make)


def _rows(step: Any) -> int:
    # 0 for a step without tensors (attentions a fused kernel does not return).
    return next((int(t.shape[0]) for t in _tensors(step) if t.dim()), 0)


def _seq_length(cache: Any) -> Any:
    get = getattr(cache, "get_seq_length", None)
    return get() if callable(get) else None


def _cat(values: list[Any], device: torch.device) -> Any:
    return gather(values, device, 0, mode="cat")


def gather_generate(
    outputs: Sequence[Any],
    target_device: Any,
    *,
    fill_token_id: int | None,
    num_beams: int = 1,
    num_return_sequences: int = 1,
    trimmed_pad_id: int | None = None,
    max_new_tokens: int | None = None,
) -> Any:
    """Join the replicas' ``generate`` outputs as one call on the whole batch returns them.

    The gather mode ``"generate"`` calls it with ``fill_token_id`` and ``num_beams``
    found from the call (its kwargs, its ``generation_config`` and the model's).

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
    device = _device(target_device)
    if all(isinstance(o, Tensor) for o in outputs):
        return _join_ids(outputs, device, fill_token_id, trimmed_pad_id, max_new_tokens)
    per = [_fields(o) for o in outputs]
    if any(f is None or "sequences" not in f for f in per):
        raise TypeError(
            "gather_generate: outputs: expected tensors or generate outputs with `sequences`, "
            f"got {[type(o).__name__ for o in outputs]}"
        )
    fields: list[dict[str, Any]] = per  # type: ignore[assignment]
    width = max(f["sequences"].shape[-1] for f in fields)
    seqs = [_pad_width(f["sequences"], width, fill_token_id, "sequences") for f in fields]
    joined: dict[str, Any] = {"sequences": torch.cat([s.to(device) for s in seqs], dim=0)}
    if fields[0].get("beam_indices") is not None:
        joined["beam_indices"] = _beam_indices(fields, device, num_beams, num_return_sequences)
    for name in _STEP_FIELDS:
        steps = _steps(fields, name, device, fill_token_id)
        if steps is not None:
            joined[name] = steps
    for name in _CACHE_FIELDS:
        caches = [f.get(name) for f in fields]
        if any(c is not None for c in caches):
            joined[name] = _caches(caches, name, device)
    rest = [{k: v for k, v in f.items() if k not in joined} for f in fields]
    joined.update(_cat(rest, device))
    return _rebuild(outputs[0], {k: joined.get(k) for k in fields[0]})


def _join_ids(
    outputs: list[Tensor], device: torch.device, fill: int | None, trimmed_pad: int | None,
    steps: int | None,
) -> Tensor:
    """The replicas' token ids, each padded to the longest as one device pads it."""
    width = max(o.shape[-1] for o in outputs)
    if trimmed_pad is not None and fill is not None:
        outputs = _pad_trimmed(outputs, width, fill, trimmed_pad, steps)
    padded = [_pad_width(o, width, fill, "sequences") for o in outputs]
    return torch.cat([p.to(device) for p in padded], dim=0)


def _beam_indices(
    fields: list[dict[str, Any]], device: torch.device, num_beams: int, returns: int
) -> Tensor:
    """Each replica's ``beam_indices`` offset by the beam rows of the replicas before it."""
    offset, parts = 0, []
    width = max(f["beam_indices"].shape[-1] for f in fields)
    for f in fields:
        bi = f["beam_indices"]
        shifted = torch.where(bi >= 0, bi + offset, bi)
        parts.append(_pad_width(shifted, width, -1, "beam_indices").to(device))
        # The rows beam search ran for this replica: its batch items times the beams.
        offset += f["sequences"].shape[0] // returns * num_beams
    return torch.cat(parts, dim=0)


def _steps(
    fields: list[dict[str, Any]], name: str, device: torch.device, fill: int | None
) -> tuple[Any, ...] | None:
    """A per-step field joined step by step, shorter replicas padded with filler steps."""
    steps = [f.get(name) for f in fields]
    if all(s is None for s in steps):
        return None
    if any(s is None for s in steps):
        raise ValueError(f"gather_generate: {name}: present on some replicas only")
    longest = max((tuple(s) for s in steps), key=len)  # type: ignore[arg-type]
    total = len(longest)
    filled = []
    for s in steps:
        s = tuple(s)  # type: ignore[arg-type]
        rows = _rows(s[0]) if s else 0
        filled.append(s + tuple(_filler_step(longest[t], rows, name, fill) for t in range(len(s), total)))
    return tuple(_cat([s[t] for s in filled], device) for t in range(total))


def _caches(caches: list[Any], name: str, device: torch.device) -> Any:
    lengths = [_seq_length(c) for c in caches]
    if len(set(map(repr, lengths))) > 1:
        warn_once(
            f"gather_generate: {name}: the replicas stopped at different steps, so their "
            f"caches hold {lengths} positions; {name} is returned as a list of "
            "per-replica caches (a joined cache would not be the one-device cache)",
            stacklevel=5,
        )
        return list(caches)
    return _cat(caches, device)


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


def _gather_mode(outputs: list[Any], device: torch.device, call: Call | None) -> Any:
    """The gather mode ``"generate"``: :func:`gather_generate` with the call's fill token."""
    if call is None:
        raise ValueError(
            "gather: mode: 'generate' needs the generate call (the model and its arguments, "
            "for the pad and eos ids), which a direct gather does not have; call "
            "dpmethods.integrations.transformers.gather_generate(outputs, device, fill_token_id=...) "
            "instead"
        )
    return gather_generate(outputs, device, **call_fill(call.module, call.args, call.kwargs))


def _check_call(call: Call) -> None:
    """Before any replica runs: a call whose generate settings the mode cannot read is refused."""
    check_generate_call(call.module, call.method, call.args, call.kwargs)


register_gather_mode("generate", _gather_mode, check=_check_call)
