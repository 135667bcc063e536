"""A sequence's writes: the slots of its positions, and one layer's K/V written into the pool.

The physical slot of logical token *i* is ``table[i // T] * T + i % T``. The model writes one layer at a time
(:meth:`~SequenceWrites.append`): the first layer to see new tokens reserves their slots, the other layers write
into the same slots; a write the pool refuses gives the step's blocks back. Part of
:class:`~memos_ref.paged.sequence.SequenceCache` (a base class of it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from memos_ref.errors import (
    ConfigError,
    InvalidArgumentError,
    KVCacheError,
    ShapeError,
    StateError,
    check_index,
    check_layer_index,
    check_type,
)
from memos_ref.paged.sequence_state import SequenceState

__all__ = ["SequenceWrites"]


class SequenceWrites(SequenceState):
    """The slot mapping and the K/V writes of a :class:`~memos_ref.paged.sequence.SequenceCache`."""

    # ------------------------------------------------------------------ slots
    def slot(self, position: int) -> int:
        """The physical slot of logical position ``position`` (in ``[0, num_tokens)``)."""
        self._check_live()
        position = check_index("position", position, lo=0, hi=self.num_tokens - 1)
        return self.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def slot_mapping(self, start: int, stop: int) -> torch.Tensor:
        """Physical slots ``[stop - start]`` of logical positions ``start..stop-1`` (within ``num_tokens``)."""
        self._check_live()
        start = check_index("start", start, lo=0, hi=self.num_tokens)
        stop = check_index("stop", stop, lo=start, hi=self.num_tokens)
        return self._slots(start, stop)

    def _slots(self, start: int, stop: int) -> torch.Tensor:
        return torch.tensor(self._slot_list(start, stop), dtype=torch.long)

    def _slot_list(self, start: int, stop: int) -> list[int]:
        t, table = self.block_size, self.block_table
        return [table[p // t] * t + p % t for p in range(start, stop)]

    def slot_list(self, start: int, stop: int) -> list[int]:
        """:meth:`slot_mapping` as a Python list (for callers that build one tensor for many rows)."""
        self._check_live()
        start = check_index("start", start, lo=0, hi=self.num_tokens)
        stop = check_index("stop", stop, lo=start, hi=self.num_tokens)
        return self._slot_list(start, stop)

    def block_table_tensor(self) -> torch.Tensor:
        return torch.tensor(self.block_table, dtype=torch.long)

    def append(self, layer: int, key: torch.Tensor, value: torch.Tensor, token_ids: Sequence[int] | None = None):
        """Write ``n`` tokens' K/V ``[H, n, D]`` of one layer. The first layer to get past ``num_tokens``
        reserves the slots; the others reuse them. Returns the slots written."""
        self._check_live()
        layer = check_layer_index(layer, len(self.layer_tokens))
        check_type("key", key, torch.Tensor)
        check_type("value", value, torch.Tensor)
        if key.ndim != 3 or key.shape != value.shape:
            raise ShapeError(
                f"key/value must be [kv_heads, tokens, head_dim], got {tuple(key.shape)} and {tuple(value.shape)}"
            )
        n = key.shape[1]
        self.pool.check_kv(key.transpose(0, 1), value.transpose(0, 1), layer=layer)  # before anything is reserved
        with self._lock:
            start = self.layer_tokens[layer]
            beyond = start + n - self.num_tokens
            if beyond > 0 and beyond != n:
                raise ConfigError(
                    f"layer {layer} holds {start} tokens and gets {n}, but {self.num_tokens} are reserved: layers "
                    f"must write the same tokens in order"
                )
            if beyond > 0:
                slots = self.reserve(n, token_ids)
            else:
                slots = self._slots(start, start + n)
            try:
                self.pool.write(layer, slots, key.transpose(0, 1), value.transpose(0, 1))
            except Exception as exc:
                if beyond > 0:
                    self.rollback_step(start)  # the blocks reserved above go back
                if isinstance(exc, KVCacheError) and not isinstance(exc, InvalidArgumentError):
                    raise
                # a slot the storage does not hold (allocator and pool apart), refused or raw
                raise StateError(
                    f"writing {n} tokens of layer {layer} failed: the pool holds {self.pool.num_blocks} blocks and "
                    f"the allocator {self.allocator.num_blocks} ({exc}); nothing was kept"
                ) from exc
            self.layer_tokens[layer] = start + n
            if self.caught_up:
                self._after_all_layers()
            return slots

    # ------------------------------------------------------------------ checks
    def to_dense(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This sequence's K and V of one layer as dense ``[H, S, D]`` tensors (a copy, for checks)."""
        self._check_live()
        layer = check_layer_index(layer, len(self.layer_tokens))
        n = self.layer_tokens[layer]
        return self.pool.gather(layer, self.block_table_tensor(), n)
