"""The allocator's side of the prefix-hash index: how a held block enters it, leaves it, and is found again.

:class:`BlockIndexing` holds the operations of :class:`~memos_ref.paged.allocator.BlockAllocator` that join the
index (:class:`~memos_ref.paged.prefix_index.PrefixIndex`) to block state: :meth:`~BlockIndexing.cache_block`
(the block is then cached, not freed, at refcount 0), :meth:`~BlockIndexing.uncache` (freed instead),
:meth:`~BlockIndexing.match_prefix` and :meth:`~BlockIndexing.take_cached` (each block found gets one more
holder; a cached one is revived), and the read-only queries. It is a base class of the allocator, not an object
of its own: every method works on the allocator's own state (``self``) under its lock, so block state keeps one
owner. The attributes it relies on are declared below and set by the allocator's ``__init__``.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Callable, Iterable, Sequence

from memos_ref.errors import InvalidBlockError, ShapeError, check_type
from memos_ref.paged.events import REMOVED, STORED, BlockEvent, EventQueue
from memos_ref.paged.free_list import BlockState, LinkedList
from memos_ref.paged.prefix_index import PrefixIndex, pack_checked

__all__ = ["BlockIndexing"]

_FREE, _ACTIVE, _CACHED = BlockState.FREE, BlockState.ACTIVE, BlockState.CACHED


class BlockIndexing:
    """The prefix-index operations of :class:`~memos_ref.paged.allocator.BlockAllocator` (its base class)."""

    # set by BlockAllocator.__init__ (see there)
    refcount: array
    state: bytearray
    cacheable: bytearray
    hash_by_block: dict[int, bytes]
    tokens_by_block: dict[int, bytes]
    _lock: threading.RLock
    _cached: LinkedList
    _index: PrefixIndex
    _routes: dict[str, tuple[EventQueue, ...]]
    _pending: list[bool]
    _emit: Callable[[tuple[EventQueue, ...], BlockEvent], None]
    _dispatch: Callable[[], None]

    # methods of BlockAllocator
    _check_id: Callable[[object], int]
    _check_ids: Callable[[Iterable[object]], list[int]]
    incref: Callable[[int], None]
    set_cacheable: Callable[..., None]

    def hash_of(self, block: int) -> bytes | None:
        """The prefix hash ``block`` is indexed under, or None."""
        return self.hash_by_block.get(self._check_id(block))

    def tokens_of(self, block: int) -> tuple[int, ...] | None:
        """The token ids of an indexed block (what a lookup verifies), or None."""
        packed = self.tokens_by_block.get(self._check_id(block))
        return None if packed is None else tuple(array("q", packed))

    def block_with_hash(self, block_hash: bytes) -> int | None:
        """The block indexed under ``block_hash`` (active or cached), or None."""
        return self._index.block_with_hash(block_hash)

    def indexed_blocks(self) -> dict[int, bytes]:
        """Every indexed block with its hash (a copy)."""
        with self._lock:
            return dict(self.hash_by_block)

    @property
    def num_indexed(self) -> int:
        return len(self._index)

    def cache_block(self, block: int, block_hash: bytes, tokens: Sequence[int], *, packed: bytes | None = None) -> bool:
        """Index the full, written ``block`` under ``block_hash`` with its token ids (it is cached, not freed, at
        refcount 0). False when the hash is already indexed (another block holds that content; this one stays
        private) or the block already has a hash. Emits ``stored``. ``packed``: the caller's ``tokens`` already
        packed as int64 bytes (:func:`pack_ids`), so they are not packed again."""
        block = self._check_id(block)
        check_type("block_hash", block_hash, bytes)
        if packed is None:
            packed = pack_checked("tokens", tokens)
        with self._lock:
            if self.state[block] == _FREE:
                raise InvalidBlockError(f"block {block} is free: only a held, written block can be cached")
            stored = self._index.add(block, block_hash, packed)
            if stored:
                self.cacheable[block] = True
                routes = self._routes[STORED]
                if routes:
                    self._emit(routes, BlockEvent(STORED, block, block_hash))
            if self._pending:
                self._dispatch()
            return stored

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
            packed = pack_checked("token_ids", token_ids[: len(blocks) * block_size])
        elif len(packed) < len(blocks) * width:
            raise ShapeError(f"{len(blocks)} blocks need {len(blocks) * width} packed bytes, got {len(packed)}")
        blocks = self._check_ids(blocks)
        with self._lock:
            state = self.state
            if blocks and _FREE in set(map(state.__getitem__, blocks)):
                b = next(b for b in blocks if state[b] == _FREE)
                raise InvalidBlockError(f"block {b} is free: only held, written blocks can be cached")
            stored = self._index.add_run(blocks, hashes, packed, width)
            cacheable, routes, hash_by_block = self.cacheable, self._routes[STORED], self.hash_by_block
            for b in stored:
                cacheable[b] = True
                if routes:
                    self._emit(routes, BlockEvent(STORED, b, hash_by_block[b]))
            if self._pending:
                self._dispatch()
            return len(stored)

    def uncache(self, block: int) -> bytes | None:
        """Drop ``block`` from the index (emits ``removed``): a cached block goes back to the free list at once
        (``freed``), an active one is freed, not cached, when its last holder lets go. Returns the hash it had."""
        block = self._check_id(block)
        with self._lock:
            block_hash = self._index.drop(block)
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
            block = self._index.verified(block_hash, tokens)
            if block is not None:
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
        with self._lock:
            found = self._index.match(hashes, token_ids, block_size, start, packed)
            state, refcount, cached = self.state, self.refcount, self._cached
            for block in found:
                if state[block] == _CACHED:
                    cached.unlink(block)
                    state[block] = _ACTIVE
                refcount[block] += 1
            return found
