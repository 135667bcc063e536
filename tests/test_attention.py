"""Paged attention reference = dense SDPA over K/V gathered independently by the slot formula."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memos_ref.attention import dense_attention, paged_attention
from memos_ref.errors import ShapeError

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _sdpa_last(q, k, v):
    """torch's SDPA for the last Q positions of a sequence of S keys (causal with offset), GQA."""
    nq, s = q.shape[1], k.shape[1]
    allowed = torch.arange(s)[None, :] <= torch.arange(s - nq, s)[:, None]  # [Q, S]
    return F.scaled_dot_product_attention(
        q[None].float(), k[None].float(), v[None].float(), attn_mask=allowed, enable_gqa=True
    )[0]


def _random_paged(batch_lens, h, d, t, num_blocks, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, h, t, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, h, t, d, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # scattered, non-contiguous block ids
    max_blocks = max(-(-n // t) for n in batch_lens) or 1
    tables = torch.full((len(batch_lens), max_blocks), -1, dtype=torch.long)
    for i, n in enumerate(batch_lens):
        need = -(-n // t)
        tables[i, :need] = torch.tensor([perm.pop() for _ in range(need)], dtype=torch.long)
    return k_cache, v_cache, tables


def _gather_by_slots(cache, table, n):
    t = cache.shape[2]
    flat = cache.permute(0, 2, 1, 3).reshape(-1, cache.shape[1], cache.shape[3])  # [blocks·T, H, D]
    pos = torch.arange(n)
    return flat[table[pos // t] * t + pos % t].transpose(0, 1)  # [H, n, D]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 128])
@pytest.mark.parametrize("queries", [1, 5])  # decode, chunked prefill
def test_paged_equals_dense_sdpa(dtype, gqa, block_size, queries):
    lens = [1, 7, block_size, block_size + 1, 3 * block_size - 1]
    lens = [max(n, queries) for n in lens]
    h, d = 2, 16
    k_cache, v_cache, tables = _random_paged(lens, h, d, block_size, 32, dtype, seed=gqa + block_size)
    gen = torch.Generator().manual_seed(7)
    query = torch.randn(len(lens), h * gqa, queries, d, generator=gen).to(dtype)
    out = paged_attention(query, k_cache, v_cache, tables, torch.tensor(lens))
    for i, n in enumerate(lens):
        k = _gather_by_slots(k_cache, tables[i], n)
        v = _gather_by_slots(v_cache, tables[i], n)
        expected = _sdpa_last(query[i], k, v)
        assert (out[i].float() - expected).abs().max().item() <= TOL[dtype]


def test_variable_query_lengths_and_empty_sequences():
    k_cache, v_cache, tables = _random_paged([10, 0, 4], 1, 8, 8, 8, torch.float32, seed=1)
    query = torch.randn(3, 2, 3, 8)
    out = paged_attention(query, k_cache, v_cache, tables, torch.tensor([10, 0, 4]), query_lens=torch.tensor([3, 0, 1]))
    assert torch.count_nonzero(out[1]) == 0 and torch.count_nonzero(out[2, :, 1:]) == 0
    k = _gather_by_slots(k_cache, tables[2], 4)
    v = _gather_by_slots(v_cache, tables[2], 4)
    assert torch.allclose(out[2, :, :1], _sdpa_last(query[2, :, :1], k, v), atol=1e-5)


def test_dense_attention_matches_sdpa_and_rejects_bad_shapes():
    q, k, v = torch.randn(8, 4, 16), torch.randn(2, 9, 16), torch.randn(2, 9, 16)
    assert torch.allclose(dense_attention(q, k, v), _sdpa_last(q, k, v), atol=1e-5)
    with pytest.raises(ShapeError):
        dense_attention(torch.randn(3, 1, 16), k, v)
    with pytest.raises(ShapeError):
        paged_attention(
            torch.randn(1, 2, 1, 8),
            torch.zeros(4, 1, 8, 4),
            torch.zeros(4, 1, 8, 4),
            torch.zeros(1, 1, dtype=torch.long),
            torch.tensor([1]),
        )
