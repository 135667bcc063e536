"""RedisBackend: the short-term memory store in a Redis server, shared by every process that points at it.

* **Native TTLs**: ``SET key value PX ms`` — the server expires entries; a ``GET`` never extends a TTL and an
  overwrite restarts it, the same semantics as :class:`~memos_ref.memory.store.TTLStore`.
* **Namespaced keys**: ``{namespace}:{tenant}:{key}``, so several stores (or tenants) share one server and
  ``clear()`` removes only its own keys (``SCAN`` + ``UNLINK``, never ``FLUSHDB``).
* **JSON values**, never pickle: a value read back from a shared server cannot run code.
* **Eviction** is the server's: set ``maxmemory`` and ``maxmemory-policy allkeys-lfu`` (Redis's approximated
  LFU, the nearest to the hybrid score) on the server; this class does not reconfigure a shared server.
* **Degraded mode** (:class:`~memos_ref.resilient.ResilientRedis`): every call has a socket timeout (default
  0.5 s) and no retries. ``failure_threshold`` consecutive connection failures (default 3; a refused
  connection at once) warn once (:class:`~memos_ref.errors.BackendDegradedWarning`), and for ``retry_after``
  seconds every read answers "miss" and every write is dropped without touching the network — so an agent
  keeps working, only slower, and never blocks on a dead server.
* **Every Redis error is a miss or a dropped write**, counted by kind (``errors_oom``, ``errors_readonly``,
  ``errors_wrongtype``, ``errors_moved``, ...): a full server, a replica, a value of another type planted at a
  key never raise into the caller.
* **One call, one timeout**: each public call is one :meth:`~memos_ref.resilient.ResilientRedis.operation`:
  after its first connection failure its other round trips are skipped, so against a hung server every call
  returns after about ``timeout`` (not one ``timeout`` per round trip) and answers a miss or a dropped write.
* **A key of another type** (a foreign client ran ``RPUSH`` on it): reads answer a miss (``errors_wrongtype``);
  ``set`` and ``update`` overwrite it, as Redis's ``SET`` does — ``update`` computes ``fn(default)`` and stores
  it, so what it returns is what ``get`` then reads.
* **Negative caching** stores one NUL byte, which no JSON document is, so a user value can never be read back as
  "nothing found" (nor the reverse).
* **Untrusted values**: a value read back is bounded (``GETRANGE`` reads at most ``max_value_bytes + 1``
  bytes) and must decode as strict JSON; anything else (not UTF-8 — a surrogate encoded as bytes included —,
  not JSON, ``NaN``/``Infinity`` or a number overflowing to an infinity such as ``1e999``, nested past the
  interpreter's recursion limit, too large) is counted ``corrupt`` and answered as a miss: what this store's
  writes refuse is never served.

Point it at an existing Redis with ``RedisBackend("redis://host:6379/0", namespace="myapp")``.
"""

from __future__ import annotations

import functools
import json
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from memos_ref.errors import ArgumentTypeError, BackendUnavailableError, ConfigError, check_type
from memos_ref.memory.backend import DEFAULT, DEFAULT_FLIGHT_WAIT_S, CacheBackend, key_list, short_key
from memos_ref.memory.store import MISSING, AbsentKeyError, encode_value, validate_key
from memos_ref.resilient import DEFAULT_FAILURE_THRESHOLD, DEFAULT_TIMEOUT_S, ResilientRedis, error_kind, ttl_to_px

__all__ = ["RedisBackend"]

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
#: A negatively cached key's value: a NUL byte, never the JSON of anything (JSON text has no raw control bytes).
_NEGATIVE = b"\x00"
#: ``update`` attempts before a key that other clients keep writing is given up (counted a dropped write).
_MAX_UPDATE_ATTEMPTS = 100

F = TypeVar("F", bound=Callable[..., Any])


def _refuse_constant(name: str) -> Any:
    """``NaN``, ``Infinity``, ``-Infinity``: not JSON, and refused by this store's writes."""
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    """A JSON number as a float, refusing one that overflows to an infinity (``1e999``)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} overflows a float")
    return value


def _operation(method: F) -> F:
    """One public call: refused from inside ``update``'s ``fn``, and bounded as one Redis operation."""

    @functools.wraps(method)
    def bounded(self: RedisBackend, *args: Any, **kwargs: Any) -> Any:
        self._check_reentry()
        with self.redis.operation():
            return method(self, *args, **kwargs)

    return bounded  # type: ignore[return-value]


class RedisBackend(CacheBackend):
    """The short-term memory store over Redis (redis-py).

    Args:
        url: ``redis://host:port/db`` (ignored when ``client`` is given).
        client: an existing ``redis.Redis`` (its own timeouts and retries then apply).
        namespace / tenant: key prefix parts; letters, digits, ``_``, ``.``, ``-`` only.
        max_value_bytes: the largest value (JSON bytes + key) accepted, as in the memory backend.
        timeout: socket connect and read timeout in seconds — the longest a call can block (default 0.5 s).
        retry_after: seconds a lost server is left alone before the next attempt.
        failure_threshold: consecutive connection failures (timeouts, resets) before degraded mode (default 3;
            a refused connection degrades at once).
        clock: the time source for ``retry_after`` (inject one in tests).
        default_ttl / negative_ttl / ttl_jitter / seed: see :class:`CacheBackend`.
    """

    name = "redis"

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        client: Any = None,
        namespace: str = "memos",
        tenant: str = "default",
        default_ttl: float | None = 300.0,
        negative_ttl: float = 5.0,
        ttl_jitter: float = 0.0,
        seed: int = 0,
        max_value_bytes: int = 2**20,
        timeout: float = DEFAULT_TIMEOUT_S,
        retry_after: float = 1.0,
        failure_threshold: int = DEFAULT_FAILURE_THRESHOLD,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(default_ttl=default_ttl, negative_ttl=negative_ttl, ttl_jitter=ttl_jitter, seed=seed)
        for label, value in (("namespace", namespace), ("tenant", tenant)):
            check_type(label, value, str)
            if not _NAME.fullmatch(value):
                raise ConfigError(f"{label} must be 1-64 of [A-Za-z0-9_.-], got {value!r}")
        check_type("max_value_bytes", max_value_bytes, int)
        if max_value_bytes <= 0:
            raise ConfigError(f"max_value_bytes must be positive, got {max_value_bytes}")
        self.redis = ResilientRedis(
            url,
            client=client,
            timeout=timeout,
            retry_after=retry_after,
            failure_threshold=failure_threshold,
            clock=clock,
        )
        self.url, self.client = url, self.redis.client
        self.prefix = f"{namespace}:{tenant}:"
        self.max_value_bytes = max_value_bytes

    # ------------------------------------------------------------------ plumbing
    def _key(self, key: str) -> str:
        return self.prefix + validate_key(key)

    def _count(self, name: str, n: int = 1) -> None:
        self.redis.count(name, n)

    def _degraded(self) -> bool:
        return self.redis.is_down()

    @property
    def degraded(self) -> bool:
        return self.redis.degraded

    def _call(self, fn: Callable[[], Any], fallback: Any) -> Any:
        return self.redis.call(fn, fallback)

    def _read(self, rkey: str) -> Any:
        """Read ``rkey`` bounded to ``max_value_bytes + 1`` bytes (GETRANGE answers "" for a missing key)."""
        return self.client.getrange(rkey, 0, self.max_value_bytes)

    def _decode(self, raw: object, sentinel: object) -> Any:
        """A stored value, or ``sentinel`` when absent, unreadable or too large (the last two counted
        ``corrupt``: another client planted something this store never writes)."""
        if isinstance(raw, Exception):  # a pipeline's failed command (a value of another type, ...)
            self.redis.count_error(raw)
            return sentinel
        if not isinstance(raw, bytes) or not raw:
            return sentinel
        if raw == _NEGATIVE:
            return MISSING
        if len(raw) > self.max_value_bytes:
            self._count("corrupt")
            return sentinel
        try:  # strict: what this store's writes refuse (NaN, 1e999, raw surrogates: not UTF-8) is not a value
            return json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant, parse_float=_finite_float)
        except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            self._count("corrupt")
            return sentinel

    # ------------------------------------------------------------------ the primitives
    @_operation
    def set(self, key: str, value: Any, ttl: float | None = DEFAULT) -> None:  # type: ignore[assignment]
        rkey = self._key(key)
        payload = encode_value(key, value, self.max_value_bytes)
        px = ttl_to_px(self.ttl_for_store(ttl))
        if self._call(lambda: self.client.set(rkey, payload, px=px), None) is None:
            self._count("dropped_sets")
        else:
            self._count("sets")

    def get(self, key: str, default: Any = None) -> Any:
        value = self._lookup(key, default)
        return default if value is MISSING else value

    @_operation
    def _lookup(self, key: str, absent: Any) -> Any:
        rkey = self._key(key)
        sentinel = object()
        value = self._decode(self._call(lambda: self._read(rkey), None), sentinel)
        if value is sentinel:
            self._count("misses")
            return absent
        self._count("hits")
        return value

    @_operation
    def _set_missing(self, key: str, ttl: float | None) -> None:
        rkey, px = self._key(key), ttl_to_px(self.ttl_for_store(ttl))
        if self._call(lambda: self.client.set(rkey, _NEGATIVE, px=px), None) is None:
            self._count("dropped_sets")
        else:
            self._count("sets")

    @_operation
    def update(self, key: str, fn: Callable[[Any], Any], default: Any = None, ttl: float | None = DEFAULT) -> Any:  # type: ignore[assignment]
        """Atomic read-modify-write by optimistic locking: ``WATCH`` the key, read it, compute ``fn`` here, then
        ``MULTI``/``SET``/``EXEC``; if another client wrote the key in between, ``EXEC`` fails and the whole
        step is retried, so ``fn`` may run more than once. A key of another type (a list, a hash, ...), a value
        that does not decode, or a negatively cached key counts as absent: ``fn(default)`` is stored over it,
        as ``set`` overwrites. While the server is unreachable, when it refuses the write (full, read-only), or
        when other clients kept writing the key through every retry, the write is dropped (counted
        ``dropped_sets``) and :class:`~memos_ref.errors.BackendUnavailableError` is raised: ``update`` returns
        only a value it stored, never one it merely computed. ``fn`` calling this backend raises
        :class:`~memos_ref.errors.StateError`."""
        if not callable(fn):
            raise ArgumentTypeError(f"fn: expected a callable, got {type(fn).__name__} ({fn!r:.80})")
        from redis.exceptions import WatchError  # redis is imported when a client is made, not with this module

        rkey, px = self._key(key), ttl_to_px(self.ttl_for_store(ttl))
        sentinel = object()
        reads: list[bool] = []  # hit or miss of the read that the committed write was based on
        computed: list[Any] = []  # fn's result of the last attempt (returned if the write is dropped)

        def read_current(pipe: Any) -> Any:
            try:
                raw = pipe.getrange(rkey, 0, self.max_value_bytes)
            except self.redis.server_errors as exc:
                if error_kind(exc) != "wrongtype":
                    raise
                self.redis.count_error(exc)  # another client's list, hash, ...: overwritten, as set does
                return sentinel
            current = self._decode(raw, sentinel)
            return sentinel if current is MISSING else current

        def read_modify_write() -> Any:
            with self.client.pipeline() as pipe:
                for _ in range(_MAX_UPDATE_ATTEMPTS):
                    try:
                        pipe.watch(rkey)
                        current = read_current(pipe)
                        reads[:] = [current is not sentinel]
                        computed[:] = [self._run_fn(fn, default if current is sentinel else current)]
                        payload = encode_value(key, computed[0], self.max_value_bytes)
                        pipe.multi()
                        pipe.set(rkey, payload, px=px)
                        pipe.execute()
                        return computed[0]
                    except WatchError:
                        self._count("update_retries")
            return sentinel  # other clients kept writing the key: give up, as a dropped write

        value = self._call(read_modify_write, sentinel)
        if value is sentinel:
            self._count("dropped_sets")
            raise BackendUnavailableError(
                f"redis update({short_key(key)}) stored nothing: the server is unreachable, refused the write, or "
                f"other clients kept writing the key through {_MAX_UPDATE_ATTEMPTS} attempts (counted "
                "dropped_sets) — retry, or fall back on your own default"
            )
        self._count("hits" if reads[0] else "misses")
        self._count("sets")
        return value

    @_operation
    def get_or_compute(
        self,
        key: str,
        compute: Callable[[], Any],
        ttl: float | None = DEFAULT,  # type: ignore[assignment]
        *,
        wait_s: float = DEFAULT_FLIGHT_WAIT_S,
    ) -> Any:
        """See :meth:`CacheBackend.get_or_compute`; one operation, so against a hung server the read costs one
        ``timeout`` and the write is skipped (``compute``'s own time is not bounded here)."""
        return super().get_or_compute(key, compute, ttl, wait_s=wait_s)

    @_operation
    def delete(self, key: str) -> bool:
        rkey = self._key(key)
        removed = bool(self._call(lambda: self.client.delete(rkey), 0))
        if removed:
            self._count("deletes")
        return removed

    @_operation
    def ttl(self, key: str) -> float | None:
        """Seconds left; :class:`AbsentKeyError` (a ``KeyError``) when absent, negatively cached, unreachable,
        or holding a value of another type (each of which ``get`` answers as a miss too)."""
        rkey = self._key(key)

        def type_pttl_head() -> list:
            pipe = self.client.pipeline(transaction=False)
            pipe.type(rkey)
            pipe.pttl(rkey)
            pipe.getrange(rkey, 0, 1)  # the NUL byte of a negatively cached key, read without the value
            return pipe.execute(raise_on_error=False)

        kind, ms, head = self._call(type_pttl_head, [b"none", -2, b""])
        if kind != b"string" or not isinstance(ms, int) or ms == -2 or head == _NEGATIVE:
            raise AbsentKeyError(key)
        return None if ms == -1 else ms / 1000

    @_operation
    def clear(self) -> None:
        def unlink_namespace() -> int:
            removed, batch = 0, []
            for rkey in self.client.scan_iter(match=self.prefix + "*", count=1000):
                batch.append(rkey)
                if len(batch) == 1000:
                    removed += self.client.unlink(*batch)
                    batch = []
            if batch:
                removed += self.client.unlink(*batch)
            return removed

        self._count("deletes", self._call(unlink_namespace, 0))

    @_operation
    def get_many(self, keys: Iterable[str]) -> dict[str, Any]:
        keys = key_list(keys)
        rkeys = [self._key(k) for k in keys]

        def read() -> list:
            pipe = self.client.pipeline(transaction=False)
            for rkey in rkeys:
                pipe.getrange(rkey, 0, self.max_value_bytes)
            return pipe.execute(raise_on_error=False)

        raws = self._call(read, None) if rkeys else []
        if raws is None:
            self._count("misses", len(keys))
            return {}
        sentinel = object()
        decoded = {k: self._decode(raw, sentinel) for k, raw in zip(keys, raws)}
        found = {k: v for k, v in decoded.items() if v is not sentinel and v is not MISSING}
        self._count("hits", len(found))
        self._count("misses", len(keys) - len(found))
        return found

    @_operation
    def set_many(self, items: Mapping[str, Any], ttl: float | None = DEFAULT) -> None:  # type: ignore[assignment]
        """One round trip (a pipeline) for every item."""
        check_type("items", items, Mapping)
        prepared = []
        for key, value in items.items():  # validate everything before writing anything
            rkey, payload = self._key(key), encode_value(key, value, self.max_value_bytes)
            prepared.append((rkey, payload, ttl_to_px(self.ttl_for_store(ttl))))

        def write() -> list:
            pipe = self.client.pipeline(transaction=False)
            for rkey, payload, px in prepared:
                pipe.set(rkey, payload, px=px)
            return pipe.execute(raise_on_error=False)

        results = self._call(write, None) if prepared else []
        if results is None:
            self._count("dropped_sets", len(prepared))
            return
        for result in results:
            if isinstance(result, Exception):  # a full server (OOM), a read-only replica, ...
                self.redis.count_error(result)
        stored = sum(1 for result in results if result is True)
        self._count("sets", stored)
        self._count("dropped_sets", len(prepared) - stored)

    def _count_keys(self) -> int | None:
        """The keys of this namespace, or None when the server could not be asked."""
        return self._call(lambda: sum(1 for _ in self.client.scan_iter(match=self.prefix + "*", count=1000)), None)

    @_operation
    def __len__(self) -> int:
        """The keys of this namespace. Raises :class:`~memos_ref.errors.BackendUnavailableError` when the server
        cannot be reached (the size is unknown, not 0)."""
        n = self._count_keys()
        if n is None:
            raise BackendUnavailableError(
                f"redis namespace {self.prefix!r}: its size is unknown, the server is unreachable (len() never "
                "answers 0 for a server it could not ask)"
            )
        return n

    @_operation
    def _counters(self) -> dict[str, int]:
        counts = dict(self.redis.counts)
        counts.setdefault("hits", 0)
        counts.setdefault("misses", 0)
        counts["degraded"] = int(self._degraded())
        if not self._degraded():
            size = self._count_keys()
            if size is not None:  # unknown while unreachable: left out, as a key the backend cannot know
                counts["size"] = size
            info = self._call(lambda: self.client.info("stats"), {})
            # server-wide (every namespace on this server), as Redis reports them
            for name in ("expired_keys", "evicted_keys"):
                if name in info:
                    counts[f"server_{name}"] = int(info[name])
        return counts
