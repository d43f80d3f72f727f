"""Which dims of a method's outputs are padding, for ``trim=True``, told from evidence.

One batch cannot tell a padded dim from a fixed size that happens to equal the batch's
padded length (a width of 32 in a batch padded to 32 tokens). A dim is padded when it
had the padded length in batches of two different padded lengths at least, and fixed
once one batch shows another size. So that the evidence comes early, the first batch
that pads an item is followed by a probe: its shortest item alone, whose output is
only measured. A batch's outputs wait until every dim of the padded length in them is
told; a map that ends with one untold is refused, naming the output. A probe that raises
(the item fails alone, as in its batch) tells nothing: the next batch that pads an item
is followed by another (three in all), and a map that ends with batches untold after a
failed probe runs the first one's shortest item alone; if that raises too, each of their
items gets an error saying that the trim could not be measured, caused by the probe's
(:class:`dpmethods.items.run.ItemIterator`).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from dpmethods.types import tree as _tree
from dpmethods.types.cut import Padding

__all__ = ["PaddedDims"]


class PaddedDims:
    """The evidence of a map's batches: per output path and dim, the padded lengths it
    matched, or that it is fixed.

    Example:
        >>> import torch
        >>> dims = PaddedDims()
        >>> dims.observe({"h": torch.zeros(2, 4, 4)}, 4)  # width 4 and padded length 4: untold
        >>> dims.told({"h": torch.zeros(2, 4, 4)}, Padding(4, [(0, 4), (0, 2)]))
        False
        >>> dims.observe({"h": torch.zeros(1, 2, 4)}, 2)  # the probe: dim 1 tracks, dim 2 does not
        >>> dims.padded("output['h']", 1), dims.padded("output['h']", 2)
        (True, False)
    """

    def __init__(self) -> None:
        self.lengths: dict[tuple[str, int], set[int]] = {}  # padded lengths a dim had
        self.fixed: set[tuple[str, int]] = set()  # dims seen with another size

    def observe(self, out: Any, longest: int) -> None:
        """Record the dims of ``out``'s tensors, from a batch padded to ``longest``."""
        for path, t in _tensors(out):
            for d, size in enumerate(t.shape):
                key = (path, d)
                if size == longest:
                    self.lengths.setdefault(key, set()).add(longest)
                else:
                    self.fixed.add(key)

    def padded(self, path: str, dim: int) -> bool:
        """Whether dim ``dim`` of the batch output at ``path`` is padding."""
        return (path, dim) not in self.fixed and len(self.lengths.get((path, dim), ())) >= 2

    def untold(self, out: Any, padding: Padding | None) -> str | None:
        """The first dim of ``out`` with the padded length not told yet, as ``path dim d``;
        None when every one is told or nothing in the batch was padded."""
        if padding is None or all(end - start == padding.longest for start, end in padding.spans):
            return None
        for path, t in _tensors(out):
            for d, size in enumerate(t.shape):
                key = (path, d)
                if size == padding.longest and key not in self.fixed and len(self.lengths.get(key, ())) < 2:
                    return f"{path}'s dim {d}"
        return None

    def told(self, out: Any, padding: Padding | None) -> bool:
        return self.untold(out, padding) is None


def _tensors(out: Any) -> list[tuple[str, Tensor]]:
    spec, leaves = _tree.flatten(out)
    return [(p, t) for p, t in zip(_tree.leaf_paths(spec), leaves) if isinstance(t, Tensor)]
