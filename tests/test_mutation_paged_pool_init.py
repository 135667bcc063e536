"""BlockPool's constructor (issue 30's survivors of its re-run): each refusal names its argument and the value
given, the largest pool accepted is exactly ``MAX_BLOCKS`` blocks, and blocks split over segments add up to
``num_blocks``. The oracle is the arithmetic of the arguments."""

from __future__ import annotations

import pytest
import torch

from memos_ref.errors import CapacityExceededError, ConfigError, DeviceError
from memos_ref.paged import BlockPool
from memos_ref.paged.allocator import MAX_BLOCKS
from memos_ref.spec import KVSpec

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=8)


@pytest.mark.parametrize("num_blocks", [0, -1, "3", 2.0])
def test_num_blocks_that_is_not_a_positive_int_is_refused_naming_it(num_blocks):
    with pytest.raises(ConfigError, match=rf"^num_blocks must be a positive int, got {num_blocks!r}$"):
        BlockPool(SPEC, num_blocks, device="meta")


@pytest.mark.parametrize("segments", [0, 5, "2"])
def test_segments_outside_1_to_num_blocks_is_refused_naming_both(segments):
    with pytest.raises(ConfigError, match=rf"^segments must be an int in \[1, num_blocks=4\], got {segments!r}$"):
        BlockPool(SPEC, 4, segments=segments, device="meta")


def test_the_largest_pool_is_exactly_max_blocks():
    """A meta pool holds no memory, so the bound itself is what refuses: MAX_BLOCKS blocks are accepted, one more
    is refused naming both numbers."""
    assert BlockPool(SPEC, MAX_BLOCKS, device="meta").num_blocks == MAX_BLOCKS
    with pytest.raises(ConfigError, match=rf"^num_blocks: expected at most {MAX_BLOCKS} blocks, got {MAX_BLOCKS + 1}$"):
        BlockPool(SPEC, MAX_BLOCKS + 1, device="meta")


@pytest.mark.parametrize(("num_blocks", "segments"), [(5, 2), (7, 3), (4, 4), (9, 1)])
def test_blocks_split_over_segments_add_up_to_num_blocks(num_blocks, segments):
    """The first ``num_blocks % segments`` segments take one block more than the others: every block id below
    ``num_blocks`` can be written and read back, and there is no block beyond."""
    pool = BlockPool(SPEC, num_blocks, segments=segments)
    assert pool.num_blocks == num_blocks
    key = torch.arange(float(num_blocks * SPEC.block_size * 8)).reshape(num_blocks * SPEC.block_size, 2, 4)
    slots = torch.arange(num_blocks * SPEC.block_size)
    pool.write(0, slots, key, -key)
    table = torch.arange(num_blocks)
    k, v = pool.gather(0, table, num_blocks * SPEC.block_size)
    assert torch.equal(k.transpose(0, 1), key) and torch.equal(v.transpose(0, 1), -key)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: 'cuda' without an index is GPU 0")
def test_a_pool_on_cuda_without_an_index_is_on_the_current_gpu():
    assert BlockPool(SPEC, 2, device="cuda").num_blocks == 2


class _ReachedAllocation(Exception):
    """Raised by the stand-in for ``_check_fits``: the device check let the pool through."""


@pytest.mark.parametrize(
    ("device", "seen", "admitted"),
    [("cuda", 1, True), ("cuda:0", 1, True), ("cuda:1", 1, False), ("cuda:1", 2, True), ("cuda", 0, False)],
)
def test_the_device_check_takes_plain_cuda_for_gpu_0(monkeypatch, device, seen, admitted):
    """Runs on the CPU: torch is made to report ``seen`` GPUs, and the pool's first step after its device check
    (``_check_fits``) stops the constructor before any allocation. Plain ``cuda`` is GPU 0, so one GPU admits it
    and ``cuda:0`` alike, and refuses ``cuda:1`` naming the device and the count (no GPU refuses every one)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: seen > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: seen)

    def reached(self, n):
        raise _ReachedAllocation(n)

    monkeypatch.setattr(BlockPool, "_check_fits", reached)
    if admitted:
        with pytest.raises(_ReachedAllocation):
            BlockPool(SPEC, 2, device=device)
    else:
        message = rf"^device: expected a CUDA device this torch can use, got {device} \(it sees {seen}\)$"
        with pytest.raises(DeviceError, match=message):
            BlockPool(SPEC, 2, device=device)


@pytest.mark.parametrize("fault", [torch.OutOfMemoryError("simulated"), MemoryError("simulated")])
def test_a_segment_the_device_cannot_allocate_is_refused_naming_its_blocks_bytes_and_device(monkeypatch, fault):
    """Out of memory while a segment is allocated (torch's error, or Python's): a ``CapacityExceededError`` naming
    the blocks, their bytes (blocks x bytes per block) and the device, carrying ``needed`` and the fault as its
    cause; the pool keeps its blocks."""
    pool = BlockPool(SPEC, 4)

    def oom(*args, **kwargs):
        raise fault

    monkeypatch.setattr(torch, "zeros", oom)
    needed = 3 * SPEC.bytes_per_block
    with pytest.raises(CapacityExceededError) as caught:
        pool.grow(3)
    assert str(caught.value) == f"could not allocate 3 blocks ({needed} bytes) on cpu: simulated"
    assert caught.value.needed == needed and caught.value.__cause__ is fault
    assert pool.num_blocks == 4


def test_a_pool_exactly_as_large_as_the_devices_memory_is_allowed_one_byte_more_is_not(monkeypatch):
    """The size check refuses only what cannot fit: a device whose whole memory is exactly the pool's bytes admits
    it; one byte less refuses it before allocating, naming needed and capacity."""
    import memos_ref.paged.pool as pool_module

    needed = 3 * SPEC.bytes_per_block
    monkeypatch.setattr(pool_module, "device_memory", lambda device: needed)
    assert BlockPool(SPEC, 3).num_blocks == 3
    monkeypatch.setattr(pool_module, "device_memory", lambda device: needed - 1)
    with pytest.raises(CapacityExceededError) as caught:
        BlockPool(SPEC, 3)
    assert (caught.value.needed, caught.value.capacity) == (needed, needed - 1)
    want = f"3 blocks of {SPEC.bytes_per_block} bytes need {needed} bytes; the cpu has {needed - 1} bytes in all"
    assert str(caught.value) == want
