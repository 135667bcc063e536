"""ContiguousCache: one preallocated buffer per layer, a ``valid_len`` pointer, writes in place (seed 003 §2).

A step writes only its new tokens — O(1) bytes per token instead of concatenation's O(t) — until the buffer
is full. Then it either grows by a factor (default 1.5×, seed 003 §4.2: one copy of everything, amortised
O(1) per token) or, with ``growth_factor=None``, raises :class:`CapacityExceededError`.

The buffer layout is configurable, to test seed 003 §3.1's claim that ``[H, S, D]`` beats ``[S, H, D]``:
``"HSD"`` stores ``[B, H, S, D]`` (each head's tokens contiguous, what attention reads); ``"SHD"`` stores
``[B, S, H, D]`` (each token's heads contiguous, what a write produces). Both hand attention a
``[B, H, S, D]`` view; with ``"SHD"`` that view is strided.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from memos_ref.caches.base import MemosCache, check_new_kv
from memos_ref.errors import CapacityExceededError, ConfigError, check_type

__all__ = ["LAYOUTS", "ContiguousCache", "ContiguousLayer", "GrowthEvent"]

LAYOUTS = ("HSD", "SHD")


@dataclass(frozen=True)
class GrowthEvent:
    """One reallocation: capacities before and after, bytes copied, and the wall time it took."""

    old_capacity: int
    new_capacity: int
    bytes_copied: int
    seconds: float


def _validate_options(capacity: int, growth_factor: float | None, layout: str) -> None:
    check_type("capacity", capacity, int)
    if growth_factor is not None:
        check_type("growth_factor", growth_factor, (int, float))
    check_type("layout", layout, str)
    if capacity <= 0:
        raise ConfigError(f"capacity must be a positive int (tokens), got {capacity!r}")
    if growth_factor is not None and not (isinstance(growth_factor, (int, float)) and growth_factor > 1.0):
        raise ConfigError(f"growth_factor must be > 1.0, or None for a fixed capacity; got {growth_factor!r}")
    if layout not in LAYOUTS:
        raise ConfigError(f"layout must be one of {LAYOUTS}, got {layout!r}")


class _Uninitialized:
    """Stand-in layer for checking K/V on their own (no stored geometry to match)."""

    is_initialized = False


class ContiguousLayer(CacheLayerMixin):
    """One layer's preallocated K and V buffers and the count of valid tokens in them."""

    is_sliding = False
    is_croppable = True
    is_compileable = False

    def __init__(self, capacity: int = 256, growth_factor: float | None = 1.5, layout: str = "HSD") -> None:
        _validate_options(capacity, growth_factor, layout)
        super().__init__()
        self.capacity = capacity
        self.growth_factor = growth_factor
        self.layout = layout
        self.valid_len = 0
        self.bytes_copied = 0
        self.growth_events: list[GrowthEvent] = []
        self._k: torch.Tensor | None = None  # [B, H, C, D] ("HSD") or [B, C, H, D] ("SHD")
        self._v: torch.Tensor | None = None

    # ------------------------------------------------------------------ storage
    def _alloc(self, capacity: int, like: torch.Tensor) -> torch.Tensor:
        b, h, d = self.batch_size, self.num_heads, self.head_dim
        shape = (b, h, capacity, d) if self.layout == "HSD" else (b, capacity, h, d)
        return torch.empty(shape, dtype=like.dtype, device=like.device)

    def _slot(self, buf: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """A ``[B, H, stop - start, D]`` view of tokens ``start:stop`` in either layout."""
        if self.layout == "HSD":
            return buf[:, :, start:stop]
        return buf[:, start:stop].transpose(1, 2)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        new_tokens = key_states.shape[2]
        if self.growth_factor is None and new_tokens > self.capacity:
            raise CapacityExceededError(
                f"prefill of {new_tokens} tokens exceeds the fixed capacity of {self.capacity} tokens; pass a "
                f"larger capacity or a growth_factor",
                needed=new_tokens,
                capacity=self.capacity,
            )
        self.batch_size, self.num_heads, _, self.head_dim = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.capacity = max(self.capacity, new_tokens)
        self._k, self._v = self._alloc(self.capacity, key_states), self._alloc(self.capacity, value_states)
        self.valid_len = 0
        self.is_initialized = True

    def _fits(self, key_states: torch.Tensor) -> bool:
        b, h, _, d = key_states.shape
        return (b, h, d, key_states.dtype, key_states.device) == (
            self.batch_size,
            self.num_heads,
            self.head_dim,
            self.dtype,
            self.device,
        )

    def _grow(self, needed: int) -> None:
        if self.growth_factor is None:
            raise CapacityExceededError(
                f"ContiguousCache is full: {needed} tokens needed, fixed capacity is {self.capacity}; pass a "
                f"larger capacity or a growth_factor",
                needed=needed,
                capacity=self.capacity,
            )
        new_capacity = max(needed, math.ceil(self.capacity * self.growth_factor))
        started = time.perf_counter()
        new_k, new_v = self._alloc(new_capacity, self._k), self._alloc(new_capacity, self._v)
        self._slot(new_k, 0, self.valid_len).copy_(self._slot(self._k, 0, self.valid_len))
        self._slot(new_v, 0, self.valid_len).copy_(self._slot(self._v, 0, self.valid_len))
        copied = 2 * self._slot(self._k, 0, self.valid_len).nbytes
        self.growth_events.append(GrowthEvent(self.capacity, new_capacity, copied, time.perf_counter() - started))
        self.bytes_copied += copied
        self._k, self._v, self.capacity = new_k, new_v, new_capacity

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new ``[B, H, S_new, D]`` K/V at ``valid_len`` (growing first if needed)."""
        if self.is_initialized and self.valid_len == 0 and key_states.ndim == 4 and not self._fits(key_states):
            # empty after reset(): any batch/geometry may start afresh (the old buffers are dropped)
            check_new_kv(_Uninitialized(), key_states, value_states)
            self.lazy_initialization(key_states, value_states)
        check_new_kv(self, key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, stop = self.valid_len, self.valid_len + key_states.shape[2]
        if stop > self.capacity:
            self._grow(stop)
        self._slot(self._k, start, stop).copy_(key_states)  # in place: only the new tokens move
        self._slot(self._v, start, stop).copy_(value_states)
        self.bytes_copied += key_states.nbytes + value_states.nbytes
        self.valid_len = stop
        self.keys, self.values = self._slot(self._k, 0, stop), self._slot(self._v, 0, stop)
        return self.keys, self.values

    # ------------------------------------------------------------------ the CacheLayerMixin protocol
    def get_seq_length(self) -> int:
        return self.valid_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.valid_len + query_length, 0

    def get_max_length(self) -> int:
        return self.capacity if self.growth_factor is None else -1

    def reset(self) -> None:
        """Forget every token; keep the buffers for reuse (a different batch or geometry reallocates)."""
        self.valid_len = 0
        if self.is_initialized:
            self.keys, self.values = self._slot(self._k, 0, 0), self._slot(self._v, 0, 0)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (transformers' convention: a negative count)."""
        check_type("tokens_to_remove", tokens_to_remove, int)
        if tokens_to_remove > 0:
            raise ConfigError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        self.valid_len = max(0, self.valid_len + tokens_to_remove)
        if self.is_initialized:
            self.keys, self.values = self._slot(self._k, 0, self.valid_len), self._slot(self._v, 0, self.valid_len)

    def _reindex_batch(self, index: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        self._k = self._k.index_select(0, index.to(self._k.device))
        self._v = self._v.index_select(0, index.to(self._v.device))
        self.batch_size = self._k.shape[0]
        self.keys, self.values = self._slot(self._k, 0, self.valid_len), self._slot(self._v, 0, self.valid_len)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._reindex_batch(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        indices = torch.as_tensor(indices)
        if indices.dtype == torch.bool:  # a mask, as transformers' DynamicLayer accepts
            indices = indices.nonzero().flatten()
        self._reindex_batch(indices.long())

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._reindex_batch(torch.arange(self.batch_size).repeat_interleave(repeats))

    def offload(self) -> None:
        raise NotImplementedError("ContiguousCache does not support transformers' layer offloading")

    prefetch = offload

    # ------------------------------------------------------------------ accounting
    def nbytes_used(self) -> int:
        if not self.is_initialized:
            return 0
        return 2 * self.batch_size * self.num_heads * self.head_dim * self.valid_len * self._k.element_size()

    def nbytes_reserved(self) -> int:
        return 0 if not self.is_initialized else self._k.nbytes + self._v.nbytes


class ContiguousCache(MemosCache):
    """Preallocated per-layer buffers with in-place writes and a growth policy.

    Args:
        capacity: initial tokens per layer (a prefill longer than this sizes the buffer to fit).
        growth_factor: multiply the capacity by this when full (default 1.5); ``None`` means a fixed
            capacity that raises :class:`CapacityExceededError` instead of growing.
        layout: ``"HSD"`` (``[B, H, S, D]``, default) or ``"SHD"`` (``[B, S, H, D]``).
        num_layers: create and bound the layers up front (see :class:`MemosCache`).

    Supports batches (with padding as transformers handles it), ``crop``, beam reordering and
    ``batch_select_indices``. Not supported: sliding windows, transformers' layer offloading,
    ``torch.compile`` (``is_compileable`` is False: the buffers may be reallocated while growing).
    """

    def __init__(
        self,
        capacity: int = 256,
        growth_factor: float | None = 1.5,
        layout: str = "HSD",
        num_layers: int | None = None,
    ) -> None:
        _validate_options(capacity, growth_factor, layout)
        self.capacity, self.growth_factor, self.layout = capacity, growth_factor, layout
        super().__init__(lambda: ContiguousLayer(capacity, growth_factor, layout), num_layers)

    @property
    def growth_events(self) -> list[GrowthEvent]:
        """Every reallocation of every layer, in order."""
        return [event for layer in self.layers for event in layer.growth_events]
