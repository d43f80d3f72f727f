"""How one method is scattered, run and gathered: :class:`MethodOptions` and its checks."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Union

from dpmethods.vocab.call_hooks import CallHooks
from dpmethods.vocab.gather_modes import BUILTIN_MODES, check_mode_name, known_modes

__all__ = [
    "OPTION_NAMES", "GatherOption", "MethodOptions",
    "check_option_names",
]

# A mode; a mapping of top-level output keys, field names or tuple positions to modes;
# a tuple of modes, one per position of a tuple output; or a callable.
GatherOption = Union[  # noqa: UP007 (runtime alias on 3.10)
    str, Mapping[Union[str, int], str], tuple[str, ...], Callable[..., Any]  # noqa: UP007
]

@dataclass(frozen=True)
class MethodOptions:
    """How one method is scattered, run and gathered.

    Args:
        dim: the batch dimension that inputs are split along and outputs joined along.
        broadcast: names of arguments that every replica gets whole.
        gather: ``"cat"``, ``"stack"``, ``"mean"``, ``"sum"``, ``"pad"``, ``"list"``,
            ``"extend"`` (concatenate the replicas' per-item lists in order) or ``"same"``
            (one value equal on every replica, such as a parameter-derived scale; an
            error if they differ); a mapping from output key, field name or tuple
            position (an int) to one of those, or a tuple of modes, one per position of a
            tuple output; or a callable ``fn(outputs, output_device)`` that receives the
            list of replica outputs.
        pad_value: the fill value of ``"pad"``.
        split: names of arguments whose value is a Python sequence with one entry per
            batch item (a list of images, of target dicts, of sentences); each replica
            gets the contiguous run of items that lines up with its share of the tensors.
        gather_dim: the dimension outputs are joined along, when it differs from ``dim``:
            an int, or a mapping from top-level output key or field name to int (outputs
            not named use ``dim``). ``None`` means ``dim``.
        scatter_dim: the dimension an argument is split along when it differs from
            ``dim``: a mapping from argument name to int (Encodec's ``decode`` takes
            ``audio_codes`` with the batch in dim 1). Arguments not named use ``dim``.
        hooks: a :class:`~dpmethods.extending.CallHooks` that adapts each call's
            arguments, each replica's share and the gathered output (what library
            integrations use for calling conventions ``split`` can't express).

    Example:
        >>> MethodOptions(gather="pad", pad_value=-1).gather
        'pad'
        >>> MethodOptions(split="images", gather_dim={"logits_per_text": 1}).split
        ('images',)
        >>> MethodOptions(gather=("cat", "cat", "same")).gather  # per tuple position
        {0: 'cat', 1: 'cat', 2: 'same'}
    """

    dim: int = 0
    broadcast: tuple[str, ...] = ()
    gather: GatherOption = "cat"
    pad_value: float = 0
    split: tuple[str, ...] = ()
    gather_dim: int | Mapping[str | int, int] | None = None
    scatter_dim: Mapping[str, int] | None = None
    hooks: CallHooks | None = None

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise TypeError(f"dim: expected an int, got {type(self.dim).__name__} {self.dim!r}")
        if not -(2**63) <= self.dim < 2**63:
            raise ValueError(f"dim: expected an int that fits in 64 bits, got {self.dim}")
        object.__setattr__(self, "broadcast", names_option("broadcast", self.broadcast))
        object.__setattr__(self, "split", names_option("split", self.split))
        both = sorted(set(self.broadcast) & set(self.split))
        if both:
            raise ValueError(
                f"split: expected names not also in broadcast, got {both} in both "
                "(an argument is either cut per item or given whole to every replica)"
            )
        object.__setattr__(self, "gather_dim", _check_gather_dim(self.gather_dim))
        object.__setattr__(self, "scatter_dim", _check_scatter_dim(self.scatter_dim))
        object.__setattr__(self, "gather", positional_modes(self.gather))
        _check_gather(self.gather)
        if self.hooks is not None and not isinstance(self.hooks, CallHooks):
            raise TypeError(
                f"hooks: expected a dpmethods.extending.CallHooks or None, got "
                f"{type(self.hooks).__name__} {self.hooks!r}"
            )
        if isinstance(self.pad_value, bool) or not isinstance(self.pad_value, (int, float)):
            raise TypeError(
                f"pad_value: expected an int or float, got {type(self.pad_value).__name__} "
                f"{self.pad_value!r}"
            )

    def with_updates(self, **changes: Any) -> MethodOptions:
        """Return a copy with ``changes`` applied (validated again).

        Args:
            **changes: any of ``dim``, ``broadcast``, ``gather``, ``pad_value``,
                ``split``, ``gather_dim``, ``scatter_dim``, ``hooks``.

        Example:
            >>> MethodOptions().with_updates(dim=1).dim
            1
        """
        check_option_names("MethodOptions.with_updates", changes)
        return replace(self, **changes)


# Read from the class, so every function that takes options takes exactly its fields.
OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in fields(MethodOptions))


def check_option_names(where: str, names: Iterable[str]) -> None:
    """Refuse names that are not fields of :class:`MethodOptions`, suggesting the nearest.

    Example:
        >>> check_option_names("register", ["gathr"])
        Traceback (most recent call last):
        ...
        TypeError: register: unknown option(s) ['gathr'] (did you mean 'gather'?); expected any of ['dim', 'broadcast', 'gather', 'pad_value', 'split', 'gather_dim', 'scatter_dim', 'hooks']
    """
    unknown = sorted(set(names) - set(OPTION_NAMES))
    if unknown:
        close = difflib.get_close_matches(unknown[0], OPTION_NAMES, n=1)
        raise TypeError(
            f"{where}: unknown option(s) {unknown}"
            + (f" (did you mean {close[0]!r}?)" if close else "")
            + f"; expected any of {list(OPTION_NAMES)}"
        )


def names_option(option: str, value: Any) -> tuple[str, ...]:
    """Argument names as a tuple: one string, or an iterable of strings.

    Example:
        >>> names_option("split", "images")
        ('images',)
    """
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Mapping) or not isinstance(value, Iterable):
        raise TypeError(
            f"{option}: expected an argument name or a tuple of names (str), got "
            f"{type(value).__name__} {value!r}"
        )
    names = tuple(value)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(
                f"{option}: expected argument names (str), got {type(name).__name__} {name!r}"
            )
    return names


def positional_modes(gather: Any) -> Any:
    """A tuple of modes as the mapping of positions it means; anything else unchanged.

    Example:
        >>> positional_modes(("extend", "cat"))
        {0: 'extend', 1: 'cat'}
    """
    if isinstance(gather, (tuple, list)):
        return dict(enumerate(gather))
    return gather


def _check_dim_value(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}: expected an int, got {type(value).__name__} {value!r}")
    return value


def _check_gather_dim(gather_dim: Any) -> int | Mapping[str | int, int] | None:
    if gather_dim is None:
        return None
    if isinstance(gather_dim, Mapping):
        checked: dict[str | int, int] = {}
        for key, value in gather_dim.items():
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise TypeError(
                    f"gather_dim: expected output keys or field names (str) or tuple "
                    f"positions (int), got {type(key).__name__} {key!r}"
                )
            checked[key] = _check_dim_value(f"gather_dim[{key!r}]", value)
        # A copy, so later changes to the caller's dict don't change the options (a plain
        # dict rather than a mappingproxy, which can't be pickled or deep-copied).
        return checked
    if isinstance(gather_dim, bool) or not isinstance(gather_dim, int):
        raise TypeError(
            f"gather_dim: expected an int, a mapping of output keys to ints, or None, got "
            f"{type(gather_dim).__name__} {gather_dim!r}"
        )
    return gather_dim


def _check_scatter_dim(scatter_dim: Any) -> dict[str, int] | None:
    if scatter_dim is None:
        return None
    if not isinstance(scatter_dim, Mapping):
        raise TypeError(
            f"scatter_dim: expected a mapping of argument names to ints, or None, got "
            f"{type(scatter_dim).__name__} {scatter_dim!r}"
        )
    checked: dict[str, int] = {}
    for key, value in scatter_dim.items():
        if not isinstance(key, str):
            raise TypeError(
                f"scatter_dim: expected argument names (str), got {type(key).__name__} {key!r}"
            )
        checked[key] = _check_dim_value(f"scatter_dim[{key!r}]", value)
    return checked


def _check_gather(gather: Any) -> None:
    if isinstance(gather, str):
        # A typo of a built-in is refused now; any other name may be a library's mode,
        # registered once the library is imported: it is resolved when the method runs.
        check_mode_name("gather", gather)
    elif isinstance(gather, Mapping):
        for key, mode in gather.items():
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise TypeError(
                    f"gather: expected output keys or field names (str) or tuple positions "
                    f"(int) as the mapping's keys, got {type(key).__name__} {key!r}"
                )
            if not isinstance(mode, str) or mode not in BUILTIN_MODES:
                # A named mode joins a whole output, not one of its keys.
                raise ValueError(
                    f"gather[{key!r}]: expected one of {list(BUILTIN_MODES)}, got {mode!r}"
                )
    elif not callable(gather):
        raise TypeError(
            f"gather: expected one of {known_modes()}, a mapping of output keys or tuple "
            f"positions to those, a tuple of those, or a callable, got {type(gather).__name__} {gather!r}"
        )
