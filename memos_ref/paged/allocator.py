"""BlockAllocator: the one owner of KV block state — refcounts and states — composing its three parts.

Metadata only — no tensors (the K/V memory is :class:`memos_ref.paged.pool.BlockPool`). It plays the part of
vLLM v1's ``BlockPool`` (``vllm/v1/core/block_pool.py``); here that name belongs to the tensor pool. Each block
is in one of three states:

* **free** — on the free list, holding nothing anyone wants;
* **active** — refcount >= 1, held by one or more sequences;
* **cached** — refcount 0 but holding a reusable full prefix block (``cacheable``); kept on an LRU list and
  evicted inline, oldest first, only when an allocation finds no free block.

The allocator keeps the refcounts, states and ``cacheable`` flags (integer arrays) and moves blocks between its
parts, as vLLM's ``BlockPool`` does with its ``FreeKVCacheBlockQueue`` and its hash-to-block map:

* :mod:`memos_ref.paged.free_list` — the free and the cached (LRU) lists, intrusive linked lists with O(1)
  unlink;
* :mod:`memos_ref.paged.prefix_index` — ``hash -> block`` with each block's packed token ids for verification.
  Evicting a cached block drops its hash in the same step, so the index and the lists can never disagree.
  :class:`~memos_ref.paged.prefix.PrefixCache` is the hashing and statistics front end over this index;
* :mod:`memos_ref.paged.events` — :class:`BlockEvent` queues for the consumers that :meth:`subscribe`.

The parts never read block state nor each other. The operations that join the index to block state
(:meth:`cache_block`, :meth:`uncache`, :meth:`match_prefix`, :meth:`take_cached`) are written in
:mod:`memos_ref.paged.indexing`, a base class of the allocator working on its own state. The public names of
those modules are re-exported here (``from memos_ref.paged.allocator import EVICTED, BlockEvent`` still works).

One re-entrant lock (:attr:`lock`) makes every public method thread-safe; hold it to make a check and an action
on block state atomic.
"""

from __future__ import annotations

import threading
import time
from array import array
from collections.abc import Callable, Iterable

from memos_ref.errors import (
    ArgumentTypeError,
    CapacityExceededError,
    ConfigError,
    DoubleFreeError,
    InvalidArgumentError,
    InvalidBlockError,
    OutOfBlocksError,
    RefcountUnderflowError,
    check_index,
    check_type,
)
from memos_ref.paged.events import (
    ALLOCATED,
    CACHED,
    EVENT_KINDS,
    EVICTED,
    FREED,
    REMOVED,
    STORED,
    BlockEvent,
    EventHub,
    EventQueue,
    block_handler,
)
from memos_ref.paged.free_list import BlockState, FreeLists
from memos_ref.paged.indexing import BlockIndexing
from memos_ref.paged.prefix_index import PrefixIndex, pack_ids

__all__ = [
    "ALLOCATED",
    "CACHED",
    "EVENT_KINDS",
    "EVICTED",
    "FREED",
    "MAX_BLOCKS",
    "REMOVED",
    "STORED",
    "BlockAllocator",
    "BlockEvent",
    "BlockState",
    "EventQueue",
    "pack_ids",
]


#: The most blocks a pool and its allocator may hold (``grow`` refuses more, naming the limit): block ids, slots
#: (``id · T + offset``) and element offsets stay far inside int64.
MAX_BLOCKS = 2**40


_FREE, _ACTIVE, _CACHED = BlockState.FREE, BlockState.ACTIVE, BlockState.CACHED
_INT_ONLY, _ACTIVE_ONLY = {int}, {int(_ACTIVE)}


class BlockAllocator(BlockIndexing):
    """Hands out block ids ``0..num_blocks-1`` with refcounts, and indexes full blocks by prefix hash.

    Args:
        num_blocks: blocks in the pool.
        on_evict / on_free / on_cache: kept for old callers: each subscribes a handler ``fn(block)`` to the
            ``evicted`` / ``freed`` / ``cached`` events (see :meth:`subscribe`).
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
        self._lock = threading.RLock()
        self._capacity: Callable[[], int] | None = None  # the storage's block count, once an owner binds it
        # Per-block state in flat arrays, not lists: the garbage collector never walks them (a million-entry list
        # is scanned on every full collection), so the cost of an operation does not grow with the pool.
        # Read-only outside this class: refcount, state (BlockState values), cacheable (0/1).
        self.refcount = array("l", [0]) * num_blocks
        self.state = bytearray(num_blocks)  # BlockState.FREE == 0
        self.cacheable = bytearray(num_blocks)
        # the parts (each keeps the same arrays, dicts and lists for its life, so the references below stay valid)
        self._lists = FreeLists(num_blocks)
        self._free, self._cached = self._lists.free, self._lists.cached
        self._index = PrefixIndex()
        # the prefix-hash index per block: its hash, and its token ids packed as int64 bytes (read-only outside;
        # tokens_of() unpacks them)
        self.hash_by_block, self.tokens_by_block = self._index.hash_by_block, self._index.tokens_by_block
        self.evictions = 0
        # events: per kind, the subscriptions that want it; handlers drained at the end of each operation
        self._events = EventHub(self._lock)
        self._routes, self._pending = self._events.routes, self._events.pending
        self._emit, self._dispatch = self._events.emit, self._events.dispatch
        for kind, fn in ((EVICTED, on_evict), (FREED, on_free), (CACHED, on_cache)):
            if fn is not None:
                self.subscribe({kind}, handler=block_handler(fn))

    # ------------------------------------------------------------------ growth
    def grow(self, n: int) -> range:
        """Add ``n`` free blocks with the next ids (``num_blocks .. num_blocks + n - 1``), appended to the back of
        the free list in id order — the bookkeeping half of a pool that grows by a segment
        (:meth:`memos_ref.paged.store.PagedKV.grow` grows both). Every block state, list and the hash index are
        kept; the per-block arrays are extended in place. All or nothing: a bad ``n`` raises before any change.
        Returns the new ids."""
        if isinstance(n, bool) or type(n) is not int:
            n = check_index("n", n, lo=1)
        if n < 1:
            raise InvalidArgumentError(f"n: expected a positive number of blocks to add, got {n}")
        with self._lock:
            if n > MAX_BLOCKS - self.num_blocks:
                raise InvalidArgumentError(
                    f"n: expected at most {MAX_BLOCKS - self.num_blocks} more blocks (an allocator holds at most "
                    f"{MAX_BLOCKS}; it holds {self.num_blocks}), got {n}"
                )
            if self._capacity is not None and self.num_blocks + n > (capacity := self._capacity()):
                raise ConfigError(
                    f"n: the storage holds {capacity} blocks and this allocator {self.num_blocks}: growing it by {n} "
                    f"would hand out blocks with no memory; grow the pool and the allocator together "
                    f"(PagedKV.grow)"
                )
            try:
                return self._grow(n)
            except MemoryError as exc:  # the per-block arrays could not be built: nothing was changed
                raise CapacityExceededError(
                    f"could not grow the allocator by {n} blocks: out of host memory", needed=n
                ) from exc

    def bind_capacity(self, capacity: Callable[[], int]) -> None:
        """Tie growth to the storage behind the ids: from now on :meth:`grow` refuses (:class:`ConfigError`, the
        allocator unchanged) to go past ``capacity()`` blocks — the pool's count, which its owner
        (:class:`~memos_ref.paged.store.PagedKV`) grows first — so the allocator alone can never hand out a block
        the pool does not hold."""
        if not callable(capacity):
            raise ArgumentTypeError(f"capacity: expected a callable returning a block count, got {capacity!r:.80}")
        with self._lock:
            self._capacity = capacity

    def _grow(self, n: int) -> range:
        """:meth:`grow` (checked, under the lock): build the new links, then commit them with the arrays."""
        old = self.num_blocks
        links = self._lists.grown_links(old, n)  # built first: a failure changes nothing
        # commit: extend the shared arrays in place (sequences hold references to refcount)
        try:
            self.refcount.extend(array("l", [0]) * n)
            self.state.extend(bytes(n))  # FREE
            self.cacheable.extend(bytes(n))
        except BaseException:  # (out of memory) every array back to its old length
            del self.refcount[old:], self.state[old:], self.cacheable[old:]
            raise
        self._lists.commit_growth(links, n)
        self.num_blocks = old + n
        return range(old, old + n)

    # ------------------------------------------------------------------ events
    @property
    def lock(self) -> threading.RLock:
        """The lock behind every operation (re-entrant): hold it to check and change block state atomically."""
        return self._lock

    def subscribe(
        self,
        kinds: Iterable[str] = EVENT_KINDS,
        *,
        handler: Callable[[BlockEvent], None] | None = None,
        maxlen: int | None = None,
    ) -> EventQueue:
        """A queue that receives the events of ``kinds`` from now on. With ``handler``, the allocator drains it
        into ``handler`` at the end of each operation (still holding :attr:`lock`, before returning); without, the
        consumer drains it."""
        return self._events.subscribe(kinds, handler, maxlen)

    def unsubscribe(self, queue: EventQueue) -> None:
        """End a subscription (its waiting events stay readable with ``drain``)."""
        self._events.unsubscribe(queue)

    # ------------------------------------------------------------------ checks
    def _check_id(self, block: object) -> int:
        """The block id as an int: :class:`ArgumentTypeError` for a non-integer (a float, a string, a bool),
        :class:`InvalidBlockError` outside ``[0, num_blocks)``."""
        if type(block) is int and 0 <= block < self.num_blocks:  # the common case, without the checks below
            return block
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
        """Blocks held by a sequence. Its three counts are read together under the lock: a lock-free read could
        see a growth's free blocks before its new ``num_blocks`` (a negative count) or a block between lists."""
        with self._lock:
            return self.num_blocks - self._free.size - self._cached.size

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take: free ones plus evictable cached ones (both read under the lock)."""
        with self._lock:
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
        """Take ``n`` blocks (refcount 1 each), all or nothing; evict cached blocks (least recently used first,
        dropping their hashes) only when none is free."""
        if type(n) is not int or n < 0:
            n = check_index("n", n, lo=0)
        with self._lock:
            timed = self._routes[ALLOCATED]
            started = time.perf_counter() if timed else 0.0
            free, cached = self._free, self._cached
            if n > free.size + cached.size:
                raise OutOfBlocksError(needed=n, available=free.size + cached.size)
            refcount, state, nxt = self.refcount, self.state, free.next
            blocks = []
            for _ in range(n):
                if free.size:
                    block = nxt[free.sentinel]
                    free.unlink(block)
                else:
                    block = cached.pop_front()  # least recently used cached block
                    self._evict(block)
                refcount[block] = 1
                state[block] = _ACTIVE
                blocks.append(block)
            if timed:
                self._emit(timed, BlockEvent(ALLOCATED, -1, None, n, time.perf_counter() - started))
            if self._pending:
                self._dispatch()
            return blocks

    def allocate_up_to(self, n: int) -> list[int]:
        """Take ``min(n, num_available)`` blocks at once (the count and the allocation agree under the lock)."""
        n = check_index("n", n, lo=0)
        with self._lock:
            return self.allocate(min(n, self.num_available))

    def _evict(self, block: int) -> None:
        """A cached block leaves the LRU list for a new owner: its hash leaves the index in the same step."""
        self.cacheable[block] = False
        self.evictions += 1
        block_hash = self._index.drop(block)
        routes = self._routes[EVICTED]
        if routes:
            self._emit(routes, BlockEvent(EVICTED, block, block_hash))

    def incref(self, block: int) -> None:
        """Add a holder. A cached block is revived (touched) in O(1); a free block cannot be shared."""
        block = self._check_id(block)
        with self._lock:
            state = self.state[block]
            if state == _FREE:
                raise InvalidBlockError(f"block {block} is free: it holds nothing to share")
            if state == _CACHED:
                self._cached.unlink(block)
                self.state[block] = _ACTIVE
            self.refcount[block] += 1

    touch = incref

    def free(self, block: int) -> None:
        """Drop one holder; at zero the block becomes cached (if it holds a registered prefix) or free."""
        block = self._check_id(block)
        with self._lock:
            state = self.state[block]
            if state == _FREE:
                raise DoubleFreeError(f"block {block} is already free")
            if state == _CACHED:
                raise RefcountUnderflowError(f"block {block} has refcount 0 (cached); it has no holder to drop")
            self._release(block)
            if self._pending:
                self._dispatch()

    def _release(self, block: int) -> None:
        """Drop one holder of an active block (validated by the caller)."""
        refcount = self.refcount
        refcount[block] -= 1
        if refcount[block]:
            return
        if self.cacheable[block]:
            self.state[block] = _CACHED
            self._cached.push_back(block)
            routes = self._routes[CACHED]
            if routes:
                self._emit(routes, BlockEvent(CACHED, block, self.hash_by_block.get(block)))
        else:
            self.state[block] = _FREE
            self._free.push_back(block)
            routes = self._routes[FREED]
            if routes:
                self._emit(routes, BlockEvent(FREED, block))

    def _release_all(self, blocks: list[int]) -> None:
        """:meth:`_release` of distinct active blocks, in order (the loop inlined: a sequence frees hundreds)."""
        refcount, state, cacheable = self.refcount, self.state, self.cacheable
        free, cached = self._free, self._cached
        for block in blocks:
            count = refcount[block] - 1
            refcount[block] = count
            if count:
                continue
            if cacheable[block]:
                state[block] = _CACHED
                cached.push_back(block)
                routes = self._routes[CACHED]
                if routes:
                    self._emit(routes, BlockEvent(CACHED, block, self.hash_by_block.get(block)))
            else:
                state[block] = _FREE
                free.push_back(block)
                routes = self._routes[FREED]
                if routes:
                    self._emit(routes, BlockEvent(FREED, block))

    def _check_ids(self, blocks: Iterable[object]) -> list[int]:
        """Block ids as a list of ints, each checked like :meth:`_check_id` (plain ints in range in one pass)."""
        out = list(blocks)
        if not out or (set(map(type, out)) == _INT_ONLY and min(out) >= 0 and max(out) < self.num_blocks):  # in C
            return out  # type: ignore[return-value]
        return [self._check_id(b) for b in out]

    def free_many(self, blocks: Iterable[int]) -> None:
        """Free several blocks in order (validated first, so a bad id frees none). Free a sequence's blocks
        last-first so its tail is evicted before its head (a prefix stays reusable longest)."""
        check_type("blocks", blocks, Iterable)
        blocks = self._check_ids(blocks)
        with self._lock:
            state, refcount = self.state, self.refcount
            # each dropped once, all active (checked in C: the states of the blocks are one value, ACTIVE)
            if len(set(blocks)) == len(blocks) and (not blocks or set(map(state.__getitem__, blocks)) == _ACTIVE_ONLY):
                self._release_all(blocks)
                if self._pending:
                    self._dispatch()
                return
            drops: dict[int, int] = {}
            for block in blocks:
                drops[block] = drops.get(block, 0) + 1
            for block, count in drops.items():
                if state[block] == _FREE:
                    raise DoubleFreeError(f"block {block} is already free")
                if state[block] != _ACTIVE or refcount[block] < count:
                    raise RefcountUnderflowError(
                        f"block {block}: freeing {count} holder(s) but it has refcount {refcount[block]} "
                        f"(state {BlockState(state[block]).name.lower()})"
                    )
            for block in blocks:
                self._release(block)
            if self._pending:
                self._dispatch()

    def set_cacheable(self, block: int, cacheable: bool = True) -> None:
        """Mark a block as holding a reusable prefix (it is cached instead of freed at refcount 0). Unmarking
        a cached block frees it. Prefer :meth:`cache_block` / :meth:`uncache`, which keep the hash index too."""
        block = self._check_id(block)
        check_type("cacheable", cacheable, bool)
        with self._lock:
            self.cacheable[block] = cacheable
            if not cacheable and self.state[block] == _CACHED:
                self._cached.unlink(block)
                self.state[block] = _FREE
                self._free.push_back(block)
                routes = self._routes[FREED]
                if routes:
                    self._emit(routes, BlockEvent(FREED, block))
            if self._pending:
                self._dispatch()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "blocks_total": self.num_blocks,
                "blocks_active": self.num_active,
                "blocks_cached": self.num_cached,
                "blocks_free": self.num_free,
                "evictions": self.evictions,
            }
