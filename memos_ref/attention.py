"""Reference attention: dense and paged, in plain torch. The correctness oracle of the kernels.

``paged_attention`` has a kernel-shaped signature (one layer's K and V caches in pool layout, block tables,
sequence lengths), the same inputs a Triton or CUDA paged-attention kernel takes, so the kernels of
``memos_kernels`` are checked against it element for element.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from memos_ref.errors import ShapeError

if TYPE_CHECKING:
    from memos_ref.paged.sequence import SequenceCache

__all__ = ["attend_sequences", "dense_attention", "gather_kv", "paged_attention"]


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """Causal GQA attention of the *last* ``Q`` positions: ``q [Hq, Q, D]`` against ``k, v [H, S, D]``.

    Query i sits at absolute position ``S - Q + i`` and sees keys ``0..S-Q+i``. Scores and softmax in fp32.
    """
    hq, nq, d = q.shape
    h, s, _ = k.shape
    if hq % h:
        raise ShapeError(f"query heads ({hq}) must be a multiple of KV heads ({h})")
    group = hq // h
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    qg = q.reshape(h, group * nq, d)  # [H, G·Q, D]: the query heads of each KV head together
    scores = (qg @ k.transpose(-1, -2)).float() * scale  # [H, G·Q, S]
    q_pos = torch.arange(s - nq, s, device=q.device).repeat(group)  # [G·Q]
    allowed = torch.arange(s, device=q.device)[None, :] <= q_pos[:, None]  # [G·Q, S]
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = scores.softmax(-1).to(v.dtype) @ v  # [H, G·Q, D]
    return out.reshape(hq, nq, d)


def gather_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``[H, seq_len, D]`` K and V of one sequence from ``[num_blocks, H, T, D]`` caches."""
    t = key_cache.shape[2]
    blocks = block_table[: -(-seq_len // t)].to(key_cache.device)
    h, d = key_cache.shape[1], key_cache.shape[3]
    # select blocks straight into [H, n, T, D] order (one copy); the [H, n·T, D] reshape is then a view
    k = key_cache.permute(1, 0, 2, 3).index_select(1, blocks).reshape(h, -1, d)[:, :seq_len]  # [H, S, D]
    v = value_cache.permute(1, 0, 2, 3).index_select(1, blocks).reshape(h, -1, d)[:, :seq_len]
    return k, v


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    query_lens: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of each sequence's newest tokens over its paged K/V (decode: one query; chunked prefill: many).

    Args:
        query: ``[B, Hq, Q, D]``; sequence b's queries are rows ``0..query_lens[b]-1``, its newest tokens.
        key_cache, value_cache: one layer of the pool, ``[num_blocks, H, T, D]`` each.
        block_tables: ``[B, max_blocks]`` block ids (padding -1).
        seq_lens: ``[B]`` tokens in each sequence, the new ones included.
        query_lens: ``[B]`` new tokens per sequence (default: Q for all).
        scale: softmax scale (default ``1/sqrt(D)``).

    Returns:
        ``[B, Hq, Q, D]``; rows past a sequence's ``query_lens`` are zero.
    """
    b, _, nq, d = query.shape
    if key_cache.shape != value_cache.shape or key_cache.ndim != 4 or key_cache.shape[3] != d:
        raise ShapeError(
            f"key/value caches must both be [num_blocks, kv_heads, block_size, head_dim={d}], got "
            f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if block_tables.shape[0] != b or seq_lens.shape != (b,):
        raise ShapeError(
            f"block_tables [{b}, *] and seq_lens [{b}] expected, got {tuple(block_tables.shape)} "
            f"and {tuple(seq_lens.shape)}"
        )
    query_lens = query_lens if query_lens is not None else torch.full((b,), nq, dtype=torch.long)
    out = torch.zeros_like(query)
    for i in range(b):
        n, nq_i = int(seq_lens[i]), int(query_lens[i])
        if nq_i == 0 or n == 0:
            continue
        if nq_i > n or nq_i > nq:
            raise ShapeError(f"sequence {i}: {nq_i} queries but {n} tokens (and Q={nq})")
        k, v = gather_kv(key_cache, value_cache, block_tables[i], n)
        out[i, :, :nq_i] = dense_attention(query[i, :, :nq_i], k, v, scale=scale)
    return out


def attend_sequences(
    query: torch.Tensor, sequences: Sequence[SequenceCache], layer: int, *, scale: float | None = None
) -> torch.Tensor:
    """Attention of each sequence's newest queries ``[B, Hq, Q, D]`` over its own pages in one layer.

    Builds the block tables and lengths :func:`paged_attention` takes (the call a kernel replaces); a pool in
    several segments has no single cache tensor, and a quantized pool must be decoded, so their sequences are
    gathered (dequantized on read) one by one instead.
    """
    pool = sequences[0].pool
    if len(pool.segments) != 1 or getattr(pool, "quantized", False):  # gather (and dequantize) per sequence
        rows = [dense_attention(query[i], *seq.to_dense(layer), scale=scale) for i, seq in enumerate(sequences)]
        return torch.stack(rows)
    widest = max(seq.num_blocks for seq in sequences)
    tables = torch.full((len(sequences), widest), -1, dtype=torch.long)  # [B, max_blocks], -1 = padding
    for i, seq in enumerate(sequences):
        tables[i, : seq.num_blocks] = seq.block_table_tensor()
    lens = torch.tensor([seq.layer_tokens[layer] for seq in sequences])  # [B]
    view = pool.layer_view(layer)  # [num_blocks, 2, H, T, D]
    if query.shape[2] == 1:  # a decode step: the kernel when memos_ref.ops says so, else the reference
        from memos_ref import ops

        device = view.device
        out = ops.paged_decode(query[:, :, 0], view[:, 0], view[:, 1], tables.to(device), lens.to(device), scale=scale)
        return out[:, :, None]
    return paged_attention(query, view[:, 0], view[:, 1], tables, lens, scale=scale)
