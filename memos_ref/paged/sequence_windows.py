"""A sequence's residual window over a quantized pool: which of its blocks it reads at full precision.

Over a quantized pool with a full-precision residual window, a sequence tells the pool which of its blocks lie
inside its window (``pool.hold``/``pool.unhold``, blocks ``block_table[window_start:]``): a shared block is
sealed (quantized) only when it lies outside the window of every live sequence holding it. Over any other pool
these methods do nothing. Part of :class:`~memos_ref.paged.sequence.SequenceCache` (a base class of it).
"""

from __future__ import annotations

from memos_ref.errors import StagingFullError, check_index
from memos_ref.paged.sequence_state import SequenceState

__all__ = ["ResidualWindows"]


class ResidualWindows(SequenceState):
    """The residual-window bookkeeping of a :class:`~memos_ref.paged.sequence.SequenceCache`."""

    def _window_for(self, num_tokens: int) -> int:
        """Index of the first block inside the residual window of a sequence of ``num_tokens`` tokens."""
        residual = self.pool.residual_tokens  # type: ignore[attr-defined]
        return min(len(self.block_table), max(0, num_tokens - residual) // self.block_size)

    def _hold(self, blocks: list[int]) -> None:
        if self._windows:
            self.pool.hold(blocks)  # type: ignore[attr-defined]

    def _unhold(self, blocks: list[int]) -> None:
        if self._windows:
            self.pool.unhold(blocks)  # type: ignore[attr-defined]

    def _seal_behind_window(self) -> None:
        """Move the window to the current length (every layer holds every token) and seal the blocks behind it
        that no other live sequence holds inside its own window."""
        if not self._windows:
            return
        start = self._window_for(self.num_tokens)
        if start > self.window_start:
            self._unhold(self.block_table[self.window_start : start])
            self.window_start = start
        self.pool.seal_unheld(self.block_table[: self.window_start])  # type: ignore[attr-defined]

    def staging_needed(self, n: int) -> int:
        """Full-precision staging blocks that appending ``n`` tokens needs from a quantized pool (0 for other
        pools): one per new block, plus one for a partly filled tail that must be copied or re-staged."""
        self._check_live()
        n = check_index("n", n, lo=0)
        if not self._windows or n == 0:
            return 0
        new_blocks = -(-(self.num_tokens + n) // self.block_size) - len(self.block_table)
        tail = 0
        if self.num_tokens % self.block_size and self.block_table:
            sealed = int(self.pool.staging_slot[self.block_table[-1]]) < 0  # type: ignore[attr-defined]
            tail = int(self._tail_needs_copy() or sealed)
        return new_blocks + tail

    def seal_idle(self) -> int:
        """Age a sequence that has gone quiet (seed 001's "untouched for a while"): seal every *full* block,
        its residual window included — except blocks another live sequence holds inside its own window; the
        partial last block stays staged. Returns how many blocks were sealed."""
        self._check_live()
        if not self._windows or not self.caught_up:
            return 0
        with self._lock:
            full = self.num_tokens // self.block_size
            own = self.block_table[self.window_start : full]
            self._unhold(own)
            try:
                return self.pool.seal_unheld(self.block_table[:full])  # type: ignore[attr-defined]
            finally:
                self._hold(own)

    def _check_staging(self, n: int) -> None:
        need = self.staging_needed(n)
        if need and need > self.pool.staging_available:  # type: ignore[attr-defined]
            free, total = self.pool.staging_available, self.pool.staging.shape[0]  # type: ignore[attr-defined]
            raise StagingFullError(
                f"{need} blocks need full-precision staging but {free} of {total} staging blocks are free (they "
                f"hold the residual windows of live sequences): raise staging_blocks or lower residual_tokens",
                needed=need,
                capacity=free,
            )
