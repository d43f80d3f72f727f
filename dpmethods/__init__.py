"""dpmethods: data parallelism for model methods other than ``forward``.

Mark methods with :func:`parallel_method`, wrap the model in :class:`DataParallel`
(one process, several devices) or :class:`DistributedDataParallel` / :func:`fully_shard`
(torchrun), and call ``wrapper.encode(x)`` as you would call the model.
"""

from __future__ import annotations

from .data_parallel import DataParallel
from .distributed import DistributedDataParallel, fully_shard, register_fsdp_methods, route
from .gather import gather
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
