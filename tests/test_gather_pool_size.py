"""Reading a sequence's pages touches only its own blocks: no allocation scales with the pool (issue 15).

The old ``gather_kv`` (``key_cache.permute(1, 0, 2, 3).index_select(1, blocks)`` on a strided per-layer view)
made the whole layer of the pool contiguous first — 142 ms for 4,096 tokens in a 4,096-block pool against
3.2 ms in a 258-block one. These tests measure bytes allocated (torch's profiler), not time: deterministic.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from memos_ref.attention import attend_sequences, gather_kv, paged_attention
from memos_ref.paged import PagedKV
from memos_ref.paged.pool import BlockPool
from memos_ref.spec import KVSpec

SPEC = KVSpec(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_size=16)
BIG = 4096  # blocks: one layer's K of the pool is 4096 · 2 · 16 · 8 · 4 B = 4 MiB
TABLE = torch.tensor([5, 3000, 17, 4000])  # scattered, 4 blocks: a sequence's K is 4 KiB
SEQ_LEN = 57  # a partly filled last block


def _largest_allocation(fn: Callable[[], object]) -> int:
    """The largest single CPU allocation (bytes) any op made while ``fn`` ran."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events()), default=0)


def _sequence_bytes() -> int:
    return len(TABLE) * SPEC.num_kv_heads * SPEC.block_size * SPEC.head_dim * 4  # one of K or V, whole blocks


@pytest.fixture(scope="module")
def big_pool() -> BlockPool:
    pool = BlockPool(SPEC, BIG)
    gen = torch.Generator().manual_seed(0)
    pool.segments[0].copy_(torch.randn(pool.segments[0].shape, generator=gen))
    return pool


def test_gather_kv_allocates_only_the_sequences_blocks(big_pool):
    view = big_pool.layer_view(1)  # [N, 2, H, T, D], strided inside the pool
    layer_bytes = view[:, 0].numel() * 4
    assert layer_bytes >= 500 * _sequence_bytes()  # so the bound below tells the two apart
    largest = _largest_allocation(lambda: gather_kv(view[:, 0], view[:, 1], TABLE, SEQ_LEN))
    assert 0 < largest <= _sequence_bytes(), (largest, layer_bytes)


def test_decode_attention_allocation_does_not_follow_the_pool(big_pool):
    """paged_attention (the reference behind the kernels, the engine and direct=True) and BlockPool.gather."""
    view = big_pool.layer_view(2)
    query = torch.randn(1, 4, 1, SPEC.head_dim, generator=torch.Generator().manual_seed(1))
    bound = 4 * _sequence_bytes()  # the gathered K and V plus small score tensors

    def attend() -> None:
        paged_attention(query, view[:, 0], view[:, 1], TABLE[None], torch.tensor([SEQ_LEN]))

    assert _largest_allocation(attend) <= bound
    assert _largest_allocation(lambda: big_pool.gather(2, TABLE, SEQ_LEN)) <= 2 * _sequence_bytes()


def test_attend_sequences_allocation_does_not_follow_the_pool():
    """The engine's and PagedCache.attend's path, over a real PagedKV: the same bytes in a 16x larger pool."""
    largest = {}
    for blocks in (64, 64 * 16):
        kv = PagedKV(SPEC, blocks)
        seq = kv.new_sequence()
        gen = torch.Generator().manual_seed(2)
        for layer in range(SPEC.num_layers):
            k = torch.randn(SPEC.num_kv_heads, 40, SPEC.head_dim, generator=gen)
            seq.append(layer, k, k + 1)
        query = torch.randn(1, 4, 1, SPEC.head_dim, generator=gen)
        largest[blocks] = _largest_allocation(lambda: attend_sequences(query, [seq], 1))  # noqa: B023
        seq.free()
    assert largest[64 * 16] == largest[64]


def test_gather_kv_equals_a_per_block_reference(big_pool):
    view = big_pool.layer_view(0)
    k, v = gather_kv(view[:, 0], view[:, 1], TABLE, SEQ_LEN)  # [H, S, D]
    want_k = torch.cat([view[b, 0] for b in TABLE.tolist()], dim=1)[:, :SEQ_LEN]  # blocks [H, T, D] one by one
    want_v = torch.cat([view[b, 1] for b in TABLE.tolist()], dim=1)[:, :SEQ_LEN]
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    pool_k, pool_v = big_pool.gather(0, TABLE, SEQ_LEN)
    assert torch.equal(pool_k, want_k) and torch.equal(pool_v, want_v)


def test_scattered_table_takes_one_indexed_copy_and_stays_bounded(big_pool):
    """More runs than the run-copy path takes: index_select over the block dimension, then one re-layout —
    still only the sequence's bytes, and equal to the per-block reference."""
    table = torch.randperm(BIG, generator=torch.Generator().manual_seed(3))[:40]  # 40 scattered blocks
    seq_len = 40 * SPEC.block_size - 3
    view = big_pool.layer_view(1)
    k, _v = gather_kv(view[:, 0], view[:, 1], table, seq_len)
    want = torch.cat([view[b, 0] for b in table.tolist()], dim=1)[:, :seq_len]
    assert torch.equal(k, want)
    seq_bytes = 40 * SPEC.num_kv_heads * SPEC.block_size * SPEC.head_dim * 4
    largest = _largest_allocation(lambda: gather_kv(view[:, 0], view[:, 1], table, seq_len))
    assert largest <= seq_bytes


def test_reused_gather_equals_a_fresh_one(big_pool):
    """paged_attention gathers into per-thread scratch buffers (decode steps reuse their pages)."""
    view = big_pool.layer_view(0)
    fresh = [t.clone() for t in gather_kv(view[:, 0], view[:, 1], TABLE, SEQ_LEN)]
    reused = gather_kv(view[:, 0], view[:, 1], TABLE, SEQ_LEN, reuse=True)
    assert all(torch.equal(a, b) for a, b in zip(fresh, reused))
    again = gather_kv(view[:, 0], view[:, 1], TABLE[:2], 20, reuse=True)  # the same scratch, a smaller view
    assert again[0].data_ptr() == reused[0].data_ptr() and torch.equal(again[0], fresh[0][:, :20])


def test_reused_gather_works_in_and_out_of_inference_mode(big_pool):
    view = big_pool.layer_view(2)
    with torch.inference_mode():
        inside = gather_kv(view[:, 0], view[:, 1], TABLE, SEQ_LEN, reuse=True)[0].clone()
    outside = gather_kv(view[:, 0], view[:, 1], TABLE, SEQ_LEN, reuse=True)[0]  # the scratch made above
    assert torch.equal(inside, outside)
