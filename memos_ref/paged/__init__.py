"""Paged KV blocks: the pool (and the KVPool Protocol every pool implements), the O(1) allocator, block tables,
the prefix cache and the invariant checker.

The allocator (``allocator``) composes the free lists (``free_list``), the prefix-hash index (``prefix_index``,
joined to block state by ``indexing``) and the block events (``events``); a sequence's block table
(``sequence``) is written in parts: token bookkeeping (``sequence_tokens``), writes (``sequence_writes``),
copy-on-write (``sequence_cow``) and residual windows (``sequence_windows``)."""

from memos_ref.paged.allocator import BlockAllocator, BlockState
from memos_ref.paged.check import check_invariants
from memos_ref.paged.kvpool import KVPool, PoolBuilder, WindowedKVPool
from memos_ref.paged.pool import BlockPool
from memos_ref.paged.prefix import PrefixCache, block_hashes
from memos_ref.paged.sequence import UNKNOWN_TOKEN, SequenceCache
from memos_ref.paged.store import PagedKV, TierHook

__all__ = [
    "UNKNOWN_TOKEN",
    "BlockAllocator",
    "BlockPool",
    "BlockState",
    "KVPool",
    "PagedKV",
    "PoolBuilder",
    "PrefixCache",
    "SequenceCache",
    "TierHook",
    "WindowedKVPool",
    "block_hashes",
    "check_invariants",
]
