"""The type system: how structures come apart and are joined.

``tree`` walks nested inputs and outputs through the rules registered with
``rules.register_type`` (and torch's pytree registry); ``torch_rules`` holds the rules of
torch's own types; ``per_item`` and ``per_item_args`` handle sequences with one entry per
batch item; ``values`` joins non-tensor leaves; ``coupled`` and ``coupled_modules`` check
for results that couple the items of a batch.
"""

# The rules module registers the rule hooks with the tree walk (the tree imports
# nothing of its rules): importing the package is enough to have them.
from dpmethods.types import rules as _rules  # noqa: F401
