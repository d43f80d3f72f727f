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
    matched, or that it is fixed. The entries of a per-item list (a list with one entry
    per item) count as one path, ``[*]`` for their index: each entry is padded by the call
    that made it, to the longest item of that call, which is the batch's longest unless
    the batch ran in parts (``on_oom="split"``'s halves); the entries of one call are
    consecutive and of one size, so an entry's padded length is the longest item of its
    run of consecutive entries of its size.

    Example:
        >>> import torch
        >>> dims = PaddedDims()
        >>> dims.observe({"h": torch.zeros(2, 4, 4)}, Padding(4, [(0, 4), (0, 2)]))  # untold
        >>> dims.told({"h": torch.zeros(2, 4, 4)}, Padding(4, [(0, 4), (0, 2)]))
        False
        >>> dims.observe({"h": torch.zeros(1, 2, 4)}, Padding(2, [(0, 2)]))  # the probe
        >>> dims.padded("output['h']", 1), dims.padded("output['h']", 2)
        (True, False)
        >>> halves = [torch.zeros(3, 4), torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(5, 4)]
        >>> dims.observe(halves, Padding(5, [(0, 3), (0, 2), (0, 5), (0, 4)]))  # a batch in halves
        >>> dims.padded("output[*]", 0), dims.padded("output[*]", 1)
        (True, False)
    """

    def __init__(self) -> None:
        self.lengths: dict[tuple[str, int], set[int]] = {}  # padded lengths a dim had
        self.fixed: set[tuple[str, int]] = set()  # dims seen with another size

    def observe(self, out: Any, padding: Padding) -> None:
        """Record the dims of ``out``'s tensors, from a batch padded as ``padding`` says."""
        for key, sizes, lengths in _dims(out, padding):
            if sizes == lengths:
                self.lengths.setdefault(key, set()).update(lengths)
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
        for key, sizes, lengths in _dims(out, padding):
            if sizes == lengths and key not in self.fixed and len(self.lengths.get(key, ())) < 2:
                return f"{key[0]}'s dim {key[1]}"
        return None

    def told(self, out: Any, padding: Padding | None) -> bool:
        return self.untold(out, padding) is None


def _dims(out: Any, padding: Padding) -> list[tuple[tuple[str, int], list[int], list[int]]]:
    """Per path and dim of ``out``'s tensors: their sizes there, and the padded lengths
    that would match (one tensor, the batch's longest; a per-item list's entries, each
    its call's longest)."""
    spec, leaves = _tree.flatten(out)
    found: dict[tuple[str, int], tuple[list[int], list[int | None]]] = {}
    for path, entry, t in _walk(spec, leaves, len(padding.spans)):
        for d, size in enumerate(t.shape):
            sizes, entries = found.setdefault((path, d), ([], []))
            sizes.append(size)
            entries.append(entry)
    result = []
    own = [end - start for start, end in padding.spans]
    for key, (sizes, entries) in found.items():
        if entries[0] is None or len(entries) != len(own) or entries != list(range(len(own))):
            result += [(key, [size], [padding.longest]) for size in sizes]
            continue
        lengths = []
        i = 0
        while i < len(sizes):  # each run of one size: a call, padded to its longest item
            j = i
            while j < len(sizes) and sizes[j] == sizes[i]:
                j += 1
            lengths += [max(own[i:j])] * (j - i)
            i = j
        result.append((key, sizes, lengths))
    return result


def _walk(spec: _tree.Spec, leaves: list[Any], rows: int) -> list[tuple[str, int | None, Tensor]]:
    """``(path, entry, tensor)`` of each tensor leaf; in a per-item list (a list of ``rows``
    entries, not of batch outputs) its path has ``[*]`` for the index, and entry the index."""
    found: list[tuple[str, int | None, Tensor]] = []

    def walk(spec: _tree.Spec, pos: int, path: str, entry: int | None) -> int:
        if spec in _tree.LEAVES:
            if isinstance(leaves[pos], Tensor):
                found.append((path, entry, leaves[pos]))
            return pos + 1
        each = entry is None and spec.kind == _tree.LIST and len(spec.children) == rows and not (
            all(c == _tree.LEAF for c in spec.children)  # a list of batch outputs (one per layer)
            and all(isinstance(t, Tensor) and t.dim() and t.shape[0] == rows for t in leaves[pos:pos + rows]))
        for i, (child, label) in enumerate(zip(spec.children, _tree.children_labels(spec))):
            pos = walk(child, pos, path + ("[*]" if each else label), i if each else entry)
        return pos

    walk(spec, 0, "output", None)
    return found
