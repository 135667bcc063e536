"""Short-term memory store (seed 002): a TTL key-value cache with hybrid LRU/LFU eviction, an expiry heap,
sharded locks and stampede protection. Independent of the attention KV cache (see notebook 10, coming)."""

from memos_ref.memory.sharded import MISSING, ShardedStore
from memos_ref.memory.store import POLICIES, KVEntry, TTLStore, validate_key

__all__ = ["MISSING", "POLICIES", "KVEntry", "ShardedStore", "TTLStore", "validate_key"]
