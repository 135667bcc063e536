"""Issue 24 items 11, 14 and 15: MLA K/V are refused with a hint by every cache, a growth past any memory is
refused by name with nothing changed, and an out-of-range layer is one error everywhere."""

from __future__ import annotations

import pytest
import torch

from memos_ref.caches import ConcatCache, ContiguousCache
from memos_ref.errors import (
    ArgumentTypeError,
    CapacityExceededError,
    InvalidArgumentError,
    KVCacheError,
    LayerIndexError,
    ShapeError,
    UnsupportedModelError,
)
from memos_ref.paged import BlockAllocator, BlockPool, PagedKV
from memos_ref.paged.allocator import MAX_BLOCKS
from memos_ref.paged.step import StepBatch
from memos_ref.spec import KVSpec

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=8)


# ---------------------------------------------------------------------------------------------- item 11: MLA
@pytest.mark.parametrize("make", [ContiguousCache, ConcatCache, lambda: ContiguousCache(num_layers=2)])
@pytest.mark.parametrize("first", [True, False])
def test_mla_kv_on_a_dense_cache_names_mla_and_changes_nothing(make, first):
    """K of head_dim 12 (nope 8 + rope 4) and V of head_dim 8, as DeepSeek-V2/V3 hand a cache: refused with the
    MLA hint, as PagedCache does — on the first step and after normal steps — and the cache is unchanged."""
    cache = make()
    if not first:
        cache.update(torch.ones(1, 2, 3, 8), torch.ones(1, 2, 3, 8), 0)
    before = (cache.get_seq_length(), len(cache.layers), cache.nbytes_used())
    with pytest.raises(UnsupportedModelError, match=r"(?s)head_dim 12 != value head_dim 8.*MLA.*DeepSeek"):
        cache.update(torch.zeros(1, 2, 1, 12), torch.zeros(1, 2, 1, 8), 0)
    assert (cache.get_seq_length(), len(cache.layers), cache.nbytes_used()) == before


def test_other_kv_mismatches_stay_shape_errors():
    with pytest.raises(ShapeError, match="differ"):
        ContiguousCache().update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 2, 4), 0)
    with pytest.raises(ShapeError, match="differ"):
        ConcatCache().update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 3, 1, 8), 0)


# ---------------------------------------------------------------------------------------------- item 14: huge grow
def _state(kv: PagedKV) -> tuple:
    a = kv.allocator
    return (a.num_blocks, kv.pool.num_blocks, len(kv.pool.segments), a.free_blocks(), bytes(a.state))


@pytest.mark.parametrize(
    ("n", "error", "match"),
    [
        (2**62, InvalidArgumentError, r"n_blocks: expected at most \d+ more blocks .*got 4611686018427387904"),
        (MAX_BLOCKS, InvalidArgumentError, "n_blocks: expected at most"),
        (MAX_BLOCKS - 4, CapacityExceededError, r"need \d+ bytes; the cpu has \d+ bytes"),
        (2**34, CapacityExceededError, r"need \d+ bytes; the cpu has \d+ bytes"),
    ],
)
def test_a_huge_grow_is_refused_by_name_and_changes_nothing(n, error, match):
    kv = PagedKV(SPEC, 4)
    seq = kv.new_sequence()
    seq.append(0, torch.ones(2, 3, 4), torch.ones(2, 3, 4))
    before = _state(kv)
    with pytest.raises(error, match=match) as info:
        kv.grow(n)
    assert not isinstance(info.value, RuntimeError)
    assert _state(kv) == before
    kv.check()
    assert kv.grow(2) == range(4, 6)  # and the pool still grows


def test_the_pool_and_the_allocator_bound_growth_on_their_own():
    pool = BlockPool(SPEC, 4)
    for n in (2**62, MAX_BLOCKS):
        with pytest.raises(InvalidArgumentError, match="n: expected at most"):
            pool.grow(n)
    with pytest.raises(CapacityExceededError) as info:
        pool.grow(2**34)
    assert info.value.needed == 2**34 * SPEC.bytes_per_block and info.value.capacity > 0
    assert pool.num_blocks == 4 and len(pool.segments) == 1
    alloc = BlockAllocator(4)
    with pytest.raises(InvalidArgumentError, match="at most"):
        alloc.grow(2**62)
    assert alloc.num_blocks == 4 and alloc.free_blocks() == [0, 1, 2, 3]
    with pytest.raises(KVCacheError):
        BlockPool(SPEC, 2**62)
    with pytest.raises(CapacityExceededError):
        BlockPool(SPEC, 2**34)


def test_an_allocation_that_fails_is_a_package_error(monkeypatch):
    """Under the device's size but still refused by the allocator (out of memory): CapacityExceededError, with
    the torch error as its cause, and the pool unchanged."""
    pool = BlockPool(SPEC, 4)

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated: out of memory")

    monkeypatch.setattr(torch, "zeros", oom)
    with pytest.raises(CapacityExceededError, match="could not allocate 3 blocks") as info:
        pool.grow(3)
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    assert pool.num_blocks == 4 and len(pool.segments) == 1


# ---------------------------------------------------------------------------------------------- item 15: layers
def _paged_layer_calls():
    kv = PagedKV(SPEC, 8)
    seq = kv.new_sequence()
    kv4 = torch.ones(2, 1, 4)
    one = torch.ones(1, 2, 4)  # [n, H, D]
    yield "pool.write", lambda layer: kv.pool.write(layer, torch.tensor([0]), one, one)
    yield "pool.gather", lambda layer: kv.pool.gather(layer, torch.tensor([0]), 1)
    yield "pool.layer_view", lambda layer: kv.pool.layer_view(layer)
    yield "seq.append", lambda layer: seq.append(layer, kv4, kv4)
    yield "seq.to_dense", lambda layer: seq.to_dense(layer)
    step_seq = kv.new_sequence()
    step = StepBatch.reserve([step_seq], 1)
    yield "step.write", lambda layer: step.write(layer, torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4))
    from memos_ref.quant import FP8E4M3

    quant = PagedKV(SPEC, 4, quant=FP8E4M3(), prefix_caching=False).pool
    yield "quantized pool.write", lambda layer: quant.write(layer, torch.tensor([0]), one, one)
    yield "quantized pool.gather", lambda layer: quant.gather(layer, torch.tensor([0]), 1)
    cache = ContiguousCache(num_layers=2)
    yield "ContiguousCache.update", lambda layer: cache.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4), layer)
    concat = ConcatCache(num_layers=2)
    yield "ConcatCache.update", lambda layer: concat.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4), layer)


@pytest.mark.parametrize("layer", [2, -1, 10**6])
def test_an_out_of_range_layer_is_one_error_everywhere(layer):
    """The same mistake, the same error: LayerIndexError — which is also an InvalidArgumentError (what paged/ used
    to raise) and an IndexError (what the dense caches' callers catch) — naming the range and the value."""
    for name, call in _paged_layer_calls():
        with pytest.raises(LayerIndexError, match=rf"expected a layer index in \[0, 2\).*got {layer}") as info:
            call(layer)
        assert isinstance(info.value, InvalidArgumentError) and isinstance(info.value, IndexError), name


@pytest.mark.parametrize("layer", [1.0, True, "0", None])
def test_a_layer_of_the_wrong_type_is_an_argument_type_error(layer):
    for _name, call in _paged_layer_calls():
        with pytest.raises(ArgumentTypeError, match="expected int"):
            call(layer)
