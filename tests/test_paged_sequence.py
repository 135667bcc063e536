"""SequenceCache and PrefixCache: contents equal a dense cache; fork, copy-on-write, truncate; prefix reuse."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memos_ref.errors import ConfigError, InvalidArgumentError, OutOfBlocksError
from memos_ref.paged import PagedKV, block_hashes
from memos_ref.spec import KVSpec

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=8)


def _append(seq, n, gen, ids=None):
    """Append n tokens to every layer; return the K/V written, per layer [H, n, D]."""
    written = []
    for layer in range(SPEC.num_layers):
        k, v = torch.randn(2, 2, n, 4, generator=gen).unbind(0)
        seq.append(layer, k, v, ids)
        written.append((k, v))
    return written


@settings(max_examples=40, deadline=None)
@given(chunks=st.lists(st.integers(1, 20), min_size=1, max_size=8), segments=st.integers(1, 3))
def test_appends_equal_a_dense_concat(chunks, segments):
    kv = PagedKV(SPEC, 32, segments=segments)
    seq, gen = kv.new_sequence(), torch.Generator().manual_seed(sum(chunks))
    dense = [[], []]
    for n in chunks:
        for layer, (k, v) in enumerate(_append(seq, n, gen)):
            dense[layer].append((k, v))
    total = sum(chunks)
    assert seq.num_tokens == total and seq.num_blocks == -(-total // 8)
    for layer in range(2):
        k, v = seq.to_dense(layer)
        assert torch.equal(k, torch.cat([a for a, _ in dense[layer]], dim=1))
        assert torch.equal(v, torch.cat([b for _, b in dense[layer]], dim=1))
    kv.check()


def test_fork_shares_blocks_and_copies_the_tail_on_first_write():
    kv, gen = PagedKV(SPEC, 16), torch.Generator().manual_seed(0)
    parent = kv.new_sequence()
    _append(parent, 12, gen)  # one full block + 4 tokens in the tail
    before = [parent.to_dense(layer) for layer in range(2)]
    child = parent.fork()
    assert child.block_table == parent.block_table
    assert all(kv.allocator.refcount[b] == 2 for b in parent.block_table)
    kv.check()
    _append(child, 3, gen)  # writes into the shared tail: copy-on-write
    assert child.cow_copies == 1 and child.block_table[0] == parent.block_table[0]
    assert child.block_table[1] != parent.block_table[1]
    for layer in range(2):  # the parent did not change
        assert torch.equal(parent.to_dense(layer)[0], before[layer][0])
        assert torch.equal(child.to_dense(layer)[0][:, :12], before[layer][0])
    kv.check()
    parent.free()
    child.free()
    assert kv.allocator.num_free == 16
    kv.check()


def test_truncate_then_append_and_mid_step_errors():
    kv, gen = PagedKV(SPEC, 8), torch.Generator().manual_seed(1)
    seq = kv.new_sequence()
    _append(seq, 20, gen)
    seq.truncate(9)
    assert seq.num_tokens == 9 and seq.num_blocks == 2 and kv.allocator.num_active == 2
    _append(seq, 10, gen)
    assert seq.num_tokens == 19
    k, _ = torch.randn(2, 2, 1, 4, generator=gen).unbind(0)
    seq.append(0, k, k)  # layer 0 ahead of layer 1
    with pytest.raises(ConfigError, match="middle of a model step"):
        seq.fork()
    with pytest.raises(ConfigError, match="same tokens in order"):
        seq.append(1, torch.zeros(2, 2, 4), torch.zeros(2, 2, 4))
    with pytest.raises(InvalidArgumentError, match="n: expected an integer in"):
        seq.truncate(50)


def test_out_of_blocks_leaves_the_sequence_unchanged():
    kv, gen = PagedKV(SPEC, 2), torch.Generator().manual_seed(2)
    seq = kv.new_sequence()
    _append(seq, 10, gen)
    table = list(seq.block_table)
    with pytest.raises(OutOfBlocksError):
        seq.reserve(20)
    assert seq.block_table == table and seq.num_tokens == 10
    kv.check()


def test_prefix_lookup_reuses_whole_blocks_but_never_the_whole_prompt():
    kv, gen = PagedKV(SPEC, 32, fingerprint="model-a"), torch.Generator().manual_seed(3)
    ids = list(range(100, 124))  # 24 tokens = 3 full blocks
    first = kv.new_sequence()
    _append(first, 24, gen, ids)
    assert len(kv.prefix_cache) == 3
    # the same 24-token prompt: only 2 blocks are reused, so at least one token is computed
    again = kv.start_from_prefix(ids)
    assert again.num_tokens == 16 and again.block_table == first.block_table[:2]
    # a longer prompt sharing the prefix reuses all 3 blocks
    longer = kv.start_from_prefix([*ids, 7, 8])
    assert longer.num_tokens == 24
    # the same tokens at another position share nothing (the chain differs)
    shifted = kv.start_from_prefix([0, *ids])
    assert shifted.num_tokens == 0
    stats = kv.prefix_cache.stats()
    assert stats["prefix_hit_tokens"] == 16 + 24 and stats["prefix_query_tokens"] == 24 + 26 + 25
    kv.check()


def test_salts_and_fingerprints_isolate_tenants_and_models():
    ids = list(range(16))
    assert block_hashes(ids, 8) != block_hashes(ids, 8, cache_salt="tenant-b")
    assert block_hashes(ids, 8, fingerprint="m1") != block_hashes(ids, 8, fingerprint="m2")
    assert all(len(h) == 16 for h in block_hashes(ids, 8))  # 128-bit
    kv, gen = PagedKV(SPEC, 16), torch.Generator().manual_seed(4)
    _append(kv.new_sequence(cache_salt="a"), 16, gen, ids)
    assert kv.start_from_prefix([*ids, 1], cache_salt="b").num_tokens == 0
    assert kv.start_from_prefix([*ids, 1], cache_salt="a").num_tokens == 16


def test_a_hash_collision_cannot_return_wrong_blocks(monkeypatch):
    kv, gen = PagedKV(SPEC, 16), torch.Generator().manual_seed(5)
    _append(kv.new_sequence(), 8, gen, list(range(8)))
    # force every prompt to hash like the cached one: the stored token ids must still be compared
    monkeypatch.setattr(kv.prefix_cache, "hashes", lambda ids, salt=None, **_: list(kv.prefix_cache._block_of)[:1])
    assert kv.start_from_prefix([9] * 9).num_tokens == 0


def test_freed_prefix_blocks_stay_cached_until_needed():
    kv, gen = PagedKV(SPEC, 4), torch.Generator().manual_seed(6)
    ids = list(range(16))
    seq = kv.new_sequence()
    _append(seq, 16, gen, ids)
    seq.free()
    assert kv.allocator.num_cached == 2 and kv.allocator.num_free == 2
    hit = kv.start_from_prefix([*ids, 1])  # revived, no recompute
    assert hit.num_tokens == 16 and kv.allocator.num_cached == 0
    hit.free()
    other = kv.new_sequence()
    other.reserve(32)  # needs all 4 blocks: the cached ones are evicted, their hashes forgotten
    assert len(kv.prefix_cache) == 0 and kv.allocator.evictions == 2
    kv.check()


def test_admit_over_a_quantized_pool_with_windows_is_lookup_adopt_advance():
    """admit's general path (a residual window to track): the same tables, windows and holds as the three calls."""
    from memos_ref.quant import FP8E4M3

    def run(fused: bool):
        kv = PagedKV(SPEC, 16, quant=FP8E4M3(), residual_tokens=16, staging_blocks=8, fingerprint="w")
        first = kv.new_sequence()
        first.admit(list(range(40)))
        first.free()
        seq = kv.new_sequence()
        prompt = [*range(32), 7, 7, 7]
        if fused:
            assert seq.admit(prompt) == range(32, 35)
        else:
            seq.adopt_prefix(kv.prefix_cache.lookup(prompt), prompt)
            seq.advance(prompt[seq.num_tokens :])
        kv.check()
        holds = kv.pool.window_holds.tolist()
        return seq.block_table, seq.token_ids, seq.window_start, holds, kv.allocator.indexed_blocks()

    assert run(True) == run(False)


def test_admit_with_unknown_tokens_never_shares_their_blocks():
    """-1 (UNKNOWN_TOKEN) is the design's "token not known" mark (padded positions): admit accepts it, as advance
    does, but a block holding one, and every later block, is never indexed nor matched; -2 is refused."""
    kv = PagedKV(SPEC, 16)
    prompt = list(range(1, 18))  # 17 tokens: two full blocks and one token
    unknown_first = [1, -1, *prompt[2:]]
    a, b = kv.new_sequence(), kv.new_sequence()
    assert a.admit(unknown_first) == range(0, 17) and b.admit(unknown_first) == range(0, 17)
    assert not set(a.block_table) & set(b.block_table)  # nothing shared
    unknown_second = [*prompt[:9], -1, *prompt[10:]]
    c, d = kv.new_sequence(), kv.new_sequence()
    c.admit(prompt)
    assert d.admit(unknown_second) == range(8, 17)  # the first block is reused, the one holding -1 is not
    assert d.block_table[0] == c.block_table[0] and set(d.block_table[1:]).isdisjoint(c.block_table)
    with pytest.raises(InvalidArgumentError, match="got -2"):
        kv.new_sequence().admit([1, -2, 3])
    kv.check()
