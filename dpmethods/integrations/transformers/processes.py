"""transformers models in worker processes (``workers="processes"``).

- The output-capturing hooks transformers installs on a model's first call with
  ``output_attentions`` or ``output_hidden_states`` (closures, which cannot be pickled,
  with the ``_output_capturing_hooks_installed`` flag) belong to the process that made
  that call: they are never sent, and a worker's model installs its own.
- A model's constructor registers which outputs its class can capture, per process; a
  model unpickled in a worker skips the constructor, so the worker registers it again
  (else ``hidden_states`` and ``attentions`` would come back empty there).

Example:
    >>> _capturing_hook(print)
    False
"""

from __future__ import annotations

import sys
from typing import Any

from dpmethods.extending import register_process_rule

__all__: list[str] = []

_CAPTURING = "transformers.utils.output_capturing"


def _capturing_hook(hook: Any) -> bool:
    return getattr(hook, "__module__", None) == _CAPTURING


def _register_outputs(module: Any) -> None:
    registry = getattr(sys.modules.get(_CAPTURING), "_CAN_RECORD_REGISTRY", None)
    if registry is not None and hasattr(type(module), "_can_record_outputs"):
        if str(type(module)) not in registry:  # keyed by class, as transformers keys it
            registry[module] = module._can_record_outputs


register_process_rule(
    _capturing_hook, attributes=("_output_capturing_hooks_installed",), rebuilt=_register_outputs
)
