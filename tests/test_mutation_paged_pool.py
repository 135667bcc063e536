"""BlockPool, PagedKV.grow/stats, StepBatch and PrefixCache (the paged area's mutation survivors): each test states
what a user relies on, against an oracle kept beside the pool (a dense tensor, counts worked out by hand)."""

from __future__ import annotations

import pytest
import torch

from memos_ref.errors import (
    ArgumentTypeError,
    CapacityExceededError,
    DeviceError,
    DTypeError,
    InvalidArgumentError,
)
from memos_ref.paged import BlockPool
from memos_ref.paged.allocator import MAX_BLOCKS
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
