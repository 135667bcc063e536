"""Multi-segment pools that grow (issue 15 item 2): ``PagedKV.grow`` appends a pool segment and extends the
allocator's free list with the next block ids; everything written before stays, every failure changes nothing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memos_ref.errors import (
    ArgumentTypeError,
    ConfigError,
    DeviceError,
    DTypeError,
    InvalidArgumentError,
    StateError,
)
from memos_ref.paged import BlockAllocator, BlockPool, PagedKV
from memos_ref.paged.allocator import ALLOCATED, CACHED, EVICTED, FREED, STORED
from memos_ref.paged.check import check_invariants
from memos_ref.spec import KVSpec

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=8)


def _kv(seed: int, ids: list[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic K/V ``[H, n, D]`` for tokens ``ids`` at positions 0.. of one layer."""
    g = torch.Generator().manual_seed(seed * 1000 + layer)
    k = torch.randn(SPEC.num_kv_heads, len(ids), SPEC.head_dim, generator=g)
    return k, -k + 0.5


def _write(seq, ids: list[int], seed: int) -> None:
    """Append ``ids`` to ``seq`` writing K/V in every layer (the K/V of position p depend on seed and p)."""
    start = seq.num_tokens
    for layer in range(SPEC.num_layers):
        k, v = _kv(seed, list(range(start + len(ids))), layer)
        seq.append(layer, k[:, start:], v[:, start:], token_ids=ids)


def _dense(seq) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [seq.to_dense(layer) for layer in range(SPEC.num_layers)]


def _snapshot(kv: PagedKV) -> tuple:
    a = kv.allocator
    return (
        a.num_blocks,
        kv.pool.num_blocks,
        len(kv.pool.segments),
        a.free_blocks(),
        a.cached_blocks(),
        a.refcount.tolist(),
        bytes(a.state),
        bytes(a.cacheable),
        a.indexed_blocks(),
        [seg.clone() for seg in kv.pool.segments],
    )


def _same(a: tuple, b: tuple) -> bool:
    return a[:-1] == b[:-1] and len(a[-1]) == len(b[-1]) and all(torch.equal(x, y) for x, y in zip(a[-1], b[-1]))


def _run(kv: PagedKV, grow_at: int | None) -> list:
    """Three sequences written in steps (two sharing a prompt prefix); ``grow_at``: grow by 6 after that step."""
    steps = [
        (0, list(range(20))),  # seq 0: 3 blocks
        (1, list(range(12))),  # seq 1 shares the first full block of seq 0 via the prefix cache
        (0, list(range(20, 38))),
        (2, list(range(100, 126))),
        (1, list(range(50, 64))),
    ]
    seqs: dict[int, object] = {}
    for i, (who, ids) in enumerate(steps):
        if who not in seqs:
            seqs[who] = kv.start_from_prefix(ids)
            ids = ids[seqs[who].num_tokens :]
        _write(seqs[who], ids, seed=who)
        if grow_at == i:
            kv.grow(6)
        kv.check()
    return [_dense(seqs[w]) for w in sorted(seqs)]


def test_grow_then_write_and_gather_across_segments_equals_a_single_segment_pool():
    grown = PagedKV(SPEC, 9)  # too small for the whole run: it grows after step 1 (blocks 9..14 new)
    oracle = PagedKV(SPEC, 15)
    got, want = _run(grown, grow_at=1), _run(oracle, grow_at=None)
    assert len(grown.pool.segments) == 2 and grown.pool.num_blocks == grown.allocator.num_blocks == 15
    assert any(b >= 9 for seq in grown.sequences.values() for b in seq.block_table)  # the new segment is used
    for g, w in zip(got, want):
        for (gk, gv), (wk, wv) in zip(g, w):
            assert torch.equal(gk, wk) and torch.equal(gv, wv)


def test_new_ids_follow_the_old_at_the_back_of_the_free_list():
    kv = PagedKV(SPEC, 4)
    seq = kv.new_sequence()
    _write(seq, list(range(17)), seed=0)  # blocks 0, 1, 2
    assert kv.grow(3) == range(4, 7)
    assert kv.allocator.free_blocks() == [3, 4, 5, 6]
    assert kv.allocator.num_free == 4 and kv.allocator.num_active == 3 and kv.allocator.num_cached == 0
    assert [int(x) for x in kv.allocator.refcount] == [1, 1, 1, 0, 0, 0, 0]
    taken = kv.allocator.allocate(4)
    assert taken == [3, 4, 5, 6]
    kv.allocator.free_many(taken)
    kv.check()


def test_prefix_sharing_across_the_segment_boundary():
    kv = PagedKV(SPEC, 2)
    first = kv.new_sequence()
    _write(first, list(range(16)), seed=3)  # blocks 0, 1: the whole first segment
    kv.grow(4)
    _write(first, list(range(16, 33)), seed=3)  # blocks 2, 3 (new segment) full, 4 partial
    assert first.block_table == [0, 1, 2, 3, 4]
    before = _dense(first)
    first.free()  # 0..3 stay cached (full, registered); 4 is freed
    assert kv.allocator.num_cached == 4 and kv.allocator.num_free == 2
    second = kv.start_from_prefix(list(range(33)))
    assert second.block_table == [0, 1, 2, 3] and second.num_tokens == 32  # reused across the boundary
    assert [int(kv.allocator.refcount[b]) for b in range(6)] == [1, 1, 1, 1, 0, 0]
    _write(second, [32], seed=3)
    for (bk, bv), (sk, sv) in zip(before, _dense(second)):
        assert torch.equal(bk, sk) and torch.equal(bv, sv)
    third = kv.start_from_prefix(list(range(25)))  # shares blocks 0..1 and the new-segment block 2
    assert third.block_table == [0, 1, 2] and [int(kv.allocator.refcount[b]) for b in (0, 1, 2, 3)] == [2, 2, 2, 1]
    kv.check()


def test_events_name_the_new_blocks_after_growth():
    kv = PagedKV(SPEC, 2)
    queue = kv.allocator.subscribe()
    kv.grow(2)
    assert queue.drain() == []  # growth itself changes no block's state: nothing to report
    seq = kv.new_sequence()
    _write(seq, list(range(32)), seed=1)  # blocks 0..3, all full and registered
    events = queue.drain()
    assert [(e.kind, e.block) for e in events if e.kind == STORED] == [(STORED, b) for b in range(4)]
    assert sum(e.count for e in events if e.kind == ALLOCATED) == 4
    seq.free()
    assert [(e.kind, e.block) for e in queue.drain()] == [(CACHED, b) for b in (3, 2, 1, 0)]
    other = kv.new_sequence()
    _write(other, list(range(900, 909)), seed=2)  # evicts the least recently used: 3 then 2
    kinds = [(e.kind, e.block) for e in queue.drain() if e.kind != ALLOCATED]
    assert kinds[:2] == [(EVICTED, 3), (EVICTED, 2)]
    other.free()
    assert (FREED, 2) in [(e.kind, e.block) for e in queue.drain()]  # the partial block, not cacheable
    kv.check()


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"n_blocks": 0}, InvalidArgumentError),
        ({"n_blocks": -3}, InvalidArgumentError),
        ({"n_blocks": 1.5}, ArgumentTypeError),
        ({"n_blocks": True}, ArgumentTypeError),
        ({"n_blocks": "4"}, ArgumentTypeError),
        ({"n_blocks": 2, "dtype": torch.float16}, DTypeError),
        ({"n_blocks": 2, "device": "meta"}, DeviceError),
        ({"n_blocks": 2, "device": "nonsense"}, DeviceError),  # not a device at all (was a raw RuntimeError)
    ],
)
def test_a_failed_grow_changes_nothing(kwargs, error):
    kv = PagedKV(SPEC, 3)
    seq = kv.new_sequence()
    _write(seq, list(range(12)), seed=0)
    kv.new_sequence().free()
    before = _snapshot(kv)
    with pytest.raises(error):
        kv.grow(**kwargs)
    assert _same(_snapshot(kv), before)
    kv.check()


def test_grow_out_of_memory_in_the_allocator_rolls_the_pool_back(monkeypatch):
    kv = PagedKV(SPEC, 3)
    _write(kv.new_sequence(), list(range(6)), seed=0)
    before = _snapshot(kv)

    def fail(n):
        raise MemoryError("simulated")

    monkeypatch.setattr(kv.allocator, "grow", fail)
    with pytest.raises(MemoryError):
        kv.grow(4)
    assert _same(_snapshot(kv), before)


def test_a_quantized_pool_refuses_to_grow_and_is_unchanged():
    from memos_ref.quant import FP8E4M3

    kv = PagedKV(SPEC, 4, quant=FP8E4M3(), prefix_caching=False)
    free = kv.allocator.free_blocks()
    with pytest.raises(ConfigError, match="cannot grow"):
        kv.grow(2)
    assert kv.allocator.num_blocks == kv.pool.num_blocks == 4 and kv.allocator.free_blocks() == free


def test_pool_grow_and_shrink_are_exact():
    pool = BlockPool(SPEC, 3)
    ids = pool.grow(2)
    assert ids == range(3, 5) and len(pool.segments) == 2
    with pytest.raises(InvalidArgumentError):
        pool.shrink(range(0, 3))  # not the last grown segment
    pool.shrink(ids)
    assert pool.num_blocks == 3 and len(pool.segments) == 1
    with pytest.raises(InvalidArgumentError):
        pool.shrink(range(0, 3))  # the first segment never goes


def test_the_allocator_of_a_pagedkv_cannot_outgrow_its_pool():
    kv = PagedKV(SPEC, 2, prefix_caching=False)
    with pytest.raises(ConfigError, match="storage holds 2 blocks"):
        kv.allocator.grow(2)  # alone, without the pool: the ids would have no memory
    assert kv.allocator.num_blocks == kv.pool.num_blocks == 2 and kv.allocator.free_blocks() == [0, 1]
    assert kv.grow(2) == range(2, 4)  # together they still grow
    assert kv.allocator.num_blocks == kv.pool.num_blocks == 4
    kv.check()


def _apart() -> PagedKV:
    """A PagedKV whose allocator holds 4 blocks and pool 2 (the pool's last segment dropped behind its back)."""
    kv = PagedKV(SPEC, 2, prefix_caching=False)
    kv.pool.shrink(kv.grow(2))
    assert (kv.allocator.num_blocks, kv.pool.num_blocks) == (4, 2)
    return kv


def test_a_sequence_write_past_the_pool_is_refused_and_gives_back_its_blocks():
    kv = _apart()
    seq = kv.new_sequence()
    _write(seq, list(range(4)), seed=0)  # block 0
    k, v = _kv(0, list(range(24)), 0)
    with pytest.raises(StateError, match="pool holds 2 blocks and the allocator 4"):
        seq.append(0, k[:, 4:], v[:, 4:])  # 20 more tokens: blocks 1 and 2; block 2 has no memory
    assert seq.num_tokens == 4 and seq.layer_tokens == [4, 4] and seq.block_table == [0]
    assert kv.allocator.num_active == 1 and kv.allocator.num_available == 3
    kv.check()


def test_the_allocator_refuses_a_bad_growth_unchanged():
    alloc = BlockAllocator(3)
    blocks = alloc.allocate(2)
    state = (alloc.free_blocks(), alloc.refcount.tolist(), bytes(alloc.state), alloc.num_blocks)
    for bad in (0, -1, 2.0, True, None):
        with pytest.raises((ArgumentTypeError, InvalidArgumentError)):
            alloc.grow(bad)  # type: ignore[arg-type]
    assert (alloc.free_blocks(), alloc.refcount.tolist(), bytes(alloc.state), alloc.num_blocks) == state
    alloc.free_many(blocks)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "cache", "grow"]), st.integers(0, 5)), max_size=40))
def test_growth_keeps_the_free_list_a_fifo_over_all_ids(ops):
    """Against a model: allocation takes the front of the free list (then the oldest cached block), a free
    appends to the back (cached if indexed), growth appends the next ids; invariants hold after every step."""
    alloc = BlockAllocator(2)
    free, cached, held, total = list(range(2)), [], [], 2
    indexed: set[int] = set()
    for op, k in ops:
        if op == "alloc" and k <= len(free) + len(cached):
            got = alloc.allocate(k)
            want = []
            for _ in range(k):
                if free:
                    want.append(free.pop(0))
                else:
                    b = cached.pop(0)
                    indexed.discard(b)
                    want.append(b)
            assert got == want
            held.extend(got)
        elif op == "free" and held:
            b = held.pop(k % len(held))
            alloc.free(b)
            (cached if b in indexed else free).append(b)
        elif op == "cache" and held:
            b = held[k % len(held)]
            if b not in indexed and alloc.cache_block(b, b"h%d" % b, [b] * 4):
                indexed.add(b)
        elif op == "grow" and k:
            assert alloc.grow(k) == range(total, total + k)
            free.extend(range(total, total + k))
            total += k
        assert alloc.free_blocks() == free and alloc.cached_blocks() == cached and alloc.num_blocks == total
        holder = SimpleNamespace(seq_id=0, block_table=held, num_tokens=0, block_size=8, pool=None, window_start=0)
        check_invariants(alloc, [holder], None)  # type: ignore[list-item]
