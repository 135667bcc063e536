"""The free list: the blocks an allocation can take — free ones, then cached ones least recently used first.

Two *intrusive doubly linked lists* over two shared integer arrays (``prev``/``next`` per block, with a sentinel
per list), as in vLLM v1's ``FreeKVCacheBlockQueue``: any block can be unlinked in O(1) — which a Python
``deque.remove`` cannot (it scans, so its cost grows with the pool). Nodes ``0..N-1`` are blocks; ``N`` and
``N+1`` are the sentinels of the free and the cached list.

A block's :class:`BlockState` says which list it is on: ``FREE`` (the free list), ``CACHED`` (the cached list)
or ``ACTIVE`` (neither: held). Links only: which list a block belongs on is decided by its owner,
:class:`~memos_ref.paged.allocator.BlockAllocator`, which keeps the refcounts and states and moves blocks between
the lists.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from enum import IntEnum

__all__ = ["BlockState", "FreeLists", "LinkedList"]


class BlockState(IntEnum):
    """A block's state: ``FREE`` (on the free list), ``ACTIVE`` (held: refcount >= 1, on no list) or ``CACHED``
    (refcount 0, holding a reusable prefix: on the cached list)."""

    FREE = 0
    ACTIVE = 1
    CACHED = 2


class LinkedList:
    """An intrusive doubly linked list over shared ``prev``/``next`` arrays; ``sentinel`` is its own node."""

    __slots__ = ("next", "prev", "sentinel", "size")

    def __init__(self, prev: array, nxt: array, sentinel: int) -> None:
        self.prev, self.next, self.sentinel, self.size = prev, nxt, sentinel, 0
        prev[sentinel] = nxt[sentinel] = sentinel

    def push_back(self, node: int) -> None:
        prev, nxt, s = self.prev, self.next, self.sentinel
        last = prev[s]
        nxt[last] = node
        prev[node] = last
        nxt[node] = s
        prev[s] = node
        self.size += 1

    def unlink(self, node: int) -> None:
        prev, nxt = self.prev, self.next
        before, after = prev[node], nxt[node]
        nxt[before] = after
        prev[after] = before
        prev[node] = nxt[node] = -1
        self.size -= 1

    def pop_front(self) -> int:
        node = self.next[self.sentinel]
        self.unlink(node)
        return node

    def __iter__(self) -> Iterator[int]:
        node = self.next[self.sentinel]
        while node != self.sentinel:
            yield node
            node = self.next[node]


class FreeLists:
    """The free list (:attr:`free`) and the LRU list of cached blocks (:attr:`cached`) of ``num_blocks`` blocks.

    At first every block is free, in id order. The arrays and the two lists are the same objects for the life of
    the lists (:meth:`commit_growth` changes them in place), so an owner may keep references to them.
    """

    __slots__ = ("cached", "free", "next", "prev")

    def __init__(self, num_blocks: int) -> None:
        self.prev = array("q", range(-1, num_blocks + 1))
        self.next = array("q", range(1, num_blocks + 3))
        self.free = LinkedList(self.prev, self.next, num_blocks)
        self.cached = LinkedList(self.prev, self.next, num_blocks + 1)
        if num_blocks:  # blocks 0..N-1 in order on the free list (built in one pass, not N push_backs)
            self.prev[0], self.next[num_blocks - 1] = num_blocks, num_blocks
            self.next[num_blocks], self.prev[num_blocks] = 0, num_blocks - 1
            self.free.size = num_blocks

    def grown_links(self, old: int, n: int) -> tuple[array, array]:
        """The ``prev``/``next`` arrays after adding blocks ``old..old+n-1`` (``old``: the current block count) at
        the back of the free list, in id order — built as new arrays, so nothing changes until
        :meth:`commit_growth` (a failure here, out of memory, leaves the lists as they were)."""
        new = old + n
        # the two sentinels move from old, old+1 to new, new+1; the nodes linked to them are re-pointed
        prev, nxt = array("q", self.prev), array("q", self.next)
        tail = array("q", [-1]) * (n + 2)
        del prev[old:], nxt[old:]
        prev.extend(tail)
        nxt.extend(tail)
        for lst, sentinel in ((self.free, new), (self.cached, new + 1)):
            s = lst.sentinel
            first, last = self.next[s], self.prev[s]
            if first == s:  # empty
                prev[sentinel] = nxt[sentinel] = sentinel
            else:
                nxt[sentinel], prev[first] = first, sentinel
                prev[sentinel], nxt[last] = last, sentinel
        # the new blocks, in order, at the back of the free list
        free_s = new
        last = prev[free_s]
        prev[old:new] = array("q", range(old - 1, new - 1))
        nxt[old:new] = array("q", range(old + 1, new + 1))
        prev[old], nxt[last] = last, old
        nxt[new - 1], prev[free_s] = free_s, new - 1
        return prev, nxt

    def commit_growth(self, links: tuple[array, array], n: int) -> None:
        """Adopt :meth:`grown_links`' arrays (copied into the shared arrays in place) for ``n`` new blocks."""
        prev, nxt = links
        new = len(prev) - 2
        self.prev[:] = prev
        self.next[:] = nxt
        self.free.sentinel, self.cached.sentinel = new, new + 1
        self.free.size += n
