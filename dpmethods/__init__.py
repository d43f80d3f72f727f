"""dpmethods: data parallelism for model methods other than ``forward``.

Mark methods with :func:`parallel_method`, wrap the model in :class:`DataParallel`
(one process, several devices) or :class:`DistributedDataParallel` / :func:`fully_shard`
(torchrun), and call ``wrapper.encode(x)`` as you would call the model. The stages are
in :mod:`dpmethods.parallel`, the extension API in :mod:`dpmethods.extending`.

Example:
    >>> import torch, dpmethods
    >>> dp = dpmethods.DataParallel(torch.nn.Linear(4, 2), device_ids=["cpu"] * 2)
    >>> dp(torch.randn(5, 4)).shape
    torch.Size([5, 2])
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

# Importing dpmethods loads torch and the compiled extension (so its op exists once
# `import dpmethods` returns, as torchvision's do) and hooks the integrations in; the
# public names themselves are imported on first use (PEP 562). Type checkers see the
# eager imports below. To add a public name: one line in _EXPORTS, one import below.
_EXPORTS: dict[str, str] = {
    "DataParallel": "dpmethods.data_parallel",
    "DistributedDataParallel": "dpmethods.distributed",
    "MethodOptions": "dpmethods.vocab.options",
    "fully_shard": "dpmethods.distributed",
    "get_options": "dpmethods.wrapper.registry",
    "load_state_dict": "dpmethods.state_dicts",
    "parallel_method": "dpmethods.wrapper.registry",
    "parallel_methods": "dpmethods.wrapper.registry",
    "register": "dpmethods.wrapper.registry",
    "register_type": "dpmethods.types.rules",
    "route": "dpmethods.distributed",
    "unwrap": "dpmethods.state_dicts",
}
# Top-level spellings that code may use, resolved outside __all__: the stages (whose home
# is dpmethods.parallel, as torch.nn.parallel is theirs) and helpers with a home of their own.
_ALIASES: dict[str, str] = {
    "chunk_sizes": "dpmethods.parallel",
    "extension_info": "dpmethods.ops",
    "gather": "dpmethods.parallel",
    "gather_generate": "dpmethods.integrations.transformers",
    "parallel_apply": "dpmethods.parallel",
    "register_fsdp_methods": "dpmethods.distributed",
    "replicate": "dpmethods.parallel",
    "scatter": "dpmethods.parallel",
    "scatter_call": "dpmethods.parallel",
    "strip_prefix": "dpmethods.state_dicts",
}

if TYPE_CHECKING:
    from dpmethods.data_parallel import DataParallel
    from dpmethods.distributed import DistributedDataParallel, fully_shard, route
    from dpmethods.state_dicts import load_state_dict, unwrap
    from dpmethods.types.rules import register_type
    from dpmethods.vocab.options import MethodOptions
    from dpmethods.wrapper.registry import get_options, parallel_method, parallel_methods, register

__version__ = "0.1.0"

__all__ = [
    "DataParallel",
    "DistributedDataParallel",
    "MethodOptions",
    "fully_shard",
    "get_options",
    "load_state_dict",
    "parallel_method",
    "parallel_methods",
    "register",
    "register_type",
    "route",
    "unwrap",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name) or _ALIASES.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    if not name.startswith("__"):
        try:  # a submodule, as dpmethods.parallel or dpmethods.extending, on first use
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The subpackages and modules that are homes of public names (dpmethods.parallel.gather,
# dpmethods.extending.register_gather_mode, ...); the others are the layers under them.
_PUBLIC_MODULES = (
    "distributed", "extending", "integrations", "ops", "parallel", "state_dicts", "testing",
)


def __dir__() -> list[str]:
    # The public names only: not this file's own imports (importlib, Any, ...), the
    # internal layers, or the aliases that __getattr__ also resolves.
    return sorted({*__all__, *_PUBLIC_MODULES, "__version__"})


# Load dpmethods._C now, as torchvision registers its ops on import: code that calls
# torch.ops.dpmethods.gather_coalesced directly, or loads a saved torch.export program
# holding it, must find the op after `import dpmethods`. A missing or broken build, or
# DPMETHODS_DISABLE_EXTENSION=1, leaves the pure-PyTorch gather, logged once.
# The built-in integrations hook into the registries, to load each once its library is
# imported (dpmethods.integrations); none imports its library itself.
from dpmethods import integrations as _integrations  # noqa: E402, F401
from dpmethods import ops as _ops  # noqa: E402, F401
from dpmethods.vocab.warn_once import warn_once as _warn_once  # noqa: E402

# A wrapper pickled by version 0.1.0 names its classes by these module paths; pickle
# imports them by name, so each path is the module that holds those classes.
_PICKLED_PATHS = {"dpmethods._wrapping": "dpmethods.wrapper.base", "dpmethods.options": "dpmethods.vocab.options"}
for _old, _new in _PICKLED_PATHS.items():
    sys.modules.setdefault(_old, importlib.import_module(_new))


class _Renamed(ModuleType):
    """A module's former name: each name read through it is the new module's, with one
    FutureWarning per process that gives the new name."""

    def __init__(self, old: str, new: str) -> None:
        super().__init__(old, f"The former name of {new}.")
        self._new = new

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        _warn_once(f"{self.__name__} is named {self._new}: import its names from {self._new}",
                  stacklevel=3, category=FutureWarning)
        return getattr(importlib.import_module(self._new), name)


# The state-dict helpers' module is dpmethods.state_dicts (map(checkpoint=) is the map's
# record): code that imports them by the module's former name gets them, and is told.
sys.modules.setdefault("dpmethods.checkpoints", _Renamed("dpmethods.checkpoints", "dpmethods.state_dicts"))
