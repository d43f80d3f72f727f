"""dpmethods: data parallelism for model methods other than ``forward``.

Mark methods with :func:`parallel_method`, wrap the model in :class:`DataParallel`
(one process, several devices) or :class:`DistributedDataParallel` / :func:`fully_shard`
(torchrun), and call ``wrapper.encode(x)`` as you would call the model.

Example:
    >>> import dpmethods
    >>> dpmethods.chunk_sizes(10, 4)
    [3, 3, 2, 2]
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

# The public names are imported on first use (PEP 562): importing the package costs
# torch and the compiled extension (loaded at the end of this file, so its ops exist
# once `import dpmethods` returns), not every submodule. Type checkers see the eager
# imports below. To add a public name: one line in _EXPORTS, one import in the
# TYPE_CHECKING block.
_EXPORTS: dict[str, str] = {
    "DataParallel": "data_parallel",
    "DistributedDataParallel": "distributed",
    "MethodOptions": "registry",
    "chunk_sizes": "scatter",
    "extension_info": "ops",
    "fully_shard": "distributed",
    "gather": "gather",
    "gather_generate": "generate",
    "get_options": "registry",
    "load_state_dict": "utils",
    "parallel_apply": "parallel_apply",
    "parallel_method": "registry",
    "parallel_methods": "registry",
    "register": "registry",
    "register_fsdp_methods": "distributed",
    "replicate": "replicate",
    "route": "distributed",
    "scatter": "scatter",
    "scatter_call": "scatter",
    "strip_prefix": "utils",
    "register_type": "type_rules",
    "unwrap": "utils",
}

if TYPE_CHECKING:
    from .data_parallel import DataParallel
    from .distributed import DistributedDataParallel, fully_shard, register_fsdp_methods, route
    from .gather import gather
    from .generate import gather_generate
    from .ops import extension_info
    from .parallel_apply import parallel_apply
    from .registry import MethodOptions, get_options, parallel_method, parallel_methods, register
    from .replicate import replicate
    from .scatter import chunk_sizes, scatter, scatter_call
    from .type_rules import register_type
    from .utils import load_state_dict, strip_prefix, unwrap

__version__ = "0.1.0"

__all__ = [
    "DataParallel",
    "DistributedDataParallel",
    "MethodOptions",
    "__version__",
    "chunk_sizes",
    "extension_info",
    "fully_shard",
    "gather",
    "gather_generate",
    "get_options",
    "load_state_dict",
    "parallel_apply",
    "parallel_method",
    "parallel_methods",
    "register",
    "register_fsdp_methods",
    "register_type",
    "replicate",
    "route",
    "scatter",
    "scatter_call",
    "strip_prefix",
    "unwrap",
]


class _Package(types.ModuleType):
    """This package's module type: a function keeps its name over its submodule's.

    ``gather``, ``scatter``, ``replicate`` and ``parallel_apply`` name both a function
    and the submodule defining it. The import system binds a submodule on its package
    when the submodule is first imported, which with lazy imports can happen after the
    function was bound (``from dpmethods.data_parallel import ...`` imports ``gather``).
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == name:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    if not name.startswith("__"):
        try:
            return importlib.import_module(f".{name}", __name__)  # dpmethods.ops, ...
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


# The built-in integrations hook into the registries, to load each once its library is
# imported (dpmethods.integrations); none imports its library itself.
from . import integrations as _integrations  # noqa: E402, F401

# Load dpmethods._C now, as torchvision registers its ops on import: code that calls
# torch.ops.dpmethods.gather_coalesced directly, or loads a saved torch.export program
# holding it, must find the op after `import dpmethods`. Importing dpmethods.ops loads
# the extension (after torch, whose libtorch it links against) and gives the op its
# fake and autograd kernels; a missing or broken build, or
# DPMETHODS_DISABLE_EXTENSION=1, leaves the pure-PyTorch gather, logged once as before.
from . import ops as _ops  # noqa: E402, F401
