"""ConcatCache: the naive cache of seed 000 §2.1 — on every step, ``torch.cat`` the new K/V onto the old.

Each step allocates a new tensor and copies everything cached so far into it, so step t moves O(t) bytes and
n steps move O(n²) bytes in total: the traffic notebook 01 measures. It is exactly what transformers'
``DynamicCache`` does, with checks and byte accounting added.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from memos_ref.caches.base import MemosCache, check_new_kv

__all__ = ["ConcatCache", "ConcatLayer"]


class ConcatLayer(DynamicLayer):
    """One layer: ``keys``/``values`` are ``[B, H_kv, S, D]`` tensors rebuilt by concatenation each step."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes_copied = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.dtype = key_states.dtype
        self.batch_size, self.num_heads, _, self.head_dim = key_states.shape

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_new_kv(self, key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states], dim=-2)  # [B, H, S_old + S_new, D]: a full copy
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.bytes_copied += self.keys.nbytes + self.values.nbytes
        return self.keys, self.values

    def _sync_batch(self) -> None:
        if self.is_initialized and self.keys is not None and self.keys.ndim == 4:
            self.batch_size = self.keys.shape[0]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._sync_batch()

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._sync_batch()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._sync_batch()

    def nbytes_used(self) -> int:
        return 0 if not self.is_initialized else self.keys.nbytes + self.values.nbytes

    nbytes_reserved = nbytes_used


class ConcatCache(MemosCache):
    """Per-layer ``torch.cat`` cache. Works in the package's forward and as a transformers cache.

    Supports greedy and sampled generation, batches (with padding, as transformers handles it), ``crop``
    and beam reordering (inherited from transformers' ``DynamicLayer``). No sliding windows.
    """

    def __init__(self, num_layers: int | None = None) -> None:
        super().__init__(ConcatLayer, num_layers)
