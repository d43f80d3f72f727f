"""The type system: how structures come apart and are joined.

``tree`` walks nested inputs and outputs through the rules registered with
``rules.register_type`` (and torch's pytree registry); ``torch_rules`` holds the rules of
torch's own types; ``per_item`` is the structure of sequences with one entry per batch
item; ``cut`` cuts a batch's output into its items' outputs; ``named_classes`` resolves
``"module:Class"`` names once their module is imported; ``owners`` finds the class that
owns a module's methods (through ``torch.compile``); ``coupled_modules`` keeps the
module classes whose result couples the items of a batch; ``digests`` tells values and
models apart cheaply (what a resumable map checks). How the stages use these
lives with the stages: ``dpmethods.core.scatter`` and ``dpmethods.core.gather``.
"""

# The rules module puts torch's own rules in the tree walk's table, and waits for
# torch.distributions for the others (the tree imports nothing of its rules): importing
# the package is enough to have them.
from dpmethods.types import rules as _rules  # noqa: F401
