"""The ``@parallel_method`` decorator and the registry of parallel methods.

A decorated method carries its :class:`MethodOptions` on the function object
itself, so registration needs no metaclass and survives any metaclass. Lookup
walks the class's MRO: the first class that defines the name decides, and a
subclass that overrides a decorated method without decorating it again
inherits the options of the closest decorated ancestor.
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar, Union, overload

from torch import nn

from dpmethods.types.owners import method_owner
from dpmethods.vocab.call_hooks import CallHooks
from dpmethods.vocab.loading import load_pending
from dpmethods.vocab.options import GatherOption, MethodOptions, check_option_names

__all__ = [
    "get_options",
    "parallel_method",
    "parallel_methods",
    "register",
    "register_method_finder",
    "resolve_methods",
]

_OPTIONS_ATTR = "__dpmethods_options__"
_F = TypeVar("_F", bound=Callable[..., Any])

# Options given with ``register(cls, name, ...)`` for classes the user doesn't own.
_REGISTERED: weakref.WeakKeyDictionary[type, dict[str, MethodOptions]] = (
    weakref.WeakKeyDictionary()
)


def _check_method(fn: Any, where: str) -> None:
    """Reject what cannot be a per-replica method, saying what to do instead."""
    if isinstance(fn, staticmethod):
        raise TypeError(
            f"{where}: @parallel_method cannot mark a staticmethod; a replica needs `self`. "
            "Make it a regular method, or call it yourself inside a decorated method."
        )
    if isinstance(fn, classmethod):
        raise TypeError(
            f"{where}: @parallel_method cannot mark a classmethod; replicas are instances. "
            "Make it a regular method that takes `self`."
        )
    if isinstance(fn, property):
        raise TypeError(
            f"{where}: @parallel_method cannot mark a property; attribute reads are not run "
            "in parallel. Make it a regular method and call it."
        )
    if not inspect.isfunction(fn):
        raise TypeError(
            f"{where}: @parallel_method expects a function defined with `def` in an nn.Module "
            f"subclass, got {type(fn).__name__} {fn!r}"
        )


class _Marker:
    """Checks the owning class when the class body finishes, then steps aside.

    ``__set_name__`` is called by ``type.__new__`` for any metaclass, which is why
    no metaclass of ours is needed. The marker then puts the plain function back,
    so an unwrapped module calls exactly the undecorated code.
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __set_name__(self, owner: type, name: str) -> None:
        if not (isinstance(owner, type) and issubclass(owner, nn.Module)):
            raise TypeError(
                f"@parallel_method on {owner.__qualname__}.{name}: expected a method of an "
                f"nn.Module subclass, but {owner.__qualname__} is not an nn.Module. "
                "Derive the class from torch.nn.Module."
            )
        setattr(owner, name, self.fn)

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        return self.fn.__get__(obj, objtype)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def _unmarked(attr: Any) -> Any:
    # A marker stays in place only when assigned to a class after its creation.
    return attr.fn if isinstance(attr, _Marker) else attr


@overload
def parallel_method(fn: _F) -> _F: ...


@overload
def parallel_method(  # for type checkers; the options taken are MethodOptions' fields
    fn: None = None,
    *,
    dim: int = 0,
    broadcast: Iterable[str] = (),
    gather: GatherOption = "cat",
    pad_value: float = 0,
    split: Iterable[str] = (),
    gather_dim: int | Mapping[str | int, int] | None = None,
    scatter_dim: Mapping[str, int] | None = None,
    hooks: CallHooks | None = None,
) -> Callable[[_F], _F]: ...


def parallel_method(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
    """Mark a method of an ``nn.Module`` subclass to run data-parallel.

    Used bare (``@parallel_method``) or with options (``@parallel_method(...)``).
    On a module that is not wrapped the method behaves exactly as undecorated.

    Args:
        fn: the method, when used without parentheses.
        **options: every field of :class:`MethodOptions`, with its meaning and default:
            ``dim``, ``broadcast``, ``gather``, ``pad_value``, ``split``, ``gather_dim``,
            ``scatter_dim``, ``hooks``.

    Example:
        >>> import torch
        >>> class Net(torch.nn.Module):
        ...     @parallel_method(gather="pad", pad_value=-1)
        ...     def generate(self, x):
        ...         return x
        >>> Net().generate(torch.ones(2)).tolist()
        [1.0, 1.0]
    """
    check_option_names("parallel_method", options)
    options_ = MethodOptions(**options)

    def mark(f: Any) -> Any:
        _check_method(f, getattr(f, "__qualname__", repr(f)))
        setattr(f, _OPTIONS_ATTR, options_)
        return _Marker(f)

    if fn is not None:
        if not callable(fn) and not isinstance(fn, (staticmethod, classmethod, property)):
            raise TypeError(
                f"@parallel_method: expected a method or keyword options, got "
                f"{type(fn).__name__} {fn!r}; write @parallel_method(dim=...)"
            )
        return mark(fn)
    return mark


# help() and inspect.signature show each option with its default, read from MethodOptions
# itself, so the decorator takes exactly the options MethodOptions has.
parallel_method.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [inspect.Parameter("fn", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)]
    + [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
        for f in dataclasses.fields(MethodOptions)
    ]
)


def register(cls: type, name: str, **options: Any) -> None:
    """Make ``cls.name`` a parallel method for every instance of ``cls`` and its subclasses.

    For classes you don't own (a library model's ``generate``).

    Args:
        cls: an ``nn.Module`` subclass.
        name: the name of a method defined on ``cls``.
        **options: every field of :class:`MethodOptions`, as in :func:`parallel_method`.

    Example:
        >>> import torch
        >>> class Tagger(torch.nn.Linear):  # a class of its own: registration is global
        ...     def tag(self, x):
        ...         return self(x).argmax(-1)
        >>> register(Tagger, "tag", gather="list")
        >>> get_options(Tagger, "tag").gather
        'list'
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"register: cls: expected an nn.Module subclass, got {cls!r}")
    attr = inspect.getattr_static(cls, name, None)
    if attr is None:
        raise AttributeError(f"register: {cls.__qualname__} has no method {name!r}")
    _check_method(attr, f"register({cls.__qualname__}, {name!r})")
    check_option_names("register", options)
    _REGISTERED.setdefault(cls, {})[name] = MethodOptions(**options)


def get_options(cls: type | nn.Module, name: str) -> MethodOptions | None:
    """The options of ``cls.name`` if it is a parallel method, else ``None``.

    Decorations and :func:`register` come first; then the built-in methods of imported
    libraries (see :mod:`dpmethods.integrations`).

    Args:
        cls: the class to look the method up on (its MRO is searched), or a module
            (its class is used).
        name: the method name.

    Example:
        >>> import torch
        >>> get_options(torch.nn.Linear, "forward") is None
        True
        >>> get_options(torch.nn.Linear(2, 2), "forward") is None
        True
    """
    cls = _as_class("get_options", cls)
    own = _own_options(cls, name)
    return own if own is not None else _builtin(cls).get(name)  # libraries' methods last


def _as_class(function: str, cls: Any) -> type:
    """``cls`` itself, or the class of a module (the model's, through ``torch.compile``)."""
    if isinstance(cls, type):
        return cls
    if isinstance(cls, nn.Module):
        return method_owner(cls)
    raise TypeError(
        f"{function}: cls: expected an nn.Module subclass or a module, got "
        f"{type(cls).__name__} {cls!r}"
    )


def _own_options(cls: type, name: str) -> MethodOptions | None:
    """Options given by a decoration or :func:`register` on ``cls`` or a base."""
    for klass in cls.__mro__:
        registered = _REGISTERED.get(klass)
        if registered is not None and name in registered:
            return registered[name]
        options = getattr(_unmarked(klass.__dict__.get(name)), _OPTIONS_ATTR, None)
        if options is not None:
            return options
    return None


MethodFinder = Callable[[type], Mapping[str, MethodOptions]]
# Libraries' finders (dpmethods.integrations and users' own), in registration order; a
# later finder's options win for a name both give.
_FINDERS: list[MethodFinder] = []


def register_method_finder(find: MethodFinder) -> None:
    """Add ``find(cls) -> {name: MethodOptions}``: a library's built-in parallel methods.

    ``find`` is asked for each wrapped module's class and returns the methods it makes
    parallel (an empty dict for classes not of its library). These have the lowest
    precedence: ``@parallel_method``, :func:`register` and ``methods=`` override them.

    Example:
        >>> import torch
        >>> class Doubler(torch.nn.Module):
        ...     def double(self, x):
        ...         return 2 * x
        >>> register_method_finder(  # (the class as a default: the finder outlives this scope)
        ...     lambda cls, own=Doubler: {"double": MethodOptions()} if issubclass(cls, own) else {})
        >>> sorted(parallel_methods(Doubler))
        ['double']
    """
    if not callable(find):
        raise TypeError(
            f"register_method_finder: find: expected a callable find(cls), got "
            f"{type(find).__name__} {find!r}"
        )
    _FINDERS.append(find)


def _builtin(cls: type) -> dict[str, MethodOptions]:
    load_pending()  # the integrations of libraries imported since the last lookup
    found: dict[str, MethodOptions] = {}
    for find in list(_FINDERS):
        found.update(find(cls))
    return found


def parallel_methods(cls: type | nn.Module) -> dict[str, MethodOptions]:
    """All parallel methods of ``cls``, by name.

    Args:
        cls: an ``nn.Module`` subclass, or a module (its class is used).

    Example:
        >>> import torch
        >>> parallel_methods(torch.nn.Linear), parallel_methods(torch.nn.Linear(2, 2))
        ({}, {})
    """
    cls = _as_class("parallel_methods", cls)
    builtin = _builtin(cls)  # asked once: every finder walks the class
    names: set[str] = set(builtin)
    for klass in cls.__mro__:
        names.update(_REGISTERED.get(klass, ()))
        names.update(
            k for k, v in klass.__dict__.items() if hasattr(_unmarked(v), _OPTIONS_ATTR)
        )
    found = {name: _own_options(cls, name) or builtin.get(name) for name in sorted(names)}
    return {name: opts for name, opts in found.items() if opts is not None}


MethodsArg = Union[Iterable[str], Mapping[str, Mapping[str, Any]], None]  # noqa: UP007


def resolve_methods(module: nn.Module, methods: MethodsArg = None) -> dict[str, MethodOptions]:
    """The parallel methods of ``module``: its class's, plus those given with ``methods=``.

    Args:
        module: the wrapped module.
        methods: ``["generate"]`` or ``{"generate": {"gather": "pad"}}``; these override
            the class's options. A name may also be a child module's attribute name
            (``["features"]``): ``dp.features(x)`` then calls each replica's copy of it.

    Example:
        >>> import torch
        >>> sorted(resolve_methods(torch.nn.Linear(1, 1), ["forward"]))
        ['forward']
    """
    owner = method_owner(module)  # the model's class, through torch.compile's wrapper
    found = parallel_methods(owner)
    if methods is None:
        return found
    if isinstance(methods, str):
        raise TypeError(f"methods: expected a list of names or a dict, got the string {methods!r}")
    items: Iterable[tuple[str, Mapping[str, Any]]]
    if isinstance(methods, Mapping):
        items = methods.items()
    elif not isinstance(methods, Iterable):
        raise TypeError(
            f"methods: expected a list of method names or a dict of options per name, got "
            f"{type(methods).__name__} {methods!r}"
        )
    else:
        items = ((name, {}) for name in methods)
    for name, opts in items:
        if not isinstance(name, str):
            raise TypeError(f"methods: expected method names (str), got {name!r}")
        if not isinstance(opts, Mapping):
            raise TypeError(f"methods[{name!r}]: expected a dict of options, got {opts!r}")
        attr = inspect.getattr_static(owner, name, None)
        if attr is None:
            # A child module (``methods=["features"]``): each replica calls its own copy.
            if not isinstance(getattr(module, name, None), nn.Module):
                raise AttributeError(
                    f"methods: {owner.__qualname__} has no method or submodule {name!r}"
                )
        else:
            _check_method(attr, f"methods[{name!r}]")
        check_option_names(f"methods[{name!r}]", opts)
        base = found.get(name) or MethodOptions()
        found[name] = base.with_updates(**opts)
    return found
