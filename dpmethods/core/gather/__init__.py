"""The gather stage: the replicas' outputs joined onto one device.

``run`` walks the outputs and joins each leaf by its mode; ``join`` joins tensor leaves
(one coalesced call for everything concatenated; ``sparse`` the sparse ones), ``values``
the other leaves, ``keys`` maps a mode or gather dim given per output key onto the
leaves, and ``coupled`` checks outputs that hold a replica's share in two dims or in the
wrong one.
"""

from dpmethods.core.gather.run import gather, join_outputs

__all__ = ["gather", "join_outputs"]
