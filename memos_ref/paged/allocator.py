"""BlockAllocator: O(1) allocate, free and touch of KV blocks, whatever the pool size.

Metadata only — no tensors. Each block is in one of three states:

* **free** — on the free list, holding nothing anyone wants;
* **active** — refcount >= 1, held by one or more sequences;
* **cached** — refcount 0 but holding a reusable full prefix block (registered by the prefix cache); kept on
  an LRU list and evicted, oldest first, only when an allocation finds no free block.

Both lists are *intrusive doubly linked lists* over two integer arrays (``prev``/``next`` per block, with a
sentinel per list), as in vLLM v1's ``FreeKVCacheBlockQueue``: any block can be unlinked in O(1) — which a
Python ``deque.remove`` cannot (it scans, so its cost grows with the pool). Refcounts are an integer array.
One lock makes every public method thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from enum import IntEnum

from memos_ref.errors import (
    ConfigError,
    DoubleFreeError,
    InvalidArgumentError,
    InvalidBlockError,
    OutOfBlocksError,
    RefcountUnderflowError,
    check_index,
    check_type,
)

__all__ = ["BlockAllocator", "BlockState"]


class BlockState(IntEnum):
    FREE = 0
    ACTIVE = 1
    CACHED = 2


class _LinkedList:
    """An intrusive doubly linked list over shared ``prev``/``next`` arrays; ``sentinel`` is its own node."""

    __slots__ = ("next", "prev", "sentinel", "size")

    def __init__(self, prev: list[int], nxt: list[int], sentinel: int) -> None:
        self.prev, self.next, self.sentinel, self.size = prev, nxt, sentinel, 0
        prev[sentinel] = nxt[sentinel] = sentinel

    def push_back(self, node: int) -> None:
        last = self.prev[self.sentinel]
        self.next[last], self.prev[node] = node, last
        self.next[node], self.prev[self.sentinel] = self.sentinel, node
        self.size += 1

    def unlink(self, node: int) -> None:
        before, after = self.prev[node], self.next[node]
        self.next[before], self.prev[after] = after, before
        self.prev[node] = self.next[node] = -1
        self.size -= 1

    def pop_front(self) -> int:
        node = self.next[self.sentinel]
        self.unlink(node)
        return node

    def __iter__(self):
        node = self.next[self.sentinel]
        while node != self.sentinel:
            yield node
            node = self.next[node]


class BlockAllocator:
    """Hands out block ids ``0..num_blocks-1`` with refcounts.

    Args:
        num_blocks: blocks in the pool.
        on_evict: called with a block id when a cached block is taken back for a new allocation (the prefix
            cache forgets its hash there).
        on_free: called with a block id whenever a block returns to the free list (debug poisoning hooks in
            here; cached blocks keep their contents for reuse and are not reported).
        on_cache: called with a block id when its last holder lets go and it stays cached for prefix reuse (a
            quantized pool seals it there).
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        on_evict: Callable[[int], None] | None = None,
        on_free: Callable[[int], None] | None = None,
        on_cache: Callable[[int], None] | None = None,
    ) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ConfigError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.on_evict, self.on_free, self.on_cache = on_evict, on_free, on_cache
        self._lock = threading.RLock()
        self.refcount = [0] * num_blocks
        self.state = [BlockState.FREE] * num_blocks
        self.cacheable = [False] * num_blocks
        # Nodes 0..N-1 are blocks; N and N+1 are the sentinels of the free and cached lists.
        self._prev = [-1] * (num_blocks + 2)
        self._next = [-1] * (num_blocks + 2)
        self._free = _LinkedList(self._prev, self._next, num_blocks)
        self._cached = _LinkedList(self._prev, self._next, num_blocks + 1)
        for block in range(num_blocks):
            self._free.push_back(block)
        self.evictions = 0

    # ------------------------------------------------------------------ checks
    def _check_id(self, block: object) -> int:
        """The block id as an int: :class:`ArgumentTypeError` for a non-integer (a float, a string, a bool),
        :class:`InvalidBlockError` outside ``[0, num_blocks)``."""
        try:
            b = check_index("block", block)
        except InvalidArgumentError as exc:
            raise InvalidBlockError(f"block id {block!r} is not in [0, {self.num_blocks})") from exc
        if b >= self.num_blocks:
            raise InvalidBlockError(f"block id {b} is not in [0, {self.num_blocks})")
        return b

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        return self._free.size

    @property
    def num_cached(self) -> int:
        return self._cached.size

    @property
    def num_active(self) -> int:
        return self.num_blocks - self._free.size - self._cached.size

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take: free ones plus evictable cached ones."""
        return self._free.size + self._cached.size

    def free_blocks(self) -> list[int]:
        with self._lock:
            return list(self._free)

    def cached_blocks(self) -> list[int]:
        """Cached blocks, least recently used first (the eviction order)."""
        with self._lock:
            return list(self._cached)

    # ------------------------------------------------------------------ operations
    def allocate(self, n: int = 1) -> list[int]:
        """Take ``n`` blocks (refcount 1 each), all or nothing; evict cached blocks only when none is free."""
        n = check_index("n", n, lo=0)
        with self._lock:
            if n > self.num_available:
                raise OutOfBlocksError(needed=n, available=self.num_available)
            blocks = []
            for _ in range(n):
                if self._free.size:
                    block = self._free.pop_front()
                else:
                    block = self._cached.pop_front()  # least recently used cached block
                    self.cacheable[block] = False
                    self.evictions += 1
                    if self.on_evict is not None:
                        self.on_evict(block)
                self.refcount[block] = 1
                self.state[block] = BlockState.ACTIVE
                blocks.append(block)
            return blocks

    def incref(self, block: int) -> None:
        """Add a holder. A cached block is revived (touched) in O(1); a free block cannot be shared."""
        block = self._check_id(block)
        with self._lock:
            state = self.state[block]
            if state == BlockState.FREE:
                raise InvalidBlockError(f"block {block} is free: it holds nothing to share")
            if state == BlockState.CACHED:
                self._cached.unlink(block)
                self.state[block] = BlockState.ACTIVE
            self.refcount[block] += 1

    touch = incref

    def free(self, block: int) -> None:
        """Drop one holder; at zero the block becomes cached (if it holds a registered prefix) or free."""
        block = self._check_id(block)
        with self._lock:
            state = self.state[block]
            if state == BlockState.FREE:
                raise DoubleFreeError(f"block {block} is already free")
            if state == BlockState.CACHED:
                raise RefcountUnderflowError(f"block {block} has refcount 0 (cached); it has no holder to drop")
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                if self.cacheable[block]:
                    self.state[block] = BlockState.CACHED
                    self._cached.push_back(block)
                    if self.on_cache is not None:
                        self.on_cache(block)
                else:
                    self.state[block] = BlockState.FREE
                    self._free.push_back(block)
                    if self.on_free is not None:
                        self.on_free(block)

    def free_many(self, blocks: Iterable[int]) -> None:
        """Free several blocks (validated first, so a bad id frees none)."""
        check_type("blocks", blocks, Iterable)
        blocks = [self._check_id(block) for block in blocks]
        with self._lock:
            drops: dict[int, int] = {}
            for block in blocks:
                drops[block] = drops.get(block, 0) + 1
            for block, count in drops.items():
                if self.state[block] == BlockState.FREE:
                    raise DoubleFreeError(f"block {block} is already free")
                if self.state[block] != BlockState.ACTIVE or self.refcount[block] < count:
                    raise RefcountUnderflowError(
                        f"block {block}: freeing {count} holder(s) but it has refcount {self.refcount[block]} "
                        f"(state {self.state[block].name.lower()})"
                    )
            for block in blocks:
                self.free(block)

    def set_cacheable(self, block: int, cacheable: bool = True) -> None:
        """Mark a block as holding a registered prefix (it is cached instead of freed at refcount 0)."""
        block = self._check_id(block)
        check_type("cacheable", cacheable, bool)
        with self._lock:
            self.cacheable[block] = cacheable
            if not cacheable and self.state[block] == BlockState.CACHED:
                self._cached.unlink(block)
                self.state[block] = BlockState.FREE
                self._free.push_back(block)
                if self.on_free is not None:
                    self.on_free(block)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "blocks_total": self.num_blocks,
                "blocks_active": self.num_active,
                "blocks_cached": self.num_cached,
                "blocks_free": self.num_free,
                "evictions": self.evictions,
            }
