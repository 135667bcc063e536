"""BlockAllocator: the one owner of KV block state — refcounts, free and LRU lists, the prefix-hash index, events.

Metadata only — no tensors (the K/V memory is :class:`memos_ref.paged.pool.BlockPool`). It plays the part of
vLLM v1's ``BlockPool`` (``vllm/v1/core/block_pool.py``); here that name belongs to the tensor pool. Each block
is in one of three states:

* **free** — on the free list, holding nothing anyone wants;
* **active** — refcount >= 1, held by one or more sequences;
* **cached** — refcount 0 but holding a reusable full prefix block (``cacheable``); kept on an LRU list and
  evicted inline, oldest first, only when an allocation finds no free block.

Both lists are *intrusive doubly linked lists* over two integer arrays (``prev``/``next`` per block, with a
sentinel per list), as in vLLM v1's ``FreeKVCacheBlockQueue``: any block can be unlinked in O(1) — which a
Python ``deque.remove`` cannot (it scans, so its cost grows with the pool). Refcounts are an integer array.

**The prefix-hash index** lives here too: ``hash -> block`` with the block's token ids for verification
(:meth:`cache_block`, :meth:`uncache`, :meth:`match_prefix`, :meth:`take_cached`). Evicting a cached block
drops its hash in the same step, so the index and the lists can never disagree. A block's token ids are kept
packed (signed 64-bit, the bytes its hash covers): a lookup verifies a block with one ``bytes`` comparison.
:class:`~memos_ref.paged.prefix.PrefixCache` is the hashing and statistics front end over this index.

**Events** instead of hook chains: every change a consumer may care about is appended as a
:class:`BlockEvent` (``stored``, ``cached``, ``evicted``, ``removed``, ``freed``, ``allocated``) to the queue of
each :meth:`subscribe`-r that asked for that kind. A subscription with a ``handler`` is drained by the allocator
itself at the end of the operation that produced the events, before it returns (so a write-back sees an evicted
block's bytes before the caller overwrites them, and a quantized pool releases a staging slot before the block
is handed out again); one without is drained by its consumer (:meth:`EventQueue.drain`). Nothing is recorded for
a kind nobody subscribed to.

One re-entrant lock (:attr:`lock`) makes every public method thread-safe; hold it to make a check and an action
on block state atomic.
"""

from __future__ import annotations

import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from enum import IntEnum
from typing import NamedTuple

from memos_ref.errors import (
    ArgumentTypeError,
    CapacityExceededError,
    ConfigError,
    DoubleFreeError,
    InvalidArgumentError,
    InvalidBlockError,
    OutOfBlocksError,
    RefcountUnderflowError,
    ShapeError,
    check_index,
    check_type,
)

__all__ = [
    "ALLOCATED",
    "CACHED",
    "EVENT_KINDS",
    "EVICTED",
    "FREED",
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


class BlockState(IntEnum):
    FREE = 0
    ACTIVE = 1
    CACHED = 2


_FREE, _ACTIVE, _CACHED = BlockState.FREE, BlockState.ACTIVE, BlockState.CACHED
_INT_ONLY, _ACTIVE_ONLY = {int}, {int(_ACTIVE)}

#: A full block entered the prefix-hash index (``block_hash`` set).
STORED = "stored"
#: The last holder let go of a cacheable block: it stays, evictable, on the LRU list.
CACHED = "cached"
#: A cached block was taken back for a new allocation (``block_hash``: the hash it held, or None).
EVICTED = "evicted"
#: A block's hash left the index without an eviction (:meth:`BlockAllocator.uncache`).
REMOVED = "removed"
#: A block returned to the free list (not after an eviction: that block is handed out at once).
FREED = "freed"
#: One :meth:`BlockAllocator.allocate` call: ``count`` blocks in ``seconds``.
ALLOCATED = "allocated"
EVENT_KINDS = frozenset({STORED, CACHED, EVICTED, REMOVED, FREED, ALLOCATED})


class BlockEvent(NamedTuple):
    """One change of block state. ``block`` is -1 for an ``allocated`` event (``count`` says how many)."""

    kind: str
    block: int
    block_hash: bytes | None = None
    count: int = 1
    seconds: float = 0.0


class EventQueue:
    """A consumer's queue of :class:`BlockEvent` (from :meth:`BlockAllocator.subscribe`).

    Without a handler the consumer calls :meth:`drain` when it likes (``maxlen`` bounds what waits; the oldest
    events are dropped and counted in :attr:`dropped`). With a handler the allocator drains it at the end of each
    operation. :meth:`close` ends the subscription.
    """

    def __init__(
        self,
        owner: BlockAllocator,
        kinds: frozenset[str],
        handler: Callable[[BlockEvent], None] | None,
        maxlen: int | None,
    ) -> None:
        self.owner, self.kinds, self.handler = owner, kinds, handler
        self._items: deque[BlockEvent] = deque()
        self.maxlen = maxlen
        self.dropped = 0

    def _put(self, event: BlockEvent) -> None:
        if self.maxlen is not None and len(self._items) >= self.maxlen:
            self._items.popleft()
            self.dropped += 1
        self._items.append(event)

    def drain(self) -> list[BlockEvent]:
        """Every event waiting, oldest first; the queue is left empty."""
        with self.owner.lock:
            out = list(self._items)
            self._items.clear()
            return out

    def __len__(self) -> int:
        return len(self._items)

    def close(self) -> None:
        """Stop receiving events (idempotent)."""
        self.owner.unsubscribe(self)


class _LinkedList:
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


class BlockAllocator:
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
        # the prefix-hash index: hash -> block, and per indexed block its hash and its token ids packed as int64
        # bytes (read-only outside; tokens_of() unpacks them)
        self.hash_by_block: dict[int, bytes] = {}
        self.tokens_by_block: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}
        # Nodes 0..N-1 are blocks; N and N+1 are the sentinels of the free and cached lists.
        self._prev = array("q", range(-1, num_blocks + 1))
        self._next = array("q", range(1, num_blocks + 3))
        self._free = _LinkedList(self._prev, self._next, num_blocks)
        self._cached = _LinkedList(self._prev, self._next, num_blocks + 1)
        if num_blocks:  # blocks 0..N-1 in order on the free list (built in one pass, not N push_backs)
            self._prev[0], self._next[num_blocks - 1] = num_blocks, num_blocks
            self._next[num_blocks], self._prev[num_blocks] = 0, num_blocks - 1
            self._free.size = num_blocks
        self.evictions = 0
        # events: per kind, the subscriptions that want it; handlers drained at the end of each operation
        self._subs: list[EventQueue] = []
        self._routes: dict[str, tuple[EventQueue, ...]] = {kind: () for kind in EVENT_KINDS}
        self._handled: list[EventQueue] = []
        self._pending = False
        self._dispatching = False
        for kind, fn in ((EVICTED, on_evict), (FREED, on_free), (CACHED, on_cache)):
            if fn is not None:
                self.subscribe({kind}, handler=_block_handler(fn))

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
        """:meth:`grow` (checked, under the lock): build the new arrays, then commit them."""
        old = self.num_blocks
        new = old + n
        # the two sentinels move from old, old+1 to new, new+1; the nodes linked to them are re-pointed
        prev, nxt = array("q", self._prev), array("q", self._next)  # built first: a failure changes nothing
        tail = array("q", [-1]) * (n + 2)
        del prev[old:], nxt[old:]
        prev.extend(tail)
        nxt.extend(tail)
        for lst, sentinel in ((self._free, new), (self._cached, new + 1)):
            s = lst.sentinel
            first, last = self._next[s], self._prev[s]
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
        # commit: extend the shared arrays in place (sequences hold references to refcount)
        try:
            self.refcount.extend(array("l", [0]) * n)
            self.state.extend(bytes(n))  # FREE
            self.cacheable.extend(bytes(n))
        except BaseException:  # (out of memory) every array back to its old length
            del self.refcount[old:], self.state[old:], self.cacheable[old:]
            raise
        self._prev[:] = prev
        self._next[:] = nxt
        self._free.sentinel, self._cached.sentinel = new, new + 1
        self._free.size += n
        self.num_blocks = new
        return range(old, new)

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
        if isinstance(kinds, str):
            kinds = {kinds}
        kinds = frozenset(kinds)
        unknown = kinds - EVENT_KINDS
        if unknown:
            raise InvalidArgumentError(f"unknown event kinds {sorted(unknown)}; expected some of {sorted(EVENT_KINDS)}")
        if handler is not None and not callable(handler):
            raise InvalidArgumentError(f"handler must be callable, got {type(handler).__name__}")
        if maxlen is not None:
            maxlen = check_index("maxlen", maxlen, lo=1)
        with self._lock:
            queue = EventQueue(self, kinds, handler, maxlen)
            self._subs.append(queue)
            self._reroute()
            return queue

    def unsubscribe(self, queue: EventQueue) -> None:
        """End a subscription (its waiting events stay readable with ``drain``)."""
        with self._lock:
            if queue in self._subs:
                self._subs.remove(queue)
                self._reroute()

    def _reroute(self) -> None:
        self._routes = {kind: tuple(q for q in self._subs if kind in q.kinds) for kind in EVENT_KINDS}
        self._handled = [q for q in self._subs if q.handler is not None]

    def _emit(self, routes: tuple[EventQueue, ...], event: BlockEvent) -> None:
        for queue in routes:
            queue._put(event)
            if queue.handler is not None:
                self._pending = True

    def _dispatch(self) -> None:
        """Drain handler subscriptions (called at the end of each operation, under the lock)."""
        if self._dispatching:  # a handler's own allocator call: the outer dispatch loop delivers its events
            return
        self._dispatching = True
        try:
            while self._pending:
                self._pending = False
                for queue in self._handled:
                    items = queue._items
                    while items:
                        queue.handler(items.popleft())  # type: ignore[misc]
        finally:
            self._dispatching = False

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
            refcount, state, nxt = self.refcount, self.state, self._next
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
        block_hash = self._drop_hash(block)
        routes = self._routes[EVICTED]
        if routes:
            self._emit(routes, BlockEvent(EVICTED, block, block_hash))

    def _drop_hash(self, block: int) -> bytes | None:
        block_hash = self.hash_by_block.pop(block, None)
        if block_hash is not None:
            del self.tokens_by_block[block]
            if self._by_hash.get(block_hash) == block:
                del self._by_hash[block_hash]
        return block_hash

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

    # ------------------------------------------------------------------ prefix-hash index
    def hash_of(self, block: int) -> bytes | None:
        """The prefix hash ``block`` is indexed under, or None."""
        return self.hash_by_block.get(self._check_id(block))

    def tokens_of(self, block: int) -> tuple[int, ...] | None:
        """The token ids of an indexed block (what a lookup verifies), or None."""
        packed = self.tokens_by_block.get(self._check_id(block))
        return None if packed is None else tuple(array("q", packed))

    def block_with_hash(self, block_hash: bytes) -> int | None:
        """The block indexed under ``block_hash`` (active or cached), or None."""
        return self._by_hash.get(block_hash)

    def indexed_blocks(self) -> dict[int, bytes]:
        """Every indexed block with its hash (a copy)."""
        with self._lock:
            return dict(self.hash_by_block)

    @property
    def num_indexed(self) -> int:
        return len(self._by_hash)

    def cache_block(self, block: int, block_hash: bytes, tokens: Sequence[int], *, packed: bytes | None = None) -> bool:
        """Index the full, written ``block`` under ``block_hash`` with its token ids (it is cached, not freed, at
        refcount 0). False when the hash is already indexed (another block holds that content; this one stays
        private) or the block already has a hash. Emits ``stored``. ``packed``: the caller's ``tokens`` already
        packed as int64 bytes (:func:`pack_ids`), so they are not packed again."""
        block = self._check_id(block)
        check_type("block_hash", block_hash, bytes)
        if packed is None:
            packed = _pack_checked("tokens", tokens)
        with self._lock:
            if self.state[block] == _FREE:
                raise InvalidBlockError(f"block {block} is free: only a held, written block can be cached")
            stored = self._index(block, block_hash, packed)
            if self._pending:
                self._dispatch()
            return stored

    def _index(self, block: int, block_hash: bytes, tokens: bytes) -> bool:
        if block_hash in self._by_hash or block in self.hash_by_block:
            return False
        self._by_hash[block_hash] = block
        self.hash_by_block[block] = block_hash
        self.tokens_by_block[block] = tokens
        self.cacheable[block] = True
        routes = self._routes[STORED]
        if routes:
            self._emit(routes, BlockEvent(STORED, block, block_hash))
        return True

    def cache_blocks(
        self,
        blocks: Sequence[int],
        hashes: Sequence[bytes],
        token_ids: Sequence[int],
        block_size: int,
        *,
        packed: bytes | None = None,
    ) -> int:
        """Index full blocks in one call: ``blocks[i]`` holds ``token_ids[i*block_size:(i+1)*block_size]`` under
        ``hashes[i]`` (the caller's guarantee: they are held and written). Returns how many were newly indexed.
        ``packed``: ``token_ids`` already packed as int64 bytes (:func:`pack_ids`), so they are not packed again."""
        if not len(blocks) == len(hashes) or len(token_ids) < len(blocks) * block_size:
            raise ShapeError(
                f"{len(blocks)} blocks need {len(blocks)} hashes and {len(blocks) * block_size} token ids, got "
                f"{len(hashes)} and {len(token_ids)}"
            )
        width = 8 * block_size
        if packed is None:
            packed = _pack_checked("token_ids", token_ids[: len(blocks) * block_size])
        elif len(packed) < len(blocks) * width:
            raise ShapeError(f"{len(blocks)} blocks need {len(blocks) * width} packed bytes, got {len(packed)}")
        blocks = self._check_ids(blocks)
        with self._lock:
            state = self.state
            if blocks and _FREE in set(map(state.__getitem__, blocks)):
                b = next(b for b in blocks if state[b] == _FREE)
                raise InvalidBlockError(f"block {b} is free: only held, written blocks can be cached")
            stored, index = 0, self._index
            for i, (b, h) in enumerate(zip(blocks, hashes)):
                stored += index(b, h, packed[i * width : (i + 1) * width])
            if self._pending:
                self._dispatch()
            return stored

    def uncache(self, block: int) -> bytes | None:
        """Drop ``block`` from the index (emits ``removed``): a cached block goes back to the free list at once
        (``freed``), an active one is freed, not cached, when its last holder lets go. Returns the hash it had."""
        block = self._check_id(block)
        with self._lock:
            block_hash = self._drop_hash(block)
            if block_hash is not None:
                routes = self._routes[REMOVED]
                if routes:
                    self._emit(routes, BlockEvent(REMOVED, block, block_hash))
            self.set_cacheable(block, False)
            return block_hash

    def uncache_if(self, block: int, block_hash: bytes) -> bool:
        """Atomically: if ``block`` is cached (no holder) under ``block_hash``, drop it to the free list (tier
        swap-out after its copy is safe elsewhere). False when it was revived or reused meanwhile."""
        block = self._check_id(block)
        with self._lock:
            if self.state[block] != _CACHED or self.hash_by_block.get(block) != block_hash:
                return False
            self.uncache(block)
            return True

    def take_cached(self, block_hash: bytes, tokens: Sequence[int]) -> int | None:
        """The block indexed under ``block_hash`` whose token ids equal ``tokens``, with one more holder (the
        caller owns it); None on a miss."""
        with self._lock:
            block = self._by_hash.get(block_hash)
            if block is None or self.tokens_by_block.get(block) != pack_ids(tokens):
                return None
            self.incref(block)
            return block

    def match_prefix(
        self,
        hashes: Iterable[bytes],
        token_ids: Sequence[int],
        block_size: int,
        start: int = 0,
        *,
        packed: bytes | None = None,
    ) -> list[int]:
        """Longest run of indexed blocks continuing a prefix: block ``start + i`` must be indexed under
        ``hashes[i]`` with ``token_ids[(start+i)*block_size : ...]`` as its tokens. Each block found gets one more
        holder (the caller owns those references). ``hashes`` may be a lazy iterator: it is consumed only up to
        the first miss, so a prompt is hashed no further than its cached prefix. ``packed``: ``token_ids`` packed
        as int64 bytes (:func:`pack_ids`; what the caller hashed), so each block is verified by one comparison."""
        found: list[int] = []
        width = 8 * block_size
        with self._lock:
            by_hash, tokens_of = self._by_hash, self.tokens_by_block
            position = start * block_size
            for block_hash in hashes:
                block = by_hash.get(block_hash)
                if block is None:
                    break
                # verify the token ids: a hash collision must not return wrong KV
                if packed is not None:
                    held = packed[position * 8 : position * 8 + width]
                else:
                    held = pack_ids(token_ids[position : position + block_size])
                if tokens_of[block] != held:
                    break
                found.append(block)
                position += block_size
            state, refcount, cached = self.state, self.refcount, self._cached
            for block in found:
                if state[block] == _CACHED:
                    cached.unlink(block)
                    state[block] = _ACTIVE
                refcount[block] += 1
            return found

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "blocks_total": self.num_blocks,
                "blocks_active": self.num_active,
                "blocks_cached": self.num_cached,
                "blocks_free": self.num_free,
                "evictions": self.evictions,
            }


def pack_ids(tokens: Sequence[int]) -> bytes | None:
    """Token ids packed as signed 64-bit ints (the bytes a block hash covers), or None when they cannot be (a
    non-integer, an id outside int64, a ``str``/``bytes``): such ids match no indexed block."""
    if isinstance(tokens, (str, bytes, bytearray, memoryview)):
        return None
    try:
        return array("q", tokens).tobytes()
    except (TypeError, OverflowError):
        return None


def _pack_checked(name: str, tokens: Sequence[int]) -> bytes:
    """:func:`pack_ids`, refusing ids it cannot pack: :class:`ArgumentTypeError` for a non-integer,
    :class:`InvalidArgumentError` for an id outside int64."""
    packed = pack_ids(tokens)
    if packed is None:
        if isinstance(tokens, (str, bytes, bytearray, memoryview)):
            raise ArgumentTypeError(f"{name}: expected a sequence of int token ids, got {type(tokens).__name__}")
        bad = next((t for t in tokens if not hasattr(t, "__index__")), None)
        if bad is not None:
            raise ArgumentTypeError(f"{name}: expected int token ids, got {type(bad).__name__} ({bad!r:.40})")
        raise InvalidArgumentError(f"{name}: token ids must fit a signed 64-bit int")
    return packed


def _block_handler(fn: Callable[[int], None]) -> Callable[[BlockEvent], None]:
    """Adapt an old-style ``fn(block)`` hook to an event handler."""

    def handler(event: BlockEvent) -> None:
        fn(event.block)

    return handler
