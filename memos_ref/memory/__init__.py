"""Short-term memory store (seed 002): a TTL key-value cache of JSON values with hybrid LRU/LFU eviction, an
expiry heap, sharded locks and stampede protection, in this process (:class:`MemoryBackend`) or in Redis
(:class:`RedisBackend`) behind one interface (:class:`CacheBackend`). Independent of the attention KV cache:
see notebook 12 for how the two differ."""

from memos_ref.memory.backend import MISSING, CacheBackend
from memos_ref.memory.metrics import MemoryMetrics
from memos_ref.memory.redis_backend import RedisBackend
from memos_ref.memory.redis_server import RedisServer, redis_server_path
from memos_ref.memory.sharded import MemoryBackend, ShardedStore
from memos_ref.memory.store import POLICIES, AbsentKeyError, KVEntry, TTLStore, validate_key

__all__ = [
    "MISSING",
    "POLICIES",
    "AbsentKeyError",
    "CacheBackend",
    "KVEntry",
    "MemoryBackend",
    "MemoryMetrics",
    "RedisBackend",
    "RedisServer",
    "ShardedStore",
    "TTLStore",
    "redis_server_path",
    "validate_key",
]
