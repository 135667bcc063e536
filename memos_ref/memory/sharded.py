"""MemoryBackend (also called ShardedStore): a thread-safe short-term memory in this process — N
:class:`TTLStore` shards, each behind its own lock (seed 002 §5.1), so threads touching different keys rarely
wait for each other. Stampede protection and jitter come from :class:`CacheBackend`.
"""

from __future__ import annotations

import threading
import zlib
from collections import Counter
from collections.abc import Callable
from typing import Any

from memos_ref.errors import ArgumentTypeError, ConfigError, check_type
from memos_ref.memory.backend import DEFAULT, MISSING, CacheBackend
from memos_ref.memory.store import TTLStore, validate_key

__all__ = ["MISSING", "MemoryBackend", "ShardedStore"]


class ShardedStore(CacheBackend):
    """Thread-safe TTL store over ``shards`` independent shards (keys routed by a stable hash).

    Args:
        shards: number of shards (1 = a single lock).
        default_ttl / negative_ttl / ttl_jitter / seed: see :class:`CacheBackend`.
        **store_kwargs: passed to every :class:`TTLStore` (capacity limits are per shard; ``policy``, ``clock``).
    """

    name = "memory"

    def __init__(
        self,
        shards: int = 8,
        *,
        default_ttl: float | None = 300.0,
        negative_ttl: float = 5.0,
        ttl_jitter: float = 0.0,
        seed: int = 0,
        **store_kwargs: Any,
    ) -> None:
        check_type("shards", shards, int)
        if shards < 1:
            raise ConfigError(f"shards must be >= 1, got {shards}")
        super().__init__(default_ttl=default_ttl, negative_ttl=negative_ttl, ttl_jitter=ttl_jitter, seed=seed)
        self.shards = [TTLStore(default_ttl=default_ttl, **store_kwargs) for _ in range(shards)]
        self.locks = [threading.Lock() for _ in range(shards)]

    def _shard(self, key: str) -> int:
        validate_key(key)
        return zlib.crc32(key.encode()) % len(self.shards) if len(self.shards) > 1 else 0

    def set(self, key: str, value: Any, ttl: float | None = DEFAULT) -> None:  # type: ignore[assignment]
        i = self._shard(key)
        ttl = self.ttl_for_store(ttl)
        with self.locks[i]:
            self.shards[i].set(key, value, ttl)

    def get(self, key: str, default: Any = None) -> Any:
        i = self._shard(key)
        with self.locks[i]:
            return self.shards[i].get(key, default)

    def update(self, key: str, fn: Callable[[Any], Any], default: Any = None, ttl: float | None = DEFAULT) -> Any:  # type: ignore[assignment]
        """Atomic read-modify-write under the key's shard lock (see :meth:`CacheBackend.update`)."""
        if not callable(fn):
            raise ArgumentTypeError(f"fn: expected a callable, got {type(fn).__name__} ({fn!r:.80})")
        i = self._shard(key)
        ttl = self.ttl_for_store(ttl)
        with self.locks[i]:
            return self.shards[i].update(key, fn, default, ttl)

    def delete(self, key: str) -> bool:
        i = self._shard(key)
        with self.locks[i]:
            return self.shards[i].delete(key)

    def ttl(self, key: str) -> float | None:
        i = self._shard(key)
        with self.locks[i]:
            return self.shards[i].remaining_ttl(key)

    def clear(self) -> None:
        for shard, lock in zip(self.shards, self.locks):
            with lock:
                shard.clear()

    def sweep(self) -> int:
        """Remove expired entries from every shard (by their expiry heaps); returns how many."""
        removed = 0
        for shard, lock in zip(self.shards, self.locks):
            with lock:
                removed += shard.sweep()
        return removed

    def __len__(self) -> int:
        return sum(len(s) for s in self.shards)

    def _counters(self) -> dict[str, int]:
        total: Counter[str] = Counter()
        for shard, lock in zip(self.shards, self.locks):
            with lock:
                total.update(shard.snapshot_stats())
        return dict(total)


#: The in-process backend, under the name the backend interface uses.
MemoryBackend = ShardedStore
