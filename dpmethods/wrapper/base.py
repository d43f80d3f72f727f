"""What every dpmethods wrapper shares: parallel methods as real attributes, and
attribute forwarding to the wrapped module.

A wrapper instance belongs to a small subclass made for its module's class, whose
class body holds one ``functools.wraps``-ed method per parallel method. That makes
``dp.encode`` a real attribute: ``inspect.signature``, ``help``, ``dir`` and tab
completion show the model's own method, and no ``__getattr__`` lookup runs per call.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

from dpmethods.types.owners import method_owner
from dpmethods.vocab.options import MethodOptions
from dpmethods.wrapper.registry import MethodsArg, resolve_methods

__all__ = ["MethodWrapper", "check_argument_names", "check_flag", "check_module"]

# Weak all ways: an entry lives while wrappers of its class do (the value), and its key
# holds the wrapper base (maybe a user's subclass) and the module class only weakly, so
# no class is kept alive by the cache, nor outlives its wrapper class by a gc pass.
_CLASS_CACHE: weakref.WeakValueDictionary[
    tuple[weakref.ref[type], weakref.ref[type], tuple[str, ...]], type
] = weakref.WeakValueDictionary()


def _make_method(fn: Callable[..., Any] | None, name: str) -> Callable[..., Any]:
    """The wrapper's method ``name``; ``fn`` is the model's (None for a child module)."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return self._run_method(name, args, kwargs)

    if fn is None:
        method.__name__ = method.__qualname__ = name
        method.__doc__ = f"Call the wrapped module's child ``{name}`` on every replica."
        return method
    return functools.wraps(fn)(method)


def _method_class(base: type, module_cls: type, names: tuple[str, ...]) -> type:
    key = (weakref.ref(base), weakref.ref(module_cls), names)
    cls = _CLASS_CACHE.get(key)
    if cls is None:
        namespace: dict[str, Any] = {
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
            "_dpm_base": base,
            "_dpm_names": names,
        }
        for name in names:
            fn = getattr(module_cls, name, None)  # None: a child module, an instance attribute
            namespace[name] = _make_method(fn if callable(fn) else None, name)
        cls = type(base.__name__, (base,), namespace)
        _CLASS_CACHE[key] = cls
    return cls


def _rebuild(base: type, module_cls: type, names: tuple[str, ...]) -> Any:
    """Unpickling entry point: the per-module subclass is made again, not looked up by name."""
    return object.__new__(_method_class(base, module_cls, names))


def check_module(module: Any) -> None:
    """Raise a TypeError naming ``module`` unless it is an ``nn.Module``.

    Example:
        >>> check_module(nn.Linear(2, 2))
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected an nn.Module, got {type(module).__name__}")


class MethodWrapper(nn.Module):
    """Mixin base of the dpmethods wrappers.

    Subclasses define ``_run_method(name, args, kwargs)`` and may override
    ``_undecorated_warning(name)``. ``self._dpm_methods`` maps each parallel method
    name to its :class:`MethodOptions`; ``self.module`` is the wrapped module.

    Example:
        >>> from dpmethods import DataParallel, DistributedDataParallel
        >>> issubclass(DataParallel, MethodWrapper), issubclass(DistributedDataParallel, MethodWrapper)
        (True, True)
    """

    _dpm_methods: dict[str, MethodOptions]

    def _init_methods(self, module: nn.Module, methods: MethodsArg) -> None:
        check_module(module)
        self._dpm_methods = resolve_methods(module, methods)
        self._dpm_warned: set[str] = set()
        # The instance moves to a subclass holding one method per parallel method. Done
        # here, where our __init__ has the real module and methods, not in __new__: a
        # subclass's constructor may take its own arguments in any position or name
        # (BalancedDataParallel's ``__init__(self, gpu0_bsz, *args, **kwargs)``).
        cls = type(self)
        base: type = getattr(cls, "_dpm_base", cls)
        names = tuple(n for n in self._dpm_methods if not hasattr(base, n))
        self.__class__ = _method_class(base, method_owner(module), names)
        for name in self._dpm_methods:
            if name != "forward" and name not in type(self).__dict__.get("_dpm_names", ()):
                warnings.warn(
                    f"{type(self).__name__}: parallel method {name!r} has the name of a "
                    f"method of {type(self).__name__} itself, which keeps its meaning; "
                    f"rename the model's method to run it in parallel",
                    UserWarning,
                    stacklevel=3,
                )

    def __reduce_ex__(self, protocol: Any) -> Any:
        cls = type(self)
        if "_dpm_base" not in cls.__dict__:
            return super().__reduce_ex__(protocol)
        module_cls = method_owner(self.__dict__["_modules"]["module"])
        base, names = cls.__dict__["_dpm_base"], cls.__dict__["_dpm_names"]
        # __getstate__ lets torch's wrappers drop what can't be pickled (DDP's logger).
        return (_rebuild, (base, module_cls, names), self.__getstate__())

    def _run_method(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError

    def _undecorated_warning(self, name: str) -> str | None:
        """The warning shown the first time an undecorated method is called, or None
        (asked again at the next call)."""
        return None

    def _submodule_warning(self, name: str) -> str | None:
        """The warning shown the first time a child module is read through the wrapper, or None."""
        return None

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        module = self.__dict__.get("_modules", {}).get("module")
        # Protocol probes (copy's __deepcopy__, pickle's __reduce__...) must see the
        # wrapper, never the module: a forwarded one would copy the module instead.
        if module is None or (name.startswith("__") and name.endswith("__")):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        try:
            attr = getattr(module, name)
        except AttributeError:
            raise AttributeError(self._missing(module, name)) from None
        if inspect.ismethod(attr) and attr.__self__ is module:
            return self._single_device(name, attr)
        if isinstance(attr, nn.Module) and name not in self._dpm_warned:
            # dp.features(x) would run the child on one device without a word.
            self._dpm_warned.add(name)
            message = self._submodule_warning(name)
            if message is not None:
                warnings.warn(message, UserWarning, stacklevel=2)
        return attr

    def _missing(self, module: nn.Module, name: str) -> str:
        """The message of a missing attribute: the nearest name, and the parallel methods."""
        methods = sorted(set(self._dpm_methods) - {"forward"})
        public = {n for n in dir(module) if not n.startswith("_")} | set(methods)
        close = difflib.get_close_matches(name, sorted(public), n=1)
        kind = type(module).__name__
        return (
            f"{type(self).__name__!r} object has no attribute {name!r}, and neither has the "
            f"wrapped {kind}" + (f": did you mean {close[0]!r}?" if close else ".")
            + (f" The parallel methods of {kind} are {methods}." if methods
               else f" {kind} has no parallel methods besides forward.")
        )

    def _single_device(self, name: str, bound: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(bound)
        def call(*args: Any, **kwargs: Any) -> Any:
            if name not in self._dpm_warned:
                message = self._undecorated_warning(name)
                if message is not None:  # None: nothing to say of this call; a later one may warn
                    self._dpm_warned.add(name)
                    warnings.warn(message, UserWarning, stacklevel=2)
            return bound(*args, **kwargs)

        return call

    def __dir__(self) -> list[str]:
        names = set(super().__dir__())
        module = self.__dict__.get("_modules", {}).get("module")
        if module is not None:
            names.update(dir(module))
        return sorted(names)


def check_argument_names(module: nn.Module, methods: dict[str, MethodOptions]) -> None:
    """Refuse ``broadcast``/``split`` names that are not arguments of their method.

    Example:
        >>> check_argument_names(nn.Linear(2, 2), {"forward": MethodOptions(broadcast="input")})
    """
    for name, opts in methods.items():
        if not opts.broadcast and not opts.split:
            continue
        params = inspect.signature(getattr(method_owner(module), name)).parameters
        if any(p.kind == p.VAR_KEYWORD for p in params.values()):
            continue
        for option, names in (("broadcast", opts.broadcast), ("split", opts.split)):
            unknown = [b for b in names if b not in params]
            if unknown:
                raise ValueError(
                    f"{option}: {unknown} are not arguments of "
                    f"{type(module).__name__}.{name}; its arguments are "
                    f"{[p for p in params if p != 'self']}"
                )


def check_flag(name: str, value: Any) -> None:
    """Refuse a wrapper option that must be True or False.

    Example:
        >>> check_flag("cache_replicas", 1)
        Traceback (most recent call last):
        ...
        TypeError: cache_replicas: expected a bool, got int 1
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")
