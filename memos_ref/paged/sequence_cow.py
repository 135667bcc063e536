"""A sequence's sharing and copy-on-write: blocks shared with other sequences are never written in place.

A sequence may share blocks with others — after :meth:`~CopyOnWrite.fork`, or after adopting a prefix-cache hit
(:meth:`~CopyOnWrite.adopt_prefix`). The first write into a shared (or prefix-indexed), partly filled tail block
copies it to a private block first (:meth:`~CopyOnWrite._grow`, counted in ``cow_copies``); full shared blocks
are only read. Part of :class:`~memos_ref.paged.sequence.SequenceCache` (a base class of it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Self

from memos_ref.errors import ArgumentTypeError, ConfigError, InvalidBlockError, ShapeError, StateError, check_index
from memos_ref.paged.allocator import BlockState
from memos_ref.paged.prefix import PrefixHit, check_token_ids
from memos_ref.paged.sequence_state import SequenceState

__all__ = ["CopyOnWrite"]


class CopyOnWrite(SequenceState):
    """The sharing and copy-on-write of a :class:`~memos_ref.paged.sequence.SequenceCache`."""

    def _tail_needs_copy(self) -> bool:
        if self.num_tokens % self.block_size == 0 or not self.block_table:
            return False  # the next token starts a new block
        tail = self.block_table[-1]
        # shared, or in the prefix index (a registered full block made a partial tail again by truncate)
        return self.allocator.refcount[tail] > 1 or tail in self.allocator.hash_by_block

    def blocks_needed(self, n: int) -> int:
        """Blocks that reserving ``n`` more tokens would allocate (new blocks plus a copy-on-write)."""
        self._check_live()
        n = check_index("n", n, lo=0)
        if n == 0:
            return 0
        new_blocks = -(-(self.num_tokens + n) // self.block_size) - len(self.block_table)
        return new_blocks + int(self._tail_needs_copy())

    def _grow(self, new_blocks: int, copy_tail: bool) -> None:
        """Allocate ``new_blocks`` blocks (all or nothing) and copy a shared tail to a private block first."""
        fresh = self.allocator.allocate(new_blocks + copy_tail)  # raises before any change
        if copy_tail:
            private, old = fresh.pop(), self.block_table[-1]
            try:
                self.pool.copy_block(old, private)
            except BaseException as exc:  # give everything back
                self.allocator.free_many([*fresh, private])
                if not isinstance(exc, Exception):
                    raise  # an interrupt
                # a block the storage does not hold (allocator and pool apart), or a raw device error
                raise StateError(
                    f"copying the shared tail block {old} to block {private} failed ({exc}); nothing was kept"
                ) from exc
            self.block_table[-1] = private
            self._hold([private])  # the tail always lies inside the window
            self._unhold([old])
            self.allocator.free(old)
            self.cow_copies += 1
        if fresh:
            self._hold(fresh)
            self.block_table.extend(fresh)

    def adopt_prefix(self, blocks: Sequence[int], token_ids: Sequence[int]) -> None:
        """Start an empty sequence from prefix-cache blocks (already incref'd by the lookup)."""
        self._check_live()
        if self.num_tokens or self.block_table:
            raise StateError(f"a prefix can only be adopted by an empty sequence; this one holds {self.num_tokens}")
        if isinstance(blocks, (str, bytes)) or not isinstance(blocks, Sequence):
            raise ArgumentTypeError(f"blocks: expected a sequence of block ids, got {type(blocks).__name__}")
        hit = blocks if isinstance(blocks, PrefixHit) and self.prefix_cache is not None else None
        blocks = self._check_held_all(blocks)
        token_ids = check_token_ids("token_ids", token_ids)
        n = len(blocks) * self.block_size
        if len(token_ids) < n:
            raise ShapeError(f"{len(blocks)} blocks need {n} token ids, got {len(token_ids)}")
        carried = self._carried_chain(hit, token_ids[:n]) if hit is not None else None
        with self._lock:
            self.block_table = list(blocks)
            self.token_ids = list(token_ids[:n])
            self.num_tokens = n
            self.layer_tokens = [n] * len(self.layer_tokens)
            self.num_registered = len(blocks)
            if self.prefix_cache is not None:
                self._lookahead = (carried, hit.token_ids) if carried is not None else None  # type: ignore
                self._chain = (
                    carried[: len(blocks)]
                    if carried is not None
                    else self.prefix_cache.hashes(self.token_ids, self.cache_salt)
                )
            self.window_start = self._window_for(n) if self._windows else 0
            self._hold(self.block_table[self.window_start :])
            self._seal_behind_window()

    def _carried_chain(self, hit: PrefixHit, token_ids: list[int]) -> list[bytes] | None:
        """The hash chain a lookup computed for the prompt (each block hashed once per sequence), if it is this
        sequence's chain: same fingerprint and salt, covering the adopted blocks, and the lookup hashed exactly
        these token ids. None otherwise (the chain is then computed from the token ids)."""
        t = self.block_size
        if len(hit.chain) < len(hit) or hit.extra != self.prefix_cache.extra_key(self.cache_salt):  # type: ignore
            return None
        if hit.token_ids[: len(hit) * t] != token_ids:
            return None
        return list(hit.chain)

    def _check_held_all(self, blocks: Sequence[int]) -> list[int]:
        """Every block id allocated (see :meth:`_check_held`), as a list of ints."""
        out, alloc = list(blocks), self.allocator
        if not out or (  # plain ints in range, all active: checked in C
            set(map(type, out)) == {int}
            and min(out) >= 0
            and max(out) < alloc.num_blocks
            and set(map(alloc.state.__getitem__, out)) == {int(BlockState.ACTIVE)}
        ):
            return out
        return [self._check_held(b) for b in blocks]

    def _check_held(self, block: object) -> int:
        """A block id that is allocated (held by someone: the lookup's reference), as an int."""
        b = check_index("block", block, lo=-(2**62))
        if not 0 <= b < self.allocator.num_blocks:
            raise InvalidBlockError(f"block id {b} is not in [0, {self.allocator.num_blocks})")
        if self.allocator.state[b] != BlockState.ACTIVE:
            raise InvalidBlockError(
                f"block {b} is {BlockState(self.allocator.state[b]).name.lower()}: adopt only blocks a prefix "
                f"lookup returned (they carry the reference this sequence takes over)"
            )
        return b

    def fork(self) -> Self:
        """A new sequence sharing every block (refcounts +1); the first write to a shared tail copies it."""
        self._check_live()
        with self._lock:
            if not self.caught_up:
                raise ConfigError("cannot fork in the middle of a model step (layers hold different lengths)")
            child = type(self)(  # a SequenceCache
                self.pool, self.allocator, self.prefix_cache, cache_salt=self.cache_salt, registry=self.registry
            )
            for block in self.block_table:
                self.allocator.incref(block)
            child.block_table = list(self.block_table)
            child.token_ids = list(self.token_ids)
            child.num_tokens = self.num_tokens
            child.layer_tokens = list(self.layer_tokens)
            child.num_registered = self.num_registered
            child._chain = list(self._chain)
            child._lookahead = self._lookahead
            child.window_start = self.window_start
            child._hold(child.block_table[child.window_start :])
            return child
