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


# ---------------------------------------------------------------------------------------------- KVPool Protocol
def _pools():
    from memos_ref.bench.common import NullPool
    from memos_ref.quant import KIVI, PerTokenInt8, QuantizedBlockPool

    spec16 = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32, block_size=32)
    return {
        "plain": BlockPool(SPEC, 4),
        "streaming": QuantizedBlockPool(SPEC, 4, PerTokenInt8()),
        "windowed": QuantizedBlockPool(spec16, 4, KIVI(bits=4, group_size=32)),
        "null": NullPool(),
    }


def test_every_pool_is_a_kvpool_with_plain_flags():
    from memos_ref.paged import KVPool, WindowedKVPool

    flags = {"plain": (False, False), "streaming": (True, False), "windowed": (True, True), "null": (False, False)}
    for name, pool in _pools().items():
        assert isinstance(pool, KVPool), name
        assert (pool.quantized, pool.tracks_windows) == flags[name], name
        assert "quantized" in vars(type(pool)) and isinstance(pool.quantized, bool), name  # a plain attribute
        assert not isinstance(getattr(type(pool), "tracks_windows", None), property), name
        assert isinstance(pool, WindowedKVPool) or not pool.tracks_windows, name


def test_paged_kv_takes_a_pool_and_hears_its_events():
    from memos_ref.paged import PagedKV
    from memos_ref.quant import KIVI, QuantizedBlockPool

    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32, block_size=32)
    pool = QuantizedBlockPool(spec, 6, KIVI(bits=4, group_size=32), residual_tokens=32, staging_blocks=4)
    kv = PagedKV(spec, pool=pool)
    assert kv.pool is pool and kv.allocator.num_blocks == 6
    seq = kv.new_sequence()
    gen = torch.Generator().manual_seed(0)
    for layer in range(2):
        seq.append(layer, *torch.randn(2, 2, 40, 32, generator=gen).unbind(0))
    assert pool.staging_available < 4
    seq.free()  # FREED events reach the pool, which gives the staging slots back
    assert pool.staging_available == 4
    kv.check()
    # the shorthand builds the same pool through the scheme (paged never imports quant)
    built = PagedKV(spec, 6, quant=KIVI(bits=4, group_size=32), residual_tokens=32, staging_blocks=4).pool
    assert isinstance(built, QuantizedBlockPool) and built.staging_capacity == 4


def test_paged_kv_refuses_a_pool_with_sizing_or_another_spec():
    from memos_ref.errors import ArgumentTypeError
    from memos_ref.paged import PagedKV

    with pytest.raises(ConfigError, match="num_blocks"):
        PagedKV(SPEC, 4, pool=BlockPool(SPEC, 4))
    with pytest.raises(ConfigError, match="built for"):
        PagedKV(SPEC, pool=BlockPool(KVSpec(num_layers=1, num_kv_heads=2, head_dim=4, block_size=8), 4))
    with pytest.raises(ArgumentTypeError):
        PagedKV(SPEC, pool=object())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="quant"):
        PagedKV(SPEC, 4, residual_tokens=16)


def test_paged_kv_asks_the_quant_scheme_for_its_pool():
    """PagedKV(quant=...) builds no quantized pool itself (paged imports nothing from quant): it calls the
    scheme's build_pool with the sizing, so any PoolBuilder works."""
    from memos_ref.paged import PagedKV

    calls = []

    class Builder:
        def build_pool(self, spec, num_blocks, **kw):
            calls.append((num_blocks, kw))
            return BlockPool(spec, num_blocks)

    kv = PagedKV(SPEC, 5, quant=Builder(), residual_tokens=8)
    assert isinstance(kv.pool, BlockPool) and kv.allocator.num_blocks == 5
    assert calls == [(5, {"residual_tokens": 8, "staging_blocks": None, "layer_scales": None, "device": "cpu"})]
