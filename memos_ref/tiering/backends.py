"""Storage backends for KV blocks below the device pool: host memory, disk, Redis — one interface.

A backend stores opaque bytes (:mod:`memos_ref.tiering.blockfile` makes and checks them) under validated keys:
``put``, ``get``, ``delete``, ``contains``, ``keys``, ``stats`` and batched ``put_many`` / ``get_many``. Each
has a byte budget and evicts its least recently used blocks to stay inside it — handing each to ``on_evict``
first, so the tier store can demote it to the next tier (Redis: its own ``maxmemory`` policy, plus an optional
TTL).
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from memos_ref.errors import ConfigError
from memos_ref.resilient import ResilientRedis

__all__ = ["DiskBackend", "HostMemoryBackend", "RedisTierBackend", "TierBackend", "validate_block_key"]

_KEY = re.compile(r"[A-Za-z0-9_-]{1,128}")


def validate_block_key(key: str) -> str:
    """Block keys become file names and Redis keys: 1-128 of ``[A-Za-z0-9_-]`` (no dots, no slashes)."""
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ConfigError(f"invalid block key {key!r}: expected 1-128 characters of [A-Za-z0-9_-]")
    return key


class TierBackend(ABC):
    """Bytes by key, within a budget."""

    name = "tier"

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._lock = threading.RLock()

    @abstractmethod
    def put(self, key: str, data: bytes) -> bool:
        """Store ``data``; False if it was not stored (larger than the budget, or the backend is down)."""

    @abstractmethod
    def get(self, key: str) -> bytes | None: ...

    @abstractmethod
    def delete(self, key: str) -> bool: ...

    @abstractmethod
    def keys(self) -> list[str]: ...

    @property
    @abstractmethod
    def nbytes(self) -> int: ...

    def contains(self, key: str) -> bool:
        return key in set(self.keys())

    def put_many(self, items: Mapping[str, bytes]) -> dict[str, bool]:
        return {k: self.put(k, v) for k, v in items.items()}

    def get_many(self, keys: Iterable[str]) -> dict[str, bytes]:
        found = {k: self.get(k) for k in keys}
        return {k: v for k, v in found.items() if v is not None}

    def stats(self) -> dict[str, Any]:
        keys = self.keys()
        return {**self.counts, "blocks": len(keys), "bytes": self.nbytes}


class _BudgetLRU(TierBackend):
    """Shared bookkeeping: sizes in least-recently-used order and eviction to a byte budget."""

    def __init__(self, budget_bytes: int) -> None:
        super().__init__()
        if not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ConfigError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._used = 0
        #: called with (key, data) for each block evicted to fit the budget (the tier store demotes it)
        self.on_evict: Callable[[str, bytes], None] | None = None

    @property
    def nbytes(self) -> int:
        return self._used

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._sizes)

    def contains(self, key: str) -> bool:
        return validate_block_key(key) in self._sizes

    def delete(self, key: str) -> bool:
        validate_block_key(key)
        with self._lock:
            if key not in self._sizes:
                return False
            self._drop(key)
            return True

    def _reserve(self, key: str, size: int) -> bool:
        """Make room for ``size`` bytes under ``key`` (what it holds now will be replaced); False if it can
        never fit. The books change only in :meth:`_commit`, once the bytes are really stored."""
        if size > self.budget_bytes:
            self.counts["rejected"] += 1
            return False
        self._make_room(size - self._sizes.get(key, 0), keep=key)
        return True

    def _commit(self, key: str, size: int) -> None:
        self._used += size - self._sizes.pop(key, 0)
        self._sizes[key] = size  # most recently used
        self.counts["puts"] += 1

    def _make_room(self, need: int, keep: str) -> None:
        while self._used + need > self.budget_bytes and self._sizes:
            victim = next(iter(self._sizes))
            if victim == keep:
                break
            if self.on_evict is not None:
                data = self._peek(victim)
                if data is not None:
                    self.on_evict(victim, data)
            self._drop(victim)
            self.counts["evictions"] += 1

    @abstractmethod
    def _drop(self, key: str) -> None: ...

    @abstractmethod
    def _peek(self, key: str) -> bytes | None:
        """The stored bytes, without counting a hit or touching the LRU order."""


class HostMemoryBackend(_BudgetLRU):
    """Blocks in host RAM (pinned when CUDA is available, so device copies can be asynchronous)."""

    name = "host"

    def __init__(self, budget_bytes: int, *, pin: bool | None = None) -> None:
        super().__init__(budget_bytes)
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._data: dict[str, Any] = {}

    def put(self, key: str, data: bytes) -> bool:
        validate_block_key(key)
        with self._lock:
            if not self._reserve(key, len(data)):
                return False
            try:
                if self.pin:
                    buf = torch.empty(len(data), dtype=torch.uint8, pin_memory=True)
                    buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
                    self._data[key] = buf
                else:
                    self._data[key] = bytes(data)
            except RuntimeError:  # pinned memory can run out: refuse the block rather than fail the caller
                self.counts["errors"] += 1
                return False
            self._commit(key, len(data))
            return True

    def get(self, key: str) -> bytes | None:
        validate_block_key(key)
        with self._lock:
            value = self._data.get(key)
            if value is None:
                self.counts["misses"] += 1
                return None
            self._sizes.move_to_end(key)
            self.counts["hits"] += 1
            return value.numpy().tobytes() if isinstance(value, torch.Tensor) else value

    def _drop(self, key: str) -> None:
        self._used -= self._sizes.pop(key)
        del self._data[key]

    def _peek(self, key: str) -> bytes | None:
        value = self._data.get(key)
        return value.numpy().tobytes() if isinstance(value, torch.Tensor) else value


class DiskBackend(_BudgetLRU):
    """One file per block under ``root`` (``root/ab/abcd….kvb``), written atomically: a temporary file in the
    same directory, fsync, then rename — a crash leaves the old file or the new one, never half of one.
    Existing files are adopted at start (oldest first in the LRU order)."""

    name = "disk"
    SUFFIX = ".kvb"

    def __init__(self, root: str | Path, budget_bytes: int) -> None:
        super().__init__(budget_bytes)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        found = []
        for path in self.root.glob(f"*/*{self.SUFFIX}"):
            key = path.name[: -len(self.SUFFIX)]
            if _KEY.fullmatch(key):
                found.append((path.stat().st_mtime, key, path.stat().st_size))
        for _, key, size in sorted(found):
            self._sizes[key] = size
            self._used += size
        for stale in self.root.glob("*/.tmp-*"):  # a crash mid-write leaves these; they were never renamed
            stale.unlink(missing_ok=True)

    def path(self, key: str) -> Path:
        validate_block_key(key)
        return self.root / key[:2] / f"{key}{self.SUFFIX}"

    def put(self, key: str, data: bytes) -> bool:
        path = self.path(key)
        with self._lock:
            if not self._reserve(key, len(data)):
                return False
            tmp = None
            try:
                path.parent.mkdir(exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, path)
            except OSError:
                if tmp is not None:
                    Path(tmp).unlink(missing_ok=True)
                self.counts["errors"] += 1
                return False  # the old file, if any, is untouched and still counted
            self._commit(key, len(data))
            return True

    def get(self, key: str) -> bytes | None:
        path = self.path(key)
        with self._lock:
            if key not in self._sizes:
                self.counts["misses"] += 1
                return None
            try:
                data = path.read_bytes()
            except OSError:
                self._used -= self._sizes.pop(key)
                self.counts["misses"] += 1
                return None
            self._sizes.move_to_end(key)
            self.counts["hits"] += 1
            return data

    def _drop(self, key: str) -> None:
        self._used -= self._sizes.pop(key)
        self.path(key).unlink(missing_ok=True)

    def _peek(self, key: str) -> bytes | None:
        try:
            return self.path(key).read_bytes()
        except OSError:
            return None


class RedisTierBackend(TierBackend):
    """Blocks in Redis, shared by every process (or machine) that points at the server: the remote tier.

    Keys are ``{namespace}:{fingerprint[:16]}:{tenant}:{key}``: blocks of one model never mix with another's,
    and tenants are separated. ``ttl`` (seconds) lets the server expire cold blocks; its ``maxmemory-policy``
    evicts under pressure. Degraded mode as :class:`~memos_ref.resilient.ResilientRedis`: a dead server answers
    misses quickly and drops writes.
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
        timeout: float = 0.05,
        retry_after: float = 1.0,
        redis: ResilientRedis | None = None,
    ) -> None:
        super().__init__()
        for label, value in (("namespace", namespace), ("tenant", tenant), ("fingerprint", fingerprint)):
            if not isinstance(value, str) or not _KEY.fullmatch(value):  # no ':' or glob characters anywhere
                raise ConfigError(f"{label} must be 1-128 of [A-Za-z0-9_-], got {value!r}")
        if ttl is not None and ttl <= 0:
            raise ConfigError(f"ttl must be positive or None, got {ttl}")
        self.redis = redis or ResilientRedis(url, timeout=timeout, retry_after=retry_after)
        self.prefix = f"{namespace}:{fingerprint[:16]}:{tenant}:"
        self.ttl = ttl
        self._px = None if ttl is None else max(1, round(ttl * 1000))

    def _k(self, key: str) -> str:
        return self.prefix + validate_block_key(key)

    def put(self, key: str, data: bytes) -> bool:
        rkey = self._k(key)
        ok = self.redis.call(lambda: self.redis.client.set(rkey, data, px=self._px), None)
        self.counts["puts" if ok else "dropped_puts"] += 1
        return bool(ok)

    def get(self, key: str) -> bytes | None:
        rkey = self._k(key)
        data = self.redis.call(lambda: self.redis.client.get(rkey), None)
        self.counts["hits" if data is not None else "misses"] += 1
        return data

    def get_many(self, keys: Iterable[str]) -> dict[str, bytes]:
        keys = list(keys)
        rkeys = [self._k(k) for k in keys]
        values = self.redis.call(lambda: self.redis.client.mget(rkeys), None) if rkeys else []
        found = {k: v for k, v in zip(keys, values or []) if v is not None}
        self.counts["hits"] += len(found)
        self.counts["misses"] += len(keys) - len(found)
        return found

    def put_many(self, items: Mapping[str, bytes]) -> dict[str, bool]:
        prepared = [(self._k(k), v) for k, v in items.items()]

        def write() -> list:
            pipe = self.redis.client.pipeline(transaction=False)
            for rkey, data in prepared:
                pipe.set(rkey, data, px=self._px)
            return pipe.execute()

        ok = self.redis.call(write, None) is not None
        self.counts["puts" if ok else "dropped_puts"] += len(prepared)
        return dict.fromkeys(items, ok)

    def delete(self, key: str) -> bool:
        rkey = self._k(key)
        return bool(self.redis.call(lambda: self.redis.client.delete(rkey), 0))

    def contains(self, key: str) -> bool:
        rkey = self._k(key)
        return bool(self.redis.call(lambda: self.redis.client.exists(rkey), 0))

    def keys(self) -> list[str]:
        n = len(self.prefix)
        found = self.redis.call(
            lambda: [k.decode()[n:] for k in self.redis.client.scan_iter(match=self.prefix + "*", count=1000)], []
        )
        return found

    @property
    def nbytes(self) -> int:
        def total() -> int:
            pipe = self.redis.client.pipeline(transaction=False)
            keys = list(self.redis.client.scan_iter(match=self.prefix + "*", count=1000))
            for k in keys:
                pipe.strlen(k)
            return sum(pipe.execute()) if keys else 0

        return self.redis.call(total, 0)

    def clear(self) -> None:
        """Remove this namespace's blocks (SCAN + UNLINK; never FLUSHDB on a shared server)."""
        keys = self.redis.call(lambda: list(self.redis.client.scan_iter(match=self.prefix + "*", count=1000)), [])
        for i in range(0, len(keys), 1000):
            self.redis.call(lambda i=i: self.redis.client.unlink(*keys[i : i + 1000]), 0)

    def stats(self) -> dict[str, Any]:
        base = {**self.counts, **{f"redis_{k}": v for k, v in self.redis.counts.items()}}
        base["degraded"] = int(self.redis.is_down())
        if not self.redis.is_down():
            base["blocks"] = len(self.keys())
            base["bytes"] = self.nbytes
        return base
