"""Storage backends for KV blocks below the device pool: host memory, disk, Redis — one interface.

A backend stores opaque bytes (:mod:`memos_ref.tiering.blockfile` makes and checks them) under validated keys:
``put``, ``get``, ``delete``, ``contains``, ``keys``, ``stats`` and batched ``put_many`` / ``get_many``. Each
has a byte budget and evicts its least recently used blocks to stay inside it — handing each to ``on_evict``
first, so the tier store can demote it to the next tier (Redis: its own ``maxmemory`` policy, plus an optional
TTL).

What a backend reads is untrusted (another process, or anyone with write access to the directory or the
server, may have put it there): reads are bounded by ``max_item_bytes`` (the tier store sets it to the largest
block file its geometry allows) and a copy that cannot be a block — too large, not a regular file, a symlink —
is answered as a miss and counted ``corrupt``. Nothing raises into the caller for what it finds stored.

One module per backend (issue 29): :mod:`~memos_ref.tiering.backend_base` (the interface and the shared
byte-budget LRU), :mod:`~memos_ref.tiering.host_backend`, :mod:`~memos_ref.tiering.disk_backend`,
:mod:`~memos_ref.tiering.redis_tier`; this module re-exports them.
"""

from memos_ref.tiering.backend_base import TierBackend, validate_block_key
from memos_ref.tiering.disk_backend import DiskBackend, temp_name
from memos_ref.tiering.host_backend import HostMemoryBackend
from memos_ref.tiering.redis_tier import RedisTierBackend

__all__ = ["DiskBackend", "HostMemoryBackend", "RedisTierBackend", "TierBackend", "temp_name", "validate_block_key"]
