"""The invariant checker (seed 000 §6.2): the allocator, the block tables and the prefix cache must agree.

Checked, each failure naming the offending block ids:

1. refcount of every block = number of block-table entries that hold it;
2. no block both free (or cached) and held; every block in a table is active;
3. no block writable in place by two sequences: follows from 1 (a partly filled tail two sequences hold has
   refcount >= 2, so the next write copies it), so it has no check of its own;
4. free + active + cached = total, and the free and cached lists hold exactly the blocks in those states;
5. every prefix-cached block is active or cached, never free;
6. over a quantized pool with residual windows: each block's ``window_holds`` equals the number of live
   sequences holding it inside their window, and no staging slot belongs to a free or cached block.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from memos_ref.errors import InvariantError
from memos_ref.paged.allocator import BlockAllocator, BlockState
from memos_ref.paged.prefix import PrefixCache
from memos_ref.paged.sequence import SequenceCache

__all__ = ["check_invariants"]


def check_invariants(
    allocator: BlockAllocator, sequences: Iterable[SequenceCache], prefix_cache: PrefixCache | None = None
) -> None:
    """Raise :class:`InvariantError` if any invariant is broken; return None otherwise."""
    sequences = list(sequences)
    with allocator.lock:
        holders: Counter[int] = Counter()
        for seq in sequences:
            holders.update(seq.block_table)
            dupes = [b for b, n in Counter(seq.block_table).items() if n > 1]
            if dupes:
                raise InvariantError(f"sequence {seq.seq_id} lists blocks {dupes} more than once", dupes)
        bad = [b for b in range(allocator.num_blocks) if allocator.refcount[b] != holders.get(b, 0)]
        if bad:
            detail = ", ".join(f"{b}: refcount {allocator.refcount[b]} vs {holders.get(b, 0)} holders" for b in bad[:8])
            raise InvariantError(f"refcount != number of holders for blocks {bad[:8]} ({detail})", bad)
        not_live = sorted(b for b in holders if allocator.state[b] != BlockState.ACTIVE)
        if not_live:
            raise InvariantError(f"blocks {not_live} are held by a sequence but are free or cached", not_live)
        states = Counter(allocator.state)
        free, cached = allocator.free_blocks(), allocator.cached_blocks()
        if sorted(free) != [b for b in range(allocator.num_blocks) if allocator.state[b] == BlockState.FREE]:
            raise InvariantError(
                "the free list does not hold exactly the free blocks",
                sorted(set(free) ^ {b for b, s in enumerate(allocator.state) if s == BlockState.FREE}),
            )
        if sorted(cached) != [b for b in range(allocator.num_blocks) if allocator.state[b] == BlockState.CACHED]:
            raise InvariantError("the cached list does not hold exactly the cached blocks")
        if states[BlockState.FREE] + states[BlockState.ACTIVE] + states[BlockState.CACHED] != allocator.num_blocks:
            raise InvariantError("free + active + cached != total")
        cached_not_ok = [b for b in cached if allocator.refcount[b] != 0 or not allocator.cacheable[b]]
        if cached_not_ok:
            raise InvariantError(f"cached blocks {cached_not_ok} have holders or no prefix", cached_not_ok)
        _check_windows(allocator, sequences)
        _check_index(allocator)
        if prefix_cache is not None:
            t = prefix_cache.block_size
            for seq in sequences:  # a holder's tokens must be the tokens the cache says the block holds
                for i, block in enumerate(seq.block_table):
                    stored = allocator.tokens_of(block)
                    held = tuple(seq.token_ids[i * t : (i + 1) * t])
                    if stored is not None and len(held) == t and -1 not in held and held != stored:
                        raise InvariantError(
                            f"sequence {seq.seq_id} holds prefix-cached block {block} with other token ids", [block]
                        )


def _check_index(allocator: BlockAllocator) -> None:
    """The prefix-hash index: no free block indexed, every indexed block cacheable, hash -> block one to one."""
    indexed = allocator.indexed_blocks()
    stale = sorted(b for b in indexed if allocator.state[b] == BlockState.FREE)
    if stale:
        raise InvariantError(f"prefix-cached blocks {stale} are on the free list", stale)
    uncacheable = sorted(b for b in indexed if not allocator.cacheable[b])
    if uncacheable:
        raise InvariantError(f"indexed blocks {uncacheable} are not marked cacheable", uncacheable)
    unmapped = sorted(b for b, h in indexed.items() if allocator.block_with_hash(h) != b)
    if unmapped or allocator.num_indexed != len(indexed):
        raise InvariantError(f"the hash index and the blocks' hashes disagree for blocks {unmapped}", unmapped)


def _check_windows(allocator: BlockAllocator, sequences: list[SequenceCache]) -> None:
    pools = {id(seq.pool): seq.pool for seq in sequences if getattr(seq.pool, "tracks_windows", False)}
    for pool in pools.values():
        want: Counter[int] = Counter()
        for seq in sequences:
            if seq.pool is pool:
                want.update(seq.block_table[seq.window_start :])
        holds = pool.window_holds.tolist()
        bad = [b for b in range(pool.num_blocks) if holds[b] != want.get(b, 0)]
        if bad:
            detail = ", ".join(f"{b}: {holds[b]} vs {want.get(b, 0)}" for b in bad[:8])
            raise InvariantError(
                f"window holds disagree with the sequences' windows for blocks {bad[:8]} ({detail})", bad
            )
        staged_free = [
            b
            for b in range(pool.num_blocks)
            if int(pool.staging_slot[b]) >= 0 and allocator.state[b] == BlockState.FREE
        ]
        if staged_free:
            raise InvariantError(f"free blocks {staged_free[:8]} still hold staging slots", staged_free)
