"""SizedLRU: keys in recency order, each with a value of a known size, and the running total of the sizes.

The one least-recently-used bookkeeping of the package's byte-budgeted stores (issue 15: four LRU copies): the
short-term memory's :class:`~memos_ref.memory.store.TTLStore` (entries, bytes held, the victims its policies
choose from) and the tier backends' byte budgets (:mod:`memos_ref.tiering.backends`). It decides nothing: a
store asks for the oldest keys and evicts by its own policy. ``cachetools.LRUCache`` was considered and does
not fit: it evicts on insert by itself (a store must first choose — LFU sampling, a protected key, a demotion
callback — and commit only once the bytes are stored) and does not expose its recency order.
Not thread-safe: each user holds its own lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["SizedLRU"]

V = TypeVar("V")


class SizedLRU(Generic[V]):
    """A recency-ordered map (least recently used first) keeping ``total`` = the sum of ``size_of(value)``.

    Args:
        size_of: the size of a value (bytes); the value itself when it *is* the size (``int``).
    """

    def __init__(self, size_of: Callable[[V], int]) -> None:
        self._items: OrderedDict[str, V] = OrderedDict()
        self._size_of = size_of
        self.total = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __iter__(self) -> Iterator[str]:
        """Keys, least recently used first."""
        return iter(self._items)

    def get(self, key: str) -> V | None:
        """The value, without touching the order (None if absent)."""
        return self._items.get(key)

    def values(self) -> Iterator[V]:
        """Values, least recently used first."""
        return iter(self._items.values())

    def items(self) -> Iterator[tuple[str, V]]:
        return iter(self._items.items())

    def put(self, key: str, value: V) -> V | None:
        """Store ``value`` under ``key`` as the most recently used; returns what it replaced (None if new)."""
        items, size_of = self._items, self._size_of
        old = items.pop(key, None)
        if old is not None:
            self.total -= size_of(old)
        items[key] = value
        self.total += size_of(value)
        return old

    def touch(self, key: str) -> None:
        """Mark ``key`` most recently used (KeyError if absent)."""
        self._items.move_to_end(key)

    def pop(self, key: str) -> V:
        """Remove ``key`` and return its value (KeyError if absent)."""
        value = self._items.pop(key)
        self.total -= self._size_of(value)
        return value

    def oldest(self, exclude: str | None = None) -> str | None:
        """The least recently used key other than ``exclude`` (None if there is none)."""
        return next((k for k in self._items if k != exclude), None)

    def clear(self) -> None:
        self._items.clear()
        self.total = 0
