"""BlockAllocator: states, refcounts, all-or-nothing allocation, specific errors, LRU eviction, threads."""

from __future__ import annotations

import contextlib
import random
import threading

import pytest

from memos_ref.errors import (
    ConfigError,
    DoubleFreeError,
    InvalidBlockError,
    OutOfBlocksError,
    RefcountUnderflowError,
)
from memos_ref.paged import BlockAllocator, BlockState, check_invariants


def test_allocate_free_and_counts():
    alloc = BlockAllocator(8)
    blocks = alloc.allocate(5)
    assert len(set(blocks)) == 5 and alloc.num_active == 5 and alloc.num_free == 3
    assert all(alloc.refcount[b] == 1 and alloc.state[b] == BlockState.ACTIVE for b in blocks)
    alloc.incref(blocks[0])
    alloc.free(blocks[0])
    assert alloc.state[blocks[0]] == BlockState.ACTIVE
    alloc.free_many(blocks)
    assert alloc.num_free == 8 and alloc.num_active == 0


def test_out_of_blocks_is_all_or_nothing():
    alloc = BlockAllocator(4)
    alloc.allocate(3)
    with pytest.raises(OutOfBlocksError, match="needed 2, available 1") as info:
        alloc.allocate(2)
    assert (info.value.needed, info.value.available) == (2, 1)
    assert alloc.num_free == 1 and alloc.num_active == 3


def test_specific_errors_leave_state_unchanged():
    alloc = BlockAllocator(4)
    (b,) = alloc.allocate(1)
    alloc.free(b)
    with pytest.raises(DoubleFreeError):
        alloc.free(b)
    with pytest.raises(InvalidBlockError):
        alloc.free(4)
    with pytest.raises(InvalidBlockError):
        alloc.free(-1)
    with pytest.raises(InvalidBlockError, match="free"):
        alloc.incref(b)  # nothing to share
    (c,) = alloc.allocate(1)
    alloc.set_cacheable(c)
    alloc.free(c)  # -> cached, refcount 0
    with pytest.raises(RefcountUnderflowError):
        alloc.free(c)
    held = alloc.allocate(1)
    with pytest.raises(RefcountUnderflowError):
        alloc.free_many([held[0], held[0]])  # one holder, freed twice: nothing is freed
    assert alloc.refcount[held[0]] == 1
    with pytest.raises(ConfigError):
        BlockAllocator(0)


def test_cached_blocks_are_evicted_oldest_first_only_when_nothing_is_free():
    evicted: list[int] = []
    alloc = BlockAllocator(4, on_evict=evicted.append)
    blocks = alloc.allocate(4)
    for b in blocks[:3]:
        alloc.set_cacheable(b)
    alloc.free(blocks[1])
    alloc.free(blocks[0])
    alloc.free(blocks[2])  # cached LRU order: 1, 0, 2
    alloc.free(blocks[3])  # not cacheable: free
    assert alloc.cached_blocks() == [blocks[1], blocks[0], blocks[2]]
    assert alloc.allocate(1) == [blocks[3]] and evicted == []  # the free block goes first
    alloc.incref(blocks[0])  # touch: revived in O(1), leaves the LRU list
    assert alloc.allocate(2) == [blocks[1], blocks[2]] and evicted == [blocks[1], blocks[2]]
    assert alloc.evictions == 2


def test_poison_callback_only_for_truly_freed_blocks():
    freed: list[int] = []
    alloc = BlockAllocator(3, on_free=freed.append)
    a, b = alloc.allocate(2)
    alloc.set_cacheable(a)
    alloc.free(a)
    alloc.free(b)
    assert freed == [b]  # a keeps its contents: it is cached
    alloc.set_cacheable(a, False)
    assert freed == [b, a] and alloc.state[a] == BlockState.FREE


def test_threads_hammering_the_allocator_keep_invariants():
    alloc = BlockAllocator(256)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng, held = random.Random(seed), []
        try:
            for _ in range(1500):
                op = rng.random()
                if op < 0.45:
                    with contextlib.suppress(OutOfBlocksError):
                        held.extend(alloc.allocate(rng.randint(1, 4)))
                elif op < 0.55 and held:
                    block = rng.choice(held)
                    alloc.incref(block)
                    held.append(block)
                elif held:
                    alloc.free(held.pop(rng.randrange(len(held))))
            alloc.free_many(held)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert alloc.num_free == 256 and all(r == 0 for r in alloc.refcount)
    check_invariants(alloc, [])
