"""Dense KV caches: the naive concat cache (notebook 01) and the preallocated contiguous cache (notebook 02)."""

from memos_ref.caches.base import MemosCache, check_new_kv
from memos_ref.caches.concat import ConcatCache, ConcatLayer
from memos_ref.caches.contiguous import LAYOUTS, ContiguousCache, ContiguousLayer, GrowthEvent

__all__ = [
    "LAYOUTS",
    "ConcatCache",
    "ConcatLayer",
    "ContiguousCache",
    "ContiguousLayer",
    "GrowthEvent",
    "MemosCache",
    "check_new_kv",
]
