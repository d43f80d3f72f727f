"""The Qwen2-VL family: all images' patches in one tensor, beside one grid row per image.

``pixel_values`` is ``[sum of patches, d]`` and ``image_grid_thw`` ``[images, 3]``
(``t, h, w`` per image); each image stands in its row's text as
``prod(t, h, w) / merge_size**2`` image tokens. The patches and grids reach every
replica whole (they are in ``broadcast``), and :data:`VISION_SHARES` keeps, for each
replica, the patches and grid rows of the images whose tokens are in its rows of
``input_ids`` (videos likewise), and gives a replica whose rows have no images none, as
a text-only batch. Per-image outputs (``image_outputs``) are joined in
image order by :func:`take_per_image`: per-image sequences extended, tensors and the
per-layer tuples of them joined along dim 0.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from dpmethods.extending import Call, CallHooks, gather, unwrap_compiled

__all__ = ["VISION_ARGUMENTS", "VISION_SHARES", "take_per_image", "takes_vision_grids"]

# (patches, grid rows, per-grid extras, the config's token id).
_VISION = (
    ("pixel_values", "image_grid_thw", (), "image_token_id"),
    ("pixel_values_videos", "video_grid_thw", ("second_per_grid_ts",), "video_token_id"),
)
VISION_ARGUMENTS: tuple[str, ...] = tuple(
    name for patches, grid, extra, _ in _VISION for name in (patches, grid, *extra)
)
_PER_IMAGE = ("image_outputs", "video_outputs")


def takes_vision_grids(cls: type) -> bool:
    """Whether ``cls.forward`` takes images as patches beside per-image grids.

    Example:
        >>> takes_vision_grids(object)
        False
    """
    try:
        return "image_grid_thw" in inspect.signature(cls.forward).parameters  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError):
        return False


def _input_ids(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    ids = kwargs.get("input_ids")
    if ids is None and args and isinstance(args[0], Tensor):
        ids = args[0]
    return ids


def _images_per_row(ids: Tensor, grid: Tensor, token: int, merge: int, what: str) -> list[int]:
    tokens = (grid.prod(-1) // merge**2).tolist()
    counts, image = [], 0
    for row, have in enumerate((ids == token).sum(-1).tolist()):
        start = image
        while have > 0 and image < len(tokens):
            have -= tokens[image]
            image += 1
        if have != 0:
            raise ValueError(
                f"DataParallel: {what}: row {row} of input_ids has image tokens that match no "
                f"run of the {len(tokens)} grids ({tokens} tokens each, in order); expected "
                "each row's images, in order, with prod(t, h, w) / merge_size**2 tokens each"
            )
        counts.append(image - start)
    return counts


def _shares(
    args: tuple[Any, ...], kwargs: dict[str, Any], start: int, call: Call
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``per_replica``: a replica keeps the patches and grid rows of its rows' images."""
    mine, full = _input_ids(args, kwargs), _input_ids(call.args, call.kwargs)
    if not isinstance(mine, Tensor) or not isinstance(full, Tensor):
        return args, kwargs
    config = getattr(unwrap_compiled(call.module), "config", None)
    merge = getattr(getattr(config, "vision_config", None), "spatial_merge_size", None)
    kwargs = dict(kwargs)
    for patches, grid_name, extra, token_attr in _VISION:
        grid, token = kwargs.get(grid_name), getattr(config, token_attr, None)
        if not isinstance(grid, Tensor) or token is None or merge is None:
            continue
        counts = _images_per_row(full.to(grid.device), grid, int(token), int(merge), grid_name)
        first = sum(counts[:start])
        last = first + sum(counts[start : start + mine.shape[0]])
        if first == last:  # rows without images: none given, as to a text-only batch
            for name in (patches, grid_name, *extra):
                kwargs.pop(name, None)
            continue
        sizes = grid.prod(-1)
        offset = int(sizes[:first].sum())
        kwargs[grid_name] = grid[first:last]
        if isinstance(kwargs.get(patches), Tensor):
            kwargs[patches] = kwargs[patches][offset : offset + int(sizes[first:last].sum())]
        for name in extra:
            if kwargs.get(name) is not None:
                kwargs[name] = kwargs[name][first:last]
    return args, kwargs


VISION_SHARES = CallHooks(per_replica=_shares)
"""The hooks that give each replica the patches and grid rows of its rows' images."""


def take_per_image(outputs: list[Any], device: torch.device) -> dict[str, Any]:
    """Per-image outputs (a vision tower's, one entry per image) joined in image order.

    A replica holds its rows' images only, none for rows without images: they are taken
    out of the outputs (left ``None``) and joined apart, to be put back in the joined
    output.

    Example:
        >>> outs = [{"image_outputs": [1, 2]}, {"image_outputs": None}, {"image_outputs": [3]}]
        >>> take_per_image(outs, torch.device("cpu")), outs[0]
        ({'image_outputs': [1, 2, 3]}, {'image_outputs': None})
    """
    taken: dict[str, Any] = {}
    if not all(isinstance(o, Mapping) for o in outputs):
        return taken
    for key in _PER_IMAGE:
        present = [o.get(key) for o in outputs if o.get(key) is not None]
        if not present:
            continue
        for o in outputs:
            if o.get(key) is not None:
                o[key] = None
        taken[key] = _join_images(present, device)
    return taken


def _per_layer(name: str) -> bool:
    # transformers' name for a tuple with one entry per layer, each batched as the output.
    return name.endswith(("hidden_states", "attentions"))


def _join_images(present: list[Any], device: torch.device) -> Any:
    """The replicas' per-image outputs in image order: a sequence with one entry per
    image (a tower's ``pooler_output``) extended; tensors (a row or patches per image)
    and the per-layer tuples of them (``hidden_states``, ``attentions``) joined along
    dim 0, layer by layer."""
    first = present[0]
    if not isinstance(first, Mapping):
        return gather(present, device, 0, mode="extend")
    modes = {k: "cat" if _per_layer(k) else "extend" for k in first}
    joined = gather(present, device, 0, mode=modes)
    for key, value in first.items():
        if type(value) is tuple and type(joined[key]) is list:
            joined[key] = tuple(joined[key])  # as the tower returns it (Qwen2-VL's pooler_output)
    return joined
