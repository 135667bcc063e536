"""PagedCache: the paged KV memory as a ``transformers.Cache``, for transformers models and the package's forward.

Each batch row is a :class:`~memos_ref.paged.sequence.SequenceCache` over a shared :class:`PagedKV`, so rows
of one cache, and different caches over the same memory, share blocks: ``fork()`` gives sub-agents the
prefix for free, and ``from_prefix()`` starts a new prompt from the prefix cache so only the rest is
computed.

How attention reads the pages, three ways:

* the package's forward calls :meth:`PagedCache.attend`, which runs the kernel-shaped
  :func:`memos_ref.attention.paged_attention` on the pool;
* a transformers model loaded with ``attn_implementation="memos_paged"`` (after
  :func:`register_paged_attention`) and a ``PagedCache(kv, direct=True)`` does the same: ``update`` returns a
  handle instead of dense K/V, and the registered attention function attends over the pages (unpadded
  batches only: transformers passes custom attention functions no mask);
* otherwise ``update`` gathers each row's blocks into a dense ``[B, H, S, D]`` tensor every step, which any
  attention implementation accepts.

In this reference all three still gather per sequence inside torch (``bench decode`` measures the cost beside
the contiguous cache); a kernel that reads the pool in place (``memos_kernels``) removes the copy behind the
same two seams.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from memos_ref.errors import ConfigError, DeviceError, DTypeError, OutOfBlocksError, ShapeError
from memos_ref.paged.sequence import SequenceCache
from memos_ref.paged.store import PagedKV

__all__ = ["PAGED_ATTENTION", "PagedCache", "PagedLayer", "PagedView", "register_paged_attention"]

#: The name under which :func:`register_paged_attention` registers the paged attention function.
PAGED_ATTENTION = "memos_paged"


class PagedView:
    """What ``PagedCache(direct=True).update`` returns instead of dense K/V: which cache and layer to read."""

    __slots__ = ("cache", "layer")

    def __init__(self, cache: PagedCache, layer: int) -> None:
        self.cache, self.layer = cache, layer


def _paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: attend over the pages when given a :class:`PagedView`, else SDPA."""
    if isinstance(key, PagedView):
        out = key.cache._attend_stored(query, key.layer, scaling)  # [B, Hq, S, D]
        return out.transpose(1, 2).contiguous(), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def register_paged_attention() -> str:
    """Register the paged attention function with transformers; load models with the returned name as
    ``attn_implementation``."""
    from transformers import AttentionInterface

    AttentionInterface.register(PAGED_ATTENTION, _paged_attention_forward)
    return PAGED_ATTENTION


class PagedLayer(CacheLayerMixin):
    """One layer's face of a :class:`PagedCache` (the storage is the shared pool)."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, owner: PagedCache, layer_idx: int) -> None:
        super().__init__()
        self.owner, self.layer_idx = owner, layer_idx

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        keys, values = self.owner._update(key_states, value_states, self.layer_idx)
        self.is_initialized = True
        self.keys, self.values = keys, values
        return keys, values

    def get_seq_length(self) -> int:
        seqs = self.owner.sequences
        return seqs[0].layer_tokens[self.layer_idx] if seqs else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.owner.free()

    def crop(self, tokens_to_remove: int) -> None:
        if self.layer_idx == 0:
            self.owner.crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.layer_idx == 0:
            self.owner._select_rows([int(i) for i in beam_idx])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.layer_idx == 0:
            idx = torch.as_tensor(indices)
            rows = idx.nonzero().flatten() if idx.dtype == torch.bool else idx
            self.owner._select_rows([int(i) for i in rows])

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.layer_idx == 0:
            self.owner._select_rows([i for i in range(len(self.owner.sequences)) for _ in range(repeats)])

    def offload(self) -> None:
        raise NotImplementedError("PagedCache does not support transformers' layer offloading")

    prefetch = offload


class PagedCache(Cache):
    """A paged, refcounted KV cache over a :class:`PagedKV` (one :class:`SequenceCache` per batch row).

    Args:
        kv: the shared paged memory (pool, allocator, prefix cache).
        sequences: start from these sequences (e.g. forks or prefix hits); default: created on first use.
        cache_salt: tenant salt for prefix hashing.

    Supports greedy/sampled generation, left-padded batches, ``crop``, beam reordering (rows are forked,
    sharing blocks). Not supported: sliding windows, layer offloading, ``torch.compile``.
    """

    def __init__(
        self,
        kv: PagedKV,
        sequences: Sequence[SequenceCache] | None = None,
        *,
        cache_salt: str | None = None,
        direct: bool = False,
    ) -> None:
        self.kv, self.cache_salt, self.direct = kv, cache_salt, direct
        self.sequences: list[SequenceCache] = list(sequences or [])
        super().__init__(layers=[PagedLayer(self, i) for i in range(kv.spec.num_layers)])

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def from_prefix(cls, kv: PagedKV, input_ids: torch.Tensor, *, cache_salt: str | None = None) -> PagedCache:
        """A cache already holding the longest cached prefix of each row of ``input_ids [B, S]``.

        Give the same ``input_ids`` to ``generate`` (or feed ``input_ids[:, cache.get_seq_length():]`` to a
        forward): only the uncached rest is computed. Rows must reuse the same number of tokens (they are
        trimmed to the shortest hit).
        """
        rows = [kv.start_from_prefix(ids.tolist(), cache_salt) for ids in input_ids]
        shortest = min(seq.num_tokens for seq in rows)
        for seq in rows:
            if seq.num_tokens > shortest:
                if kv.prefix_cache is not None:
                    kv.prefix_cache.uncount_hits(seq.num_tokens - shortest)  # looked up but not reused
                seq.truncate(shortest)
        return cls(kv, rows, cache_salt=cache_salt)

    def fork(self) -> PagedCache:
        """A new cache sharing every block of this one (a sub-agent); writes copy a shared tail first."""
        return PagedCache(
            self.kv, [seq.fork() for seq in self.sequences], cache_salt=self.cache_salt, direct=self.direct
        )

    def set_token_ids(self, input_ids: torch.Tensor) -> None:
        """Record the token ids ``[B, S]`` of the first S positions so full blocks enter the prefix cache
        (``update`` sees only K/V; call this after ``generate`` with its output, minus the last token)."""
        if input_ids.shape[0] != len(self.sequences):
            raise ShapeError(f"{len(self.sequences)} rows in the cache, {input_ids.shape[0]} rows of ids given")
        held = max((seq.num_tokens for seq in self.sequences), default=0)
        if input_ids.shape[1] < held:
            raise ShapeError(f"the cache holds {held} tokens per row but only {input_ids.shape[1]} ids were given")
        for seq, ids in zip(self.sequences, input_ids):
            seq.set_token_ids(ids[: seq.num_tokens].tolist())

    # ------------------------------------------------------------------ the Cache protocol
    def _check(self, key: torch.Tensor, value: torch.Tensor) -> None:
        spec = self.kv.spec
        if key.ndim != 4 or key.shape != value.shape:
            raise ShapeError(
                f"key/value must both be [batch, kv_heads, tokens, head_dim], got {tuple(key.shape)} "
                f"and {tuple(value.shape)}"
            )
        if (key.shape[1], key.shape[3]) != (spec.num_kv_heads, spec.head_dim):
            raise ShapeError(
                f"key shape {tuple(key.shape)}: expected kv_heads={spec.num_kv_heads}, head_dim={spec.head_dim}"
            )
        if key.dtype != spec.dtype or value.dtype != spec.dtype:
            raise DTypeError(f"key dtype {key.dtype} does not match the pool's {spec.dtype}")
        if key.device != self.kv.pool.device:
            raise DeviceError(f"key device {key.device} does not match the pool's {self.kv.pool.device}")
        if self.sequences and key.shape[0] != len(self.sequences):
            raise ShapeError(f"batch of {key.shape[0]} rows, but this cache holds {len(self.sequences)}")

    def _write(self, key: torch.Tensor, value: torch.Tensor, layer: int) -> None:
        """Append this step's K/V ``[B, H, n, D]`` of one layer to every row (all rows or none)."""
        self._check(key, value)
        if not self.sequences:
            self.sequences = [self.kv.new_sequence(self.cache_salt) for _ in range(key.shape[0])]
        n = key.shape[2]
        if self.sequences[0].layer_tokens[layer] + n > self.sequences[0].num_tokens:
            needed = sum(seq.blocks_needed(n) for seq in self.sequences)
            if needed > self.kv.allocator.num_available:
                raise OutOfBlocksError(needed=needed, available=self.kv.allocator.num_available)
        for row, seq in enumerate(self.sequences):
            seq.append(layer, key[row], value[row])

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int) -> torch.Tensor:
        """Store this step's K/V and compute causal attention of ``query [B, Hq, n, D]`` over each row's pages.

        The package's forward calls this instead of ``update`` (no dense ``[B, H, S, D]`` is handed back);
        it is the seam where a paged-attention kernel reads the pool directly. Returns ``[B, Hq, n, D]``.
        """
        self._write(key, value, layer)
        return self._attend_stored(query, layer)

    def _attend_stored(self, query: torch.Tensor, layer: int, scale: float | None = None) -> torch.Tensor:
        from memos_ref.attention import attend_sequences

        return attend_sequences(query, self.sequences, layer, scale=scale)

    def _update(self, key: torch.Tensor, value: torch.Tensor, layer: int) -> tuple[Any, Any]:
        self._write(key, value, layer)
        if self.direct:  # the registered attention function reads the pages
            view = PagedView(self, layer)
            return view, view
        keys, values = [], []
        for seq in self.sequences:
            k, v = seq.to_dense(layer)  # [H, S, D]: the gather transformers' attention needs
            keys.append(k)
            values.append(v)
        if len(keys) == 1:  # no second copy for a single row
            return keys[0].unsqueeze(0), values[0].unsqueeze(0)
        return torch.stack(keys), torch.stack(values)  # [B, H, S, D]

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens of every row (transformers' negative convention)."""
        if tokens_to_remove > 0:
            raise ConfigError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        for seq in self.sequences:
            seq.truncate(max(0, seq.num_tokens + tokens_to_remove))

    def _select_rows(self, rows: list[int]) -> None:
        new = [self.sequences[i].fork() for i in rows]  # beams share their common blocks
        for seq in self.sequences:
            seq.free()
        self.sequences = new

    def free(self) -> None:
        """Release every row's blocks back to the shared memory."""
        for seq in self.sequences:
            seq.free()
        self.sequences = []

    def stats(self) -> dict[str, Any]:
        return {
            "tokens": self.get_seq_length(),
            "rows": len(self.sequences),
            "blocks": sum(seq.num_blocks for seq in self.sequences),
            **self.kv.stats(),
        }
