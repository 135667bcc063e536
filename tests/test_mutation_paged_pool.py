"""BlockPool, PagedKV.grow/stats, StepBatch and PrefixCache (the paged area's mutation survivors): each test states
what a user relies on, against an oracle kept beside the pool (a dense tensor, counts worked out by hand)."""

from __future__ import annotations

import pytest
import torch

from memos_ref.errors import (
    ArgumentTypeError,
    CapacityExceededError,
    ConfigError,
    DeviceError,
    DTypeError,
    InvalidArgumentError,
    LayerIndexError,
    StateError,
)
from memos_ref.paged import BlockPool, PagedKV, block_hashes
from memos_ref.paged.allocator import MAX_BLOCKS
from memos_ref.paged.step import StepBatch, rollback
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
    """Counting no layers (an empty list) on a resumed batch changes nothing: a caught-up row whose full block has
    known but unregistered ids (ids recorded mid-step, the step rolled back) stays unregistered."""
    kv = PagedKV(SPEC, 16, fingerprint=FP)
    seq = kv.new_sequence()
    StepBatch.reserve([seq], T).mark_written_by_kernel()  # 8 tokens of unknown ids
    StepBatch.reserve([seq], T)
    seq.set_token_ids(list(range(400, 400 + 2 * T)))  # not caught up: recorded only
    rollback(seq, T)  # the step failed: back to 8 tokens, caught up
    assert seq.caught_up and kv.allocator.hash_of(seq.block_table[0]) is None
    batch = StepBatch.resume([seq], 0, 0)
    batch.mark_written_by_kernel([])
    assert kv.allocator.hash_of(seq.block_table[0]) is None and seq.layer_tokens == [T, T]
