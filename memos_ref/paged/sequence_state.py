"""The fields every part of a :class:`~memos_ref.paged.sequence.SequenceCache` works on, declared once.

:class:`SequenceState` is the common base of the sequence's parts — its token bookkeeping
(:mod:`~memos_ref.paged.sequence_tokens`), its writes (:mod:`~memos_ref.paged.sequence_writes`), its
copy-on-write (:mod:`~memos_ref.paged.sequence_cow`) and its residual windows
(:mod:`~memos_ref.paged.sequence_windows`): it declares the attributes ``SequenceCache.__init__`` sets and holds
the few checks all of them use. A part works only on its own sequence (``self``); one object owns a sequence's
state.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Callable, Sequence

import torch

from memos_ref.errors import UseAfterFreeError
from memos_ref.paged.allocator import BlockAllocator
from memos_ref.paged.pool import BlockPool
from memos_ref.paged.prefix import PrefixCache

__all__ = ["SequenceState"]


class SequenceState:
    """The state of one sequence (set by :class:`~memos_ref.paged.sequence.SequenceCache`), and its common checks.

    The physical slot of logical token *i* is ``block_table[i // block_size] * block_size + i % block_size``.
    ``layer_tokens[l]`` is how many tokens layer *l* holds; ``num_tokens`` how many are reserved.
    """

    pool: BlockPool
    allocator: BlockAllocator
    prefix_cache: PrefixCache | None
    cache_salt: str | None
    registry: dict[int, SequenceState] | None
    seq_id: int
    block_size: int
    block_table: list[int]
    token_ids: list[int]  # one per reserved position (UNKNOWN_TOKEN where not given)
    num_tokens: int
    layer_tokens: list[int]
    num_registered: int  # leading full blocks already offered to the prefix cache
    _chain: list[bytes]  # their chained hashes
    _lookahead: tuple[list[bytes], list[int]] | None  # (hashes, token ids) a prefix lookup hashed
    cow_copies: int
    _windows: bool  # over a quantized pool with residual windows
    window_start: int  # blocks block_table[window_start:] lie inside this sequence's residual window
    _lock: threading.RLock
    _freed: bool
    _plain: bool  # live, and no window to track (append_token's inline case)
    _refcount: array  # the allocator's refcounts and index (the same objects for the allocator's life)
    _indexed: dict[int, bytes]

    # methods one part calls on another (annotations only: each is defined once, in the module named)
    reserve: Callable[..., torch.Tensor]  # sequence_tokens
    _after_all_layers: Callable[[], None]  # sequence_tokens
    _slots: Callable[[int, int], torch.Tensor]  # sequence_writes
    adopt_prefix: Callable[[Sequence[int], Sequence[int]], None]  # sequence_cow
    _grow: Callable[[int, bool], None]  # sequence_cow
    _tail_needs_copy: Callable[[], bool]  # sequence_cow
    _window_for: Callable[[int], int]  # sequence_windows
    _hold: Callable[[list[int]], None]  # sequence_windows
    _unhold: Callable[[list[int]], None]  # sequence_windows
    _seal_behind_window: Callable[[], None]  # sequence_windows
    _check_staging: Callable[[int], None]  # sequence_windows
    rollback_step: Callable[[int], None]  # sequence (SequenceCache itself)

    @property
    def caught_up(self) -> bool:
        """Every layer holds every reserved token (between model steps)."""
        return all(n == self.num_tokens for n in self.layer_tokens)

    @property
    def freed(self) -> bool:
        return self._freed

    def _check_live(self) -> None:
        if self._freed:
            raise UseAfterFreeError(f"sequence {self.seq_id} was freed; create a new one (or fork() it before freeing)")

    @property
    def num_blocks(self) -> int:
        return len(self.block_table)
