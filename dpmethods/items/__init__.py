"""Item mode of ``DataParallel.map``: batches built for the data, from single items.

With ``batch_size=`` or ``max_tokens=``, ``map`` reads its input as items. This layer
sits on top of the map: it reads the items a window at a time, sorts each window by
length (longest first), cuts it into batches under the caps (:mod:`.batches`), collates
each batch (:mod:`.collate`), runs the batches through the map as ``(index, batch)``
pairs, cuts each batch's output back into one output per item by the inverse of the
method's gather rules (:mod:`dpmethods.types.cut`; :mod:`.trim` tells the padded dims
for ``trim=True``) and restores the input order (:mod:`.run`).
"""

from dpmethods.items.options import ItemOptions, item_options
from dpmethods.items.run import map_items

__all__ = ["ItemOptions", "item_options", "map_items"]
