"""TTLStore: the application-level short-term memory of an agent (seed 002) — a bounded key-value cache with
absolute expiry, hybrid LRU/LFU eviction and an expiry heap. One shard; :class:`ShardedStore` adds locks.

Semantics (seed 002 §3, §7):

* ``set`` stores a value with a TTL; overwriting resets ``access_count`` and restarts the TTL;
* ``get`` never extends the TTL (§7.2's bug) and expires lazily; ``sweep()`` pops an expiry min-heap instead of
  scanning everything: each entry holds one heap record, due no later than it expires (an overwrite that
  moves the expiry later keeps it, and sweep moves it on), and records of deleted or evicted keys are skipped;
  the heap is rebuilt from the live entries when it outgrows four times their number, so it stays bounded;
* values are stored as compact JSON text, ASCII only (non-ASCII characters escaped), so a payload's length is
  its size in bytes; every ``get`` decodes a fresh copy, so a caller can never mutate the stored value (§7.1's
  bug); the cost is one ``json.loads`` per hit, paid for safety;
* capacity by entry count, total bytes and largest value: a value (its JSON bytes plus key) larger than
  ``max_value_bytes`` *or* than ``max_bytes`` — one entry that could never fit the byte budget — is refused with
  :class:`CapacityExceededError` and the store is left as it was (§4.3, §7.3);
* values are strict JSON: NaN and infinities are refused (``ConfigError``), as are objects JSON cannot encode;
  JSON's own conversions apply (a tuple reads back as a list, a non-string dict key as a string);
* a negatively cached key (:meth:`set_missing`, used by ``get_or_compute``) holds an empty payload, which no
  JSON value encodes to, so no user value can be mistaken for "nothing found";
* ``update(key, fn)`` refuses re-entry: a ``fn`` that calls this store raises :class:`StateError`;
* eviction policy ``"lru"``, ``"lfu"`` or ``"hybrid"`` — score ``(1 + a·access_count) / (1 + age/b)``, lowest
  evicted (§4.2; ``a`` = 0.1, ``b`` = 1000 s by default). LRU is O(1) (an ordered dict in access order). LFU
  and hybrid score the ``sample`` *least recently used* entries (default 16), or all entries with
  ``sample=None``, and evict the lowest score; the key being set is never its own victim. This is not Redis's
  approximation: Redis's ``allkeys-lfu`` samples ``maxmemory-samples`` (default 5) *random* keys into an
  eviction pool, and its 8-bit logarithmic counter decays with idle time (``lfu-decay-time``). Here the
  candidates are the LRU tail, so a hot entry that was read recently is never even scored, and
  ``access_count`` is an exact count that never decays (only the hybrid score's age term discounts it; an
  overwrite resets it).

The write path is the hot path (issue 29 item 3): an overwrite reuses the entry's list in place (no new object
for the garbage collector to track) and, when its expiry moves later, its heap record (no push); the per-call
counters are plain ints (:attr:`TTLStore.stats` merges them); the payload is the encoder's text itself (no
``.encode()`` copy).
"""

from __future__ import annotations

import heapq
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from memos_ref.errors import ArgumentTypeError, CapacityExceededError, ConfigError, StateError, check_type
from memos_ref.lru import SizedLRU
from memos_ref.memory.values import MAX_KEY as _MAX_KEY
from memos_ref.memory.values import MISSING, AbsentKeyError, encode_value, json_text, validate_key
from memos_ref.memory.values import NEGATIVE as _NEGATIVE
from memos_ref.resilient import validate_ttl

__all__ = ["MISSING", "POLICIES", "AbsentKeyError", "KVEntry", "TTLStore", "encode_value", "json_text", "validate_key"]

POLICIES = ("lru", "lfu", "hybrid")
#: A store's default capacity (a :class:`ShardedStore` splits it across its shards).
DEFAULT_MAX_ENTRIES = 10_000
DEFAULT_MAX_BYTES = 64 * 2**20


@dataclass(slots=True, init=False)
class KVEntry:
    """One entry's metadata and payload. ``size_bytes``: the JSON value plus the key (computed when not given)."""

    key: str
    payload: str  # the value as JSON text, ASCII only (empty: a negatively cached key)
    expire_at: float | None
    access_count: int
    last_access: float
    created: float
    version: int
    size_bytes: int

    def __init__(
        self,
        key: str,
        payload: str,
        expire_at: float | None,
        access_count: int,
        last_access: float,
        created: float,
        version: int,
        size_bytes: int = -1,
    ) -> None:  # written out (not the dataclass's): one call per write, on the hot path of set
        self.key, self.payload, self.expire_at, self.access_count = key, payload, expire_at, access_count
        self.last_access, self.created, self.version = last_access, created, version
        self.size_bytes = len(payload) + len(key) if size_bytes < 0 else size_bytes


# An entry is kept as a list (built in one step, mutated in place; a KVEntry is made only for inspection). Its
# last slot is its record in the expiry heap, ``(due, version, key)``, or None (no expiry): see TTLStore.sweep.
_PAYLOAD, _EXPIRE, _COUNT, _LAST, _CREATED, _VERSION, _SIZE, _RECORD = range(8)
_entry_size = itemgetter(_SIZE)
_heappush = heapq.heappush


def _as_entry(key: str, e: list) -> KVEntry:
    return KVEntry(key, *e[:_RECORD])


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
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_bytes: int = DEFAULT_MAX_BYTES,
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
        #: the largest entry accepted: one entry over ``max_bytes`` could never be held within the budget
        self.max_item_bytes = min(max_value_bytes, max_bytes)
        self._entries: SizedLRU[list] = SizedLRU(_entry_size)  # least recently used first
        self._heap: list[tuple[float, int, str]] = []  # (expire_at, version, key)
        self._version = 0
        self._heap_cap = 64
        # event counters: the three of every call as plain ints (a Counter's ``+= 1`` costs about three times a
        # dict's on CPython 3.11), the rare ones in a Counter; :attr:`stats` merges them
        self._sets = self._hits = self._misses = 0
        self._events: Counter[str] = Counter()
        self._in_fn = False  # True while update()'s fn runs: a call back into this store is refused

    @property
    def stats(self) -> Counter[str]:
        """The event counters (a snapshot): ``sets``, ``hits``, ``misses``, ``expirations``, ``deletes``,
        ``evictions_entries``, ``evictions_bytes`` — each present once it is non-zero."""
        out = Counter(self._events)
        for name, count in (("sets", self._sets), ("hits", self._hits), ("misses", self._misses)):
            if count:
                out[name] = count
        return out

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

    def _expired(self, entry: list, now: float) -> bool:
        return entry[_EXPIRE] is not None and now >= entry[_EXPIRE]

    def _remove(self, key: str, reason: str | None = None) -> None:
        self._entries.pop(key)
        if reason:
            self._events[reason] += 1

    def set(self, key: str, value: Any, ttl: float | None = ...) -> None:  # type: ignore[assignment]
        """Store ``value`` (JSON-serialisable) for ``ttl`` seconds (default: the store's); resets its count.
        A value over :attr:`max_item_bytes` raises :class:`CapacityExceededError` with the store unchanged."""
        self._check_reentry()
        payload = self.encode(key, value)
        self.put_encoded(key, payload, validate_ttl(self.default_ttl if ttl is ... else ttl))

    def encode(self, key: str, value: Any) -> str:
        """``value``'s stored form for ``key``: the key validated, the value as compact JSON text (ASCII, so its
        length is its size in bytes) within :attr:`max_item_bytes` (refused with :class:`ConfigError` /
        :class:`CapacityExceededError`)."""
        if type(key) is not str or not 0 < len(key) <= _MAX_KEY or " " in key or not key.isprintable():
            validate_key(key)  # raises, saying why
        try:
            payload = json_text(value)
        except (TypeError, ValueError, RecursionError):
            payload = encode_value(key, value, self.max_item_bytes)  # raises the error, with its message
        if len(payload) + len(key) <= self.max_item_bytes:
            return payload
        try:
            return encode_value(key, value, self.max_item_bytes)
        except CapacityExceededError as exc:
            if self.max_item_bytes < self.max_value_bytes:  # the byte budget is the binding limit: say so
                raise CapacityExceededError(
                    f"{exc}: max_bytes is {self.max_bytes}, so an entry this large could never be held",
                    needed=exc.needed,
                    capacity=self.max_item_bytes,
                ) from None
            raise

    def set_under(self, lock: Any, key: str, value: Any, ttl: float | None) -> None:
        """:meth:`set` for :class:`ShardedStore`: encode ``value`` (validating ``key``) outside ``lock`` — a
        context manager, the shard's lock — then write under it. ``ttl`` is already validated."""
        # encode(), inline (one call less on the hot path)
        if type(key) is not str or not 0 < len(key) <= _MAX_KEY or " " in key or not key.isprintable():
            validate_key(key)  # raises, saying why
        try:
            payload = json_text(value)
        except (TypeError, ValueError, RecursionError):
            payload = self.encode(key, value)  # raises, saying why
        size = len(payload) + len(key)
        if size > self.max_item_bytes:
            self.encode(key, value)  # raises, saying why
        with lock:
            if self._in_fn:
                self._check_reentry()
            # put_encoded's body, inline (this is the hot path of every ShardedStore.set)
            now = self.clock()
            entries = self._entries
            version = self._version = self._version + 1
            expire_at = None if ttl is None else now + ttl
            old = entries.get(key)
            record = None if old is None else old[_RECORD]
            if expire_at is not None and (record is None or record[0] > expire_at):
                record = (expire_at, version, key)  # else the entry's record, due no later, stands (see sweep)
                _heappush(self._heap, record)
            if old is None:
                entries.put(key, [payload, expire_at, 0, now, now, version, size, record])
            else:  # an overwrite reuses the entry's list: no new object for the garbage collector to track
                entries.total += size - old[_SIZE]
                old[:] = payload, expire_at, 0, now, now, version, size, record
                entries.touch(key)
            if len(self._heap) > self._heap_cap:
                self._compact_heap()
            self._sets += 1
            if entries.total > self.max_bytes or (old is None and len(entries) > self.max_entries):
                self._evict_to_fit(protect=key)  # an overwrite adds no entry: only its bytes can overflow

    def set_missing(self, key: str, ttl: float | None) -> None:
        """Cache "nothing found" for ``key`` (read back by :meth:`lookup` as :data:`MISSING`; by :meth:`get` as
        absent)."""
        self._check_reentry()
        validate_key(key)
        self.put_encoded(key, _NEGATIVE, validate_ttl(ttl))

    def put_encoded(self, key: str, payload: str, ttl: float | None) -> None:
        """The write path of :meth:`set` for a ``payload`` that :meth:`encode` made and a ``ttl`` already
        validated (:class:`ShardedStore` encodes outside its shard lock and writes under it). The new value is
        the most recently used entry, with a zero count; the entry it replaces is evicted by no policy."""
        now = self.clock()
        entries = self._entries
        version = self._version = self._version + 1
        size = len(payload) + len(key)
        expire_at = None if ttl is None else now + ttl
        old = entries.get(key)
        record = None if old is None else old[_RECORD]
        if expire_at is not None and (record is None or record[0] > expire_at):
            record = (expire_at, version, key)  # as in set_under
            _heappush(self._heap, record)
        if old is None:
            entries.put(key, [payload, expire_at, 0, now, now, version, size, record])
        else:  # reused in place, as in set_under
            entries.total += size - old[_SIZE]
            old[:] = payload, expire_at, 0, now, now, version, size, record
            entries.touch(key)
        if len(self._heap) > self._heap_cap:
            self._compact_heap()
        self._sets += 1
        if entries.total > self.max_bytes or (old is None and len(entries) > self.max_entries):
            self._evict_to_fit(protect=key)

    def get(self, key: str, default: Any = None) -> Any:
        """A fresh copy of the value, or ``default`` if missing or expired (or negatively cached). Never extends
        the TTL."""
        value = self.lookup(key, default)
        return default if value is MISSING else value

    def lookup(self, key: str, absent: Any = None) -> Any:
        """As :meth:`get`, but a negatively cached key answers :data:`MISSING` (``absent`` when there is no
        live entry). Counts a hit or a miss."""
        if self._in_fn:
            self._check_reentry()
        if type(key) is not str or not 0 < len(key) <= _MAX_KEY or " " in key or not key.isprintable():
            validate_key(key)  # raises, saying why
        entry = self._entries.get(key)
        if entry is None:
            self._misses += 1
            return absent
        now = self.clock()
        expire_at = entry[_EXPIRE]
        if expire_at is not None and now >= expire_at:
            self._remove(key, "expirations")
            self._misses += 1
            return absent
        entry[_COUNT] += 1
        entry[_LAST] = now
        self._entries.touch(key)
        self._hits += 1
        payload = entry[_PAYLOAD]
        return json.loads(payload) if payload else MISSING

    def delete(self, key: str) -> bool:
        """Remove ``key``; True if a live entry was removed (an expired one is dropped and reported as absent)."""
        self._check_reentry()
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
        """Seconds until ``key`` expires (None: never). Raises :class:`AbsentKeyError` (a ``KeyError``) if it is
        absent, expired or negatively cached — absent as ``in`` and :meth:`get` say."""
        entry = self._entries.get(validate_key(key))
        now = self.clock()
        if entry is None or self._expired(entry, now) or not entry[_PAYLOAD]:
            raise AbsentKeyError(key)
        return None if entry[_EXPIRE] is None else entry[_EXPIRE] - now

    def clear(self) -> None:
        """Drop every entry (counted as ``deletes``)."""
        self._check_reentry()
        self._events["deletes"] += len(self._entries)
        self._entries.clear()
        self._heap.clear()

    def update(self, key: str, fn: Callable[[Any], Any], default: Any = None, ttl: float | None = ...) -> Any:  # type: ignore[assignment]
        """Store and return ``fn(current)`` (``current``: the live value, or ``default``). One shard is not
        thread-safe: :meth:`ShardedStore.update` runs this under the shard's lock. If ``fn`` raises or its
        result is refused, the store is unchanged (the read still counts a hit or a miss). ``fn`` must not call
        this store: a call from inside it raises :class:`StateError` (under a shard lock it would deadlock)."""
        if not callable(fn):
            raise ArgumentTypeError(f"fn: expected a callable, got {type(fn).__name__} ({fn!r:.80})")
        value = self.run_fn(fn, self.get(key, default))
        self.set(key, value, ttl)
        return value

    def run_fn(self, fn: Callable[[Any], Any], current: Any) -> Any:
        """``fn(current)`` with every call back into this store refused (:class:`StateError`) while it runs."""
        self._check_reentry()
        self._in_fn = True
        try:
            return fn(current)
        finally:
            self._in_fn = False

    def _check_reentry(self) -> None:
        if self._in_fn:
            raise StateError(
                "the store was called from inside update()'s fn: fn must compute the new value from the current one "
                "only (it runs under the key's lock); read other keys before calling update()"
            )

    def entry(self, key: str) -> KVEntry | None:
        """The entry's metadata (a copy), for inspection."""
        entry = self._entries.get(key)
        return None if entry is None else _as_entry(key, entry)

    def entries(self) -> list[KVEntry]:
        """Copies of every entry's metadata (expired ones not yet swept included), least recently used first."""
        return [_as_entry(key, entry) for key, entry in self._entries.items()]

    @property
    def heap_size(self) -> int:
        """Records in the expiry heap: one per entry with an expiry, plus stale ones (deleted or evicted keys, or
        replaced by a record due earlier) until a sweep or a rebuild."""
        return len(self._heap)

    # ------------------------------------------------------------------ expiry and eviction
    def sweep(self) -> int:
        """Remove every expired entry by popping the expiry heap; returns how many were removed.

        Every entry with an expiry holds one record in the heap, due no later than the entry expires: an
        overwrite that moves the expiry later keeps the record it has (no push on the common path of ``set``),
        one that moves it earlier pushes a new one. A popped record that is not its entry's (deleted, evicted,
        replaced) is skipped; an entry whose record falls due before it expires gets a record at its expiry."""
        now, removed, heap = self.clock(), 0, self._heap
        while heap and heap[0][0] <= now:
            record = heapq.heappop(heap)
            key = record[2]
            entry = self._entries.get(key)
            if entry is None or entry[_RECORD] is not record:
                continue  # stale: deleted, evicted, or replaced by a record due earlier
            expire_at = entry[_EXPIRE]
            if expire_at is None:  # overwritten with no expiry
                entry[_RECORD] = None
            elif now >= expire_at:
                self._remove(key, "expirations")
                removed += 1
            else:  # overwritten with a later expiry: the record moves there (due after now: the loop ends)
                entry[_RECORD] = (expire_at, entry[_VERSION], key)
                _heappush(heap, entry[_RECORD])
        if len(heap) > self._heap_cap:  # too many stale records: rebuild
            self._compact_heap()
        return removed

    def _compact_heap(self) -> None:
        """Rebuild the expiry heap from the live entries (stale records dropped); the next rebuild comes when it
        holds four times as many records again (at least 64), so the rebuilds cost O(1) per write amortised."""
        heap = []
        for key, entry in self._entries.items():
            entry[_RECORD] = None if entry[_EXPIRE] is None else (entry[_EXPIRE], entry[_VERSION], key)
            if entry[_RECORD] is not None:
                heap.append(entry[_RECORD])
        heapq.heapify(heap)
        self._heap = heap
        self._heap_cap = max(64, 4 * len(self._heap))

    def score(self, entry: KVEntry, now: float) -> float:
        """Higher is more worth keeping."""
        return self._score(entry.access_count, entry.last_access, now)

    def _score(self, access_count: int, last_access: float, now: float) -> float:
        if self.policy == "lfu":
            return float(access_count)
        age = max(0.0, now - last_access)
        return (1 + self.hybrid_a * access_count) / (1 + age / self.hybrid_b)

    def _victim(self, protect: str) -> str:
        if self.policy == "lru":
            return self._entries.oldest(exclude=protect)
        now = self.clock()
        candidates: list[tuple[str, list]] = []
        for key, entry in self._entries.items():  # least recently used first
            if key != protect:
                candidates.append((key, entry))
            if self.sample is not None and len(candidates) >= self.sample:
                break
        return min(candidates, key=lambda item: self._score(item[1][_COUNT], item[1][_LAST], now))[0]

    def _evict_to_fit(self, protect: str) -> None:
        if len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            self.sweep()  # expired entries go first
        while len(self._entries) > self.max_entries:
            self._remove(self._victim(protect), "evictions_entries")
        while self.bytes > self.max_bytes and len(self._entries) > 1:
            self._remove(self._victim(protect), "evictions_bytes")

    def snapshot_stats(self) -> dict[str, int]:
        return {**self.stats, "size": len(self._entries), "bytes": self.bytes}
