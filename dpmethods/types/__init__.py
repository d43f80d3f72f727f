"""The type system: how structures come apart and are joined.

``tree`` walks nested inputs and outputs through the rules registered with
``rules.register_type`` (and torch's pytree registry); ``torch_rules`` holds the rules of
torch's own types; ``per_item`` is the structure of sequences with one entry per batch
item; ``named_classes`` resolves ``"module:Class"`` names; ``owners`` finds the class
that owns a module's methods (through ``torch.compile``); ``coupled_modules`` records the
module classes whose result couples the items of a batch. How the stages use these
lives with the stages: ``dpmethods.core.scatter`` and ``dpmethods.core.gather``.
"""

# The rules module registers the rule hooks with the tree walk (the tree imports
# nothing of its rules): importing the package is enough to have them.
from dpmethods.types import rules as _rules  # noqa: F401
