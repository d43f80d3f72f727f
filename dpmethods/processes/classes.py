"""The model's classes as the worker processes have them: methods patched in the caller.

A worker process imports each class of the model by name, from its module, and runs
it as that module defines it. A method replaced on a class in the caller
(``Linear.forward = my_forward``, a kernel patch applied in the script) would run
unpatched there: the outputs of another model, with no error. So each model sent
carries a :class:`ClassState`:

- ``described``: what each method of the model's classes and their bases is in the
  caller (:func:`describe`: a function by its qualified name and where its code is);
- ``values``: the attributes that do not look defined where they are (a function whose
  qualified name is not ``Class.name``: a patch), each pickled on its own, by reference.

The worker sets those values on its own classes (:func:`set_values`, before it
unpickles the model), then describes its classes the same way (:func:`check`). A
method of the user's own code that still differs (a patch with a lambda or a closure,
which cannot be sent by reference; a function defined under the script's
``if __name__ == "__main__":``) is a warning, once, naming it and what to do: the
worker's outputs would not be the caller's model's. A function the caller's class has
and no class of the worker has (one a library adds as it runs, wherever the library is
installed) is not compared: the worker puts an :class:`_Unsent` in its place, absent
as it was, which warns once where the model looks it up. An installed library's wrappers
(torch's dynamo wraps ``nn.Module.__init__`` and ``__setstate__`` once it compiles) are
not compared: they are made to be transparent. Neither sent nor compared: data set on
a class (``Attention.scale = 2.0``, a cache a library keeps there as it runs), a method
deleted, and functions replaced in a module rather than on a class.

Example:
    >>> from torch import nn
    >>> state = class_state([nn.Linear])
    >>> state.described[("torch.nn.modules.linear", "Linear", "forward")][0]
    'function'
"""

from __future__ import annotations

import dataclasses
import gc
import pickle
import sysconfig
import types
from collections.abc import Hashable, Iterable
from pathlib import Path
from typing import Any

from torch import nn

from dpmethods.vocab.warn_once import warn_once

__all__ = ["ClassState", "check", "class_dicts", "class_state", "classes_of", "describe", "set_values"]

# Attributes Python or pickling sets on a class by itself, or that hold no behaviour:
# ``__slotnames__`` appears in the caller when an instance is pickled, never in a worker.
_SKIP = frozenset((
    "__slotnames__", "__dict__", "__weakref__", "__doc__", "__module__", "__qualname__",
    "__annotations__", "__annotate__", "__annotate_func__", "__annotations_cache__",
    "__static_attributes__", "__firstlineno__", "__parameters__", "__orig_bases__",
    "__abstractmethods__", "_abc_impl",
))

# How a class makes its instances: never run on a model a worker unpickles.
_CONSTRUCTION = frozenset(("__init__", "__new__", "__init_subclass__", "__class_getitem__", "__set_name__"))
Key = tuple[str, str, str]  # (the class's module, its qualified name, the attribute)
_ABSENT = object()
# In a worker: each class attribute the last model's values replaced, as it was before
# (_ABSENT: it had none), put back before the next model's are set.
_REPLACED: dict[tuple[type, str], Any] = {}


def _module(name: str | None) -> str | None:
    """A module's name as both processes call it: a worker runs the caller's main
    module as ``__mp_main__``."""
    return "__main__" if name == "__mp_main__" else name


def describe(value: Any) -> Hashable | None:
    """What ``value`` does, as another process that imported the same code describes it:
    a function by its qualified name and where its code is, a builtin or class by its
    name, a static or class method or property by what it wraps; None for a value that
    is data (a number, a cache, an object), which libraries set on their classes as they
    run and which is not compared.

    Example:
        >>> describe(len), describe(1.5), describe(staticmethod(len))[0]
        (('builtin', 'builtins', 'len'), None, 'staticmethod')
    """
    if isinstance(value, (staticmethod, classmethod)):
        return (type(value).__name__, describe(value.__func__))
    if isinstance(value, property):
        return ("property", describe(value.fget), describe(value.fset), describe(value.fdel))
    if isinstance(value, types.FunctionType):
        code = value.__code__
        return ("function", _module(value.__module__), value.__qualname__, code.co_filename, code.co_firstlineno)
    if isinstance(value, type):
        return ("class", _module(value.__module__), value.__qualname__)
    if isinstance(value, (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType)):
        return ("builtin", getattr(value, "__module__", None), value.__qualname__)
    return None


def _function(value: Any) -> types.FunctionType | None:
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        value = value.fget
    return value if isinstance(value, types.FunctionType) else None


def _placed(cls: type, name: str, value: Any) -> bool:
    """Whether ``value`` looks defined where it is: a function of the class body (its
    qualified name ``Class.name``, in the class's module), or anything else."""
    f = _function(value)
    return f is None or (
        f.__qualname__ == f"{cls.__qualname__}.{name}" and _module(f.__module__) == _module(cls.__module__)
    )


def classes_of(modules: Iterable[nn.Module]) -> list[type]:
    """The classes of ``modules`` (a model's ``modules()``) and their bases (``object``
    and builtins left out), each once, in a fixed order.

    Example:
        >>> [c.__name__ for c in classes_of(nn.Linear(1, 1).modules())]
        ['Linear', 'Module']
    """
    seen: dict[type, None] = {}
    for m in modules:
        for cls in type(m).__mro__:
            if cls.__module__ != "builtins":
                seen.setdefault(cls, None)
    return list(seen)


def class_dicts(classes: Iterable[type]) -> list[dict[str, Any]]:
    """The dicts behind ``classes``' ``__dict__`` proxies: their versions change with
    every attribute set on or deleted from a class.

    Example:
        >>> class_dicts([nn.Linear])[0]["forward"] is nn.Linear.forward
        True
    """
    return [d for cls in classes for d in gc.get_referents(vars(cls)) if type(d) is dict]


@dataclasses.dataclass(frozen=True)
class ClassState:
    """What the caller's classes do (``described``), and the values to set on a worker's
    (``values``: ``(key, pickled value)``); see the module docstring."""

    described: dict[Key, Hashable]
    values: tuple[tuple[Key, bytes], ...]

    def key(self) -> Hashable:
        """What a worker's classes are made to match: equal for equal descriptions.

        Example:
            >>> class_state([nn.Linear]).key() == class_state([nn.Linear]).key()
            True
        """
        return frozenset(self.described.items())


def _key(cls: type, name: str) -> Key:
    return (_module(cls.__module__) or "", cls.__qualname__, name)


def _described(classes: Iterable[type]) -> dict[Key, Hashable]:
    described = ((_key(cls, name), describe(value)) for cls in classes for name, value in vars(cls).items()
                 if name not in _SKIP)
    return {key: d for key, d in described if d is not None}


def _parts(value: Any) -> tuple[str, Any]:
    """``value`` as a wrapper's kind and what it wraps, each picklable by reference (a
    staticmethod, classmethod or property object itself is not)."""
    if isinstance(value, (staticmethod, classmethod)):
        return type(value).__name__, value.__func__
    if isinstance(value, property):
        return "property", (value.fget, value.fset, value.fdel, value.__doc__)
    return "plain", value


def _whole(kind: str, parts: Any) -> Any:
    if kind == "property":
        return property(*parts)
    return {"staticmethod": staticmethod, "classmethod": classmethod}.get(kind, lambda v: v)(parts)


def class_state(classes: Iterable[type]) -> ClassState:
    """The :class:`ClassState` of ``classes`` in this process.

    Example:
        >>> class_state([nn.Module]).values != ()  # nn.Module's forward is set from a function
        True
    """
    classes = list(classes)
    values = []
    for cls in classes:
        for name, value in vars(cls).items():
            if name in _SKIP or _placed(cls, name, value):
                continue
            try:
                values.append((_key(cls, name), pickle.dumps((cls, *_parts(value)), pickle.HIGHEST_PROTOCOL)))
            except Exception:  # a lambda, a closure: the worker's comparison names it
                continue
    return ClassState(_described(classes), tuple(values))


def set_values(state: ClassState) -> None:
    """In a worker, before the model is unpickled (its classes' ``__setstate__`` may be
    among them): set the caller's values on this process's classes, putting back first
    what the last model's values replaced.

    Example:
        >>> set_values(class_state([nn.Linear, nn.Module]))
    """
    for (cls, name), before in _REPLACED.items():  # as imported, before the last model's values
        if before is _ABSENT:
            delattr(cls, name)
        else:
            setattr(cls, name, before)
    _REPLACED.clear()
    for (_, _, name), data in state.values:
        try:
            cls, kind, parts = pickle.loads(data)
        except Exception:  # defined where this process cannot import it: compared after
            continue
        _REPLACED.setdefault((cls, name), vars(cls).get(name, _ABSENT))
        setattr(cls, name, _whole(kind, parts))


def check(state: ClassState, model: nn.Module) -> None:
    """In a worker, once the model is built: warn once for each method of ``model``'s
    classes that still differs from the caller's (see the module docstring), and put an
    :class:`_Unsent` in the place of each one that no class of this process has.

    Example:
        >>> check(class_state([nn.Linear, nn.Module]), nn.Linear(1, 1))
    """
    # A user's method the caller set where the class only inherited one (a subclass's
    # override) is compared: this process's class lacks it and runs what it inherits. Only
    # the user's code is compared: an installed library's wrapper (torch's dynamo wraps
    # nn.Module.__init__ and __setstate__ once it compiles, with closures) is made to be
    # transparent, and made again wherever that library does the same. Nor how a class
    # makes an instance: a worker's model is unpickled, never constructed. A name no class
    # of this process has (a function a library adds as it runs: transformers gives
    # nn.Module a smart_apply when it initializes weights, wherever transformers is
    # installed) is not compared but watched: the model here cannot run something else
    # in its place, only miss it, and the warning comes where it looks it up.
    classes = classes_of(model.modules())
    mine, owners = _described(classes), {_key(cls, "")[:2]: cls for cls in classes}
    for key in sorted(state.described.keys()):
        theirs, here = state.described[key], mine.get(key)
        if key[2] in _CONSTRUCTION or theirs == here:
            continue
        cls = owners.get(key[:2])
        if here is None and cls is not None and not any(key[2] in vars(c) for c in cls.__mro__):
            _REPLACED.setdefault((cls, key[2]), _ABSENT)  # taken away before the next model's values
            setattr(cls, key[2], _Unsent(_differs(key, theirs, _LACKED)))
        elif _yours(theirs):
            warn_once(_differs(key, theirs, here), stacklevel=2)


class _Unsent:
    """In a worker, in the place of a method the caller's class has and no class here has:
    absent, as it would be (a lookup raises ``AttributeError``, so ``hasattr`` is False
    and ``nn.Module.__getattr__`` answers), and a warning once where an instance looks
    it up: the model's code reached for what only the caller has."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is not None:
            warn_once(self.message, stacklevel=2)
        raise AttributeError(self.message)


def _yours(described: Any) -> bool:
    """Whether a described method's code is the user's: not in an installed library
    (``site-packages``) or the standard library, nor code a library generated
    (``<eval_with_key>``); code typed in the main module (``python -c``, an interactive
    session: ``<string>``, ``<stdin>``) is the user's."""
    kind, *rest = described
    if kind in ("staticmethod", "classmethod", "property"):
        return any(part is not None and _yours(part) for part in rest)
    if kind != "function":
        return False
    module, _, filename, _ = rest
    if filename.startswith("<"):
        return module == "__main__"
    parts = Path(filename).parts
    return not ("site-packages" in parts or "dist-packages" in parts or filename.startswith(_STDLIB))


_STDLIB = sysconfig.get_paths()["stdlib"]


def _said(described: Any) -> str:
    kind, *rest = described
    if kind == "function":
        module, qualname, filename, line = rest
        return f"the function {module}.{qualname} ({filename}:{line})"
    if kind in ("staticmethod", "classmethod", "property"):
        return f"a {kind} of {_said(rest[0])}" if rest[0] is not None else f"a {kind}"
    return f"the {kind} {rest[0]}.{rest[1]}"


_LACKED = "lacked"  # _differs' worker value for a method no class of the worker has


def _differs(key: Key, caller: Hashable, worker: Hashable | None) -> str:
    module, qualname, name = key
    looked = ""
    if worker == _LACKED:
        there, looked = "absent from the class and its bases", ", and the model looked it up there"
    else:
        there = "not set on the class (it inherits one)" if worker is None else _said(worker)
    return (
        f"DataParallel(workers='processes'): {module}.{qualname}.{name} is {_said(caller)} in this "
        f"process, but {there} in the worker processes, which import the class from its "
        f"module{looked}: they would not run this process's model. Make the change where the workers "
        f"make it too (at the top level of a module they import: the model's own module, or the "
        f"script outside `if __name__ == '__main__':`, with a function defined at a module's top "
        f"level), or build the model with factory= and make it there; or use workers='threads'"
    )
