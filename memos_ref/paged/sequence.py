"""SequenceCache: one sequence's logical view of the pool — a block table, its tokens, copy-on-write.

The physical slot of logical token *i* is ``table[i // T] * T + i % T``. Appending fills the tail block
before allocating a new one. A sequence may share blocks with others (after ``fork()`` or a prefix-cache
hit); a shared block is never written in place: the first write into a shared (or prefix-cached),
partly filled tail block copies it to a private block first (copy-on-write).

The model writes one layer at a time: the first layer to see new tokens reserves their slots (allocating and
copying as needed), the other layers write into the same slots. ``layer_tokens[l]`` is how many tokens layer
*l* holds; ``num_tokens`` is how many are reserved.

Over a quantized pool with a full-precision residual window, a sequence tells the pool which of its blocks lie
inside its window (``pool.hold``/``pool.unhold``, blocks ``block_table[window_start:]``): a shared block is
sealed only when it lies outside the window of every live sequence holding it.

Every argument is validated before anything changes (:class:`ArgumentTypeError`,
:class:`InvalidArgumentError`, :class:`ShapeError`); a freed sequence raises :class:`UseAfterFreeError`.

:class:`SequenceCache` is one object written in parts, one module each (its base classes, all working on
``self``; their fields are declared in :mod:`~memos_ref.paged.sequence_state`):

* :mod:`~memos_ref.paged.sequence_tokens` — token bookkeeping: ``reserve``, ``advance``, ``append_token``,
  ``admit``, ``set_token_ids`` and the registration of full blocks for prefix reuse;
* :mod:`~memos_ref.paged.sequence_writes` — writes: the slot mapping, ``append`` of one layer's K/V, ``to_dense``;
* :mod:`~memos_ref.paged.sequence_cow` — sharing and copy-on-write: ``fork``, ``adopt_prefix``, the copy of a
  shared tail, ``blocks_needed``;
* :mod:`~memos_ref.paged.sequence_windows` — residual windows over a quantized pool.

This module holds the class itself: its construction and its end (``truncate``, ``rollback_step``, ``free``).
"""

from __future__ import annotations

import itertools
import threading

from memos_ref.errors import ConfigError, check_index, check_type
from memos_ref.paged.allocator import BlockAllocator
from memos_ref.paged.pool import BlockPool
from memos_ref.paged.prefix import UNKNOWN_TOKEN, PrefixCache, check_token_ids
from memos_ref.paged.sequence_cow import CopyOnWrite
from memos_ref.paged.sequence_tokens import SequenceTokens
from memos_ref.paged.sequence_windows import ResidualWindows
from memos_ref.paged.sequence_writes import SequenceWrites

__all__ = ["UNKNOWN_TOKEN", "SequenceCache", "check_token_ids"]

_ids = itertools.count()


class SequenceCache(SequenceTokens, SequenceWrites, CopyOnWrite, ResidualWindows):
    """A sequence's block table over a shared pool and allocator.

    Args:
        pool: the KV memory.
        allocator: block bookkeeping for ``pool``.
        prefix_cache: when given, full blocks with known token ids are registered for reuse.
        cache_salt: per-tenant salt mixed into prefix hashes.
    """

    def __init__(
        self,
        pool: BlockPool,
        allocator: BlockAllocator,
        prefix_cache: PrefixCache | None = None,
        *,
        cache_salt: str | None = None,
        registry: dict[int, SequenceCache] | None = None,
    ) -> None:
        check_type("cache_salt", cache_salt, (str, type(None)))
        check_type("allocator", allocator, BlockAllocator)
        check_type("prefix_cache", prefix_cache, (PrefixCache, type(None)))
        self.pool, self.allocator, self.prefix_cache, self.cache_salt = pool, allocator, prefix_cache, cache_salt
        self.registry = registry
        self.seq_id = next(_ids)
        self.block_size = pool.spec.block_size
        self.block_table: list[int] = []
        self.token_ids: list[int] = []  # one per reserved position (UNKNOWN_TOKEN where not given)
        self.num_tokens = 0
        self.layer_tokens = [0] * pool.spec.num_layers
        self.num_registered = 0  # leading full blocks already offered to the prefix cache
        self._chain: list[bytes] = []  # their chained hashes
        # (hashes, token ids) of the prompt a prefix lookup hashed: reused when the blocks after the adopted
        # prefix are registered, as long as this sequence's tokens are the ones hashed
        self._lookahead: tuple[list[bytes], list[int]] | None = None
        self.cow_copies = 0
        # a quantized pool with a residual window: blocks block_table[window_start:] are held in the pool's
        # window_holds (this sequence reads them at full precision)
        self._windows = bool(getattr(pool, "tracks_windows", False))
        self.window_start = 0
        self._lock = threading.RLock()
        self._freed = False
        # append_token's inline case reads these: live and no window to track; the allocator's refcounts and
        # index (the same objects for the allocator's life: grow() extends them in place)
        self._plain = not self._windows
        self._refcount, self._indexed = allocator.refcount, allocator.hash_by_block
        if registry is not None:
            registry[self.seq_id] = self

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens (speculative decoding rollback, undo); blocks past them are freed."""
        self._check_live()
        with self._lock:
            n = check_index("n", n, lo=0, hi=self.num_tokens)
            if not self.caught_up:
                raise ConfigError("cannot truncate in the middle of a model step")
            keep = -(-n // self.block_size)
            dropped = self.block_table[keep:]
            # the window: let go of the dropped blocks, and take back kept blocks the shorter window covers again
            self._unhold(self.block_table[max(self.window_start, keep) :])
            old_start = min(self.window_start, keep)
            del self.block_table[keep:]
            if self._windows:
                self.window_start = self._window_for(n)
                self._hold(self.block_table[self.window_start : old_start])
            self.allocator.free_many(dropped)  # a dropped block left in the prefix cache is sealed there
            del self.token_ids[n:]
            self.num_tokens = n
            self.layer_tokens = [n] * len(self.layer_tokens)
            self.num_registered = min(self.num_registered, n // self.block_size)
            del self._chain[self.num_registered :]
            if self.prefix_cache is not None:  # full blocks every layer holds whose ids were recorded mid-step
                self._register_full_blocks()  # (a step rolled back): registered now, as at the step's end

    def rollback_step(self, n: int) -> None:
        """Undo a model step that failed part-way: back to ``n`` tokens in every layer, the blocks reserved past
        them given back (as :meth:`truncate`, which refuses mid-step). ``n`` is at most what every layer holds:
        tokens some layer already wrote are kept only up to ``n``."""
        self._check_live()
        with self._lock:
            n = check_index("n", n, lo=0, hi=min(self.layer_tokens, default=self.num_tokens))
            self.layer_tokens = [self.num_tokens] * len(self.layer_tokens)  # the step is abandoned, not finished
            self.truncate(n)

    def free(self) -> None:
        """Release every block; the sequence cannot be used afterwards (freeing twice is harmless)."""
        with self._lock:
            if self._freed:
                return
            self._unhold(self.block_table[self.window_start :])
            if self._windows and self.caught_up:
                # blocks this sequence alone kept in a window, now behind every remaining holder's: seal them.
                # All of them, the partial tail too: a block partial here (truncated into) may be whole for
                # another holder, and one partial for every holder is its tail, inside its window, so never
                # sealed. Blocks whose last holder this was are sealed by the allocator if cached.
                shared = [b for b in self.block_table if self.allocator.refcount[b] > 1]
                self.pool.seal_unheld(shared)  # type: ignore[attr-defined]
            # last block first: cached blocks are evicted oldest first, so a prefix outlives its tail (vLLM's order)
            self.allocator.free_many(self.block_table[::-1])
            self.block_table = []
            self.num_tokens = 0
            self.window_start = 0
            self._freed = True
            self._plain = False
            self._lookahead = None
            if self.registry is not None:
                self.registry.pop(self.seq_id, None)

    def __repr__(self) -> str:
        return f"SequenceCache(id={self.seq_id}, tokens={self.num_tokens}, blocks={self.block_table})"
