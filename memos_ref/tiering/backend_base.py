"""The interface of the KV-block storage backends below the device pool, and the byte-budget bookkeeping that
host memory and disk share.

A backend stores opaque bytes (:mod:`memos_ref.tiering.blockfile` makes and checks them) under validated keys:
``put``, ``get``, ``delete``, ``contains``, ``keys``, ``stats`` and batched ``put_many`` / ``get_many``. Each
has a byte budget and evicts its least recently used blocks to stay inside it — handing each to ``on_evict``
first, so the tier store can demote it to the next tier. The backends themselves:
:mod:`~memos_ref.tiering.host_backend`, :mod:`~memos_ref.tiering.disk_backend`,
:mod:`~memos_ref.tiering.redis_tier` (all re-exported by :mod:`memos_ref.tiering.backends`).
"""

from __future__ import annotations

import re
import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from memos_ref.errors import ArgumentTypeError, ConfigError, check_type
from memos_ref.lru import SizedLRU

__all__ = [
    "BLOCK_BYTES",
    "BLOCK_KEY",
    "BudgetLRU",
    "TierBackend",
    "block_key_list",
    "check_data",
    "positive_int",
    "validate_block_key",
]

#: A block key: 1-128 of ``[A-Za-z0-9_-]``.
BLOCK_KEY = re.compile(r"[A-Za-z0-9_-]{1,128}")
#: The types a block's data may have.
BLOCK_BYTES = (bytes, bytearray, memoryview)


def validate_block_key(key: str) -> str:
    """Block keys become file names and Redis keys: 1-128 of ``[A-Za-z0-9_-]`` (no dots, no slashes)."""
    if not isinstance(key, str):
        raise ArgumentTypeError(f"block key: expected str, got {type(key).__name__} ({key!r:.80})")
    if not BLOCK_KEY.fullmatch(key):
        raise ConfigError(f"invalid block key {key!r}: expected 1-128 characters of [A-Za-z0-9_-]")
    return key


def check_data(data: object) -> None:
    """Refuse block data that is not bytes-like (:class:`ArgumentTypeError`)."""
    check_type("data", data, BLOCK_BYTES)


def positive_int(name: str, value: object) -> int:
    """``value`` when it is a positive int; else a package error naming ``name``."""
    check_type(name, value, int)
    if value <= 0:  # type: ignore[operator]
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value  # type: ignore[return-value]


class TierBackend(ABC):
    """Bytes by key, within a budget."""

    name = "tier"

    def __init__(self, max_item_bytes: int) -> None:
        self.counts: Counter[str] = Counter()
        self._lock = threading.RLock()
        #: the largest stored item a read accepts (larger ones are answered as misses and counted corrupt)
        self.max_item_bytes = positive_int("max_item_bytes", max_item_bytes)

    def limit_item_bytes(self, limit: int) -> None:
        """Lower :attr:`max_item_bytes` to ``limit`` (the tier store passes its geometry's largest block file)."""
        self.max_item_bytes = min(self.max_item_bytes, positive_int("limit", limit))

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
        check_type("items", items, Mapping)
        return {k: self.put(k, v) for k, v in items.items()}

    def get_many(self, keys: Iterable[str]) -> dict[str, bytes]:
        found = {k: self.get(k) for k in block_key_list(keys)}
        return {k: v for k, v in found.items() if v is not None}

    def stats(self) -> dict[str, Any]:
        keys = self.keys()
        return {**self.counts, "blocks": len(keys), "bytes": self.nbytes}


class BudgetLRU(TierBackend):
    """Shared bookkeeping: sizes in least-recently-used order and eviction to a byte budget."""

    def __init__(self, budget_bytes: int, max_item_bytes: int | None = None) -> None:
        budget_bytes = positive_int("budget_bytes", budget_bytes)
        super().__init__(budget_bytes if max_item_bytes is None else max_item_bytes)
        self.budget_bytes = budget_bytes
        self._sizes: SizedLRU[int] = SizedLRU(int)  # key -> stored bytes, least recently used first
        #: called with (key, data) for each block evicted to fit the budget (the tier store demotes it)
        self.on_evict: Callable[[str, bytes], None] | None = None

    @property
    def nbytes(self) -> int:
        return self._sizes.total

    def keys(self) -> list[str]:
        self._check_usable()
        with self._lock:
            return list(self._sizes)

    def contains(self, key: str) -> bool:
        self._check_usable()
        return validate_block_key(key) in self._sizes

    def _check_usable(self) -> None:
        """Raise :class:`StateError` when the backend can no longer be used (see :class:`DiskBackend`)."""

    def delete(self, key: str) -> bool:
        validate_block_key(key)
        self._check_usable()
        with self._lock:
            if key not in self._sizes:
                return False
            self._drop(key)
            return True

    def _reserve(self, key: str, size: int) -> bool:
        """Make room for ``size`` bytes under ``key`` (what it holds now will be replaced); False if it can
        never fit. The books change only in :meth:`_commit`, once the bytes are really stored."""
        if size > self.budget_bytes or size > self.max_item_bytes:
            self.counts["rejected"] += 1
            return False
        self._make_room(size - (self._sizes.get(key) or 0), keep=key)
        return True

    def _commit(self, key: str, size: int) -> None:
        self._sizes.put(key, size)  # most recently used
        self.counts["puts"] += 1

    def _make_room(self, need: int, keep: str) -> None:
        """Evict least recently used entries other than ``keep`` (the key being replaced, whose old size is
        still counted) until ``need`` more bytes fit."""
        while self._sizes.total + need > self.budget_bytes:
            victim = self._sizes.oldest(exclude=keep)
            if victim is None:
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


def block_key_list(keys: Iterable[str]) -> list[str]:
    """``keys`` as a list of valid block keys (a lone string is refused: it would iterate characters)."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
        raise ArgumentTypeError(f"keys: expected an iterable of str, got {type(keys).__name__} ({keys!r:.80})")
    out = list(keys)
    for k in out:
        validate_block_key(k)
    return out
