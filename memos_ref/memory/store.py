"""TTLStore: the application-level short-term memory of an agent (seed 002) — a bounded key-value cache with
absolute expiry, hybrid LRU/LFU eviction and an expiry heap. One shard; :class:`ShardedStore` adds locks.

Semantics (seed 002 §3, §7):

* ``set`` stores a value with a TTL; overwriting resets ``access_count`` and restarts the TTL;
* ``get`` never extends the TTL (§7.2's bug) and expires lazily; ``sweep()`` pops an expiry min-heap instead of
  scanning everything (stale heap entries — overwritten or deleted keys — are skipped by a version check);
* values are stored as JSON bytes and every ``get`` decodes a fresh copy, so a caller can never mutate the
  stored value (§7.1's bug); the cost is one ``json.loads`` per hit, paid for safety;
* capacity by entry count, total bytes and largest value (a value over the limit is refused with
  :class:`CapacityExceededError`: §4.3, §7.3);
* eviction policy ``"lru"``, ``"lfu"`` or ``"hybrid"`` — score ``(1 + a·access_count) / (1 + age/b)``, lowest
  evicted (§4.2; ``a`` = 0.1, ``b`` = 1000 s by default). LRU is O(1) (an ordered dict in access order); LFU
  and hybrid score the ``sample`` least recently used entries (default 16, as Redis approximates LFU), or all
  entries with ``sample=None``.
"""

from __future__ import annotations

import heapq
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memos_ref.errors import ArgumentTypeError, CapacityExceededError, ConfigError, check_type
from memos_ref.lru import SizedLRU
from memos_ref.resilient import validate_ttl

__all__ = ["POLICIES", "KVEntry", "TTLStore", "encode_value", "validate_key"]

POLICIES = ("lru", "lfu", "hybrid")
_MAX_KEY = 250


def validate_key(key: str) -> str:
    """Keys become Redis keys: printable, no whitespace or control characters, at most 250 characters."""
    # str.isprintable() is False for every whitespace character except the ASCII space, checked separately.
    if not isinstance(key, str):
        raise ArgumentTypeError(f"key: expected str, got {type(key).__name__} ({key!r:.80})")
    if not 0 < len(key) <= _MAX_KEY or not key.isprintable() or " " in key:
        raise ConfigError(f"invalid key {key!r}: expected 1-{_MAX_KEY} printable characters without whitespace")
    return key


def encode_value(key: str, value: Any, max_value_bytes: int) -> bytes:
    """``value`` as compact JSON, refused when not JSON-serialisable or when it (with its key) exceeds
    ``max_value_bytes`` (seed 002 §4.3, §7.3)."""
    try:
        payload = json.dumps(value, separators=(",", ":")).encode()
    except (TypeError, ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
        raise ConfigError(f"value for {key!r} is not JSON-serialisable: {type(exc).__name__}: {exc}") from None
    size = len(payload) + len(key)
    if size > max_value_bytes:
        raise CapacityExceededError(
            f"value for {key!r} is {size} bytes; the largest allowed is {max_value_bytes}",
            needed=size,
            capacity=max_value_bytes,
        )
    return payload


@dataclass
class KVEntry:
    key: str
    payload: bytes  # the value as JSON
    expire_at: float | None
    access_count: int
    last_access: float
    created: float
    version: int

    @property
    def size_bytes(self) -> int:
        return len(self.payload) + len(self.key)


class TTLStore:
    """A bounded TTL cache (one shard, not thread-safe on its own: see :class:`ShardedStore`).

    Args:
        max_entries / max_bytes / max_value_bytes: capacity limits.
        policy: ``"lru"``, ``"lfu"`` or ``"hybrid"``.
        default_ttl: seconds, or None for no expiry.
        clock: returns the current time in seconds (inject a fake one in tests).
        hybrid_weights: ``(a, b)`` of the hybrid score.
        sample: entries scored per eviction for lfu/hybrid (None = all).
    """

    def __init__(
        self,
        *,
        max_entries: int = 10_000,
        max_bytes: int = 64 * 2**20,
        max_value_bytes: int = 2**20,
        policy: str = "hybrid",
        default_ttl: float | None = 300.0,
        clock: Callable[[], float] = time.monotonic,
        hybrid_weights: tuple[float, float] = (0.1, 1000.0),
        sample: int | None = 16,
    ) -> None:
        for name, limit in (
            ("max_entries", max_entries),
            ("max_bytes", max_bytes),
            ("max_value_bytes", max_value_bytes),
        ):
            check_type(name, limit, int)
        check_type("policy", policy, str)
        if policy not in POLICIES:
            raise ConfigError(f"policy must be one of {POLICIES}, got {policy!r}")
        if min(max_entries, max_bytes, max_value_bytes) <= 0:
            raise ConfigError("capacity limits must be positive")
        default_ttl = validate_ttl(default_ttl, "default_ttl")
        if not callable(clock):
            raise ArgumentTypeError(f"clock: expected a callable, got {type(clock).__name__}")
        check_type("hybrid_weights", hybrid_weights, tuple)
        if len(hybrid_weights) != 2:
            raise ConfigError(f"hybrid_weights must be a pair (a, b), got {hybrid_weights!r}")
        for w in hybrid_weights:
            check_type("hybrid_weights[i]", w, (int, float))
        if sample is not None:
            check_type("sample", sample, int)
            if sample < 1:
                raise ConfigError(f"sample must be >= 1 or None, got {sample}")
        self.max_entries, self.max_bytes, self.max_value_bytes = max_entries, max_bytes, max_value_bytes
        self.policy, self.default_ttl, self.clock = policy, default_ttl, clock
        self.hybrid_a, self.hybrid_b = hybrid_weights
        self.sample = sample
        self._entries: SizedLRU[KVEntry] = SizedLRU(lambda e: e.size_bytes)  # least recently used first
        self._heap: list[tuple[float, int, str]] = []  # (expire_at, version, key)
        self._version = 0
        self.stats: Counter[str] = Counter()

    @property
    def bytes(self) -> int:
        """Bytes held: JSON values plus keys of every entry (expired ones not yet swept included)."""
        return self._entries.total

    # ------------------------------------------------------------------ basics
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        entry = self._entries.get(key)
        return entry is not None and not self._expired(entry, self.clock())

    def _expired(self, entry: KVEntry, now: float) -> bool:
        return entry.expire_at is not None and now >= entry.expire_at

    def _remove(self, key: str, reason: str | None = None) -> None:
        self._entries.pop(key)
        if reason:
            self.stats[reason] += 1

    def set(self, key: str, value: Any, ttl: float | None = ...) -> None:  # type: ignore[assignment]
        """Store ``value`` (JSON-serialisable) for ``ttl`` seconds (default: the store's); resets its count."""
        validate_key(key)
        payload = encode_value(key, value, self.max_value_bytes)
        ttl = validate_ttl(self.default_ttl if ttl is ... else ttl)
        now = self.clock()
        if key in self._entries:
            self._remove(key)
        self._version += 1
        expire_at = None if ttl is None else now + ttl
        entry = KVEntry(key, payload, expire_at, 0, now, now, self._version)
        self._entries.put(key, entry)
        if expire_at is not None:
            heapq.heappush(self._heap, (expire_at, self._version, key))
        self.stats["sets"] += 1
        self._evict_to_fit(protect=key)

    def get(self, key: str, default: Any = None) -> Any:
        """A fresh copy of the value, or ``default`` if missing or expired. Never extends the TTL."""
        validate_key(key)
        now = self.clock()
        entry = self._entries.get(key)
        if entry is None:
            self.stats["misses"] += 1
            return default
        if self._expired(entry, now):
            self._remove(key, "expirations")
            self.stats["misses"] += 1
            return default
        entry.access_count += 1
        entry.last_access = now
        self._entries.touch(key)
        self.stats["hits"] += 1
        return json.loads(entry.payload)

    def delete(self, key: str) -> bool:
        """Remove ``key``; True if a live entry was removed (an expired one is dropped and reported as absent)."""
        validate_key(key)
        entry = self._entries.get(key)
        if entry is None:
            return False
        if self._expired(entry, self.clock()):
            self._remove(key, "expirations")
            return False
        self._remove(key, "deletes")
        return True

    def remaining_ttl(self, key: str) -> float | None:
        """Seconds until ``key`` expires (None: never). Raises KeyError if it is absent or expired."""
        entry = self._entries.get(validate_key(key))
        now = self.clock()
        if entry is None or self._expired(entry, now):
            raise KeyError(key)
        return None if entry.expire_at is None else entry.expire_at - now

    def clear(self) -> None:
        """Drop every entry (counted as ``deletes``)."""
        self.stats["deletes"] += len(self._entries)
        self._entries.clear()
        self._heap.clear()

    def update(self, key: str, fn: Callable[[Any], Any], default: Any = None, ttl: float | None = ...) -> Any:  # type: ignore[assignment]
        """Store and return ``fn(current)`` (``current``: the live value, or ``default``). One shard is not
        thread-safe: :meth:`ShardedStore.update` runs this under the shard's lock. If ``fn`` raises or its
        result is refused, the store is unchanged (the read still counts a hit or a miss)."""
        if not callable(fn):
            raise ArgumentTypeError(f"fn: expected a callable, got {type(fn).__name__} ({fn!r:.80})")
        value = fn(self.get(key, default))
        self.set(key, value, ttl)
        return value

    def entry(self, key: str) -> KVEntry | None:
        """The entry's metadata (a copy), for inspection."""
        entry = self._entries.get(key)
        return None if entry is None else KVEntry(**vars(entry))

    def entries(self) -> list[KVEntry]:
        """Copies of every entry's metadata (expired ones not yet swept included), least recently used first."""
        return [KVEntry(**vars(entry)) for entry in self._entries.values()]

    @property
    def heap_size(self) -> int:
        """Records in the expiry heap, stale ones (overwritten or deleted keys) included until a sweep."""
        return len(self._heap)

    # ------------------------------------------------------------------ expiry and eviction
    def sweep(self) -> int:
        """Remove every expired entry by popping the expiry heap; returns how many were removed."""
        now, removed = self.clock(), 0
        while self._heap and self._heap[0][0] <= now:
            _, version, key = heapq.heappop(self._heap)
            entry = self._entries.get(key)
            if entry is not None and entry.version == version:  # else: stale (overwritten or deleted)
                self._remove(key, "expirations")
                removed += 1
        if len(self._heap) > 4 * max(16, len(self._entries)):  # too many stale entries: rebuild
            self._heap = [(e.expire_at, e.version, k) for k, e in self._entries.items() if e.expire_at is not None]
            heapq.heapify(self._heap)
        return removed

    def score(self, entry: KVEntry, now: float) -> float:
        """Higher is more worth keeping."""
        if self.policy == "lfu":
            return float(entry.access_count)
        age = max(0.0, now - entry.last_access)
        return (1 + self.hybrid_a * entry.access_count) / (1 + age / self.hybrid_b)

    def _victim(self, protect: str) -> str:
        if self.policy == "lru":
            return self._entries.oldest(exclude=protect)
        now = self.clock()
        candidates: list[tuple[str, KVEntry]] = []
        for key, entry in self._entries.items():  # least recently used first
            if key != protect:
                candidates.append((key, entry))
            if self.sample is not None and len(candidates) >= self.sample:
                break
        return min(candidates, key=lambda item: self.score(item[1], now))[0]

    def _evict_to_fit(self, protect: str) -> None:
        if len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            self.sweep()  # expired entries go first
        while len(self._entries) > self.max_entries:
            self._remove(self._victim(protect), "evictions_entries")
        while self.bytes > self.max_bytes and len(self._entries) > 1:
            self._remove(self._victim(protect), "evictions_bytes")

    def snapshot_stats(self) -> dict[str, int]:
        return {**self.stats, "size": len(self._entries), "bytes": self.bytes}
