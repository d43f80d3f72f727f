"""The fill token of one ``generate`` call, and each replica's ``prefix_allowed_tokens_fn``.

:func:`call_fill` reads what :func:`~dpmethods.integrations.transformers.gather_generate`
needs from the call as transformers would run it: the pad and eos ids, the beams and
the returned sequences, merged from the call's keyword arguments, the
``generation_config`` it was given and the model's own, as ``generate`` merges them.
:data:`PREFIX_OFFSET` is the hook that tells each replica where its rows start.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

from dpmethods.extending import Call, CallHooks, unwrap_compiled
from dpmethods.integrations.transformers.arguments import bound_arguments

__all__ = ["PREFIX_OFFSET", "OffsetPrefixFn", "call_fill", "check_generate_call"]

_NEEDS = (
    "gather='generate' pads the replicas' generate outputs as one device pads them, with the "
    "fill token, beams and returned sequences of the generate call (pad_token_id, "
    "eos_token_id, num_beams, num_return_sequences), read from a call of a transformers "
    "model's own generate: its arguments, its generation_config and the model's"
)
_GIVEN = (
    "gather=functools.partial(dpmethods.integrations.transformers.gather_generate, "
    "fill_token_id=..., num_beams=..., "
    "num_return_sequences=...) with the values that call runs with (the fill token: "
    "pad_token_id, else eos_token_id[0]; with num_beams > 1, pad_token_id or "
    "eos_token_id[0], and -1 without an eos id)"
)


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
    given = bound_arguments(model.generate, args, kwargs)
    config = given.pop("generation_config", None)
    prepare = getattr(model, "_prepare_generation_config", None)
    if callable(prepare):
        # transformers' own merge: kwargs > generation_config > model.generation_config.
        plain = {k: v for k, v in given.items() if not isinstance(v, Tensor)}
        return prepare(config, **plain)[0]
    if config is None and getattr(model, "generation_config", None) is None:
        raise ValueError(
            f"{_NEEDS}; got a call of {type(model).__name__}.generate, and "
            f"{type(model).__name__} has no generation_config and was given none. Give it "
            f"the generation_config its generate runs with, or {_GIVEN}"
        )
    config = copy.deepcopy(config if config is not None else model.generation_config)
    config.update(**given)
    return config


def _is_whisper(model: Any) -> bool:
    module = sys.modules.get("transformers.models.whisper.generation_whisper")
    mixin = getattr(module, "WhisperGenerationMixin", None)
    return isinstance(mixin, type) and isinstance(model, mixin)


def _generators(model: Any) -> list[tuple[str, Any]]:
    """The outermost submodules of ``model`` that have a ``generate`` of their own."""
    found: list[tuple[str, Any]] = []
    for name, sub in model.named_modules():
        if name and callable(getattr(sub, "generate", None)) and not any(name.startswith(f + ".") for f, _ in found):
            found.append((name, sub))
    return found


def _defaults(sub: Any) -> str:
    try:
        fill = call_fill(sub, (), {})
    except Exception:  # what its own config says is only a hint
        return ""
    values = ", ".join(f"{k}={fill[k]}" for k in ("fill_token_id", "num_beams", "num_return_sequences"))
    return f" (its generation_config alone gives {values})"


def check_generate_call(module: Any, method: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """Refuse, before any replica runs, a call whose generate settings cannot be read:
    a method other than the model's own ``generate``, or one with no generation config.

    Example:
        >>> import torch
        >>> check_generate_call(torch.nn.Linear(1, 1), "complete", (), {})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: gather='generate' pads ...; got a call of Linear.complete, and Linear has no generate. ...
    """
    model = unwrap_compiled(module)
    name = type(model).__name__
    if method == "generate" and callable(getattr(model, "generate", None)):
        if callable(getattr(model, "_prepare_generation_config", None)) or getattr(model, "generation_config", None) is not None:
            return
        _generation_config(model, args, kwargs)  # the call's own generation_config, or its error
        return
    if callable(getattr(model, "generate", None)):
        got = f"{name}.{method}, whose arguments are not generate's"
        fix = f"make the parallel method {name}.generate itself"
    else:
        got = f"{name}.{method}, and {name} has no generate"
        subs = _generators(model)
        fix = "parallelize the generate of the model it calls itself"
        if len(subs) == 1:
            path, sub = subs[0]
            fix = (f"parallelize the generate of {name}.{path} ({type(sub).__name__}) itself: "
                   f"DataParallel(<your {name}>.{path}, ...).generate(...){_defaults(sub)}")
    raise ValueError(f"{_NEEDS}; got a call of {got}. To fix it, {fix}; or, to keep {name}.{method}, {_GIVEN}")


def call_fill(module: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``gather_generate`` for one ``module.generate`` call.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> config = NS(pad_token_id=None, eos_token_id=[7, 8], num_beams=1,
        ...             num_return_sequences=1, update=lambda **kw: None)
        >>> call_fill(NS(generation_config=config, generate=lambda **kw: None), (), {})
        {'fill_token_id': 7, 'num_beams': 1, 'num_return_sequences': 1}
    """
    model = unwrap_compiled(module)
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


class OffsetPrefixFn:
    """``prefix_allowed_tokens_fn`` for a replica whose first item is item ``start``.

    transformers calls it with the item's index in the batch that ``generate`` got, the
    replica's share: without the offset, the items of every replica but the first would
    get the constraints of other items.

    Example:
        >>> OffsetPrefixFn(lambda i, ids: [i], 3)(1, None)
        [4]
    """

    def __init__(self, fn: Callable[[int, Any], Any], start: int) -> None:
        self.fn, self.start = fn, start

    def __call__(self, batch_id: int, input_ids: Any) -> Any:
        return self.fn(batch_id + self.start, input_ids)


def _offset_prefix_fn(
    args: tuple[Any, ...], kwargs: dict[str, Any], start: int, call: Call
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    fn = kwargs.get("prefix_allowed_tokens_fn")
    if fn is None or start == 0:
        return args, kwargs
    return args, {**kwargs, "prefix_allowed_tokens_fn": OffsetPrefixFn(fn, start)}


PREFIX_OFFSET = CallHooks(per_replica=_offset_prefix_fn)
"""The hooks that give each replica's ``prefix_allowed_tokens_fn`` its rows' indices in
the whole batch (``generate`` of transformers and peft models)."""
