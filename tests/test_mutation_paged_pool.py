"""BlockPool, PagedKV.grow/stats, StepBatch and PrefixCache (the paged area's mutation survivors): each test states
what a user relies on, against an oracle kept beside the pool (a dense tensor, counts worked out by hand)."""

from __future__ import annotations

import hashlib
import re
from array import array
from types import SimpleNamespace

import pytest
import torch

from memos_ref.errors import (
    ArgumentTypeError,
    CapacityExceededError,
    ConfigError,
    DeviceError,
    DTypeError,
    InvalidArgumentError,
    InvalidBlockError,
    InvariantError,
    LayerIndexError,
    ShapeError,
    StateError,
)
from memos_ref.paged import BlockAllocator, BlockPool, PagedKV, PrefixCache, block_hashes
from memos_ref.paged.allocator import MAX_BLOCKS, BlockState
from memos_ref.paged.check import check_invariants
from memos_ref.paged.pool import SegmentLayout, gather_blocks
from memos_ref.paged.prefix import pack_token_ids
from memos_ref.paged.step import StepBatch, rollback
from memos_ref.quant import FP8E4M3
from memos_ref.spec import KVSpec

T = 8
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=T)


def _fill(pool: BlockPool, block: int, value: float) -> torch.Tensor:
    """Fill one block with ``value`` through its view; return the dense oracle of that block."""
    pool.block(block).fill_(value)
    return torch.full(SPEC.block_shape, value)


# ---------------------------------------------------------------------------------------------- BlockPool.check_grow
def test_check_grow_names_the_argument_and_refuses_zero_by_its_range():
    """check_grow(0) is an InvalidArgumentError naming the argument (``n`` unless told) and the range >= 1."""
    pool = BlockPool(SPEC, 2)
    with pytest.raises(InvalidArgumentError, match=r"^n: expected an integer in >= 1, got 0$"):
        pool.check_grow(0)
    with pytest.raises(InvalidArgumentError, match=r"^n_blocks: expected an integer in >= 1, got 0$"):
        pool.check_grow(0, "n_blocks")
    with pytest.raises(ArgumentTypeError, match=r"^count: expected int"):
        pool.check_grow(1.5, "count")
    assert pool.check_grow(1) == 1 and pool.num_blocks == 2  # one block is a legal growth; nothing changed


def test_check_grow_allows_exactly_the_room_left_under_max_blocks():
    """The room is MAX_BLOCKS minus the blocks held: one block more is an InvalidArgumentError naming room, cap and
    holding; exactly the room passes the count check and is then refused for the device's memory."""
    pool = BlockPool(SPEC, 3)
    room = MAX_BLOCKS - 3
    msg = rf"^n: expected at most {room} more blocks \(a pool holds at most {MAX_BLOCKS}; it holds 3\), got {room + 1}$"
    with pytest.raises(InvalidArgumentError, match=msg):
        pool.check_grow(room + 1)
    with pytest.raises(CapacityExceededError):  # the count is legal; 2**40 blocks do not fit in memory
        pool.check_grow(room)
    assert pool.num_blocks == 3 and len(pool.segments) == 1


# ---------------------------------------------------------------------------------------------- BlockPool.grow
def test_grow_on_the_pools_own_device_and_dtype_keeps_old_blocks_and_new_ones_are_writable():
    """A pool grown by n blocks (naming its own device and dtype) keeps every old block's K/V and the new ones are
    writable; another dtype or device is refused by name, and the pool is unchanged."""
    pool = BlockPool(SPEC, 3)
    old = [_fill(pool, b, float(b + 1)) for b in range(3)]
    new = pool.grow(2, device="cpu", dtype=torch.float32)
    assert new == range(3, 5) and pool.num_blocks == 5
    new2 = pool.grow(1, device=torch.device("cpu"))
    assert new2 == range(5, 6) and pool.num_blocks == 6
    for b in range(3):
        assert torch.equal(pool.block(b), old[b])
    for b in range(3, 6):
        assert torch.equal(pool.block(b), _fill(pool, b, 10.0 + b))
    msg = r"^a new segment must hold the pool's dtype torch.float32, got torch.float16$"
    with pytest.raises(DTypeError, match=msg):
        pool.grow(1, dtype=torch.float16)
    with pytest.raises(DeviceError, match=r"^a new segment must live on the pool's device cpu, got meta$"):
        pool.grow(1, device="meta")
    with pytest.raises(DeviceError, match=r"^device: a new segment must live on the pool's device cpu, got 'nons"):
        pool.grow(1, device="nonsense")
    assert pool.num_blocks == 6 and len(pool.segments) == 3


# ---------------------------------------------------------------------------------------------- BlockPool.shrink
def test_shrink_drops_only_the_last_segment_and_every_other_block_keeps_its_kv():
    """shrink(ids of the last grow) drops that segment only: the earlier segments (and their K/V) stay, ids before
    it stay valid, and the next grow reuses the dropped ids."""
    pool = BlockPool(SPEC, 2)
    a = pool.grow(3)
    b = pool.grow(2)
    oracle = {blk: _fill(pool, blk, float(blk + 1)) for blk in range(7)}
    pool.shrink(b)
    assert pool.num_blocks == 5 and len(pool.segments) == 2 and pool.layout.starts == (0, 2)
    for blk in range(5):
        assert torch.equal(pool.block(blk), oracle[blk])
    pool.shrink(a)
    assert pool.num_blocks == 2 and len(pool.segments) == 1
    assert pool.grow(4) == range(2, 6)


def test_shrink_refuses_anything_but_the_last_grown_range_and_changes_nothing():
    """A non-range, another range, or the first segment is refused by name (ids), and the pool is unchanged."""
    pool = BlockPool(SPEC, 2)
    pool.grow(3)
    with pytest.raises(ArgumentTypeError, match=r"^ids: expected range"):
        pool.shrink([2, 3, 4])
    msg = r"^ids: only the last grown segment range\(2, 5\) can be dropped \(and never the first segment\), got "
    with pytest.raises(InvalidArgumentError, match=msg + r"range\(2, 4\)$"):
        pool.shrink(range(2, 4))
    pool.shrink(range(2, 5))
    with pytest.raises(InvalidArgumentError, match=r"^ids: only the last grown segment"):
        pool.shrink(range(0, 2))
    assert pool.num_blocks == 2 and len(pool.segments) == 1


# ---------------------------------------------------------------------------------------------- BlockPool.layer_view
def test_layer_view_of_each_segment_is_that_segments_layer_and_a_segment_past_the_end_is_refused_by_name():
    """layer_view(layer, segment) is a view of that segment's layer; segment len(segments) or -1 is an
    InvalidArgumentError naming ``segment`` and the range [0, len - 1]."""
    pool = BlockPool(SPEC, 4, segments=2)
    pool.block(3).fill_(7.0)
    view = pool.layer_view(1, segment=1)
    assert view.shape == (2, 2, 2, T, 4) and torch.equal(view[1], torch.full((2, 2, T, 4), 7.0))
    with pytest.raises(InvalidArgumentError, match=r"^segment: expected an integer in \[0, 1\], got 2$"):
        pool.layer_view(0, segment=2)
    with pytest.raises(InvalidArgumentError, match=r"^segment: expected an integer in \[0, 1\], got -1$"):
        pool.layer_view(0, segment=-1)


# ---------------------------------------------------------------------------------------------- BlockPool.poison
def test_poison_of_an_integer_pool_makes_exactly_that_block_minus_one():
    """poison on an integer pool (no NaN to write) fills exactly that block with -1, the others keep their bytes."""
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.int8, block_size=T)
    pool = BlockPool(spec, 3)
    pool.block(0).fill_(5)
    pool.block(2).fill_(6)
    pool.poison(1)
    assert torch.equal(pool.block(1), torch.full(spec.block_shape, -1, dtype=torch.int8))
    assert torch.equal(pool.block(0), torch.full(spec.block_shape, 5, dtype=torch.int8))
    assert torch.equal(pool.block(2), torch.full(spec.block_shape, 6, dtype=torch.int8))


# ---------------------------------------------------------------------------------------------- StepBatch
FP = "model-m"


def _kv(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K/V ``[B=2, H, n=T, D]`` of one step."""
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, 2, SPEC.num_kv_heads, T, SPEC.head_dim, generator=gen).unbind(0)
    return k, v


def test_resume_writes_each_lagging_layer_over_the_reserved_positions_and_registers_after_the_last():
    """Positions reserved ahead of the layers (with their ids): a resumed batch per layer covers exactly the lagging
    positions (starts, lens, the slots of the rows' tables), stores each row's K/V there, and once the last layer
    catches up the rows' full blocks are registered under the hashes of their ids — not before. A layer asked for
    more tokens than are reserved is a ConfigError saying so."""
    kv = PagedKV(SPEC, 16, fingerprint=FP)
    rows = [kv.new_sequence(), kv.new_sequence()]
    ids = [list(range(100, 100 + T)), list(range(200, 200 + T))]
    for seq, row_ids in zip(rows, ids):
        seq.reserve_positions(T, row_ids)
    for layer in range(SPEC.num_layers):
        batch = StepBatch.resume(rows, layer, T)
        assert batch.resumed is True and batch.starts == [0, 0] and batch.lens == [T, T] and batch.query_len == T
        oracle_slots = [seq.block_table[0] * T + p for seq in rows for p in range(T)]
        assert batch.slot_mapping.tolist() == oracle_slots
        k, v = _kv(layer)
        batch.write(layer, k, v)
        for i, seq in enumerate(rows):
            assert seq.layer_tokens[layer] == T
            dk, dv = seq.to_dense(layer)
            assert torch.equal(dk, k[i]) and torch.equal(dv, v[i])
            registered = kv.allocator.hash_of(seq.block_table[0])
            if layer < SPEC.num_layers - 1:
                assert registered is None  # layer 1 has not written yet
            else:
                assert registered == block_hashes(ids[i], T, fingerprint=FP)[0]
    msg = r"^layer 0 holds 8 tokens and gets 1, but 8 are reserved: layers must write the same tokens in order$"
    with pytest.raises(ConfigError, match=msg):
        StepBatch.resume(rows, 0, 1)


def test_mark_written_by_kernel_counts_only_the_named_layers_and_registers_once_every_layer_is_counted():
    """Counting layers written by a kernel: only the named layers advance; a layer counted twice, named twice, or out
    of range is refused by name with nothing counted; once every layer is counted the rows' full blocks are
    registered under their ids' hashes; and a fresh batch counted with no argument counts every layer."""
    kv = PagedKV(SPEC, 16, fingerprint=FP)
    seq = kv.new_sequence()
    ids = list(range(300, 300 + 2 * T))
    batch = StepBatch.reserve([seq], 2 * T)
    seq.set_token_ids(ids)  # not caught up: recorded, not yet registered
    batch.mark_written_by_kernel([1])
    assert seq.layer_tokens == [0, 2 * T] and batch.written == [False, True] and not batch.complete
    assert [kv.allocator.hash_of(b) for b in seq.block_table] == [None, None]
    with pytest.raises(StateError, match=r"^layer 1 already wrote this step$"):
        batch.mark_written_by_kernel()
    with pytest.raises(StateError, match=r"^layers \[0, 0\]: a layer is written once per step$"):
        batch.mark_written_by_kernel([0, 0])
    with pytest.raises(LayerIndexError):
        batch.mark_written_by_kernel([2])
    assert seq.layer_tokens == [0, 2 * T] and batch.written == [False, True]  # all or none
    batch.mark_written_by_kernel([0])
    assert seq.layer_tokens == [2 * T, 2 * T] and batch.written == [True, True] and batch.complete
    assert [kv.allocator.hash_of(b) for b in seq.block_table] == block_hashes(ids, T, fingerprint=FP)
    other = kv.new_sequence()
    step = StepBatch.reserve([other], 3)
    step.mark_written_by_kernel()
    assert other.layer_tokens == [3, 3] and step.complete


def test_mark_written_by_kernel_refuses_a_row_changed_since_the_step_was_prepared():
    """A row freed, or whose layer another batch already wrote, since this step was prepared: StateError naming the
    sequence, and no layer is counted."""
    kv = PagedKV(SPEC, 16, fingerprint=FP)
    seq = kv.new_sequence()
    batch = StepBatch.reserve([seq], 4)
    other = StepBatch.resume([seq], 0, 4)  # another batch writes layer 0 first
    other.mark_written_by_kernel([0])
    with pytest.raises(StateError, match=rf"^sequence {seq.seq_id} changed since this step was prepared$"):
        batch.mark_written_by_kernel([0])
    assert batch.written == [False, False]
    gone = kv.new_sequence()
    batch2 = StepBatch.reserve([gone], 4)
    gone.free()
    with pytest.raises(StateError, match=rf"^sequence {gone.seq_id} changed since this step was prepared$"):
        batch2.mark_written_by_kernel([0])
    assert batch2.written == [False, False]


def test_mark_written_by_kernel_of_no_layers_changes_nothing():
    """Counting no layers (an empty list) on a resumed batch changes nothing: a caught-up row (ids recorded mid-step,
    the step rolled back, which registered its full block) keeps its tokens and its block's hash."""
    kv = PagedKV(SPEC, 16, fingerprint=FP)
    seq = kv.new_sequence()
    StepBatch.reserve([seq], T).mark_written_by_kernel()  # 8 tokens of unknown ids
    StepBatch.reserve([seq], T)
    seq.set_token_ids(list(range(400, 400 + 2 * T)))  # not caught up: recorded only
    rollback(seq, T)  # the step failed: back to 8 tokens, caught up
    registered = kv.allocator.hash_of(seq.block_table[0])
    assert seq.caught_up and registered is not None
    batch = StepBatch.resume([seq], 0, 0)
    batch.mark_written_by_kernel([])
    assert kv.allocator.hash_of(seq.block_table[0]) == registered and seq.layer_tokens == [T, T]
    assert seq.num_tokens == T and seq.num_registered == 1


# ---------------------------------------------------------------------------------------------- prefix hashing
def _chain(ids: list[int], extra: bytes, parent: bytes = b"") -> list[bytes]:
    """The oracle: BLAKE2b-128 of parent ‖ extra ‖ int64 ids, block by block, written out with hashlib."""
    out = []
    for i in range(len(ids) // T):
        packed = b"".join(x.to_bytes(8, "little", signed=True) for x in ids[i * T : (i + 1) * T])
        parent = hashlib.blake2b(parent + extra + packed, digest_size=16).digest()
        out.append(parent)
    return out


def test_block_hashes_default_to_no_fingerprint_and_continue_a_given_parent():
    """block_hashes without a fingerprint hashes under the empty fingerprint (extra key ``"\\0"``), and a chain
    continued from ``parent`` equals the whole chain's tail: the hashes a sequence stores after its first block."""
    ids = [*range(50, 50 + 2 * T), 7]  # two full blocks and a partial one (no hash)
    whole = block_hashes(ids, T)
    assert whole == _chain(ids, b"\x00") and len(whole) == 2
    assert block_hashes(ids, T) == block_hashes(ids, T, fingerprint="")
    assert block_hashes(ids[T:], T, parent=whole[0]) == [whole[1]] == _chain(ids[T:], b"\x00", whole[0])
    assert block_hashes(ids, T, fingerprint=FP, cache_salt="s") == _chain(ids, b"model-m\x00s")


# ---------------------------------------------------------------------------------------------- PrefixCache
def _cache(num_blocks: int = 6) -> tuple[BlockAllocator, PrefixCache]:
    alloc = BlockAllocator(num_blocks)
    return alloc, PrefixCache(alloc, T, fingerprint=FP)


def test_register_indexes_a_full_block_and_a_lookup_finds_it_only_under_its_own_tokens():
    """A registered full block is in the cache and is what a lookup of its tokens (plus one) returns; the same
    hash on a second block is refused (False, that block stays private); a lookup of other tokens finds nothing;
    a non-bytes hash or a partial block is refused by name; forget drops the block from the index."""
    alloc, cache = _cache()
    ids = list(range(10, 10 + T))
    h = block_hashes(ids, T, fingerprint=FP)[0]
    a, b = alloc.allocate(2)
    assert a not in cache
    assert cache.register(a, h, ids) is True
    assert a in cache and b not in cache and alloc.hash_of(a) == h and alloc.tokens_of(a) == tuple(ids)
    assert cache.register(b, h, ids) is False and b not in cache and alloc.hash_of(b) is None
    assert cache.lookup([*ids, 1]) == [a]
    alloc.free(a)  # the caller's reference from the lookup
    assert cache.lookup([*range(20, 20 + T), 1]) == []
    with pytest.raises(ArgumentTypeError, match=r"^block_hash: expected bytes, got str"):
        cache.register(b, "h", ids)
    msg = r"^only full blocks can be registered: got 7 tokens, block size is 8$"
    with pytest.raises(ShapeError, match=msg):
        cache.register(b, h, ids[:-1])
    cache.forget(a)
    assert a not in cache and alloc.hash_of(a) is None and cache.lookup([*ids, 1]) == []


def test_a_block_id_past_the_pool_is_not_in_the_cache():
    """``in`` answers False (never raises) for any id outside [0, num_blocks), a non-int, or an unindexed block."""
    _, cache = _cache(4)
    assert 4 not in cache and -1 not in cache and 1.0 not in cache and 0 not in cache


def test_lookup_honours_the_salt_and_count_and_names_bad_token_ids():
    """A block registered under a tenant's salt is found only with that salt; count=False keeps a lookup out of
    the statistics; token ids that are not a sequence are refused naming ``token_ids``."""
    alloc, cache = _cache()
    ids = list(range(10, 10 + T))
    (a,) = alloc.allocate(1)
    assert cache.register(a, block_hashes(ids, T, fingerprint=FP, cache_salt="tenant")[0], ids)
    assert cache.lookup([*ids, 1]) == []
    assert cache.lookup([*ids, 1], cache_salt="tenant") == [a]
    before = cache.stats()
    assert before["prefix_queries"] == 2 and before["prefix_hit_tokens"] == T
    assert cache.lookup([*ids, 1], "tenant", count=False) == [a]
    assert cache.stats() == before
    with pytest.raises(ArgumentTypeError, match=r"^token_ids: expected a sequence of int token ids, got str"):
        cache.lookup("abc")


# ---------------------------------------------------------------------------------------------- PagedKV.grow / stats
def test_paged_kv_grow_checks_n_blocks_by_name_before_anything_changes():
    """PagedKV.grow(1) adds one free block to pool and allocator together; a count below 1 or past MAX_BLOCKS is
    an InvalidArgumentError naming ``n_blocks`` — before a pool that cannot grow is even asked — and a quantized
    pool is refused naming its class; a pool grown behind the allocator's back is refused with both counts."""
    kv = PagedKV(SPEC, 4, fingerprint=FP)
    assert kv.grow(1) == range(4, 5) and kv.pool.num_blocks == 5 and kv.allocator.num_blocks == 5
    assert kv.stats()["blocks_free"] == 5
    with pytest.raises(InvalidArgumentError, match=r"^n_blocks: expected an integer in >= 1, got 0$"):
        kv.grow(0)
    with pytest.raises(InvalidArgumentError, match=rf"^n_blocks: expected at most {MAX_BLOCKS - 5} more blocks"):
        kv.grow(MAX_BLOCKS)
    kv.pool.grow(2)  # the pool alone
    msg = r"^the pool holds 7 blocks but the allocator 5: grow them together with PagedKV.grow$"
    with pytest.raises(ConfigError, match=msg):
        kv.grow(1)
    assert kv.pool.num_blocks == 7 and kv.allocator.num_blocks == 5
    quant = PagedKV(SPEC, 4, quant=FP8E4M3(), prefix_caching=False)
    with pytest.raises(InvalidArgumentError, match=r"^n_blocks: expected an integer in >= 1, got 0$"):
        quant.grow(0)
    name = type(quant.pool).__name__
    with pytest.raises(ConfigError, match=rf"^{name} cannot grow: its per-block state is sized once"):
        quant.grow(1)
    assert quant.pool.num_blocks == 4 and quant.allocator.num_blocks == 4


def test_stats_slot_utilization_is_the_tokens_held_over_the_slots_of_the_held_blocks():
    """slot_utilization counts, per held block, the most tokens any holder keeps in it, over the held blocks'
    slots: a 12-token sequence and a fork cut back to 10 (sharing both blocks) hold 8 + max(4, 2) = 12 of 16
    slots; with no sequence it is 1.0. The block counts are the allocator's: 2 active, 6 free."""
    kv = PagedKV(SPEC, 8, fingerprint=FP)
    assert kv.stats()["slot_utilization"] == 1.0
    a = kv.new_sequence()
    a.advance(list(range(100, 112)))
    b = a.fork()
    b.truncate(10)
    assert b.block_table == a.block_table  # both blocks shared
    stats = kv.stats()
    assert stats["slot_utilization"] == 12 / 16
    assert stats["blocks_active"] == 2 and stats["blocks_free"] == 6 and stats["blocks_total"] == 8
    b.free()
    c = kv.new_sequence()
    c.advance(list(range(7)))
    assert kv.stats()["slot_utilization"] == (12 + 7) / 24


def test_debug_mode_poisons_exactly_the_blocks_freed_and_keeps_cached_ones():
    """With debug=True, freeing a sequence fills its private partial block (back on the free list) with NaN, while
    its full block, kept cached for prefix reuse, keeps its K/V and serves the next prompt."""
    kv = PagedKV(SPEC, 4, fingerprint=FP, debug=True)
    seq = kv.new_sequence()
    ids = list(range(500, 500 + T + 3))
    gen = torch.Generator().manual_seed(5)
    keys = []
    for layer in range(SPEC.num_layers):
        k, v = torch.randn(2, SPEC.num_kv_heads, len(ids), SPEC.head_dim, generator=gen).unbind(0)
        seq.append(layer, k, v, ids)
        keys.append(k)
    full, tail = seq.block_table
    seq.free()
    assert torch.isnan(kv.pool.block(tail)).all()
    assert not torch.isnan(kv.pool.block(full)).any()
    again = kv.start_from_prefix([*ids[:T], 1])
    assert again.block_table == [full]
    dk, _ = again.to_dense(0)
    assert torch.equal(dk, keys[0][:, :T])


def test_stats_taken_while_a_sequence_grows_count_its_new_block_as_empty():
    """A stats() call that lands while a sequence is reserving (its new block already in its table, its token count
    not yet raised — a monitoring thread mid-step) counts that block as holding 0 tokens: 8 of 16 slots."""
    kv = PagedKV(SPEC, 4, fingerprint=FP)
    seq = kv.new_sequence()
    seq.advance(list(range(T)))
    seen: list[float] = []

    class _Table(list):
        def extend(self, blocks):
            super().extend(blocks)
            seen.append(kv.stats()["slot_utilization"])

    seq.block_table = _Table(seq.block_table)
    seq.reserve_positions(2, [1, 2])
    assert seen == [T / (2 * T)]
    assert kv.stats()["slot_utilization"] == (T + 2) / (2 * T)


# ---------------------------------------------------------------------------------------------- check_invariants
def _holder(seq_id: int, table: list[int], num_tokens: int, token_ids: list[int] | None = None) -> SimpleNamespace:
    """A stand-in sequence: what check_invariants reads of one (no quantized pool, no window)."""
    ids = token_ids if token_ids is not None else [-1] * num_tokens
    return SimpleNamespace(
        seq_id=seq_id, block_table=table, num_tokens=num_tokens, block_size=T, pool=None, window_start=0, token_ids=ids
    )


def _broken(alloc: BlockAllocator, holders: list, cache: PrefixCache | None = None) -> InvariantError:
    with pytest.raises(InvariantError) as info:
        check_invariants(alloc, holders, cache)
    return info.value


def test_check_invariants_passes_a_consistent_state_with_forks_and_cached_blocks():
    """A live PagedKV — a sequence, a fork sharing its partial tail (refcount 2), a freed sequence whose full block
    stays cached, and a sequence that reuses it — passes check_invariants with its prefix cache."""
    kv = PagedKV(SPEC, 8, fingerprint=FP)
    a = kv.new_sequence()
    a.advance(list(range(100, 112)))
    b = a.fork()
    gone = kv.new_sequence()
    gone.advance(list(range(300, 300 + T + 1)))
    gone.free()
    again = kv.start_from_prefix([*range(300, 300 + T), 5])
    assert kv.allocator.refcount[a.block_table[1]] == 2 and again.block_table
    check_invariants(kv.allocator, [a, b, again], kv.prefix_cache)
    kv.check()


def test_check_invariants_names_a_block_listed_twice_and_a_refcount_that_is_not_the_holders():
    """A table listing a block twice, and a block whose refcount is not its number of holders, are each an
    InvariantError naming those blocks (message and .blocks)."""
    alloc = BlockAllocator(4)
    b0, b1 = alloc.allocate(2)
    err = _broken(alloc, [_holder(7, [b0, b0], 16)])
    assert str(err) == f"sequence 7 lists blocks [{b0}] more than once" and err.blocks == [b0]
    err = _broken(alloc, [_holder(7, [b0], 8)])
    assert str(err) == f"refcount != number of holders for blocks [{b1}] ({b1}: refcount 1 vs 0 holders)"
    assert err.blocks == [b1]
    alloc.incref(b0)
    err = _broken(alloc, [_holder(7, [b0, b1], 16)])
    assert str(err) == f"refcount != number of holders for blocks [{b0}] ({b0}: refcount 2 vs 1 holders)"


def test_check_invariants_names_held_blocks_that_are_not_active_and_lists_out_of_step_with_states():
    """A held block marked cached, a free-list block marked active, a cached-list block marked active, a block in no
    known state, and a cached block without a prefix: each is an InvariantError saying which."""
    alloc = BlockAllocator(4)
    (b0,) = alloc.allocate(1)
    alloc.state[b0] = BlockState.CACHED
    err = _broken(alloc, [_holder(1, [b0], 3)])
    assert str(err) == f"blocks [{b0}] are held by a sequence but are free or cached" and err.blocks == [b0]
    alloc.state[b0] = BlockState.ACTIVE
    check_invariants(alloc, [_holder(1, [b0], 3)])
    free = alloc.free_blocks()
    alloc.state[free[0]] = BlockState.ACTIVE
    err = _broken(alloc, [_holder(1, [b0], 3)])
    assert str(err) == "the free list does not hold exactly the free blocks" and err.blocks == [free[0]]
    alloc.state[free[0]] = BlockState.FREE

    alloc2 = BlockAllocator(4)
    (c,) = alloc2.allocate(1)
    assert alloc2.cache_block(c, b"h" * 16, list(range(T)))
    alloc2.free(c)  # cached, refcount 0
    check_invariants(alloc2, [])
    alloc2.state[c] = BlockState.ACTIVE
    assert str(_broken(alloc2, [])) == "the cached list does not hold exactly the cached blocks"
    alloc2.state[c] = BlockState.CACHED
    alloc2.cacheable[c] = 0
    err = _broken(alloc2, [])
    assert str(err) == f"cached blocks [{c}] have holders or no prefix" and err.blocks == [c]

    alloc3 = BlockAllocator(4)
    (d,) = alloc3.allocate(1)
    alloc3.refcount[d] = 0
    alloc3.state[d] = 9  # in no state: not on the free list, not active, not cached
    assert str(_broken(alloc3, [])) == "free + active + cached != total"


def test_check_invariants_names_an_indexed_block_not_cacheable_and_a_holder_with_other_token_ids():
    """A held block in the prefix index but not marked cacheable, and a holder whose token ids differ from those
    the index verified for its block, are InvariantErrors naming the block; a holder with unknown ids or a partial
    block is not compared."""
    alloc = BlockAllocator(4)
    cache = PrefixCache(alloc, T, fingerprint=FP)
    (b,) = alloc.allocate(1)
    ids = list(range(40, 40 + T))
    assert cache.register(b, block_hashes(ids, T, fingerprint=FP)[0], ids)
    check_invariants(alloc, [_holder(2, [b], T, ids)], cache)
    check_invariants(alloc, [_holder(2, [b], T, [-1] * T)], cache)  # unknown ids: not compared
    check_invariants(alloc, [_holder(2, [b], T - 1, ids[:-1])], cache)  # a partial block: not compared
    err = _broken(alloc, [_holder(2, [b], T, [*ids[:-1], 99])], cache)
    assert str(err) == f"sequence 2 holds prefix-cached block {b} with other token ids" and err.blocks == [b]
    check_invariants(alloc, [_holder(2, [b], T, [*ids[:-1], 99])])  # without the cache: not compared
    alloc.cacheable[b] = 0
    err = _broken(alloc, [_holder(2, [b], T, ids)])
    assert str(err) == f"indexed blocks [{b}] are not marked cacheable" and err.blocks == [b]


def test_check_invariants_lists_at_most_eight_blocks_with_each_ones_counts():
    """Ten blocks whose refcount is not their holders: the message names the first eight, each with its refcount
    and holders, and .blocks carries all ten."""
    alloc = BlockAllocator(10)
    alloc.allocate(10)
    err = _broken(alloc, [])
    detail = ", ".join(f"{b}: refcount 1 vs 0 holders" for b in range(8))
    assert str(err) == f"refcount != number of holders for blocks {list(range(8))} ({detail})"
    assert err.blocks == list(range(10))


def test_check_invariants_compares_every_full_block_of_a_holder_with_the_indexed_ids():
    """A holder of two indexed blocks whose first block's ids differ from the indexed ones is caught (not only the
    last block)."""
    alloc = BlockAllocator(4)
    cache = PrefixCache(alloc, T, fingerprint=FP)
    ids = list(range(60, 60 + 2 * T))
    blocks = alloc.allocate(2)
    for block, h, i in zip(blocks, block_hashes(ids, T, fingerprint=FP), range(2)):
        assert cache.register(block, h, ids[i * T : (i + 1) * T])
    check_invariants(alloc, [_holder(3, blocks, 2 * T, ids)], cache)
    err = _broken(alloc, [_holder(3, blocks, 2 * T, [99, *ids[1:]])], cache)
    assert str(err) == f"sequence 3 holds prefix-cached block {blocks[0]} with other token ids"


def test_check_invariants_names_indexed_free_blocks_and_an_index_out_of_step_with_its_hashes():
    """A block on the free list that is still indexed, a block indexed under a hash that names another block, and
    an index whose count differs from its blocks' hashes: each an InvariantError naming the blocks."""
    alloc = BlockAllocator(4)
    f = alloc.free_blocks()[0]
    alloc.state[f] = BlockState.ACTIVE  # so the allocator takes it into the index, then back to free
    assert alloc.cache_block(f, b"s" * 16, list(range(T)))
    alloc.state[f] = BlockState.FREE
    err = _broken(alloc, [])
    assert str(err) == f"prefix-cached blocks [{f}] are on the free list" and err.blocks == [f]

    alloc2 = BlockAllocator(4)
    b1, b2 = alloc2.allocate(2)
    h = b"a" * 16
    assert alloc2.cache_block(b1, h, list(range(T)))
    holders = [_holder(1, [b1], T), _holder(2, [b2], T)]
    check_invariants(alloc2, holders)
    alloc2.hash_by_block[b2] = h  # b2 claims b1's hash
    alloc2.cacheable[b2] = 1
    err = _broken(alloc2, holders)
    assert str(err) == f"the hash index and the blocks' hashes disagree for blocks [{b2}]" and err.blocks == [b2]
    del alloc2.hash_by_block[b2]
    del alloc2.hash_by_block[b1]  # the index still counts b1's hash, no block names it
    err = _broken(alloc2, holders)
    assert str(err) == "the hash index and the blocks' hashes disagree for blocks []" and err.blocks == []


def test_check_invariants_checks_residual_window_holds_and_staging_slots_of_a_quantized_pool():
    """Over a quantized pool with residual windows: a consistent state passes; window holds that differ from the
    sequences' windows name the blocks (first eight, each 'holds vs want'); a free block keeping a staging slot
    (slot 0 included) is named too."""
    kv = PagedKV(SPEC, 12, quant=FP8E4M3(), residual_tokens=32, staging_blocks=4, prefix_caching=False)
    seq = kv.new_sequence()
    for layer in range(SPEC.num_layers):
        seq.append(layer, torch.ones(SPEC.num_kv_heads, 2 * T + 3, SPEC.head_dim), torch.ones(2, 2 * T + 3, 4))
    pool, alloc = kv.pool, kv.allocator
    held = seq.block_table
    assert len(held) == 3 and all(int(pool.window_holds[b]) == 1 for b in held)
    check_invariants(alloc, [seq])
    kv.check()
    free = alloc.free_blocks()
    assert len(free) == 9
    saved = pool.window_holds.clone()
    pool.window_holds[held[0]] = 2
    pool.window_holds[free[0]] = 1
    bad = sorted([held[0], free[0]])
    detail = ", ".join(f"{b}: {2 if b == held[0] else 1} vs {1 if b == held[0] else 0}" for b in bad)
    err = _broken(alloc, [seq])
    assert str(err) == f"window holds disagree with the sequences' windows for blocks {bad} ({detail})"
    assert err.blocks == bad
    pool.window_holds.copy_(saved)
    pool.window_holds[free] = 1
    err = _broken(alloc, [seq])
    assert str(err).startswith(f"window holds disagree with the sequences' windows for blocks {sorted(free)[:8]} (")
    assert len(err.blocks) == 9 and str(err).count(" vs ") == 8
    pool.window_holds.copy_(saved)
    check_invariants(alloc, [seq])
    saved = pool.staging_slot.clone()
    pool.staging_slot[free[0]] = 0
    err = _broken(alloc, [seq])
    assert str(err) == f"free blocks [{free[0]}] still hold staging slots" and err.blocks == [free[0]]
    pool.staging_slot[free] = 0
    err = _broken(alloc, [seq])
    assert str(err) == f"free blocks {sorted(free)[:8]} still hold staging slots" and len(err.blocks) == 9
    pool.staging_slot.copy_(saved)
    check_invariants(alloc, [seq])


def test_check_invariants_checks_the_windows_of_every_quantized_pool_among_the_sequences():
    """Sequences over two windowed pools: the window holds of each pool are checked, not only the last one seen."""
    kvs = [PagedKV(SPEC, 6, quant=FP8E4M3(), residual_tokens=32, staging_blocks=2, prefix_caching=False) for _ in "ab"]
    first = kvs[0].new_sequence()
    for layer in range(SPEC.num_layers):
        first.append(layer, torch.ones(SPEC.num_kv_heads, 3, SPEC.head_dim), torch.ones(2, 3, 4))
    empty = kvs[1].new_sequence()  # holds no block of the shared allocator
    check_invariants(kvs[0].allocator, [first, empty])
    kvs[0].pool.window_holds[5] = 1
    err = _broken(kvs[0].allocator, [first, empty])
    assert err.blocks == [5]


# ---------------------------------------------------------------------------------------------- long writes, token ids
def test_a_long_write_checks_its_slots_and_stores_all_but_the_skipped_ones():
    """A write of more than DIRECT_WRITE_TOKENS tokens (one indexed store): slot -1 skips its token and the others
    land at block·T + offset; a float or misshapen slot tensor, or any slot below -1 or at/after the pool's end, is
    refused naming the first four bad slots, with nothing written."""
    pool = BlockPool(SPEC, 10)
    n = BlockPool.DIRECT_WRITE_TOKENS + 6  # 70
    gen = torch.Generator().manual_seed(3)
    key, value = torch.randn(2, n, SPEC.num_kv_heads, SPEC.head_dim, generator=gen).unbind(0)
    slots = torch.arange(n)
    slots[5] = -1
    pool.write(1, slots, key, value)
    for p in range(n):
        got = pool.block(p // T)[1, 0, :, p % T]  # layer 1's K of that slot, [H, D]
        assert torch.equal(got, torch.zeros_like(got) if p == 5 else key[p])
    limit = 10 * T
    bad = torch.zeros(n, dtype=torch.long)
    bad[1:8] = torch.tensor([-1, -2, limit, limit + 1, limit + 2, limit + 3, 0])
    msg = rf"^slots: expected -1 \(skip\) or a slot in \[0, {limit}\), got \[-2, {limit}, {limit + 1}, {limit + 2}\]$"
    with pytest.raises(InvalidArgumentError, match=msg):
        pool.write(0, bad, key, value)
    past = torch.arange(n)
    past[9] = limit  # one slot just past the end, all others valid
    with pytest.raises(InvalidArgumentError, match=rf"got \[{limit}\]$"):
        pool.write(0, past, key, value)
    with pytest.raises(ArgumentTypeError, match=r"^slots: expected an integer tensor, got dtype torch.float32$"):
        pool.write(0, slots.float(), key, value)
    with pytest.raises(ShapeError, match=rf"^slots must be \[{n}\], got \({n - 1},\)$"):
        pool.write(0, slots[1:], key, value)
    assert torch.count_nonzero(pool.layer_view(0)) == 0


def test_pack_token_ids_of_a_long_prompt_packs_int64_and_names_a_bad_id():
    """pack_token_ids: a long list (vectorised minimum) with unknown ids (-1) is packed as int64 unchanged; a long
    list holding -2 is refused naming the argument and the id; a tensor of ids (the general path) packs the same
    bytes, -1 included."""
    ids = [*range(600), -1]
    out, packed = pack_token_ids("prompt", ids)
    assert out == ids and packed == array("q", ids).tobytes()
    with pytest.raises(InvalidArgumentError, match=r"^prompt: token ids must lie in \[0, 2\*\*63\) .*got -2$"):
        pack_token_ids("prompt", [*range(600), -2])
    with pytest.raises(InvalidArgumentError, match=r"^prompt: token ids must lie in \[0, 2\*\*63\) .*got -2$"):
        pack_token_ids("prompt", [5, -2])
    out, packed = pack_token_ids("prompt", torch.tensor([-1, 5, 7]))
    assert out == [-1, 5, 7] and packed == array("q", [-1, 5, 7]).tobytes()


def test_prefix_cache_stats_report_queries_tokens_hits_rate_and_cached_blocks():
    """PrefixCache.stats: exactly these keys; before any query the hit rate is 0.0; after a hit of one block in a
    9-token query and a miss of 5 tokens, 8 hit tokens of 14 queried."""
    alloc, cache = _cache()
    assert cache.stats() == {
        "prefix_queries": 0,
        "prefix_query_tokens": 0,
        "prefix_hit_tokens": 0,
        "prefix_hit_rate": 0.0,
        "prefix_cached_blocks": 0,
    }
    ids = list(range(10, 10 + T))
    (a,) = alloc.allocate(1)
    cache.register(a, block_hashes(ids, T, fingerprint=FP)[0], ids)
    assert cache.lookup([*ids, 1]) == [a]
    assert cache.lookup([1, 2, 3, 4, 5]) == []
    assert cache.stats() == {
        "prefix_queries": 2,
        "prefix_query_tokens": 14,
        "prefix_hit_tokens": T,
        "prefix_hit_rate": T / 14,
        "prefix_cached_blocks": 1,
    }


def test_a_short_write_stores_each_token_at_its_own_slot_whatever_the_order():
    """A short write (direct slice copies) with skips, descending slots and interleaved runs: every token lands at
    exactly its slot, the skipped one nowhere, and no other slot changes (oracle: a dense slot -> K/V map)."""
    pool = BlockPool(SPEC, 5)
    slots = [-1, 2, 3, 21, 20, 19, 5, 30, 6, -1, 7]
    gen = torch.Generator().manual_seed(4)
    key, value = torch.randn(2, len(slots), SPEC.num_kv_heads, SPEC.head_dim, generator=gen).unbind(0)
    pool.write(0, torch.tensor(slots), key, value)
    want = {s: i for i, s in enumerate(slots) if s >= 0}
    for s in range(5 * T):
        k = pool.block(s // T)[0, 0, :, s % T]
        v = pool.block(s // T)[0, 1, :, s % T]
        if s in want:
            assert torch.equal(k, key[want[s]]) and torch.equal(v, value[want[s]])
        else:
            assert torch.count_nonzero(k) == 0 and torch.count_nonzero(v) == 0
    bad = torch.tensor([0, -1, -2, 40, 41, 42, 43])  # the pool ends at slot 40
    key, value = key[:7], value[:7]
    with pytest.raises(
        InvalidArgumentError, match=r"^slots: expected -1 \(skip\) or a slot in \[0, 40\), got \[-2, 40, 41, 42\]$"
    ):
        pool.write(1, bad, key, value)
    assert torch.count_nonzero(pool.layer_view(1)) == 0


def test_block_ids_and_index_tensors_are_refused_by_name_with_the_valid_range():
    """An id below 0 or past the pool, or not an int, is refused naming the argument (block / src / dst) and the
    range [0, num_blocks); slots or a block table that is not a tensor is refused naming it."""
    pool = BlockPool(SPEC, 4)
    with pytest.raises(InvalidBlockError, match=r"^block id -1 is not in \[0, 4\)$"):
        pool.block(-1)
    with pytest.raises(InvalidBlockError, match=r"^block id 4 is not in \[0, 4\)$"):
        pool.block(4)
    with pytest.raises(ArgumentTypeError, match=r"^block: expected int, got float"):
        pool.block(1.5)
    with pytest.raises(InvalidBlockError, match=r"^src id 9 is not in \[0, 4\)$"):
        pool.copy_block(9, 0)
    with pytest.raises(InvalidBlockError, match=r"^dst id -2 is not in \[0, 4\)$"):
        pool.copy_block(0, -2)
    one = torch.ones(1, SPEC.num_kv_heads, SPEC.head_dim)
    with pytest.raises(ArgumentTypeError, match=r"^slots: expected Tensor, got list"):
        pool.write(0, [0], one, one)
    with pytest.raises(ArgumentTypeError, match=r"^block_table: expected Tensor, got list"):
        pool.gather(0, [0], 1)
    with pytest.raises(ShapeError, match=r"^block_table: expected a 1-d tensor, got shape \(1, 1\)$"):
        pool.gather(0, torch.zeros(1, 1, dtype=torch.long), 1)
    for dtype in (torch.bool, torch.complex64, torch.float16):
        with pytest.raises(ArgumentTypeError, match=rf"^block_table: expected an integer tensor, got dtype {dtype}$"):
            pool.gather(0, torch.zeros(1, dtype=dtype), 1)
    assert pool.gather(0, torch.zeros(1, dtype=torch.int32), 1)[0].shape == (SPEC.num_kv_heads, 1, SPEC.head_dim)


@pytest.mark.parametrize("table", [[3, 0], [3, 0, 1], [1, 2, 0, 3], [2, 3, 0, 1]])
def test_gather_follows_the_block_table_in_order(table):
    """gather returns the table's blocks in table order, the first num_tokens of them, whatever runs of consecutive
    ids the table holds (oracle: each block's K/V set by hand)."""
    pool = BlockPool(SPEC, 4)
    gen = torch.Generator().manual_seed(sum(table))
    dense = torch.randn(4, SPEC.num_layers, 2, SPEC.num_kv_heads, T, SPEC.head_dim, generator=gen)
    for b in range(4):
        pool.block(b).copy_(dense[b])
    n = len(table) * T - 3
    k, v = pool.gather(1, torch.tensor(table), n)
    want_k = torch.cat([dense[b, 1, 0] for b in table], dim=1)[:, :n]  # [H, n, D]
    want_v = torch.cat([dense[b, 1, 1] for b in table], dim=1)[:, :n]
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


@pytest.mark.parametrize(
    "blocks", [[0, 1, 2, 3], [5, 1, 7, 3, 0, 6, 2, 4, 9, 8], list(range(9, -1, -1)), [4, 5, 0, 1, 8]]
)
def test_gather_blocks_fills_out_with_the_blocks_in_order_and_refuses_a_wrong_or_strided_out(blocks):
    """gather_blocks of a [N, *lead, T, D] tensor: block i of the result is cache[blocks[i]] (any number of runs,
    so both the run copies and the one index_select), written into ``out`` when given; an ``out`` of another shape,
    or of the right shape but not contiguous, is a ShapeError naming the expected shape."""
    gen = torch.Generator().manual_seed(len(blocks))
    cache = torch.randn(10, 2, 3, T, 4, generator=gen)  # [N, 2, H, T, D]
    want = torch.stack([cache[b] for b in blocks], dim=2)  # [2, H, n, T, D]
    assert torch.equal(gather_blocks(cache, blocks), want)
    out = torch.empty_like(want)
    assert gather_blocks(cache, blocks, out) is out and torch.equal(out, want)
    shape = (2, 3, len(blocks), T, 4)
    with pytest.raises(
        ShapeError, match=rf"^out: expected a contiguous {re.escape(str(shape))}, got \(2, 3, 1, 8, 4\)$"
    ):
        gather_blocks(cache, blocks, torch.empty(2, 3, 1, T, 4))
    strided = torch.empty(2, 3, T, len(blocks), 4).transpose(2, 3)
    with pytest.raises(ShapeError, match=rf"^out: expected a contiguous {re.escape(str(shape))}, got "):
        gather_blocks(cache, blocks, strided)


def test_gather_blocks_of_a_scattered_table_works_whatever_torchs_default_device_is():
    """A scattered table (the index_select path) reads the cache's own device even inside ``with
    torch.device("meta")``: the index tensor is built on the cache's device, not torch's default."""
    cache = torch.arange(10 * 2 * T, dtype=torch.float32).reshape(10, 2, 1, T, 1)
    blocks = [5, 1, 7, 3, 0, 6, 2, 4, 9, 8]
    want = torch.stack([cache[b] for b in blocks], dim=2)
    with torch.device("meta"):
        got = gather_blocks(cache, blocks)
    assert got.device.type == "cpu" and torch.equal(got, want)


def _grown_pool(dtype: torch.dtype, gen: torch.Generator) -> tuple[BlockPool, torch.Tensor]:
    """A pool of ``dtype`` grown from 2 to 5 blocks (two segments), each block set to random K/V; returns the pool
    and the dense oracle ``[5, L, 2, H, T, D]`` of its blocks."""
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype=dtype, block_size=T)
    pool = BlockPool(spec, 2)
    pool.grow(3)
    assert len(pool.segments) == 2
    dense = torch.randn(5, *spec.block_shape, generator=gen).to(dtype)
    for b in range(5):
        pool.block(b).copy_(dense[b])
    return pool, dense


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gather_of_a_grown_pool_keeps_the_pools_dtype_and_device_whatever_torchs_defaults_are(dtype):
    """gather over a grown pool (a table crossing its segments) returns the pool's own dtype on the pool's own
    device, holding exactly the blocks' K/V in table order — also inside ``with torch.device("meta")`` (as code
    that builds models under a default device runs it): the result is never built on torch's default device or
    in its default dtype."""
    pool, dense = _grown_pool(dtype, torch.Generator().manual_seed(7))
    table = [4, 0, 3, 1]  # segment 1, segment 0, segment 1, segment 0
    n = 3 * T + 5
    want_k = torch.cat([dense[b, 1, 0] for b in table], dim=1)[:, :n]  # [H, n, D]
    want_v = torch.cat([dense[b, 1, 1] for b in table], dim=1)[:, :n]
    for ambient in (torch.device("cpu"), torch.device("meta")):
        with ambient:
            k, v = pool.gather(1, torch.tensor(table, device="cpu"), n)
        assert k.dtype == v.dtype == dtype and k.device == v.device == pool.device, (ambient, k.dtype, k.device)
        assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_a_grown_pool_looks_up_a_host_block_table_on_its_own_device(monkeypatch):
    """Runs on the CPU: a pool of two segments on ``meta`` (standing in for a GPU) gathers from a block table on
    the host; the ids are brought to the pool's device before they are split over its segments (a spy on that
    split records their device and stops the call: a host index into a GPU segment is refused by torch)."""
    seen = []

    def spy(layout, blocks):
        seen.append(blocks.device.type)
        raise _Stop

    monkeypatch.setattr(SegmentLayout, "index", spy)
    pool = BlockPool(SPEC, 6, segments=2, device="meta")
    with pytest.raises(_Stop):
        pool.gather(0, torch.tensor([4, 0, 3]), 2 * T + 1)
    assert seen == ["meta"]


class _Stop(Exception):
    """Raised by a spy once it has seen what it looks for."""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: a block table on another device")
def test_gather_of_a_grown_host_pool_takes_a_block_table_on_the_gpu():
    """A host pool (grown: two segments) gathers from a block table that lives on the GPU, as the single-segment
    pool does: the table is brought to the pool's device before it indexes the segments (a CUDA index into a host
    tensor is refused by torch)."""
    pool, dense = _grown_pool(torch.float32, torch.Generator().manual_seed(8))
    table = [4, 0, 3, 1]
    n = 4 * T
    k, v = pool.gather(0, torch.tensor(table, device="cuda"), n)
    assert k.device == pool.device
    assert torch.equal(k, torch.cat([dense[b, 0, 0] for b in table], dim=1))
    assert torch.equal(v, torch.cat([dense[b, 0, 1] for b in table], dim=1))


# ------------------------------------------------------------------------------------------- BlockPool's sizing
def test_a_pool_is_sized_by_exactly_one_of_num_blocks_or_byte_budget_and_the_refusal_names_both():
    """Neither or both of ``num_blocks`` and ``byte_budget`` is a ConfigError naming both arguments (as the user
    spells them); one of them alone sizes the pool (a budget: the whole blocks that fit in it)."""
    bpb = SPEC.bytes_per_block
    for kwargs in ({}, {"num_blocks": 2, "byte_budget": 4 * bpb}):
        with pytest.raises(ConfigError) as info:
            BlockPool(SPEC, **kwargs)
        assert re.search(r"\bnum_blocks\b", str(info.value)) and re.search(r"\bbyte_budget\b", str(info.value))
    assert BlockPool(SPEC, 2).num_blocks == 2
    assert BlockPool(SPEC, byte_budget=3 * bpb + bpb - 1).num_blocks == 3


@pytest.mark.parametrize("budget", [0, 1, SPEC.bytes_per_block - 1])
def test_a_byte_budget_below_one_block_is_refused_naming_the_budget_and_one_blocks_bytes(budget):
    """A ``byte_budget`` that holds no whole block is a ConfigError naming ``byte_budget``, the budget given and the
    bytes one block needs (expected vs actual), not a complaint about a ``num_blocks`` the user never gave; a budget
    of exactly one block makes a one-block pool."""
    bpb = SPEC.bytes_per_block
    with pytest.raises(ConfigError) as info:
        BlockPool(SPEC, byte_budget=budget)
    msg = str(info.value)
    assert re.search(rf"\bbyte_budget {budget}\b", msg) and re.search(rf"\b{bpb} bytes\b", msg), msg
    assert "num_blocks" not in msg
    assert BlockPool(SPEC, byte_budget=bpb).num_blocks == 1


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, total: dict[int, int]) -> list[object]:
    """Make ``torch.cuda.get_device_properties`` report GPUs of ``total[index]`` bytes (this machine may have none),
    as torch does: ``None`` or ``cuda`` without an index is the current device, 0; a non-CUDA device is a
    ValueError (and ``torch.cuda`` reports those GPUs available). Returns the list of devices it was asked about."""
    asked: list[object] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(total))

    def properties(device: object = None) -> SimpleNamespace:
        asked.append(device)
        where = torch.device("cuda", 0) if device is None else torch.device(device)
        if where.type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {where}")
        return SimpleNamespace(total_memory=total[where.index or 0])

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    return asked


def test_a_pool_bigger_than_its_gpus_memory_is_refused_before_any_allocation_naming_that_gpus_capacity(
    monkeypatch,
):
    """A pool on ``cuda:1`` whose blocks exceed that GPU's whole memory is a CapacityExceededError carrying the bytes
    needed and that GPU's own total (not the current GPU's), raised before any allocation is tried (so this runs on
    a machine without CUDA: torch's properties are faked, GPU 0 has 10 blocks' bytes, GPU 1 has 3)."""
    bpb = SPEC.bytes_per_block
    asked = _fake_gpus(monkeypatch, {0: 10 * bpb, 1: 3 * bpb})
    with pytest.raises(CapacityExceededError) as info:
        BlockPool(SPEC, 4, device="cuda:1")
    assert (info.value.needed, info.value.capacity) == (4 * bpb, 3 * bpb)
    assert f"need {4 * bpb} bytes" in str(info.value) and f"has {3 * bpb} bytes" in str(info.value)
    assert asked == [torch.device("cuda", 1)]
    with pytest.raises(CapacityExceededError) as info:
        BlockPool(SPEC, 11, device="cuda")  # the current GPU, 0
    assert (info.value.needed, info.value.capacity) == (11 * bpb, 10 * bpb)
    # A device with no known memory (meta) is never asked about or refused for its size.
    asked.clear()
    assert BlockPool(SPEC, 11, device="meta").num_blocks == 11 and asked == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine whose torch has no usable CUDA device")
def test_a_pool_on_a_cuda_device_torch_cannot_use_is_refused_by_name():
    """A pool asked for on a CUDA device this torch cannot use (a CPU-only build, or no GPU) is a DeviceError naming
    the device, raised before anything is allocated — not an error from inside torch."""
    with pytest.raises(DeviceError, match=r"\bcuda\b"):
        BlockPool(SPEC, 4, device="cuda")
