"""The cluster tier's read-ahead: blocks fetched for a prompt in one round per node, kept briefly for the
per-block ``contains``/``get`` calls of the prefix lookup that follows (so those cost no round trip).

Entries expire after ``ttl_s`` seconds and the bytes held are bounded (oldest dropped first); a miss is kept too
(``None``), so the lookup does not ask the cluster again for a block it just did not find.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping

__all__ = ["ReadAhead"]


class ReadAhead:
    """Key -> bytes (or None: known absent), each for ``ttl_s`` seconds, at most ``max_bytes`` in all."""

    def __init__(self, ttl_s: float, max_bytes: int = 256 << 20, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.max_bytes, self.clock = ttl_s, max_bytes, clock
        self._entries: OrderedDict[str, tuple[float, bytes | None]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def _expire(self, now: float) -> None:
        while self._entries:
            key, (expires, _) = next(iter(self._entries.items()))
            if expires > now and self._bytes <= self.max_bytes:
                return
            self._drop(key)

    def _drop(self, key: str) -> None:
        _, data = self._entries.pop(key)
        self._bytes -= len(data or b"")

    def missing(self, keys: Iterable[str]) -> list[str]:
        """The keys not held now (fetched moments ago: not again)."""
        with self._lock:
            self._expire(self.clock())
            return [k for k in keys if k not in self._entries]

    def hold(self, found: Mapping[str, bytes | None]) -> None:
        """Keep what a fetch answered (bytes, or None for absent)."""
        with self._lock:
            expires = self.clock() + self.ttl_s
            for key, data in found.items():
                if key in self._entries:
                    self._drop(key)
                self._entries[key] = (expires, data)
                self._bytes += len(data or b"")
            self._expire(self.clock())

    def lookup(self, key: str, *, take: bool) -> tuple[bool, bytes | None]:
        """``(known, data)``: whether ``key`` is held, and its bytes (None: known absent); ``take`` removes it."""
        with self._lock:
            self._expire(self.clock())
            entry = self._entries.get(key)
            if entry is None:
                return False, None
            if take:
                self._drop(key)
            return True, entry[1]

    def forget(self, keys: Iterable[str]) -> None:
        """Drop ``keys`` (just written or deleted)."""
        with self._lock:
            for key in keys:
                if key in self._entries:
                    self._drop(key)
