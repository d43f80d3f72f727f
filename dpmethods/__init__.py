"""dpmethods: data parallelism for model methods other than ``forward``.

Mark methods with :func:`parallel_method`, wrap the model in :class:`DataParallel`
(one process, several devices) or :class:`DistributedDataParallel` / :func:`fully_shard`
(torchrun), and call ``wrapper.encode(x)`` as you would call the model.
"""

from __future__ import annotations

from .data_parallel import DataParallel
from .gather import gather
from . import ops as _ops
from .parallel_apply import parallel_apply
from .registry import MethodOptions, get_options, parallel_method, parallel_methods, register
from .replicate import replicate
from .scatter import chunk_sizes, scatter, scatter_call
from .utils import load_state_dict, strip_prefix, unwrap

__version__ = "0.1.0"
extension_info = getattr(_ops, "extension_info", None)  # TEMP until ops lands

__all__ = [
    "DataParallel",
    "MethodOptions",
    "__version__",
    "chunk_sizes",
    "extension_info",
    "gather",
    "get_options",
    "load_state_dict",
    "parallel_apply",
    "parallel_method",
    "parallel_methods",
    "register",
    "replicate",
    "scatter",
    "scatter_call",
    "strip_prefix",
    "unwrap",
]

try:  # the distributed wrappers are optional until their module lands
    from .distributed import *  # noqa: F403
    from .distributed import __all__ as _distributed_all

    __all__ += list(_distributed_all)
except ImportError:  # pragma: no cover
    pass
