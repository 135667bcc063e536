"""Blocks in Redis, shared by every process (or machine) pointing at the server: the remote tier.

What it reads is untrusted (any client of the server may have written it): reads fetch at most
``max_item_bytes + 1`` bytes, and a value of another type or too large is a miss. Redis errors are misses or
dropped writes, counted by kind; nothing raises into the caller for what it finds stored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from memos_ref.errors import ConfigError, check_type
from memos_ref.resilient import (
    DEFAULT_FAILURE_THRESHOLD,
    DEFAULT_TIMEOUT_S,
    ResilientRedis,
    ttl_to_px,
    validate_ttl,
)
from memos_ref.tiering.backend_base import BLOCK_KEY, TierBackend, block_key_list, check_data, validate_block_key

__all__ = ["RedisTierBackend"]

#: Redis's largest string value: the default read bound of the Redis tier.
_REDIS_MAX_VALUE = 512 * 2**20


def _operation(method: Callable[..., Any]) -> Callable[..., Any]:
    """One public call of the Redis tier, bounded as one Redis operation (:meth:`ResilientRedis.operation`): a
    hung server costs it one timeout, however many round trips it makes."""

    def bounded(self: RedisTierBackend, *args: Any, **kwargs: Any) -> Any:
        with self.redis.operation():
            return method(self, *args, **kwargs)

    bounded.__name__, bounded.__doc__ = method.__name__, method.__doc__
    return bounded


class RedisTierBackend(TierBackend):
    """Blocks in Redis, shared by every process (or machine) that points at the server: the remote tier.

    Keys are ``{namespace}:{fingerprint[:16]}:{tenant}:{key}``: blocks of one model never mix with another's,
    and tenants are separated. ``ttl`` (seconds) lets the server expire cold blocks; its ``maxmemory-policy``
    evicts under pressure. Errors as :class:`~memos_ref.resilient.ResilientRedis`: every Redis error (a dead
    server, a full one, a read-only replica, a value of another type planted at a key) is a miss or a dropped
    write, counted by kind (``redis_errors_<kind>`` in :meth:`stats`); a dead server degrades after
    ``failure_threshold`` consecutive failures. Reads fetch at most ``max_item_bytes + 1`` bytes (``GETRANGE``),
    so a huge value planted by another client is a miss counted ``corrupt``, never a huge allocation.
    """

    name = "redis"

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        fingerprint: str,
        namespace: str = "memos-kv",
        tenant: str = "default",
        ttl: float | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        retry_after: float = 1.0,
        failure_threshold: int = DEFAULT_FAILURE_THRESHOLD,
        redis: ResilientRedis | None = None,
        max_item_bytes: int = _REDIS_MAX_VALUE,
    ) -> None:
        super().__init__(max_item_bytes)
        for label, value in (("namespace", namespace), ("tenant", tenant), ("fingerprint", fingerprint)):
            check_type(label, value, str)
            if not BLOCK_KEY.fullmatch(value):  # no ':' or glob characters anywhere
                raise ConfigError(f"{label} must be 1-128 of [A-Za-z0-9_-], got {value!r}")
        self.ttl = validate_ttl(ttl)
        if redis is not None:
            check_type("redis", redis, ResilientRedis)
        self.redis = redis or ResilientRedis(
            url, timeout=timeout, retry_after=retry_after, failure_threshold=failure_threshold
        )
        self.prefix = f"{namespace}:{fingerprint[:16]}:{tenant}:"
        self._px = ttl_to_px(self.ttl)

    def _k(self, key: str) -> str:
        return self.prefix + validate_block_key(key)

    def _value(self, raw: object) -> bytes | None:
        """One value read with GETRANGE: None when absent, of another type (an error object from a pipeline)
        or larger than the bound (counted ``corrupt``)."""
        if isinstance(raw, Exception):
            self.redis.count_error(raw)
            return None
        if not isinstance(raw, bytes) or not raw:  # GETRANGE answers "" for a missing key
            return None
        if len(raw) > self.max_item_bytes:
            self.counts["corrupt"] += 1
            return None
        return raw

    @_operation
    def put(self, key: str, data: bytes) -> bool:
        rkey = self._k(key)
        check_data(data)
        ok = len(data) <= self.max_item_bytes and self.redis.call(
            lambda: self.redis.client.set(rkey, bytes(data), px=self._px), None
        )
        self.counts["puts" if ok else "dropped_puts"] += 1
        return bool(ok)

    @_operation
    def get(self, key: str) -> bytes | None:
        rkey = self._k(key)
        raw = self.redis.call(lambda: self.redis.client.getrange(rkey, 0, self.max_item_bytes), None)
        data = self._value(raw)
        self.counts["hits" if data is not None else "misses"] += 1
        return data

    @_operation
    def get_many(self, keys: Iterable[str]) -> dict[str, bytes]:
        keys = block_key_list(keys)
        rkeys = [self._k(k) for k in keys]

        def read() -> list:
            pipe = self.redis.client.pipeline(transaction=False)
            for rkey in rkeys:
                pipe.getrange(rkey, 0, self.max_item_bytes)
            return pipe.execute(raise_on_error=False)

        values = self.redis.call(read, None) if rkeys else []
        found = {}
        for k, raw in zip(keys, values or []):
            data = self._value(raw)
            if data is not None:
                found[k] = data
        self.counts["hits"] += len(found)
        self.counts["misses"] += len(keys) - len(found)
        return found

    @_operation
    def put_many(self, items: Mapping[str, bytes]) -> dict[str, bool]:
        check_type("items", items, Mapping)
        prepared = []
        for k, v in items.items():
            check_data(v)
            prepared.append((k, self._k(k), v))
        small = [(k, rkey, v) for k, rkey, v in prepared if len(v) <= self.max_item_bytes]

        def write() -> list:
            pipe = self.redis.client.pipeline(transaction=False)
            for _, rkey, data in small:
                pipe.set(rkey, bytes(data), px=self._px)
            return pipe.execute(raise_on_error=False)

        results = (self.redis.call(write, None) if small else []) or [None] * len(small)
        ok = dict.fromkeys(items, False)
        for (k, _, _), result in zip(small, results):
            if isinstance(result, Exception):
                self.redis.count_error(result)
            ok[k] = result is True
        stored = sum(ok.values())
        self.counts["puts"] += stored
        self.counts["dropped_puts"] += len(ok) - stored
        return ok

    @_operation
    def delete(self, key: str) -> bool:
        rkey = self._k(key)
        return bool(self.redis.call(lambda: self.redis.client.delete(rkey), 0))

    @_operation
    def contains(self, key: str) -> bool:
        """True when a block (a string value) is stored under ``key``; a value of another type planted there is
        not a block, as :meth:`get` answers a miss for it."""
        rkey = self._k(key)
        return self.redis.call(lambda: self.redis.client.type(rkey), b"none") == b"string"

    def _scan(self) -> list[bytes]:
        return self.redis.call(lambda: list(self.redis.client.scan_iter(match=self.prefix + "*", count=1000)), [])

    @_operation
    def keys(self) -> list[str]:
        """The block keys of this namespace. Keys another client planted under the prefix that are not valid
        block keys (not UTF-8, wrong characters) are skipped and counted ``foreign_keys``."""
        prefix, out = self.prefix.encode(), []
        for rkey in self._scan():
            try:
                key = rkey[len(prefix) :].decode("ascii") if rkey.startswith(prefix) else ""
            except UnicodeDecodeError:
                key = ""
            if BLOCK_KEY.fullmatch(key):
                out.append(key)
            else:
                self.counts["foreign_keys"] += 1
        return out

    @property
    @_operation
    def nbytes(self) -> int:
        def total() -> int:
            keys = self.keys()  # block keys only: what other clients planted under the prefix is not ours
            if not keys:
                return 0
            pipe = self.redis.client.pipeline(transaction=False)
            for k in keys:
                pipe.strlen(self.prefix + k)
            return sum(n for n in pipe.execute(raise_on_error=False) if isinstance(n, int))  # skip other types

        return self.redis.call(total, 0)

    @_operation
    def clear(self) -> None:
        """Remove this namespace's blocks (SCAN + UNLINK; never FLUSHDB on a shared server)."""
        keys = self._scan()
        for i in range(0, len(keys), 1000):
            self.redis.call(lambda i=i: self.redis.client.unlink(*keys[i : i + 1000]), 0)

    @_operation
    def stats(self) -> dict[str, Any]:
        base = {**self.counts, **{f"redis_{k}": v for k, v in self.redis.counts.items()}}
        base["degraded"] = int(self.redis.is_down())
        if not self.redis.is_down():
            base["blocks"] = len(self.keys())
            base["bytes"] = self.nbytes
        return base
