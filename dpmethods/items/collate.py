"""Items into one batch: an item's length, the default collate, and where each row's
own positions lie in the padded batch.

The default collate pads 1-D tensors (and mappings of them; lists of ints are taken
as 1-D tensors) with 0 to the batch's longest, on the right, or on the left for a
decoder-only ``generate``, whose prompts must end where generation starts (an
encoder-decoder's prompts go to its encoder, padded on the right); a mapping with
``input_ids`` and no ``attention_mask`` gets one, and so do a transformers model's
``generate``'s 1-D tensors, as ``{"input_ids", "attention_mask"}``. A method that takes per-item lists
(one with ``split=``: sentence-transformers ``encode``, detection models) gets the
items as a plain list, mapping items as a mapping of per-item lists, and tuples as a
tuple of them (``(image, target)`` items: ``forward(images, targets)``).
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from dpmethods.types.cut import Padding
from dpmethods.vocab.options import MethodOptions

__all__ = ["as_call", "check_takes", "default_collate", "masks_ids", "measure", "padding_of", "pads_left"]


def _got(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of shape {list(value.shape)}"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _default_length(item: Any, index: int) -> Any:
    if isinstance(item, Tensor):
        if item.dim() == 1:
            return item.shape[0]
    elif isinstance(item, Mapping):
        ids = item.get("input_ids")
        if (isinstance(ids, Tensor) and ids.dim() == 1) or isinstance(ids, (list, tuple)):
            return len(ids)
    elif isinstance(item, (str, bytes, Sequence)):
        return len(item)
    raise TypeError(
        f"map: length: item {index} is {_got(item)}; the default length is len() of a str or a "
        "sequence, the size of a 1-D tensor, or len(item['input_ids']) of a mapping: pass "
        "length= (a function of one item that returns its cost, an int)" + _IMAGES.get(_is_image(item), "")
    )


# Single images (tensors of 2+ dims) have neither a default length nor a default collate:
# both errors name what maps images of one size.
_IMAGES = {True: "; images of one size: length=lambda image: 1, collate=torch.stack"}


def _is_image(value: Any) -> bool:
    return isinstance(value, Tensor) and value.dim() >= 2


def measure(length: Callable[[Any], Any] | None, item: Any, index: int) -> int:
    """Item ``index``'s length, checked: a non-negative int.

    Example:
        >>> measure(None, "four", 0), measure(None, {"input_ids": [1, 2]}, 1)
        (4, 2)
        >>> measure(lambda s: 2.5, "x", 7)
        Traceback (most recent call last):
        ...
        TypeError: map: length: expected a non-negative int for item 7, got float 2.5
    """
    n = _default_length(item, index) if length is None else length(item)
    try:
        if isinstance(n, bool):
            raise TypeError
        value = operator.index(n)
    except TypeError:
        raise TypeError(f"map: length: expected a non-negative int for item {index}, got {_got(n)}") from None
    if value < 0:
        raise ValueError(f"map: length: expected a non-negative int for item {index}, got {value}")
    return value


def _sequence(value: Any, index: int, key: Any) -> Tensor:
    if isinstance(value, Tensor) and value.dim() == 1:
        return value
    if isinstance(value, (list, tuple)) and all(type(v) is int for v in value):
        return torch.tensor(value, dtype=torch.long)
    where = "" if key is None else f"[{key!r}]"
    raise TypeError(
        f"map: collate: item {index}{where} is {_got(value)}; the default collate pads 1-D "
        "tensors (and mappings of them) into a batch: pass collate= (a function of a list of "
        "items that returns the batch, as a tokenizer call does)" + _IMAGES.get(key is None and _is_image(value), "")
    )


def _pad(rows: list[Tensor], left: bool, dim: int, indices: Sequence[int], key: Any) -> Tensor:
    longest = max(len(r) for r in rows)
    dtype = rows[0].dtype
    out = rows[0].new_zeros((len(rows), longest))
    for i, (row, index) in enumerate(zip(rows, indices)):
        if row.dtype != dtype:
            raise TypeError(
                f"map: collate: item {index}{'' if key is None else f'[{key!r}]'} has dtype {row.dtype}, "
                f"item {indices[0]} {dtype}: the default collate pads tensors of one dtype"
            )
        if left:
            out[i, longest - len(row):] = row
        else:
            out[i, : len(row)] = row
    if dim in (0, -2):
        return out
    if dim in (1, -1):
        return out.T
    raise ValueError(
        f"map: collate: the default collate makes 2-D batches, but the method's dim is {dim}: "
        "pass collate="
    )


def default_collate(
    items: list[Any], indices: Sequence[int], method: str, options: MethodOptions, left: bool | None = None,
    masked: bool = False,
) -> tuple[Any, Padding | None]:
    """``items`` as one batch of ``method``, and each row's own positions (None: no padding).
    ``left``: pad on the left (None: for ``generate``, see :func:`pads_left`). ``masked``:
    1-D tensors come as ``{"input_ids", "attention_mask"}`` (see :func:`masks_ids`).

    Example:
        >>> batch, padding = default_collate([{"input_ids": [5, 6]}, {"input_ids": [7]}], [0, 1],
        ...                                  "forward", MethodOptions())
        >>> batch["input_ids"].tolist(), batch["attention_mask"].tolist(), padding.spans
        ([[5, 6], [7, 0]], [[1, 1], [1, 0]], [(0, 2), (0, 1)])
    """
    if options.split:  # the method takes per-item lists: one per argument
        if all(isinstance(item, Mapping) for item in items):
            return {k: [item[k] for item in items] for k in items[0]}, None
        if all(type(item) is tuple and len(item) == len(items[0]) for item in items):
            return tuple(list(column) for column in zip(*items)), None
        return list(items), None
    if left is None:
        left = method == "generate"
    if not isinstance(items[0], Mapping):
        rows = [_sequence(item, index, None) for item, index in zip(items, indices)]
        if masked:
            items = [{"input_ids": r} for r in rows]
        else:
            return _pad(rows, left, options.dim, indices, None), Padding.of([len(r) for r in rows], left)
    keys = list(items[0])
    for item, index in zip(items, indices):
        if not isinstance(item, Mapping) or set(item) != set(keys):
            raise TypeError(
                f"map: collate: item {index} is {_got(item)}, item {indices[0]} a mapping with keys "
                f"{keys}: the default collate joins mappings with the same keys"
            )
    columns = {k: [_sequence(item[k], index, k) for item, index in zip(items, indices)] for k in keys}
    decoder = columns.get("decoder_input_ids")
    if method == "generate" and decoder is not None and len({len(r) for r in decoder}) > 1:
        raise ValueError(
            f"map: collate: the items {list(indices)} have decoder_input_ids of lengths "
            f"{[len(r) for r in decoder]}: padded into one batch, generate would continue each "
            "shorter decoder prompt after its padding, not as alone. Give every item's decoder "
            "prompt one length, or map batches of your own (no batch_size= or max_tokens=)"
        )
    batch = {k: _pad(rows, left, options.dim, indices, k) for k, rows in columns.items()}
    lengths = [len(r) for r in columns["input_ids" if "input_ids" in columns else keys[0]]]
    if "input_ids" in columns and "attention_mask" not in columns:
        ones = [torch.ones(n, dtype=torch.long, device=r.device) for n, r in zip(lengths, columns["input_ids"])]
        batch["attention_mask"] = _pad(ones, left, options.dim, indices, "attention_mask")
    return batch, Padding.of(lengths, left)


def pads_left(module: Any, method: str) -> bool:
    """Whether ``method``'s prompts are padded on the left: a ``generate`` that continues
    them (a decoder-only model), not an encoder-decoder's (``config.is_encoder_decoder``:
    T5, BART, Whisper), whose encoder reads them where they stand, so left padding
    would move each prompt's positions (BART's learned positions) away from its own.

    Example:
        >>> import torch
        >>> pads_left(torch.nn.Linear(2, 2), "generate"), pads_left(torch.nn.Linear(2, 2), "forward")
        (True, False)
    """
    if method != "generate":
        return False
    return not bool(getattr(getattr(module, "config", None), "is_encoder_decoder", False))


def masks_ids(module: Any, method: str) -> bool:
    """Whether ``method``'s 1-D tensor items are token ids that the default collate gives an
    ``attention_mask`` (as ``{"input_ids", "attention_mask"}``): a transformers model's
    ``generate`` (``main_input_name`` "input_ids"), which without one takes the mask from
    its ``pad_token_id``, so it would attend to the batch's padding (0) where that id is
    another or unset, and mask a prompt's own tokens equal to it.

    Example:
        >>> import torch
        >>> masks_ids(torch.nn.Linear(2, 2), "generate")
        False
    """
    return method == "generate" and getattr(module, "main_input_name", None) == "input_ids"


def padding_of(batch: Any, lengths: Sequence[int], left: bool, rows: int) -> Padding:
    """Each row's own positions in a batch that a given ``collate`` built: from its
    ``attention_mask`` (rows on dim 0) when it has one, else the items' ``length=``,
    padded on the right (the left for ``generate``)."""
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if not (isinstance(mask, Tensor) and mask.dim() == 2 and mask.shape[0] == rows):
        return Padding.of(lengths, left)
    spans = []
    for row in (mask != 0).cpu():
        where = row.nonzero()
        spans.append((int(where[0]), int(where[-1]) + 1) if len(where) else (0, 0))
    return Padding(int(mask.shape[1]), spans)


def as_call(batch: Any, kwargs: Mapping[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A batch as the map passes it: a Mapping as keywords, a tuple as positional
    arguments, anything else as the one argument."""
    if isinstance(batch, Mapping):
        return (), {**batch, **kwargs}
    return (batch if isinstance(batch, tuple) else (batch,)), dict(kwargs)


def check_takes(signature: inspect.Signature | None, name: str, batch: Any, kwargs: Mapping[str, Any],
                indices: Sequence[int]) -> None:
    """Refuse a collated batch that ``name`` cannot take as its arguments."""
    if batch is None:
        raise TypeError(f"map: collate: returned None for items {list(indices)}; expected the batch")
    if signature is None:
        return
    args, keywords = as_call(batch, kwargs)
    if isinstance(batch, Mapping) and not all(isinstance(k, str) for k in batch):
        return  # the map's own check names the key
    try:
        signature.bind(*args, **keywords)
    except TypeError as exc:
        what = f"a mapping with keys {list(batch)}" if isinstance(batch, Mapping) else _got(batch)
        raise TypeError(
            f"map: collate: the batch of items {list(indices)} is {what}, which {name} cannot "
            f"take ({exc}); a Mapping batch is passed as keyword arguments, a tuple as "
            "positional ones, anything else as the one argument"
        ) from None
