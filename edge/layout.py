"""The pool-layout bridge: a session's blocks out of our pool and into TensorRT-LLM's or TensorRT Edge-LLM's
KV layout, and back.

* **TensorRT-LLM** keeps its paged primary pool as ``[blocks, L, 2, H, T, D]`` — our canonical layout, so a
  session's blocks leave as one contiguous copy of the rows its block table names (``export_trtllm_blocks``).
* **TensorRT Edge-LLM** keeps a pool per layer, ``[2, pages, page, H, D]`` with 128-token pages: token-major
  inside a page, and pages sized independently of our blocks, so the bridge regathers tokens.

Byte sizes of the three granularities (:func:`granularities`): a kernel page (one of K or V, one layer)
``H·T·D·bytes``; a per-layer slab (K and V of one layer) ``2·H·T·D·bytes`` — the "~1 MiB block" of the Jetson
plan; a whole block ``L·2·H·T·D·bytes``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from memos_ref.errors import ConfigError, ShapeError
from memos_ref.paged.sequence import SequenceCache
from memos_ref.paged.store import PagedKV
from memos_ref.spec import KVSpec

__all__ = [
    "export_edge_llm",
    "export_trtllm_blocks",
    "granularities",
    "import_edge_llm",
    "import_trtllm_blocks",
]


def granularities(spec: KVSpec) -> dict[str, int]:
    h, t, d, b = spec.num_kv_heads, spec.block_size, spec.head_dim, spec.dtype.itemsize
    return {"kernel_page": h * t * d * b, "layer_slab": 2 * h * t * d * b, "block": spec.num_layers * 2 * h * t * d * b}


def export_trtllm_blocks(seq: SequenceCache) -> torch.Tensor:
    """The sequence's blocks in TensorRT-LLM's primary-pool layout ``[n, L, 2, H, T, D]`` (a copy)."""
    return torch.stack([seq.pool.block(b) for b in seq.block_table]).contiguous()


def import_trtllm_blocks(kv: PagedKV, blocks: torch.Tensor, token_ids: Sequence[int]) -> SequenceCache:
    """A new sequence over ``kv`` holding ``blocks [n, L, 2, H, T, D]`` for ``token_ids``."""
    if tuple(blocks.shape[1:]) != kv.spec.block_shape or blocks.dtype != kv.spec.dtype:
        raise ShapeError(
            f"blocks must be [n, {', '.join(map(str, kv.spec.block_shape))}] {kv.spec.dtype}, got "
            f"{tuple(blocks.shape)} {blocks.dtype}"
        )
    n = len(token_ids)
    if -(-n // kv.spec.block_size) != blocks.shape[0]:
        raise ShapeError(f"{n} tokens need {-(-n // kv.spec.block_size)} blocks, got {blocks.shape[0]}")
    seq = kv.new_sequence()
    seq.reserve(n, list(token_ids))
    for i, b in enumerate(seq.block_table):
        kv.pool.block(b).copy_(blocks[i])
    seq.mark_written()
    return seq


def export_edge_llm(seq: SequenceCache, page: int = 128) -> list[torch.Tensor]:
    """Per layer ``[2, pages, page, H, D]`` (token-major pages, zero-padded past the last token)."""
    if page <= 0:
        raise ConfigError(f"page must be positive, got {page}")
    n, spec = seq.num_tokens, seq.pool.spec
    pages = -(-n // page)
    out = []
    for layer in range(spec.num_layers):
        k, v = seq.to_dense(layer)  # [H, n, D] each
        kv = torch.zeros((2, pages * page, spec.num_kv_heads, spec.head_dim), dtype=spec.dtype)
        kv[0, :n], kv[1, :n] = k.transpose(0, 1), v.transpose(0, 1)
        out.append(kv.view(2, pages, page, spec.num_kv_heads, spec.head_dim))
    return out


def import_edge_llm(kv: PagedKV, layers: Sequence[torch.Tensor], token_ids: Sequence[int]) -> SequenceCache:
    """A new sequence over ``kv`` from Edge-LLM per-layer pools ``[2, pages, page, H, D]``."""
    spec, n = kv.spec, len(token_ids)
    if len(layers) != spec.num_layers:
        raise ShapeError(f"expected {spec.num_layers} layers, got {len(layers)}")
    seq = kv.new_sequence()
    for layer, pool in enumerate(layers):
        if pool.ndim != 5 or pool.shape[0] != 2 or tuple(pool.shape[3:]) != (spec.num_kv_heads, spec.head_dim):
            raise ShapeError(f"layer {layer}: expected [2, pages, page, {spec.num_kv_heads}, {spec.head_dim}]")
        flat = pool.reshape(2, -1, spec.num_kv_heads, spec.head_dim)[:, :n]  # [2, n, H, D]
        if flat.shape[1] != n:
            raise ShapeError(f"layer {layer} holds {flat.shape[1]} tokens, {n} token ids given")
        seq.append(layer, flat[0].transpose(0, 1), flat[1].transpose(0, 1), list(token_ids) if layer == 0 else None)
    return seq
