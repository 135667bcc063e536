"""CacheBackend: one interface for the short-term memory store, whatever holds the bytes (seed 002 §5.2).

A backend implements six primitives — ``get``, ``set``, ``update`` (an atomic read-modify-write), ``delete``,
``ttl`` (seconds left) and ``clear`` —
plus ``_counters()`` for its stats. Everything that must behave the same on every backend is written once
here: TTL jitter, single-flight ``get_or_compute`` and negative caching of misses (seed 002 §5.3), batched
forms, and the stats API. :class:`~memos_ref.memory.sharded.MemoryBackend` keeps entries in this process;
:class:`~memos_ref.memory.redis_backend.RedisBackend` keeps them in a Redis server that several processes share.

Single flight is per process: concurrent misses for one key in one process compute once. The leader hands its
result to the callers waiting on it (each gets its own JSON copy), and a caller whose miss was read before a
leader finished re-checks the store before it takes the lead, so a value just stored is never computed again.
Across processes, two may each compute once; the results are equal by assumption (a cache of a pure function),
so the cost is bounded by the process count, not by the request rate.

Re-entry: ``update(key, fn)`` runs ``fn`` under the key's lock (in memory) or inside a ``WATCH`` (on Redis). A
``fn`` that calls the same backend raises :class:`~memos_ref.errors.StateError` on every backend — it would
deadlock on the lock, or land a nested write that the outer one silently overwrites.
"""

from __future__ import annotations

import json
import math
import random
import threading
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from memos_ref.errors import ArgumentTypeError, BackendUnavailableError, ConfigError, StateError, check_type
from memos_ref.memory.store import MISSING
from memos_ref.resilient import MAX_TTL_S, check_seconds, validate_ttl

__all__ = ["DEFAULT_FLIGHT_WAIT_S", "MISSING", "CacheBackend", "key_list", "short_key"]

#: Completion stamps of single-flight computations, by a hash of the key (a fixed table: bounded memory).
_STAMPS = 64


class _Flight:
    """One in-flight computation: its waiters read ``payload`` (the leader's result as JSON) once ``done`` is set."""

    __slots__ = ("done", "leader", "ok", "payload")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.ok = False
        self.payload: str | None = None
        self.leader = threading.get_ident()  # the thread computing: it must never wait on its own flight


#: How long a ``get_or_compute`` caller waits for another thread's computation of the same key by default.
DEFAULT_FLIGHT_WAIT_S = 60.0

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
        self._inflight: dict[str, _Flight] = {}
        self._inflight_lock = threading.Lock()
        self._stamps = [0] * _STAMPS  # bumped (under _inflight_lock) when a flight for a key of that slot ends
        #: the TTL of a write given no TTL, when it needs no per-write draw (no jitter); else DEFAULT
        self._fixed_ttl = default_ttl if not ttl_jitter else DEFAULT
        self._local = threading.local()  # .in_fn: this thread is running update()'s fn
        self._fns_running = 0  # update() fns running in any thread: the fast path skips the re-entry check at 0
        self._fns_lock = threading.Lock()
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
        """Seconds left before ``key`` expires; None if it never expires. Raises
        :class:`~memos_ref.memory.store.AbsentKeyError` (a ``KeyError``) if absent or negatively cached."""

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

    def _lookup(self, key: str, absent: Any) -> Any:
        """The live value, :data:`MISSING` for a negatively cached key, or ``absent``."""
        return self.get(key, absent)

    def _set_missing(self, key: str, ttl: float | None) -> None:  # noqa: B027 - optional: no negative caching
        """Cache "nothing found" for ``key`` for ``ttl`` seconds (read back by :meth:`_lookup` as MISSING)."""

    # ------------------------------------------------------------------ re-entry
    def _check_reentry(self) -> None:
        """Raise :class:`StateError` when called from inside ``update()``'s ``fn`` on this thread."""
        if self._fns_running and getattr(self._local, "in_fn", False):
            raise StateError(
                f"the {self.name} store was called from inside update()'s fn: fn must compute the new value from "
                "the current one only (it runs under the key's lock, or may be retried); read other keys before "
                "calling update()"
            )

    def _run_fn(self, fn: Callable[[Any], Any], current: Any) -> Any:
        """``fn(current)``, with every call back into this backend from this thread refused while it runs."""
        with self._fns_lock:
            self._fns_running += 1
        self._local.in_fn = True
        try:
            return fn(current)
        finally:
            self._local.in_fn = False
            with self._fns_lock:
                self._fns_running -= 1

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

    def get_or_compute(
        self,
        key: str,
        compute: Callable[[], Any],
        ttl: float | None = DEFAULT,  # type: ignore[assignment]
        *,
        wait_s: float = DEFAULT_FLIGHT_WAIT_S,
    ) -> Any:
        """The cached value, or ``compute()`` run by exactly one caller in this process while concurrent callers
        for the same key wait for its result (single flight): each waiter gets its own copy of the leader's
        result, without another read. A ``None`` result is cached as a miss for ``negative_ttl`` seconds, so a
        storm of lookups for something that does not exist computes once. If ``compute`` raises, the error
        reaches the leader and one waiter takes the lead. A value a user stored always reads back as itself.

        A waiter waits at most ``wait_s`` seconds (default :data:`DEFAULT_FLIGHT_WAIT_S`) for the leader, then
        raises :class:`~memos_ref.errors.BackendUnavailableError` (a hung ``compute`` never blocks its waiters
        forever; the leader's flight goes on). ``compute`` calling ``get_or_compute`` for the same key (it would
        wait on its own flight forever) raises :class:`~memos_ref.errors.StateError`."""
        self._check_reentry()
        if not callable(compute):
            raise ArgumentTypeError(f"compute: expected a callable, got {type(compute).__name__} ({compute!r:.80})")
        if ttl is not DEFAULT:
            validate_ttl(ttl)
        if wait_s is not DEFAULT_FLIGHT_WAIT_S:
            wait_s = check_seconds("wait_s", wait_s)
        slot = zlib.crc32(key.encode(errors="surrogatepass")) % _STAMPS if isinstance(key, str) else 0
        absent = object()
        rechecked = False
        while True:
            stamp = self._stamps[slot]
            value = self._lookup(key, absent)
            if value is MISSING:
                self.negative_hits += 1
                return None
            if value is not absent:
                return value
            with self._inflight_lock:
                flight = self._inflight.get(key)
                leader = flight is None and (rechecked or self._stamps[slot] == stamp)
                if leader:
                    flight = self._inflight[key] = _Flight()
            if flight is None:  # a flight for this slot ended after our read: it may have stored the key
                rechecked = True
                continue
            if not leader:
                if flight.leader == threading.get_ident():
                    raise StateError(
                        f"get_or_compute({short_key(key)}) was called again from inside its own compute(): it would "
                        "wait on its own computation forever — compute must not ask for the key it computes"
                    )
                if not flight.done.wait(wait_s):
                    raise BackendUnavailableError(
                        f"get_or_compute({short_key(key)}): the computation in flight in another thread has not "
                        f"finished after wait_s={wait_s} s; nothing was stored by this call (retry later, or pass "
                        "a larger wait_s)"
                    )
                if flight.ok:
                    return None if flight.payload is None else json.loads(flight.payload)
                continue  # the leader failed: read again, and maybe take the lead
            return self._lead(key, compute, ttl, flight, slot)

    def _lead(self, key: str, compute: Callable[[], Any], ttl: Any, flight: _Flight, slot: int) -> Any:
        try:
            self.computations += 1
            result = compute()
            if result is None:
                self._set_missing(key, self.negative_ttl)
            else:
                self.set(key, result, ttl)
                flight.payload = json.dumps(result)  # set() accepted it: it is JSON
            flight.ok = True
            return result
        finally:
            with self._inflight_lock:
                del self._inflight[key]
                self._stamps[slot] += 1
            flight.done.set()

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


def short_key(key: object) -> str:
    """A key for an error message: at most 80 characters of its repr."""
    text = repr(key)
    return text if len(text) <= 80 else f"{text[:80]}... ({len(text)} characters)"


def key_list(keys: Iterable[str]) -> list[str]:
    """``keys`` as a list (a lone string is refused: iterating it would look up its characters)."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
        raise ArgumentTypeError(f"keys: expected an iterable of str, got {type(keys).__name__} ({keys!r:.80})")
    return list(keys)
