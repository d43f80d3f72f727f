"""State dicts across wrappers: the module under any wrapper (:func:`unwrap`), and
loading a state dict saved wrapped or bare into a model wrapped or bare
(:func:`load_state_dict`, through :func:`match_prefixes`)."""

from __future__ import annotations

import io
import os
import re
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any, BinaryIO

import torch
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from dpmethods.types.owners import unwrap_compiled

__all__ = ["add_prefix", "load_matched", "load_state_dict", "match_prefixes", "strip_prefix", "unwrap"]


def unwrap(model: nn.Module) -> nn.Module:
    """The innermost module under DataParallel, DDP, our wrappers and ``torch.compile``.

    Args:
        model: a module, possibly wrapped several times.

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(1, 1)
        >>> unwrap(torch.nn.DataParallel(lin)) is lin
        True
    """
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(model, (nn.DataParallel, DistributedDataParallel)):
            model = model.module
            continue
        inner = unwrap_compiled(model)
        if inner is model:
            return model
        model = inner


# The prefixes that wrappers put on their module's keys: DataParallel, DDP, our
# wrappers and AveragedModel ("module."), and torch.compile ("_orig_mod.").
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def strip_prefix(state_dict: Mapping[str, Any], prefix: str = "module.") -> OrderedDict[str, Any]:
    """A copy of ``state_dict`` with ``prefix`` removed once from every key that has it.

    Removed once only: a model with a child named ``module`` (``AveragedModel``, EMA
    wrappers) has ``module.`` in its own keys. Uses torch's
    ``consume_prefix_in_state_dict_if_present``, so ``_metadata`` follows.

    Args:
        state_dict: e.g. saved from a wrapped model.
        prefix: the prefix to remove.

    Example:
        >>> list(strip_prefix({"module.w": 1, "module.module.v": 2, "b": 3}))
        ['w', 'module.v', 'b']
    """
    out = _copy(state_dict)
    consume_prefix_in_state_dict_if_present(out, prefix)
    # consume_prefix moves renamed keys to the end: keep the saved order.
    ordered: OrderedDict[str, Any] = OrderedDict(
        (k[len(prefix) :] if k.startswith(prefix) else k, None) for k in state_dict
    )
    for k in ordered:
        ordered[k] = out[k]
    if hasattr(out, "_metadata"):
        ordered._metadata = out._metadata  # type: ignore[attr-defined]
    return ordered


def add_prefix(state_dict: Mapping[str, Any], prefix: str = "module.") -> OrderedDict[str, Any]:
    """A copy of ``state_dict`` with ``prefix`` on every key (and its ``_metadata``).

    Args:
        state_dict: e.g. saved from a bare model.
        prefix: the wrapper's prefix.

    Example:
        >>> list(add_prefix({"w": 1}))
        ['module.w']
    """
    out: OrderedDict[str, Any] = OrderedDict((prefix + k, v) for k, v in state_dict.items())
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        out._metadata = OrderedDict(  # type: ignore[attr-defined]
            (prefix + k if k else prefix.rstrip("."), v) for k, v in metadata.items()
        )
    return out


def _copy(state_dict: Mapping[str, Any]) -> OrderedDict[str, Any]:
    out: OrderedDict[str, Any] = OrderedDict(state_dict)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        out._metadata = OrderedDict(metadata)  # type: ignore[attr-defined]
    return out


def _wrapper_prefixes(keys: list[str]) -> list[str]:
    """``[""]`` and every chain of wrapper prefixes that all ``keys`` start with."""
    chain = [""]
    while keys:
        for seg in _WRAPPER_PREFIXES:
            if all(k.startswith(chain[-1] + seg) for k in keys):
                chain.append(chain[-1] + seg)
                break
        else:
            break
    return chain


def match_prefixes(
    state_dict: Mapping[str, Any], target_keys: Iterable[str]
) -> tuple[OrderedDict[str, Any], int]:
    """``state_dict`` with wrapper prefixes removed or added so its keys match ``target_keys``.

    Prefixes that every key shares (``module.``, ``_orig_mod.``, in any nesting) are
    removed from the state dict and added for the target, each at most once, choosing
    the change that makes the most keys match, and no change on a tie. Returns the
    renamed copy and the number of its keys that the target has.

    Args:
        state_dict: the state dict to load.
        target_keys: the keys of the module it is loaded into.

    Example:
        >>> sd, matched = match_prefixes({"module.w": 1}, ["_orig_mod.w"])
        >>> list(sd), matched
        (['_orig_mod.w'], 1)
    """
    targets = set(target_keys)
    keys = list(state_dict)
    best = (sum(k in targets for k in keys), 0, "", "")
    if best[0] < len(keys):
        for i, strip in enumerate(_wrapper_prefixes(keys)):
            for j, add in enumerate(_wrapper_prefixes(list(targets))):
                score = sum(add + k[len(strip) :] in targets for k in keys)
                best = max(best, (score, -(i + j), strip, add))
    score, _, strip, add = best
    out = _copy(state_dict)
    for seg in strip.split(".")[:-1]:  # one wrapper at a time, so _metadata follows
        out = strip_prefix(out, seg + ".")
    if add:
        out = add_prefix(out, add)
    return out, score


def _as_state_dict(state_dict: Any) -> Mapping[str, Any]:
    """A mapping from a mapping, a path, bytes or a binary file object."""
    source = state_dict
    if isinstance(state_dict, (bytes, bytearray, memoryview)):
        source = io.BytesIO(bytes(state_dict))
    elif not isinstance(state_dict, (Mapping, str, os.PathLike)) and not (
        hasattr(state_dict, "read") and hasattr(state_dict, "seek")
    ):
        raise TypeError(
            "state_dict: expected a mapping, a path, bytes or a binary file object, got "
            f"{type(state_dict).__name__} {state_dict!r:.80}"
        )
    if not isinstance(source, Mapping):
        source = _torch_load(source, state_dict)
        if not isinstance(source, Mapping):
            raise TypeError(
                f"state_dict: expected the file to hold a mapping of names to tensors, "
                f"got {type(source).__name__}"
            )
    return source


_ESCAPES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _short_cause(exc: BaseException) -> str:
    """One line of what torch.load said, without its advice paragraphs or terminal escapes."""
    text = _ESCAPES.sub("", str(exc)).strip()
    marker = "WeightsUnpickler error:"  # the weights-only check's own reason
    if marker in text:
        text = text.split(marker, 1)[1].strip()
    line = re.split(r"(?<=\.) ", text.split("\n", 1)[0].strip(), maxsplit=1)[0]
    if len(line) > 240:
        line = line[:237] + "..."
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


def _torch_load(source: Any, given: Any) -> Any:
    if not isinstance(given, (bytes, bytearray, memoryview)):
        # A path or file the user named as a saved state dict: torch's own errors say what is wrong.
        return torch.load(source, map_location="cpu", weights_only=True)
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:  # corrupt data raises anything: EOFError, KeyError, ...
        # Bytes could be anything: say how they were taken, with torch's reason in one
        # line (its message is paragraphs of advice with terminal escape codes).
        hint = ""
        if "Weights only load failed" in str(exc):
            hint = (
                " It is a file that needs weights_only=False: if you trust its source, "
                "load it with torch.load(..., weights_only=False) and pass the state dict."
            )
        raise ValueError(
            f"state_dict: the {memoryview(given).nbytes} bytes given were taken as a saved "
            "state dict (read with torch.load(..., weights_only=True)), and they could not be "
            f"read: {_short_cause(exc)}{hint}"
        ) from exc


def load_matched(
    loader: Callable[..., Any],
    target_keys: Iterable[str],
    state_dict: Any,
    strict: bool,
    **kwargs: Any,
) -> Any:
    """``loader(state_dict, strict=strict, **kwargs)``, with ``state_dict`` read (from a
    path, bytes or a file) and its prefixes matched to ``target_keys``
    (:func:`match_prefixes`); a wrapper's ``load_state_dict`` runs through it.

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(1, 1)
        >>> load_matched(lin.load_state_dict, lin.state_dict().keys(), {"module.weight": torch.ones(1, 1),
        ...     "module.bias": torch.zeros(1)}, strict=True)
        <All keys matched successfully>
    """
    state_dict = _as_state_dict(state_dict)
    matched_dict, matched = match_prefixes(state_dict, target_keys)
    if not strict and matched_dict and not matched:
        keys = list(matched_dict)
        warnings.warn(
            f"load_state_dict: none of the {len(keys)} keys of the state dict (such as "
            f"{keys[0]!r}) is a key of the model, so nothing was loaded (strict=False)",
            UserWarning,
            stacklevel=3,
        )
    return loader(matched_dict, strict=strict, **kwargs)


def load_state_dict(
    model: nn.Module,
    state_dict: Mapping[str, Any] | str | os.PathLike[str] | bytes | BinaryIO,
    strict: bool = True,
) -> Any:
    """Load a state dict into ``model``, wrapped or not, whether it was saved wrapped or not.

    Wrapper prefixes (``module.``, ``torch.compile``'s ``_orig_mod.``) are removed or
    added once each, as the model's own keys call for (see :func:`match_prefixes`),
    so models with a child named ``module`` (``AveragedModel``) load too. A path,
    bytes or a binary file object is read with ``torch.load(..., weights_only=True)``.
    With ``strict=False``, a state dict of which no key matches warns.

    Args:
        model: the target, bare or wrapped.
        state_dict: a state dict, or a path, bytes or file object of a saved one.
        strict: as in ``nn.Module.load_state_dict``.

    Returns:
        torch's ``(missing_keys, unexpected_keys)``, in the model's key names.

    Example:
        >>> import torch
        >>> a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        >>> _ = load_state_dict(b, torch.nn.DataParallel(a).state_dict())
        >>> torch.equal(a.weight, b.weight)
        True
    """
    return load_matched(
        model.load_state_dict, model.state_dict(keep_vars=True).keys(), state_dict, strict
    )
