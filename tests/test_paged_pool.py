"""BlockPool: the canonical layout, writes and gathers across segments, copy and poison."""

from __future__ import annotations

import pytest
import torch

from memos_ref.errors import ConfigError, DTypeError, InvalidBlockError, ShapeError
from memos_ref.paged import BlockPool
from memos_ref.spec import KVSpec

SPEC = KVSpec(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=8)


def test_layout_and_sizing():
    pool = BlockPool(SPEC, 10)
    assert pool.tensor.shape == (10, 3, 2, 2, 8, 4)  # [num_blocks, L, 2, H, T, D]
    assert pool.nbytes == 10 * SPEC.bytes_per_block
    assert BlockPool(SPEC, byte_budget=5 * SPEC.bytes_per_block + 7).num_blocks == 5
    assert pool.layer_view(1).shape == (10, 2, 2, 8, 4)
    with pytest.raises(ConfigError):
        BlockPool(SPEC, byte_budget=10)
    with pytest.raises(ConfigError):
        BlockPool(SPEC, 4, byte_budget=100)


@pytest.mark.parametrize("segments", [1, 3])
def test_write_then_gather_equals_the_slot_formula(segments):
    pool = BlockPool(SPEC, 9, segments=segments)
    gen = torch.Generator().manual_seed(0)
    table = torch.tensor([7, 2, 5])  # blocks in different segments when segmented
    n = 19
    keys, values = torch.randn(2, n, 2, 4, generator=gen).unbind(0)  # [n, H, D]
    pos = torch.arange(n)
    slots = table[pos // 8] * 8 + pos % 8
    pool.write(1, slots, keys, values)
    k, v = pool.gather(1, table, n)  # [H, n, D]
    assert torch.equal(k, keys.transpose(0, 1)) and torch.equal(v, values.transpose(0, 1))
    k0, _ = pool.gather(0, table, n)
    assert torch.count_nonzero(k0) == 0  # other layers untouched
    skipped = slots.clone()
    skipped[0] = -1
    pool.write(2, skipped, keys, values)
    assert torch.count_nonzero(pool.block(7)[2, 0, :, 0]) == 0  # -1 skips


def test_grow_adds_a_segment_and_ids_continue():
    pool = BlockPool(SPEC, 4)
    new = pool.grow(3)
    assert list(new) == [4, 5, 6] and pool.num_blocks == 7 and len(pool.segments) == 2
    pool.block(6).fill_(1.0)
    pool.copy_block(6, 1)
    assert torch.equal(pool.block(1), pool.block(6))
    with pytest.raises(ConfigError, match="segments"):
        _ = pool.tensor
    pool.poison(1)
    assert torch.isnan(pool.block(1)).all()
    with pytest.raises(InvalidBlockError):
        pool.block(7)


def test_bad_writes_are_rejected():
    pool = BlockPool(SPEC, 2)
    slots = torch.tensor([0, 1])
    with pytest.raises(ShapeError):
        pool.write(0, slots, torch.zeros(2, 3, 4), torch.zeros(2, 3, 4))
    with pytest.raises(DTypeError):
        pool.write(0, slots, torch.zeros(2, 2, 4, dtype=torch.float16), torch.zeros(2, 2, 4, dtype=torch.float16))
    with pytest.raises(ShapeError):
        pool.write(0, torch.tensor([0]), torch.zeros(2, 2, 4), torch.zeros(2, 2, 4))
