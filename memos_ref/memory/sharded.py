"""MemoryBackend (also called ShardedStore): a thread-safe short-term memory in this process — N
:class:`TTLStore` shards, each behind its own lock (seed 002 §5.1), so threads touching different keys rarely
wait for each other. Stampede protection and jitter come from :class:`CacheBackend`.

A value is validated and encoded to JSON before its shard's lock is taken, so the lock covers only the
bookkeeping. ``update(key, fn)`` runs ``fn`` under the shard's lock; a ``fn`` that calls this backend (any key,
any shard) raises :class:`~memos_ref.errors.StateError` instead of deadlocking on that lock, or on another
thread's lock in the opposite order.
"""

from __future__ import annotations

import threading
import zlib
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from memos_ref.errors import ArgumentTypeError, ConfigError, check_type
from memos_ref.memory.backend import DEFAULT, CacheBackend
from memos_ref.memory.store import DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES, MISSING, TTLStore, validate_key

__all__ = ["MISSING", "MemoryBackend", "ShardedStore"]


class ShardedStore(CacheBackend):
    """Thread-safe TTL store over ``shards`` independent shards (keys routed by a stable hash).

    Args:
        shards: number of shards (1 = a single lock).
        default_ttl / negative_ttl / ttl_jitter / seed: see :class:`CacheBackend`.
        **store_kwargs: passed to every :class:`TTLStore` (``policy``, ``clock``, ``max_value_bytes``, ...).
            ``max_entries`` and ``max_bytes`` are for the whole store: each shard gets ``limit // shards``, so
            the store never holds more than the limit (a shard may evict a little before the store is full,
            as keys hash unevenly); a limit smaller than ``shards`` is refused with ``ConfigError``.
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
        for name, default in (("max_entries", DEFAULT_MAX_ENTRIES), ("max_bytes", DEFAULT_MAX_BYTES)):
            limit = store_kwargs.get(name, default)
            if type(limit) is int and limit > 0:  # anything else: TTLStore refuses it, naming it
                if limit < shards:
                    raise ConfigError(
                        f"{name}={limit} is split across {shards} shards (the limit is for the whole store): "
                        f"expected at least {shards}, or fewer shards"
                    )
                store_kwargs[name] = limit // shards
        self.shards = [TTLStore(default_ttl=default_ttl, **store_kwargs) for _ in range(shards)]
        self.locks = [threading.Lock() for _ in range(shards)]
        #: the whole store's limits: each shard holds at most an equal share
        self.max_entries = self.shards[0].max_entries * shards
        self.max_bytes = self.shards[0].max_bytes * shards

    def _shard(self, key: str) -> int:
        validate_key(key)
        return zlib.crc32(key.encode()) % len(self.shards) if len(self.shards) > 1 else 0

    def set(self, key: str, value: Any, ttl: float | None = DEFAULT) -> None:  # type: ignore[assignment]
        if self._fns_running:
            self._check_reentry()
        i = self._shard(key) if len(self.shards) > 1 else 0
        ttl = self._fixed_ttl if ttl is DEFAULT and self._fixed_ttl is not DEFAULT else self.ttl_for_store(ttl)
        self.shards[i].set_under(self.locks[i], key, value, ttl)  # encodes outside the lock, writes under it

    def set_many(self, items: Mapping[str, Any], ttl: float | None = DEFAULT) -> None:  # type: ignore[assignment]
        """``set`` for each item, all or nothing: every key and value is validated and encoded before the first
        write (each item gets its own jittered TTL)."""
        self._check_reentry()
        check_type("items", items, Mapping)
        prepared = [
            (self._shard(key), key, self.shards[self._shard(key)].encode(key, value)) for key, value in items.items()
        ]
        ttls = [self.ttl_for_store(ttl) for _ in prepared]
        for (i, key, payload), item_ttl in zip(prepared, ttls):
            with self.locks[i]:
                self.shards[i].put_encoded(key, payload, item_ttl)

    def get(self, key: str, default: Any = None) -> Any:
        if self._fns_running:
            self._check_reentry()
        i = self._shard(key) if len(self.shards) > 1 else 0  # one shard: lookup() validates the key
        with self.locks[i]:
            value = self.shards[i].lookup(key, default)
        return default if value is MISSING else value

    def _lookup(self, key: str, absent: Any) -> Any:
        if self._fns_running:
            self._check_reentry()
        i = self._shard(key) if len(self.shards) > 1 else 0  # one shard: lookup() validates the key
        with self.locks[i]:
            return self.shards[i].lookup(key, absent)

    def _set_missing(self, key: str, ttl: float | None) -> None:
        self._check_reentry()
        i = self._shard(key)
        with self.locks[i]:
            self.shards[i].set_missing(key, ttl)

    def update(self, key: str, fn: Callable[[Any], Any], default: Any = None, ttl: float | None = DEFAULT) -> Any:  # type: ignore[assignment]
        """Atomic read-modify-write under the key's shard lock (see :meth:`CacheBackend.update`). ``fn`` must not
        call this backend: a call from inside it raises :class:`~memos_ref.errors.StateError`."""
        self._check_reentry()
        if not callable(fn):
            raise ArgumentTypeError(f"fn: expected a callable, got {type(fn).__name__} ({fn!r:.80})")
        i = self._shard(key)
        shard = self.shards[i]
        ttl = self.ttl_for_store(ttl)
        with self.locks[i]:
            current = shard.get(key, default)
            value = self._run_fn(fn, current)
            shard.set(key, value, ttl)
            return value

    def delete(self, key: str) -> bool:
        self._check_reentry()
        i = self._shard(key)
        with self.locks[i]:
            return self.shards[i].delete(key)

    def ttl(self, key: str) -> float | None:
        self._check_reentry()
        i = self._shard(key)
        with self.locks[i]:
            return self.shards[i].remaining_ttl(key)

    def clear(self) -> None:
        self._check_reentry()
        for shard, lock in zip(self.shards, self.locks):
            with lock:
                shard.clear()

    def sweep(self) -> int:
        """Remove expired entries from every shard (by their expiry heaps); returns how many."""
        self._check_reentry()
        removed = 0
        for shard, lock in zip(self.shards, self.locks):
            with lock:
                removed += shard.sweep()
        return removed

    def __len__(self) -> int:
        return sum(len(s) for s in self.shards)

    def _counters(self) -> dict[str, int]:
        self._check_reentry()
        total: Counter[str] = Counter()
        for shard, lock in zip(self.shards, self.locks):
            with lock:
                total.update(shard.snapshot_stats())
        return dict(total)


#: The in-process backend, under the name the backend interface uses.
MemoryBackend = ShardedStore
