"""ShardedStore: a thread-safe short-term memory — N :class:`TTLStore` shards, each behind its own lock
(seed 002 §5.1), with stampede protection (§5.3): single-flight ``get_or_compute``, negative caching of
misses, and TTL jitter so entries written together do not all expire together.
"""

from __future__ import annotations

import hashlib
import random
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from memos_ref.errors import ConfigError
from memos_ref.memory.store import TTLStore, validate_key

__all__ = ["MISSING", "ShardedStore"]

#: What ``get_or_compute`` caches for a computation that found nothing (negative caching).
MISSING = {"__memos_missing__": True}


class ShardedStore:
    """Thread-safe TTL store over ``shards`` independent shards (keys routed by a stable hash).

    Args:
        shards: number of shards (1 = a single lock).
        negative_ttl: seconds a "nothing found" result is cached by ``get_or_compute``.
        ttl_jitter: each TTL is multiplied by a factor in ``[1 - j, 1 + j]`` (seeded by ``seed``).
        **store_kwargs: passed to every :class:`TTLStore` (capacity limits are per shard).
    """

    def __init__(
        self, shards: int = 8, *, negative_ttl: float = 5.0, ttl_jitter: float = 0.0, seed: int = 0, **store_kwargs: Any
    ) -> None:
        if shards < 1:
            raise ConfigError(f"shards must be >= 1, got {shards}")
        if not 0 <= ttl_jitter < 1:
            raise ConfigError(f"ttl_jitter must be in [0, 1), got {ttl_jitter}")
        self.shards = [TTLStore(**store_kwargs) for _ in range(shards)]
        self.locks = [threading.Lock() for _ in range(shards)]
        self.negative_ttl, self.ttl_jitter = negative_ttl, ttl_jitter
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()
        self._inflight: dict[str, threading.Event] = {}
        self._inflight_lock = threading.Lock()
        self.computations = 0

    def _shard(self, key: str) -> int:
        digest = hashlib.blake2b(validate_key(key).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") % len(self.shards)

    def _jittered(self, ttl: float | None) -> float | None:
        if ttl is None or not self.ttl_jitter:
            return ttl
        with self._rng_lock:
            return ttl * (1 + self._rng.uniform(-self.ttl_jitter, self.ttl_jitter))

    def set(self, key: str, value: Any, ttl: float | None = ...) -> None:  # type: ignore[assignment]
        i = self._shard(key)
        with self.locks[i]:
            shard = self.shards[i]
            shard.set(key, value, self._jittered(shard.default_ttl if ttl is ... else ttl))

    def get(self, key: str, default: Any = None) -> Any:
        i = self._shard(key)
        with self.locks[i]:
            return self.shards[i].get(key, default)

    def delete(self, key: str) -> bool:
        i = self._shard(key)
        with self.locks[i]:
            return self.shards[i].delete(key)

    def sweep(self) -> int:
        removed = 0
        for shard, lock in zip(self.shards, self.locks):
            with lock:
                removed += shard.sweep()
        return removed

    def __len__(self) -> int:
        return sum(len(s) for s in self.shards)

    def get_or_compute(self, key: str, compute: Callable[[], Any], ttl: float | None = ...) -> Any:  # type: ignore[assignment]
        """The cached value, or ``compute()`` run by exactly one caller while concurrent callers for the same
        key wait for its result (single flight). A ``None`` result is cached as a miss for ``negative_ttl``."""
        sentinel = object()
        while True:
            value = self.get(key, sentinel)
            if value is not sentinel:
                return None if value == MISSING else value
            with self._inflight_lock:
                event = self._inflight.get(key)
                leader = event is None
                if leader:
                    event = self._inflight[key] = threading.Event()
            if not leader:
                event.wait()
                continue  # read what the leader stored (or retry if it failed)
            try:
                self.computations += 1
                result = compute()
                if result is None:
                    self.set(key, MISSING, self.negative_ttl)
                else:
                    self.set(key, result, ttl)
                return result
            finally:
                with self._inflight_lock:
                    del self._inflight[key]
                event.set()

    def stats(self) -> dict[str, int]:
        total: Counter[str] = Counter()
        for shard, lock in zip(self.shards, self.locks):
            with lock:
                total.update(shard.snapshot_stats())
        total["computations"] = self.computations
        return dict(total)
