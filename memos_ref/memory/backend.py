"""CacheBackend: one interface for the short-term memory store, whatever holds the bytes (seed 002 §5.2).

A backend implements six primitives — ``get``, ``set``, ``update`` (an atomic read-modify-write), ``delete``,
``ttl`` (seconds left) and ``clear`` —
plus ``_counters()`` for its stats. Everything that must behave the same on every backend is written once
here: TTL jitter, single-flight ``get_or_compute`` and negative caching of misses (seed 002 §5.3), batched
forms, and the stats API. :class:`~memos_ref.memory.sharded.MemoryBackend` keeps entries in this process;
:class:`~memos_ref.memory.redis_backend.RedisBackend` keeps them in a Redis server that several processes share.

Single flight is per process: concurrent misses for one key in one process compute once. Across processes,
two may each compute once; the results are equal by assumption (a cache of a pure function), so the cost is
bounded by the process count, not by the request rate.
"""

from __future__ import annotations

import math
import random
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from memos_ref.errors import ArgumentTypeError, ConfigError, check_type
from memos_ref.resilient import MAX_TTL_S, validate_ttl

__all__ = ["MISSING", "CacheBackend", "key_list"]

#: What ``get_or_compute`` stores for a computation that found nothing (negative caching).
MISSING = {"__memos_missing__": True}

#: Stand-in for "use the backend's default TTL" (``None`` means "never expires").
DEFAULT = ...


class CacheBackend(ABC):
    """A TTL key-value store of JSON values.

    Args:
        default_ttl: seconds an entry lives when ``set`` is not given a TTL (None: forever).
        negative_ttl: seconds a "nothing found" result is cached by ``get_or_compute``.
        ttl_jitter: each TTL is multiplied by a factor drawn from ``[1 - j, 1 + j]`` so entries written together
            do not all expire together (0 disables it).
        seed: seeds the jitter.
    """

    name = "backend"

    def __init__(
        self,
        *,
        default_ttl: float | None = 300.0,
        negative_ttl: float = 5.0,
        ttl_jitter: float = 0.0,
        seed: int = 0,
    ) -> None:
        default_ttl = validate_ttl(default_ttl, "default_ttl")
        check_type("negative_ttl", negative_ttl, (int, float))
        negative_ttl = validate_ttl(negative_ttl, "negative_ttl")
        check_type("ttl_jitter", ttl_jitter, (int, float))
        if not (math.isfinite(ttl_jitter) and 0 <= ttl_jitter < 1):
            raise ConfigError(f"ttl_jitter must be in [0, 1), got {ttl_jitter}")
        check_type("seed", seed, int)
        self.default_ttl, self.negative_ttl, self.ttl_jitter = default_ttl, negative_ttl, ttl_jitter
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()
        self._inflight: dict[str, threading.Event] = {}
        self._inflight_lock = threading.Lock()
        self.computations = 0
        self.negative_hits = 0

    # ------------------------------------------------------------------ the primitives
    @abstractmethod
    def get(self, key: str, default: Any = None) -> Any:
        """A fresh copy of the value, or ``default`` if missing or expired. Never extends the TTL."""

    @abstractmethod
    def set(self, key: str, value: Any, ttl: float | None = DEFAULT) -> None:  # type: ignore[assignment]
        """Store a JSON-serialisable ``value`` for ``ttl`` seconds (default: ``default_ttl``, jittered).
        Overwriting restarts the TTL and resets the access count."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove ``key``; True if a live entry was removed."""

    @abstractmethod
    def ttl(self, key: str) -> float | None:
        """Seconds left before ``key`` expires; None if it never expires. Raises KeyError if absent."""

    @abstractmethod
    def update(self, key: str, fn: Callable[[Any], Any], default: Any = None, ttl: float | None = DEFAULT) -> Any:  # type: ignore[assignment]
        """Atomic read-modify-write: store ``fn(current)`` where ``current`` is the live value (``default`` if
        absent or expired) and return it; no write by another caller can land between the read and the write,
        so concurrent updates are never lost (a ``get`` then a ``set`` loses them). The write restarts the TTL
        like ``set``. If ``fn`` raises, or its result is refused (not JSON, too large), nothing is stored and the
        error reaches the caller. ``fn`` must be quick and must not call this store: it runs under the key's lock
        (in memory) or may be retried (on Redis, when another client wrote the key meanwhile)."""

    @abstractmethod
    def clear(self) -> None:
        """Remove every entry of this store (only this store's namespace on a shared server)."""

    @abstractmethod
    def _counters(self) -> dict[str, int]:
        """Backend-specific counters for :meth:`stats`."""

    # ------------------------------------------------------------------ shared behaviour
    def __contains__(self, key: str) -> bool:
        sentinel = object()
        return self.get(key, sentinel) is not sentinel

    def ttl_for_store(self, ttl: float | type(...) | None = DEFAULT) -> float | None:
        """The TTL a write given ``ttl`` stores: the default resolved, then jittered (each call draws a new
        factor, as each write does). A TTL that is not a finite number of seconds in
        ``(0, MAX_TTL_S]`` (``inf``, NaN, zero, negative, beyond Redis's range) raises
        :class:`~memos_ref.errors.InvalidArgumentError` on every backend, before anything is stored."""
        ttl = validate_ttl(self.default_ttl if ttl is DEFAULT else ttl)
        if ttl is None or not self.ttl_jitter:
            return ttl
        with self._rng_lock:
            return min(MAX_TTL_S, ttl * (1 + self._rng.uniform(-self.ttl_jitter, self.ttl_jitter)))

    def get_many(self, keys: Iterable[str]) -> dict[str, Any]:
        """The live entries among ``keys`` (absent and expired keys are left out)."""
        sentinel = object()
        found = {key: self.get(key, sentinel) for key in key_list(keys)}
        return {key: value for key, value in found.items() if value is not sentinel}

    def set_many(self, items: Mapping[str, Any], ttl: float | None = DEFAULT) -> None:  # type: ignore[assignment]
        """``set`` for each item (each gets its own jittered TTL)."""
        check_type("items", items, Mapping)
        for key, value in items.items():
            self.set(key, value, ttl)

    def get_or_compute(self, key: str, compute: Callable[[], Any], ttl: float | None = DEFAULT) -> Any:  # type: ignore[assignment]
        """The cached value, or ``compute()`` run by exactly one caller in this process while concurrent callers
        for the same key wait for its result (single flight). A ``None`` result is cached as a miss for
        ``negative_ttl`` seconds, so a storm of lookups for something that does not exist computes once."""
        if not callable(compute):
            raise ArgumentTypeError(f"compute: expected a callable, got {type(compute).__name__} ({compute!r:.80})")
        if ttl is not DEFAULT:
            validate_ttl(ttl)
        sentinel = object()
        while True:
            value = self.get(key, sentinel)
            if value is not sentinel:
                if value == MISSING:
                    self.negative_hits += 1
                    return None
                return value
            with self._inflight_lock:
                event = self._inflight.get(key)
                leader = event is None
                if leader:
                    event = self._inflight[key] = threading.Event()
            if not leader:
                event.wait()
                if self._degraded():
                    return compute()  # the leader's result could not be stored: do not spin
                continue  # read what the leader stored (or take over if it failed)
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

    def _degraded(self) -> bool:
        """True while the backend cannot store anything (a remote server is down)."""
        return False

    def stats(self) -> dict[str, int]:
        """Counters (``hits``, ``misses``, ``sets``, ``deletes``, ``expirations``, evictions by reason, ...) and
        the current ``size`` in entries. Keys a backend cannot know are absent rather than made up."""
        return {**self._counters(), "computations": self.computations, "negative_hits": self.negative_hits}

    def hit_rate(self) -> float:
        s = self.stats()
        lookups = s.get("hits", 0) + s.get("misses", 0)
        return s.get("hits", 0) / lookups if lookups else 0.0


def key_list(keys: Iterable[str]) -> list[str]:
    """``keys`` as a list (a lone string is refused: iterating it would look up its characters)."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
        raise ArgumentTypeError(f"keys: expected an iterable of str, got {type(keys).__name__} ({keys!r:.80})")
    return list(keys)
