"""Sequences after a truncate (issue 30's survivors): what a refilled block is registered under, set_token_ids over
registered blocks, and blocks_needed when the tail left by a truncate is shared or in the prefix index. The oracle
for hashes is block_hashes() of the sequence's tokens; for K/V, the tensors the test wrote."""

from __future__ import annotations

import pytest
import torch

from memos_ref.errors import (
    ArgumentTypeError,
    CapacityExceededError,
    ConfigError,
    DoubleFreeError,
    InvalidArgumentError,
    InvalidBlockError,
    OutOfBlocksError,
    RefcountUnderflowError,
    ShapeError,
    StagingFullError,
)
from memos_ref.paged import UNKNOWN_TOKEN, BlockAllocator, PagedKV, block_hashes
from memos_ref.paged.allocator import ALLOCATED, CACHED, FREED, MAX_BLOCKS, REMOVED, STORED, BlockEvent
from memos_ref.paged.prefix_index import pack_ids
from memos_ref.spec import KVSpec

T = 8
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=T)
FP = "model-m"


def _append(seq, ids, gen):
    """Append len(ids) tokens with the given ids to every layer; return layer 0's K [H, n, D]."""
    first = None
    for layer in range(SPEC.num_layers):
        k, v = torch.randn(2, 2, len(ids), 4, generator=gen).unbind(0)
        seq.append(layer, k, v, list(ids))
        first = k if first is None else first
    return first


def _registered(kv, seq):
    """The hash the allocator's index holds for each of the sequence's blocks (None: not indexed)."""
    return [kv.allocator.hash_of(b) for b in seq.block_table]


def test_a_block_refilled_after_truncate_is_registered_under_its_new_tokens_and_the_old_entry_keeps_old_kv():
    """Truncating into a registered block and writing other tokens there never changes what the old hash serves:
    the refilled block is a private copy registered under the hash of its new tokens, and a later prompt with the
    old tokens still gets the old K/V."""
    kv, gen = PagedKV(SPEC, 32, fingerprint=FP), torch.Generator().manual_seed(11)
    old = list(range(100, 124))  # 3 full blocks
    seq = kv.new_sequence()
    k_old = _append(seq, old, gen)
    old_hashes = block_hashes(old, T, fingerprint=FP)
    assert _registered(kv, seq) == old_hashes
    old_third = seq.block_table[2]
    seq.truncate(20)  # into block 2, which stays in the prefix index
    new = [*old[:20], 900, 901, 902, 903]
    _append(seq, new[20:], gen)
    new_hashes = block_hashes(new, T, fingerprint=FP)
    assert new_hashes[:2] == old_hashes[:2] and new_hashes[2] != old_hashes[2]
    assert seq.block_table[2] != old_third  # copied on write, not overwritten in place
    assert _registered(kv, seq) == new_hashes
    assert kv.allocator.hash_of(old_third) == old_hashes[2]  # the old entry still names the old block
    kv.check()
    again = kv.start_from_prefix([*old, 5])
    assert again.num_tokens == 24 and again.block_table[2] == old_third
    k_again, _ = again.to_dense(0)
    torch.testing.assert_close(k_again[:, 16:24], k_old[:, 16:24])  # the old tokens' K/V, not the new ones
    fresh = kv.start_from_prefix([*new, 5])
    assert fresh.num_tokens == 24 and fresh.block_table == seq.block_table
    kv.check()


def test_refilling_with_the_same_tokens_keeps_one_entry_per_hash_and_the_chain_continues():
    """Truncate into a registered block, then write the same ids back (a copy-on-write private block): the index
    keeps exactly one block under that chained hash (the original), a lookup of the prompt still finds all three
    blocks, and the next full block is registered under the hash chained through the same ids."""
    kv, gen = PagedKV(SPEC, 32, fingerprint=FP), torch.Generator().manual_seed(12)
    ids = list(range(200, 224))
    seq = kv.new_sequence()
    _append(seq, ids, gen)
    hashes = block_hashes(ids, T, fingerprint=FP)
    third = seq.block_table[2]
    seq.truncate(19)
    assert seq.num_registered == 2
    _append(seq, ids[19:], gen)
    assert seq.num_registered == 3
    indexed = kv.allocator.indexed_blocks()
    assert [b for b, h in indexed.items() if h == hashes[2]] == [third]  # one block per hash
    assert kv.start_from_prefix([*ids, 1]).block_table == [*seq.block_table[:2], third]
    more = list(range(700, 708))
    _append(seq, more, gen)
    assert kv.allocator.hash_of(seq.block_table[3]) == block_hashes(ids + more, T, fingerprint=FP)[3]
    kv.check()


def test_truncating_to_a_block_boundary_then_refilling_registers_the_next_block_under_the_new_chain():
    """A truncate that drops a whole registered block, then other tokens: the new block's hash chains from the
    kept blocks and the new ids (block_hashes of the new prompt)."""
    kv, gen = PagedKV(SPEC, 32, fingerprint=FP), torch.Generator().manual_seed(13)
    ids = list(range(300, 324))
    seq = kv.new_sequence()
    _append(seq, ids, gen)
    seq.truncate(16)
    new = ids[:16] + list(range(600, 608))
    _append(seq, new[16:], gen)
    assert _registered(kv, seq) == block_hashes(new, T, fingerprint=FP)
    kv.check()


def test_set_token_ids_cannot_rewrite_a_registered_block_and_a_refusal_changes_nothing():
    """Ids of positions inside blocks already in the prefix index cannot change (the index would serve K/V under
    tokens it was not computed from): a differing id at the last position of the last registered block is refused
    and nothing changes; the same ids are accepted; the first position after the registered blocks can change."""
    kv, gen = PagedKV(SPEC, 32, fingerprint=FP), torch.Generator().manual_seed(14)
    ids = list(range(100, 120))  # 2 full blocks registered + 4 tokens
    seq = kv.new_sequence()
    _append(seq, ids, gen)
    assert seq.num_registered == 2
    before_ids, before_index = list(seq.token_ids), dict(kv.allocator.indexed_blocks())
    with pytest.raises(InvalidArgumentError, match="prefix cache"):
        seq.set_token_ids([ids[15] + 1], start=15)
    with pytest.raises(InvalidArgumentError, match="prefix cache"):
        seq.set_token_ids([*ids[:15], 7, 8, 9], start=0)  # a span ending past the registered blocks
    assert seq.token_ids == before_ids and dict(kv.allocator.indexed_blocks()) == before_index
    seq.set_token_ids(ids[8:16], start=8)  # the same ids: fine
    seq.set_token_ids([42, 43], start=16)  # block 2 is not registered: its ids may change
    assert seq.token_ids[16:18] == [42, 43] and seq.token_ids[:16] == ids[:16]
    kv.check()


def test_set_token_ids_over_a_truncated_registered_block_is_allowed_and_registers_the_new_chain():
    """After truncate() the block is no longer the sequence's registered block: new ids may be recorded there,
    and once it is full again it is registered under the new chain."""
    kv, gen = PagedKV(SPEC, 32, fingerprint=FP), torch.Generator().manual_seed(15)
    ids = list(range(100, 124))
    seq = kv.new_sequence()
    _append(seq, ids, gen)
    seq.truncate(20)
    seq.set_token_ids([7, 7, 7, 7], start=16)
    _append(seq, [8, 8, 8, 8], gen)
    want = [*ids[:16], 7, 7, 7, 7, 8, 8, 8, 8]
    assert seq.token_ids == want
    assert _registered(kv, seq) == block_hashes(want, T, fingerprint=FP)
    kv.check()


def _allocated_by_reserve(seq, n: int) -> int:
    """Blocks a reserve(n) takes from the allocator: new table entries plus copy-on-write copies."""
    blocks, copies = len(seq.block_table), seq.cow_copies
    seq.reserve(n)
    return len(seq.block_table) - blocks + seq.cow_copies - copies


@pytest.mark.parametrize("n", [1, 4, 5, 12])
def test_blocks_needed_counts_the_copy_of_an_indexed_tail_left_by_truncate(n):
    """After a truncate leaves a partly filled tail that is still in the prefix index, the next reserve copies it
    first: blocks_needed(n) says so, exactly what reserve(n) then allocates (an admission check relies on it)."""
    kv, gen = PagedKV(SPEC, 32, fingerprint=FP), torch.Generator().manual_seed(16)
    seq = kv.new_sequence()
    _append(seq, list(range(100, 124)), gen)
    seq.truncate(20)
    assert seq.block_table[-1] in kv.allocator.indexed_blocks()
    want = seq.blocks_needed(n)
    assert want == -(-(20 + n) // T) - 3 + 1
    assert _allocated_by_reserve(seq, n) == want


@pytest.mark.parametrize("n", [1, 4, 5])
def test_blocks_needed_counts_the_copy_of_a_shared_tail_left_by_truncate(n):
    """A fork shares the tail; after the parent truncates into it, reserving copies it: blocks_needed counts it."""
    kv, gen = PagedKV(SPEC, 32), torch.Generator().manual_seed(17)
    seq = kv.new_sequence()
    _append(seq, list(range(100, 124)), gen)
    child = seq.fork()
    seq.truncate(20)
    want = seq.blocks_needed(n)
    assert want == -(-(20 + n) // T) - 3 + 1
    assert _allocated_by_reserve(seq, n) == want
    child.free()


@pytest.mark.parametrize("n", [1, 4, 5])
def test_blocks_needed_after_truncate_with_a_private_unindexed_tail_is_just_new_blocks(n):
    """No prefix ids, no fork: the truncated tail is private and writable in place, so no copy is counted."""
    kv, gen = PagedKV(SPEC, 32), torch.Generator().manual_seed(18)
    seq = kv.new_sequence()
    for layer in range(SPEC.num_layers):
        k = torch.randn(2, 24, 4, generator=gen)
        seq.append(layer, k, k)  # no token ids: nothing is registered
    seq.truncate(20)
    assert seq.block_table[-1] not in kv.allocator.indexed_blocks()
    want = seq.blocks_needed(n)
    assert want == -(-(20 + n) // T) - 3
    assert _allocated_by_reserve(seq, n) == want


# ------------------------------------------- the allocator's parts: full mutmut run of paged-alloc (2026-12-02)
# The oracle: the blocks the test allocated, freed and cached, and the events it expects from those calls.

H1, H2 = bytes(range(32)), bytes(range(1, 33))
TOKENS = [5, 6, 7, 8]


def _cached_block(alloc):
    """A block indexed under H1 with TOKENS and then released: cached, refcount 0."""
    [block] = alloc.allocate(1)
    assert alloc.cache_block(block, H1, TOKENS)
    alloc.free(block)
    assert alloc.num_cached == 1 and alloc.refcount[block] == 0
    return block


def test_take_cached_revives_only_the_block_indexed_with_the_same_tokens():
    """take_cached serves a cached block only when both its hash and its token ids match (a hash collision never
    serves another prompt's KV), and the block it returns has one holder."""
    alloc = BlockAllocator(4)
    block = _cached_block(alloc)
    assert alloc.take_cached(H1, [5, 6, 7, 9]) is None  # same hash, other tokens
    assert alloc.take_cached(H2, TOKENS) is None  # other hash
    assert alloc.num_cached == 1 and alloc.refcount[block] == 0
    assert alloc.take_cached(H1, TOKENS) == block
    assert alloc.refcount[block] == 1 and alloc.num_cached == 0 and alloc.num_active == 1


def test_uncache_reports_the_hash_it_removed():
    """A subscriber to 'removed' (one kind given as a plain string) learns which hash left the index."""
    alloc = BlockAllocator(4)
    queue = alloc.subscribe(REMOVED)
    block = _cached_block(alloc)
    assert alloc.uncache(block) == H1
    assert queue.drain() == [BlockEvent(REMOVED, block, H1)]
    assert alloc.num_cached == 0 and alloc.num_free == 4


def test_a_cached_block_marked_cacheable_again_stays_cached():
    """set_cacheable(block, True) on a cached block changes nothing; set_cacheable(block, False) frees it; a
    non-bool is refused naming the argument."""
    alloc = BlockAllocator(4)
    block = _cached_block(alloc)
    alloc.set_cacheable(block, True)
    assert alloc.num_cached == 1 and alloc.num_free == 3
    with pytest.raises(ArgumentTypeError, match=r"^cacheable: expected bool, got int"):
        alloc.set_cacheable(block, 1)
    alloc.set_cacheable(block, False)
    assert alloc.num_cached == 0 and alloc.num_free == 4


def test_a_handler_s_own_allocator_calls_are_delivered_after_it_returns():
    """Events a handler causes (here: freeing another block) reach it after the current call returns, never
    nested inside it."""
    alloc = BlockAllocator(4)
    a, b = alloc.allocate(2)
    log = []

    def handler(event):
        log.append(("in", event.block))
        if event.block == a:
            alloc.free(b)
        log.append(("out", event.block))

    alloc.subscribe(FREED, handler=handler)
    alloc.free(a)
    assert log == [("in", a), ("out", a), ("in", b), ("out", b)]


def test_a_bounded_queue_keeps_the_newest_events_and_counts_every_drop():
    """maxlen=1 (the smallest allowed) keeps the last event; dropped counts each one pushed out."""
    alloc = BlockAllocator(4)
    queue = alloc.subscribe([FREED], maxlen=1)
    blocks = alloc.allocate(3)
    for block in blocks:
        alloc.free(block)
    assert queue.drain() == [BlockEvent(FREED, blocks[-1])] and queue.dropped == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kinds": ["freed", "nope"]}, r"^unknown event kinds \['nope'\]; expected some of \['allocated', "),
        ({"handler": 5}, r"^handler must be callable, got int$"),
        ({"maxlen": 0}, r"^maxlen: expected an integer in >= 1, got 0$"),
    ],
)
def test_a_bad_subscription_is_refused_naming_what_was_wrong(kwargs, message):
    """An unknown kind, a handler that is not callable and a maxlen below 1 are refused, each saying so."""
    alloc = BlockAllocator(2)
    with pytest.raises(InvalidArgumentError, match=message):
        alloc.subscribe(**kwargs)


def test_unsubscribe_stops_the_events():
    """After unsubscribe, the queue receives nothing more."""
    alloc = BlockAllocator(2)
    queue = alloc.subscribe(FREED)
    alloc.unsubscribe(queue)
    alloc.free(alloc.allocate(1)[0])
    assert len(queue) == 0


def test_allocate_up_to_takes_what_is_available_and_refuses_a_negative_count():
    """allocate_up_to(n) takes min(n, free + cached) blocks (0 is a valid n), evicting cached blocks last."""
    alloc = BlockAllocator(4)
    cached = _cached_block(alloc)
    assert alloc.allocate_up_to(0) == []
    got = alloc.allocate_up_to(2)
    assert len(got) == 2 and cached not in got and alloc.num_cached == 1
    got += alloc.allocate_up_to(10)
    assert sorted(got) == [0, 1, 2, 3] and alloc.num_available == 0 and alloc.num_active == 4
    with pytest.raises(InvalidArgumentError, match=r"^n: expected an integer in >= 0, got -1$"):
        alloc.allocate_up_to(-1)


def test_cache_block_announces_what_it_stored_and_refuses_bad_arguments_naming_them():
    """cache_block emits 'stored' with the block and its hash; a hash already indexed, or a block that already has
    one, is not stored again (False, no event, the block is freed, not cached, at refcount 0); a non-bytes hash,
    non-int tokens and a free block are refused, each naming what was wrong."""
    alloc = BlockAllocator(4)
    queue = alloc.subscribe(STORED)
    a, b, c = alloc.allocate(3)
    assert alloc.cache_block(a, H1, [UNKNOWN_TOKEN, 6, 7, 8])
    assert queue.drain() == [BlockEvent(STORED, a, H1)]
    assert alloc.tokens_of(a) == (UNKNOWN_TOKEN, 6, 7, 8)
    assert not alloc.cache_block(b, H1, TOKENS) and not alloc.cache_block(a, H2, TOKENS)
    assert len(queue) == 0 and alloc.hash_of(b) is None and alloc.hash_of(a) == H1
    alloc.free(b)
    assert alloc.num_cached == 0 and alloc.num_free == 2
    with pytest.raises(ArgumentTypeError, match=r"^block_hash: expected bytes, got str"):
        alloc.cache_block(c, "h", TOKENS)
    with pytest.raises(ArgumentTypeError, match=r"^tokens: expected a sequence of int token ids, got str"):
        alloc.cache_block(c, H2, "abcd")
    with pytest.raises(InvalidBlockError, match=rf"^block {b} is free: only a held, written block can be cached$"):
        alloc.cache_block(b, H2, TOKENS)
    assert alloc.hash_of(c) is None and len(queue) == 0


def test_cache_blocks_indexes_every_new_hash_of_the_run_and_checks_its_lengths():
    """A run whose first hash is already indexed still indexes the blocks after it; too few token ids for the
    blocks, or ids that are not ints, are refused naming the counts and the argument."""
    alloc = BlockAllocator(4)
    a, b, c = alloc.allocate(3)
    assert alloc.cache_block(a, H1, TOKENS)
    assert alloc.cache_blocks([b, c], [H1, H2], TOKENS * 2, 4) == 1
    assert alloc.hash_of(b) is None and alloc.hash_of(c) == H2
    with pytest.raises(ShapeError, match=r"^2 blocks need 2 hashes and 8 token ids, got 2 and 7$"):
        alloc.cache_blocks([a, b], [H1, H2], list(range(7)), 4)
    with pytest.raises(ArgumentTypeError, match=r"^token_ids: expected int token ids, got float"):
        alloc.cache_blocks([b], [bytes(32)], [1.0, 2, 3, 4], 4)
    assert alloc.hash_of(b) is None


def test_grow_refuses_a_bad_count_naming_it_and_changes_nothing():
    """grow takes a positive int (or a 0-d integer tensor); 0, a bool, a float and more than MAX_BLOCKS in all are
    refused with the reason, and the allocator keeps its size."""
    alloc = BlockAllocator(2)
    assert alloc.grow(torch.tensor(1)) == range(2, 3) and alloc.num_blocks == 3
    with pytest.raises(InvalidArgumentError, match=r"^n: expected a positive number of blocks to add, got 0$"):
        alloc.grow(0)
    with pytest.raises(InvalidArgumentError, match=r"^n: expected an integer in >= 1, got 0$"):
        alloc.grow(torch.tensor(0))
    with pytest.raises(ArgumentTypeError, match=r"^n: "):
        alloc.grow(True)
    room = MAX_BLOCKS - 3
    with pytest.raises(InvalidArgumentError, match=rf"^n: expected at most {room} more blocks \(an allocator holds"):
        alloc.grow(room + 1)
    assert alloc.num_blocks == 3 and alloc.num_free == 3


def test_grow_up_to_the_limit_is_allowed_and_running_out_of_memory_changes_nothing(monkeypatch):
    """Exactly MAX_BLOCKS in all passes the count check (arrays that large cannot be built here, so the
    bookkeeping step is stubbed); a MemoryError while building is CapacityExceededError with needed=n."""
    alloc = BlockAllocator(2)
    asked = []
    monkeypatch.setattr(alloc, "_grow", lambda n: asked.append(n) or range(2, 2 + n))
    alloc.grow(MAX_BLOCKS - 2)
    assert asked == [MAX_BLOCKS - 2]

    def out_of_memory(n):
        raise MemoryError

    monkeypatch.setattr(alloc, "_grow", out_of_memory)
    with pytest.raises(CapacityExceededError, match=r"^could not grow the allocator by 5 blocks: out of host") as info:
        alloc.grow(5)
    assert info.value.needed == 5 and isinstance(info.value.__cause__, MemoryError)
    assert alloc.num_blocks == 2


def test_free_many_announces_each_cached_block_with_its_hash_and_checks_its_argument():
    """Freeing a sequence's blocks at once emits 'cached' with the hash of each indexed block (and 'freed' for the
    others); something that is not an iterable of ids is refused naming the argument, and bind_capacity refuses a
    capacity that is not callable, saying what it got."""
    alloc = BlockAllocator(4)
    queue = alloc.subscribe([CACHED, FREED])
    a, b = alloc.allocate(2)
    assert alloc.cache_block(a, H1, TOKENS)
    alloc.free_many([b, a])
    assert queue.drain() == [BlockEvent(FREED, b), BlockEvent(CACHED, a, H1)]
    with pytest.raises(ArgumentTypeError, match=r"^blocks: expected Iterable, got int"):
        alloc.free_many(3)
    with pytest.raises(ArgumentTypeError, match=r"^capacity: expected a callable returning a block count, got 7$"):
        alloc.bind_capacity(7)


def test_free_announces_cached_and_freed_blocks_and_names_a_bad_free():
    """free() of an indexed block emits 'cached' with its hash, of a plain block 'freed'; freeing a free block or
    a cached one (no holder) is refused naming the block and why."""
    alloc = BlockAllocator(4)
    queue = alloc.subscribe([CACHED, FREED])
    a, b = alloc.allocate(2)
    assert alloc.cache_block(a, H1, TOKENS)
    alloc.free(a)
    alloc.free(b)
    assert queue.drain() == [BlockEvent(CACHED, a, H1), BlockEvent(FREED, b)]
    with pytest.raises(DoubleFreeError, match=rf"^block {b} is already free$"):
        alloc.free(b)
    with pytest.raises(
        RefcountUnderflowError, match=rf"^block {a} has refcount 0 \(cached\); it has no holder to drop$"
    ):
        alloc.free(a)


@pytest.mark.parametrize(
    ("ids", "error", "message"),
    [
        ([-1], InvalidBlockError, r"^block id -1 is not in \[0, 4\)$"),
        ([4], InvalidBlockError, r"^block id 4 is not in \[0, 4\)$"),
        ([0, True], ArgumentTypeError, r"got bool"),
    ],
)
def test_free_many_refuses_an_id_outside_the_pool_or_not_an_int_and_frees_nothing(ids, error, message):
    """Every id is checked before any block is freed: -1, num_blocks and a bool are refused, naming the id."""
    alloc = BlockAllocator(4)
    held = alloc.allocate(4)
    with pytest.raises(error, match=message):
        alloc.free_many(ids)
    assert alloc.num_active == 4 and list(alloc.refcount) == [1, 1, 1, 1] and held == [0, 1, 2, 3]


def test_free_many_refuses_a_free_block_or_too_many_drops_and_frees_nothing():
    """A free block in the list, or a block listed more often than it has holders, is refused naming it, its count
    and its state; the other blocks keep their holders."""
    alloc = BlockAllocator(4)
    a, b, c = alloc.allocate(3)
    alloc.free(c)
    with pytest.raises(DoubleFreeError, match=rf"^block {c} is already free$"):
        alloc.free_many([a, c])
    with pytest.raises(RefcountUnderflowError, match=rf"^block {b}: freeing 2 holder\(s\) but it has refcount 1 "
                       r"\(state active\)$"):  # fmt: skip
        alloc.free_many([a, b, b])
    assert alloc.refcount[a] == 1 and alloc.refcount[b] == 1 and alloc.num_free == 2


def test_cache_blocks_with_packed_ids_checks_their_length_refuses_free_blocks_and_announces_each():
    """Packed ids shorter than the blocks need are refused naming both sizes; a free block in the run is refused
    naming it (nothing is indexed); each block stored is announced with its own hash."""
    alloc = BlockAllocator(4)
    queue = alloc.subscribe(STORED)
    a, b, c = alloc.allocate(3)
    alloc.free(c)
    packed = pack_ids(TOKENS * 2)
    with pytest.raises(ShapeError, match=r"^2 blocks need 64 packed bytes, got 56$"):
        alloc.cache_blocks([a, b], [H1, H2], TOKENS * 2, 4, packed=packed[:56])
    with pytest.raises(InvalidBlockError, match=rf"^block {c} is free: only held, written blocks can be cached$"):
        alloc.cache_blocks([a, c], [H1, H2], TOKENS * 2, 4, packed=packed)
    assert alloc.hash_of(a) is None and len(queue) == 0
    assert alloc.cache_blocks([a, b], [H1, H2], TOKENS * 2, 4, packed=packed) == 2
    assert queue.drain() == [BlockEvent(STORED, a, H1), BlockEvent(STORED, b, H2)]


def test_allocate_takes_one_block_by_default_and_refuses_a_bad_count_naming_it():
    """allocate() takes one block; 0 takes none; a negative count, a bool or a float is refused naming n, and
    nothing is taken. The 'allocated' event reports the count and a sane duration (a duration, not a clock)."""
    alloc = BlockAllocator(4)
    queue = alloc.subscribe(ALLOCATED)
    assert len(alloc.allocate()) == 1 and alloc.allocate(0) == []
    assert alloc.allocate(torch.tensor(2)) == [1, 2]
    events = queue.drain()
    assert [e.count for e in events] == [1, 0, 2] and all(0.0 < e.seconds < 60.0 and e.block == -1 for e in events)
    with pytest.raises(InvalidArgumentError, match=r"^n: expected an integer in >= 0, got -1$"):
        alloc.allocate(-1)
    for bad in (True, 1.5):
        with pytest.raises(ArgumentTypeError, match=r"^n: "):
            alloc.allocate(bad)
    assert alloc.num_active == 3 and alloc.num_free == 1


def test_a_block_id_must_be_a_plain_int_inside_the_pool():
    """A bool, a float or an id outside [0, num_blocks) is refused naming the block argument or the range."""
    alloc = BlockAllocator(4)
    alloc.allocate(4)
    for bad in (True, 1.5):
        with pytest.raises(ArgumentTypeError, match=r"^block: expected"):
            alloc.free(bad)
    with pytest.raises(InvalidBlockError, match=r"^block id -1 is not in \[0, 4\)$"):
        alloc.free(-1)
    with pytest.raises(InvalidBlockError, match=r"^block id 4 is not in \[0, 4\)$"):
        alloc.incref(4)
    alloc.free(0)
    assert alloc.num_free == 1 and list(alloc.refcount) == [0, 1, 1, 1]


def test_token_ids_outside_int64_are_refused_naming_the_argument():
    alloc = BlockAllocator(2)
    [block] = alloc.allocate(1)
    with pytest.raises(InvalidArgumentError, match=r"^tokens: token ids must fit a signed 64-bit int$"):
        alloc.cache_block(block, H1, [2**63, 0, 0, 0])
    assert alloc.hash_of(block) is None


def test_an_allocator_needs_a_positive_int_size_and_reports_what_is_available():
    """BlockAllocator(1) is the smallest; 0, a float and a bool are refused naming the value. Asking for more
    blocks than free + cached says how many are available (cached blocks count)."""
    assert BlockAllocator(1).num_free == 1
    for bad in (0, 1.5, True):
        with pytest.raises(ConfigError, match=rf"^num_blocks must be a positive int, got {bad!r}$"):
            BlockAllocator(bad)
    alloc = BlockAllocator(4)
    _cached_block(alloc)
    alloc.allocate(1)
    with pytest.raises(OutOfBlocksError) as info:
        alloc.allocate(4)
    assert (info.value.needed, info.value.available) == (4, 3)


def test_a_new_free_list_is_linked_both_ways():
    """A fresh pool's free list is a consistent doubly linked list: walking it forward gives the blocks in id
    order, and each block's back link names the one before it (the sentinel for the first), so a block can be
    unlinked from anywhere in the list, not only from its front; the link arrays hold the blocks and two sentinels."""
    from memos_ref.paged.free_list import FreeLists

    for n in (0, 1, 2, 5):
        lists = FreeLists(n)
        order = list(lists.free)
        assert order == list(range(n))
        sentinel = lists.free.sentinel
        assert [lists.prev[b] for b in order] == [sentinel, *order][:n]
        assert lists.prev[sentinel] == (order[-1] if order else sentinel)
        assert len(lists.prev) == len(lists.next) == n + 2
        if n >= 3:  # unlinking a middle block keeps the rest linked both ways
            lists.free.unlink(1)
            rest = list(lists.free)
            assert rest == [b for b in range(n) if b != 1]
            assert [lists.prev[b] for b in rest] == [sentinel, *rest[:-1]]


# ------------------------------------------- a sequence's parts: full mutmut run of paged (2026-12-02)
# The oracle: slots computed by hand from the block table (block * T + offset), the token and layer counts the
# test wrote, and the error each bad argument must raise, naming the argument and its range.


def _written(n: int, seed: int = 21):
    """A plain sequence holding n tokens in every layer (ids 100..), with its pool."""
    kv, gen = PagedKV(SPEC, 32, fingerprint=FP), torch.Generator().manual_seed(seed)
    seq = kv.new_sequence()
    _append(seq, list(range(100, 100 + n)), gen)
    return kv, seq


def _by_hand(seq, start: int, stop: int) -> list[int]:
    return [seq.block_table[p // T] * T + p % T for p in range(start, stop)]


def test_slot_is_block_times_block_size_plus_offset_for_every_position_written():
    """slot(p) is block_table[p // T] * T + p % T for each written position, the first and the last included."""
    kv, seq = _written(21)
    kv.allocator.allocate(3)  # later blocks have ids > 0, so a wrong product or sum shows
    _append(seq, list(range(300, 310)), torch.Generator().manual_seed(1))
    assert len(seq.block_table) == 4 and all(b > 0 for b in seq.block_table[1:])
    assert [seq.slot(p) for p in range(31)] == _by_hand(seq, 0, 31)
    assert all(type(seq.slot(p)) is int for p in (0, 9, 30))


@pytest.mark.parametrize("position", [-1, 21])
def test_slot_outside_the_written_positions_is_refused_naming_position_and_its_range(position):
    _kv, seq = _written(21)
    with pytest.raises(InvalidArgumentError, match=rf"^position: expected an integer in \[0, 20\], got {position}$"):
        seq.slot(position)
    with pytest.raises(ArgumentTypeError, match=r"^position: expected int, got float"):
        seq.slot(1.0)


@pytest.mark.parametrize("method", ["slot_mapping", "slot_list"])
def test_slot_mapping_and_slot_list_give_block_times_t_plus_offset_for_every_position_asked(method):
    """slot_mapping(start, stop) (a long tensor) and slot_list (a list) give block * T + offset for each position
    in [start, stop): the whole sequence, a middle range, an empty range at either end."""
    kv, seq = _written(21)
    kv.allocator.allocate(2)
    _append(seq, list(range(300, 315)), torch.Generator().manual_seed(2))
    get = getattr(seq, method)
    for start, stop in [(0, 36), (5, 27), (0, 0), (36, 36), (8, 16)]:
        got = get(start, stop)
        if method == "slot_mapping":
            assert got.dtype == torch.long
            got = got.tolist()
        assert got == _by_hand(seq, start, stop)


@pytest.mark.parametrize("method", ["slot_mapping", "slot_list"])
@pytest.mark.parametrize(
    ("start", "stop", "error", "message"),
    [
        (-1, 3, InvalidArgumentError, r"^start: expected an integer in \[0, 21\], got -1$"),
        (22, 22, InvalidArgumentError, r"^start: expected an integer in \[0, 21\], got 22$"),
        (3, 2, InvalidArgumentError, r"^stop: expected an integer in \[3, 21\], got 2$"),
        (3, 22, InvalidArgumentError, r"^stop: expected an integer in \[3, 21\], got 22$"),
        ("0", 2, ArgumentTypeError, r"^start: expected int, got str"),
        (0, None, ArgumentTypeError, r"^stop: expected int, got NoneType"),
    ],
)
def test_slot_mapping_and_slot_list_refuse_a_bad_range_naming_the_argument(method, start, stop, error, message):
    """A range outside [0, num_tokens], or stop before start, is refused naming the argument and its bounds."""
    _kv, seq = _written(21)
    with pytest.raises(error, match=message):
        getattr(seq, method)(start, stop)


def _half_step(seq, ids, seed=3):
    """Layer 0 writes len(ids) new tokens; layer 1 has not yet (a model step that stops part-way)."""
    k = torch.randn(2, len(ids), 4, generator=torch.Generator().manual_seed(seed))
    seq.append(0, k, k, list(ids))


@pytest.mark.parametrize("n", [0, 5, 12])
def test_rollback_step_after_a_failed_step_leaves_the_sequence_as_before_it(n):
    """rollback_step(n) after a step that stopped part-way: every layer holds n tokens, the blocks reserved past
    them go back to the allocator, and the sequence works on (n may be 0: everything goes)."""
    kv, seq = _written(12)
    free0 = kv.allocator.num_available
    _half_step(seq, range(500, 510))
    assert seq.num_tokens == 22 and seq.layer_tokens == [22, 12]
    seq.rollback_step(n)
    assert seq.num_tokens == n and seq.layer_tokens == [n, n] and seq.token_ids == list(range(100, 100 + n))
    assert len(seq.block_table) == -(-n // T)
    assert kv.allocator.num_available == free0 + 2 - len(seq.block_table)
    kv.check()


@pytest.mark.parametrize("n", [13, 22, -1])
def test_rollback_step_cannot_keep_tokens_a_layer_did_not_write(n):
    """rollback_step keeps at most what every layer holds (12 here, layer 1 not having run): a larger n is
    refused naming n and that bound, and nothing changes."""
    _kv, seq = _written(12)
    _half_step(seq, range(500, 510))
    table = list(seq.block_table)
    with pytest.raises(InvalidArgumentError, match=rf"^n: expected an integer in \[0, 12\], got {n}$"):
        seq.rollback_step(n)
    assert seq.num_tokens == 22 and seq.layer_tokens == [22, 12] and seq.block_table == table


def test_adopt_prefix_takes_block_ids_given_as_integer_tensors_from_the_first_to_the_last_block():
    """Block ids as 0-d integer tensors (or numpy ints) are accepted like ints, block 0 and the pool's last block
    included; the sequence then reads those blocks."""
    kv = PagedKV(SPEC, 4, fingerprint=FP)
    blocks = kv.allocator.allocate(4)
    assert sorted(blocks) == [0, 1, 2, 3]
    seq = kv.new_sequence()
    seq.adopt_prefix([torch.tensor(0), torch.tensor(3)], list(range(16)))
    assert seq.block_table == [0, 3] and seq.num_tokens == 16
    assert [type(b) for b in seq.block_table] == [int, int]


@pytest.mark.parametrize(
    ("block", "error", "message"),
    [
        (-1, InvalidBlockError, r"^block id -1 is not in \[0, 4\)$"),
        (-1000, InvalidBlockError, r"^block id -1000 is not in \[0, 4\)$"),
        (4, InvalidBlockError, r"^block id 4 is not in \[0, 4\)$"),
        (-(2**62) - 1, InvalidArgumentError, rf"^block: expected an integer in >= {-(2**62)}, got"),
        (True, ArgumentTypeError, r"^block: expected int, got bool"),
        ("1", ArgumentTypeError, r"^block: expected int, got str"),
        (2, InvalidBlockError, r"^block 2 is free: adopt only blocks a prefix lookup returned \(they carry the"),
    ],
)
def test_adopt_prefix_refuses_a_block_that_is_not_held_naming_it_and_changes_nothing(block, error, message):
    """Only blocks a lookup handed over (allocated, in the pool) can be adopted; anything else is refused with
    the reason, and the sequence stays empty."""
    kv = PagedKV(SPEC, 4, fingerprint=FP)
    held = kv.allocator.allocate(2)
    assert sorted(held) == [0, 1]
    seq = kv.new_sequence()
    with pytest.raises(error, match=message):
        seq.adopt_prefix([held[0], block], list(range(16)))
    assert seq.num_tokens == 0 and seq.block_table == []
    assert [kv.allocator.refcount[b] for b in range(4)] == [1, 1, 0, 0]


def _held_prefix(kv, ids, salt=None):
    """Another live sequence holding ``ids`` (registered in the prefix index)."""
    other = kv.new_sequence(cache_salt=salt)
    other.advance(list(ids))
    assert other.num_registered == len(ids) // T
    return other


@pytest.mark.parametrize("token", [3.0, True, "7", -2, 2**63])
def test_append_token_refuses_a_bad_token_and_changes_nothing(token):
    """append_token takes only a plain int id in [-1, 2**63); anything else is refused, whether the token would go
    into the tail or start a block, and nothing is recorded."""
    kv = PagedKV(SPEC, 8, fingerprint=FP)
    seq = kv.new_sequence()
    for n in (3, 8):  # inside the tail, then at a block boundary
        seq.advance(list(range(n - seq.num_tokens)))
        table, ids, free = list(seq.block_table), list(seq.token_ids), kv.allocator.num_available
        with pytest.raises((ArgumentTypeError, InvalidArgumentError), match=r"^token_ids"):
            seq.append_token(token)
        with pytest.raises((ArgumentTypeError, InvalidArgumentError), match=r"^token_ids"):
            seq.advance([token])
        assert (seq.num_tokens, seq.token_ids, seq.block_table) == (n, ids, table)
        assert seq.layer_tokens == [n, n] and kv.allocator.num_available == free


def test_append_token_after_free_is_refused_and_takes_no_block():
    from memos_ref.errors import UseAfterFreeError

    kv = PagedKV(SPEC, 8, fingerprint=FP)
    seq = kv.new_sequence()
    seq.advance(list(range(8)))
    seq.free()
    for call in (lambda: seq.append_token(5), lambda: seq.advance([5])):
        with pytest.raises(UseAfterFreeError):
            call()
        assert kv.allocator.num_available == 8 and seq.block_table == [] and seq.num_tokens == 0


def test_append_token_and_advance_return_the_new_positions_and_register_each_filled_block():
    """Decoding token by token (append_token, advance of one id, advance of two): each call returns exactly the
    positions it added, a block is allocated every T tokens, and each filled block is registered under the hash
    of the ids so far (salted hashes for a salted sequence), so another sequence with that salt reuses it."""
    for salt in (None, "tenant-a"):
        kv = PagedKV(SPEC, 16, fingerprint=FP)
        seq = kv.new_sequence(cache_salt=salt)
        ids = [1000 + i for i in range(27)]
        done = 0
        while done < len(ids):
            if done % 3 == 0:
                got = [seq.append_token(ids[done])]
                step = 1
            elif done % 3 == 1:
                got = list(seq.advance([ids[done]]))
                step = 1
            else:
                step = min(2, len(ids) - done)
                got = list(seq.advance(ids[done : done + step]))
            assert got == list(range(done, done + step))
            done += step
            assert seq.num_tokens == done and seq.layer_tokens == [done, done] and seq.token_ids == ids[:done]
            assert len(seq.block_table) == -(-done // T)
        want = block_hashes(ids, T, fingerprint=FP, cache_salt=salt)
        assert _registered(kv, seq) == [*want, None]
        again = kv.start_from_prefix([*ids[:24], 1], cache_salt=salt)
        assert again.block_table == seq.block_table[:3]
        other = kv.start_from_prefix([*ids[:24], 1], cache_salt="someone-else")
        assert other.block_table == []
        kv.check()


@pytest.mark.parametrize("unknown_at", [0, 3, 7])
def test_a_block_holding_an_unknown_id_and_every_block_after_it_are_never_indexed(unknown_at):
    """An unknown id (-1) in a block keeps that block, and every block after it, out of the prefix index however
    the tokens arrive (append_token one by one), so no KV is ever shared on an unknown token."""
    kv = PagedKV(SPEC, 16, fingerprint=FP)
    seq = kv.new_sequence()
    ids = [2000 + i for i in range(8)] + [3000 + i for i in range(24)]
    ids[8 + unknown_at] = UNKNOWN_TOKEN  # in block 1
    for token in ids:
        seq.append_token(token)
    assert _registered(kv, seq) == [block_hashes(ids[:8], T, fingerprint=FP)[0], None, None, None]
    assert seq.num_registered == 1
    kv.check()


def test_admit_on_a_sequence_that_holds_tokens_is_refused_and_changes_nothing():
    from memos_ref.errors import StateError

    kv = PagedKV(SPEC, 8, fingerprint=FP)
    seq = kv.new_sequence()
    seq.advance([1, 2, 3])
    with pytest.raises(StateError, match=r"^admit\(\) starts an empty sequence; this one holds 3 tokens$"):
        seq.admit([4, 5])
    assert seq.token_ids == [1, 2, 3] and len(seq.block_table) == 1


@pytest.mark.parametrize(
    ("ids", "error", "message"),
    [
        ([1, 1.5], ArgumentTypeError, r"^token_ids\[1\]: expected int, got float"),
        ([1, -2], InvalidArgumentError, r"^token_ids: token ids must lie in"),
        ("ab", ArgumentTypeError, r"^token_ids: expected a sequence of int token ids"),
    ],
)
def test_admit_and_set_token_ids_refuse_bad_ids_naming_token_ids(ids, error, message):
    kv = PagedKV(SPEC, 8, fingerprint=FP)
    seq = kv.new_sequence()
    with pytest.raises(error, match=message):
        seq.admit(ids)
    assert seq.num_tokens == 0 and kv.allocator.num_available == 8
    seq.advance([7, 7, 7])
    with pytest.raises(error, match=message):
        seq.set_token_ids(ids)
    assert seq.token_ids == [7, 7, 7]


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_admit_reuses_exactly_the_longest_registered_prefix_and_computes_only_the_rest(salt):
    """admit(prompt) reuses the held prefix blocks of the same salt (never another salt's), allocates only the
    rest, and returns the positions it must compute."""
    kv = PagedKV(SPEC, 16, fingerprint=FP)
    prefix = list(range(500, 516))
    _held_prefix(kv, prefix, "someone-else")
    other = _held_prefix(kv, prefix, salt)
    seq = kv.new_sequence(cache_salt=salt)
    free = kv.allocator.num_available
    assert list(seq.admit([*prefix, 1, 2, 3])) == [16, 17, 18]
    assert seq.block_table[:2] == other.block_table and kv.allocator.num_available == free - 1
    kv.check()


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_admit_fits_when_the_pool_has_exactly_the_blocks_past_the_reused_prefix(salt):
    """A 17-token prompt whose first two blocks another sequence holds needs one new block: with exactly one free
    block admit succeeds (the admission check counts the reusable prefix, salted as the sequence is)."""
    kv = PagedKV(SPEC, 4, fingerprint=FP)
    prefix = list(range(500, 516))
    other = _held_prefix(kv, prefix, salt)
    kv.allocator.allocate(1)
    assert kv.allocator.num_available == 1
    seq = kv.new_sequence(cache_salt=salt)
    assert list(seq.admit([*prefix, 9])) == [16]
    assert seq.block_table[:2] == other.block_table and kv.allocator.num_available == 0


@pytest.mark.parametrize("n", [8, 16])
def test_admit_refused_for_lack_of_blocks_takes_no_reference_and_counts_no_lookup(n):
    """A prompt of n = k * T tokens whose blocks another sequence holds still needs its last block computed (one
    token is always left): with no free block admit raises OutOfBlocksError(needed=1, available=0) before any
    change — no reference taken on the held blocks, no lookup counted."""
    kv = PagedKV(SPEC, 2, fingerprint=FP)
    prefix = list(range(500, 500 + n))
    other = _held_prefix(kv, prefix)
    if n == 8:
        kv.allocator.allocate(1)
    assert kv.allocator.num_available == 0
    stats = kv.prefix_cache.stats()
    seq = kv.new_sequence()
    with pytest.raises(OutOfBlocksError) as info:
        seq.admit(prefix)
    assert (info.value.needed, info.value.available) == (1, 0)
    assert [kv.allocator.refcount[b] for b in other.block_table] == [1] * len(other.block_table)
    assert kv.prefix_cache.stats() == stats and seq.block_table == [] and seq.num_tokens == 0


def test_admit_and_set_token_ids_work_without_a_prefix_cache():
    """A store with prefix caching off: admit allocates every block (no lookup), set_token_ids records ids."""
    kv = PagedKV(SPEC, 8, prefix_caching=False)
    assert kv.prefix_cache is None
    seq = kv.new_sequence()
    assert list(seq.admit(list(range(20)))) == list(range(20))
    assert len(seq.block_table) == 3 and kv.allocator.num_available == 5
    seq.set_token_ids([7] * 16)
    assert seq.token_ids == [7] * 16 + list(range(16, 20))
    kv.check()


@pytest.mark.parametrize(
    ("ids", "start", "error", "message"),
    [
        ([], 21, InvalidArgumentError, r"^start: expected an integer in \[0, 20\], got 21$"),
        ([1], -1, InvalidArgumentError, r"^start: expected an integer in \[0, 20\], got -1$"),
        ([1, 2, 3], 18, ShapeError, r"^3 ids from 18 exceed the 20 tokens held$"),
        ([9] * 4, 12, InvalidArgumentError, r"^token_ids: positions 12\.\.15 lie in blocks already in the prefix"),
        ([9] * 20, 0, InvalidArgumentError, r"^token_ids: positions 0\.\.15 lie in blocks already in the prefix"),
    ],
)
def test_set_token_ids_refuses_a_bad_range_or_registered_positions_naming_them(ids, start, error, message):
    """set_token_ids names the bad start, the ids that overrun, or exactly the registered positions it would
    rewrite; nothing changes."""
    kv = PagedKV(SPEC, 8, fingerprint=FP)
    seq = kv.new_sequence()
    seq.advance(list(range(20)))
    with pytest.raises(error, match=message):
        seq.set_token_ids(ids, start=start)
    assert seq.token_ids == list(range(20))


# a quantized pool with a full-precision residual window of one block (8 tokens) and a few staging blocks
def _quant_kv(num_blocks=24, staging=4, residual=8, **kw):
    from memos_ref.quant import FP8E4M3

    return PagedKV(
        SPEC, num_blocks, quant=FP8E4M3(), residual_tokens=residual, staging_blocks=staging, fingerprint=FP, **kw
    )


def _staged(kv, seq) -> list[bool]:
    """Per block of the sequence: still at full precision in a staging slot (False: sealed)."""
    return [int(kv.pool.staging_slot[b]) >= 0 for b in seq.block_table]


def test_seal_idle_seals_every_full_block_no_other_sequence_holds_in_its_window():
    """seal_idle on a quiet sequence seals its full blocks (window included), keeps the partial tail staged,
    returns how many it sealed, and never seals a block a live fork still holds in its own window; a plain pool
    or a sequence in the middle of a step seals nothing (0)."""
    kv, gen = _quant_kv(), torch.Generator().manual_seed(31)
    seq = kv.new_sequence()
    _append(seq, list(range(20)), gen)
    assert seq.window_start == 1 and _staged(kv, seq) == [False, True, True]
    child = seq.fork()
    assert seq.seal_idle() == 0 and _staged(kv, seq) == [False, True, True]  # the fork holds blocks 1 and 2
    child.free()
    assert seq.seal_idle() == 1 and _staged(kv, seq) == [False, False, True]
    kv.check()  # the window's holds are back: the sequence still holds blocks 1..2
    k = torch.randn(2, 4, 4, generator=gen)
    seq.append(0, k, k, [20, 21, 22, 23])  # layer 1 has not written yet
    assert seq.seal_idle() == 0 and _staged(kv, seq) == [False, False, True]
    seq.append(1, k, k)
    assert seq.seal_idle() == 1 and _staged(kv, seq) == [False, False, False]
    kv.check()
    plain = PagedKV(SPEC, 8).new_sequence()
    plain.advance(list(range(20)))
    assert plain.seal_idle() == 0


def test_staging_needed_counts_new_blocks_plus_a_tail_to_copy_or_restage():
    """staging_needed(n): one staging block per new block, plus one when a partly filled tail is shared (copied on
    write) or sealed at a block boundary it is not; 0 for n = 0 and for a plain pool. Counted by hand."""
    kv, gen = _quant_kv(), torch.Generator().manual_seed(32)
    seq = kv.new_sequence()
    _append(seq, [1, 2, 3], gen)
    assert int(kv.pool.staging_slot[seq.block_table[-1]]) == 0  # a staged tail in slot 0 is not sealed
    assert [seq.staging_needed(n) for n in (0, 1, 5, 6, 13, 14)] == [0, 0, 0, 1, 1, 2]
    child = seq.fork()  # the tail is now shared: the next write copies it first
    assert [seq.staging_needed(n) for n in (0, 1, 5, 6)] == [0, 1, 1, 2]
    child.free()
    _append(seq, list(range(4, 25)), gen)  # 24 tokens: at a block boundary
    seq.seal_idle()
    assert _staged(kv, seq) == [False, False, False]
    assert [seq.staging_needed(n) for n in (0, 1, 8, 9)] == [0, 1, 1, 2]  # a full sealed tail is not re-staged
    plain = PagedKV(SPEC, 8).new_sequence()
    plain.advance([1, 2, 3])
    assert [plain.staging_needed(n) for n in (0, 1, 6, 20)] == [0, 0, 0, 0]
    with pytest.raises(InvalidArgumentError, match=r"^n: expected an integer in >= 0, got -1$"):
        seq.staging_needed(-1)
    with pytest.raises(ArgumentTypeError, match=r"^n: expected int, got float"):
        plain.staging_needed(1.0)


def test_a_write_past_the_free_staging_is_refused_naming_need_and_capacity_and_changes_nothing():
    kv, gen = _quant_kv(staging=3), torch.Generator().manual_seed(33)
    seq = kv.new_sequence()
    table = list(seq.block_table)
    with pytest.raises(StagingFullError) as info:
        _append(seq, list(range(25)), gen)
    assert (info.value.needed, info.value.capacity) == (4, 3)
    assert str(info.value).startswith("4 blocks need full-precision staging but 3 of 3 staging blocks are free")
    assert seq.block_table == table and seq.num_tokens == 0 and kv.pool.staging_available == 3
    kv.check()


def _cached_prefix(kv, ids, gen):
    """Write ``ids`` in a sequence and free it: its full blocks stay cached (refcount 0) in the prefix index."""
    seq = kv.new_sequence()
    _append(seq, ids, gen)
    table = list(seq.block_table)
    seq.free()
    return table


def test_admit_over_a_windowed_pool_reuses_the_prefix_of_its_salt_and_refuses_what_does_not_fit():
    """admit over a quantized pool with residual windows: the cached prefix of the same salt is reused (the rest
    computed), a prompt the pool cannot hold is refused with OutOfBlocksError before anything changes (no lookup
    counted), and a salted sequence never reuses another salt's prefix."""
    kv, gen = _quant_kv(num_blocks=6), torch.Generator().manual_seed(34)
    prefix = list(range(600, 616))
    blocks = _cached_prefix(kv, [*prefix, 1], gen)
    stats = kv.prefix_cache.stats()
    big = kv.new_sequence()
    with pytest.raises(OutOfBlocksError) as info:
        big.admit([*prefix, *range(50)])  # 66 tokens: 9 blocks, 2 of them cached
    assert (info.value.needed, info.value.available) == (7, 4)
    assert kv.prefix_cache.stats() == stats and big.block_table == []
    salted = kv.new_sequence(cache_salt="tenant-a")
    assert list(salted.admit([*prefix, 2])) == list(range(17))
    assert not set(salted.block_table) & set(blocks[:2])
    salted.free()
    seq = kv.new_sequence()
    assert list(seq.admit([*prefix, 3])) == [16]
    assert seq.block_table[:2] == blocks[:2]
    kv.check()


def test_admit_over_a_windowed_pool_that_runs_out_of_staging_leaves_an_empty_reusable_sequence():
    """When the rest of the prompt cannot be staged, admit raises StagingFullError and the sequence is empty and
    live again: no block held, hit statistics as before, the prefix still cached, and the same sequence takes
    writes (registering its full blocks) and admits a prompt that fits."""
    kv, gen = _quant_kv(num_blocks=12, staging=2), torch.Generator().manual_seed(35)
    prefix = list(range(700, 716))
    blocks = _cached_prefix(kv, prefix, gen)
    stats = kv.prefix_cache.stats()
    seq = kv.new_sequence()
    with pytest.raises(StagingFullError):
        seq.admit([*prefix, *range(40)])  # 56 tokens: 5 blocks past the prefix, 2 staging blocks
    assert seq.block_table == [] and seq.token_ids == [] and seq.num_tokens == 0
    assert seq.layer_tokens == [0, 0] and seq.window_start == 0 and seq.num_registered == 0
    st = kv.prefix_cache.stats()
    assert st["prefix_hit_tokens"] == stats["prefix_hit_tokens"]
    assert [kv.allocator.refcount[b] for b in blocks[:2]] == [0, 0]
    assert kv.allocator.num_available == 12
    kv.check()
    _append(seq, list(range(900, 910)), gen)  # written directly: its full block is registered as for a new one
    assert _registered(kv, seq) == [block_hashes(list(range(900, 908)), T, fingerprint=FP)[0], None]
    seq.truncate(0)
    assert list(seq.admit([*prefix, 5, 6])) == [16, 17]
    assert seq.block_table[:2] == blocks[:2] and seq.num_registered == 2
    _append(seq, list(range(800, 814)), gen)  # fills block 2 and 3: registered after the adopted chain
    assert _registered(kv, seq)[:4] == block_hashes([*prefix, 5, 6, *range(800, 814)], T, fingerprint=FP)
    seq.free()
    kv.check()


def test_a_failed_windowed_admit_gives_its_blocks_back_last_first_so_the_prefix_outlives_its_tail():
    """The blocks a failed admit adopted go back to the cache tail first: evicting all but one cached block keeps
    the prefix's first block, the one a later prompt needs first."""
    kv, gen = _quant_kv(num_blocks=6, staging=2), torch.Generator().manual_seed(36)
    prefix = list(range(700, 716))
    blocks = _cached_prefix(kv, prefix, gen)
    seq = kv.new_sequence()
    with pytest.raises(StagingFullError):
        seq.admit([*prefix, *range(30)])
    kv.allocator.allocate(kv.allocator.num_available - 1)  # evicts every cached block but the newest free
    assert kv.allocator.hash_of(blocks[0]) is not None and kv.allocator.hash_of(blocks[1]) is None


@pytest.mark.parametrize("how", ["advance", "append_token"])
def test_a_one_token_advance_mid_step_registers_the_blocks_whose_ids_were_set_as_reserve_and_mark_written(how):
    """advance([token]) is reserve + mark_written in one call: after positions were reserved and their ids recorded
    with set_token_ids mid-step, declaring them written registers every full block, whichever path the token takes
    (append_token is advance of one token)."""
    kv = PagedKV(SPEC, 8, fingerprint=FP)
    seq = kv.new_sequence()
    seq.reserve(20)  # a bookkeeping step: ids not known yet, nothing written
    ids = list(range(100, 120))
    seq.set_token_ids(ids)
    getattr(seq, how)(*([[5]] if how == "advance" else [5]))
    assert seq.layer_tokens == [21, 21]
    assert _registered(kv, seq) == [*block_hashes(ids, T, fingerprint=FP), None]


def test_truncate_mid_step_is_refused_and_changes_nothing():
    _kv, seq = _written(12)
    _half_step(seq, range(500, 510))
    table = list(seq.block_table)
    with pytest.raises(ConfigError, match=r"^cannot truncate in the middle of a model step$"):
        seq.truncate(4)
    assert seq.num_tokens == 22 and seq.layer_tokens == [22, 12] and seq.block_table == table


def test_truncate_over_a_windowed_pool_takes_back_the_kept_blocks_the_shorter_window_covers():
    """Truncating a sequence moves its residual window back: kept blocks that fall inside it again are held by the
    sequence again (the pool's window holds agree with every sequence's window: check() passes)."""
    kv, gen = _quant_kv(staging=8, residual=16), torch.Generator().manual_seed(37)
    seq = kv.new_sequence()
    _append(seq, list(range(40)), gen)
    assert seq.window_start == 3
    assert [int(kv.pool.window_holds[b]) for b in seq.block_table] == [0, 0, 0, 1, 1]
    seq.truncate(20)
    assert seq.window_start == 0 and len(seq.block_table) == 3
    assert [int(kv.pool.window_holds[b]) for b in seq.block_table] == [1, 1, 1]
    kv.check()


@pytest.mark.parametrize(
    ("key", "value", "error", "message"),
    [
        ([[1.0]], torch.zeros(2, 1, 4), ArgumentTypeError, r"^key: expected Tensor, got list"),
        (torch.zeros(2, 1, 4), None, ArgumentTypeError, r"^value: expected Tensor, got NoneType"),
        (
            torch.zeros(2, 3, 4),
            torch.zeros(2, 4, 4),
            ShapeError,
            r"^key/value must be \[kv_heads, tokens, head_dim\], got \(2, 3, 4\) and \(2, 4, 4\)$",
        ),
        (torch.zeros(2, 4), torch.zeros(2, 4), ShapeError, r"^key/value must be .*, got \(2, 4\) and \(2, 4\)$"),
    ],
)
def test_append_refuses_a_non_tensor_or_mismatched_key_value_naming_them_and_changes_nothing(
    key, value, error, message
):
    _kv, seq = _written(5)
    with pytest.raises(error, match=message):
        seq.append(0, key, value, [1, 2, 3])
    assert seq.num_tokens == 5 and seq.layer_tokens == [5, 5] and len(seq.block_table) == 1


def test_writing_every_layer_without_a_prefix_cache_registers_nothing_and_works():
    kv, gen = PagedKV(SPEC, 8, prefix_caching=False), torch.Generator().manual_seed(38)
    seq = kv.new_sequence()
    _append(seq, list(range(20)), gen)
    assert seq.num_tokens == 20 and seq.num_registered == 0 and not kv.allocator.indexed_blocks()
    kv.check()
