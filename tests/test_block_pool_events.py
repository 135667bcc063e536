"""The allocator as the one owner of block state (issue 15 item 1): the prefix-hash index lives with the refcounts
and lists, eviction drops a hash in the same step, and consumers get events instead of hook chains."""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import memos_ref.paged.prefix as prefix_module
from memos_ref.errors import InvalidArgumentError, InvalidBlockError, ShapeError
from memos_ref.metrics import PagedMetrics
from memos_ref.paged import BlockAllocator, PagedKV, PrefixCache, SequenceCache
from memos_ref.paged.allocator import ALLOCATED, CACHED, EVICTED, FREED, REMOVED, STORED, BlockEvent
from memos_ref.spec import KVSpec
from memos_ref.tiering.backends import HostMemoryBackend
from memos_ref.tiering.manager import TierManager
from memos_ref.tiering.store import Tier, TierStore

ROOT = Path(__file__).resolve().parents[1]
SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=4, block_size=8, dtype=torch.float32)


def _written(kv: PagedKV, ids: list[int], fill: float = 1.0) -> SequenceCache:
    """A sequence holding ``ids`` with K/V written (every value ``fill``)."""
    seq = kv.new_sequence()
    kv_ = torch.full((SPEC.num_kv_heads, len(ids), SPEC.head_dim), fill)
    for layer in range(SPEC.num_layers):
        seq.append(layer, kv_, kv_, ids if layer == 0 else None)
    return seq


def test_events_report_stored_cached_evicted_and_freed_in_order():
    alloc = BlockAllocator(3)
    pc = PrefixCache(alloc, 8)
    queue = alloc.subscribe()  # every kind, drained by this test
    seq = SequenceCache(_NullPool(), alloc, pc)
    seq.advance(list(range(1, 10)))  # block 0 full (stored), block 1 partial
    seq.free()  # tail first: block 1 freed, block 0 cached
    other = SequenceCache(_NullPool(), alloc, pc)
    other.advance(list(range(100, 124)))  # needs 3 blocks: the free ones, then block 0 is evicted
    events = [e for e in queue.drain() if e.kind != ALLOCATED]
    assert [(e.kind, e.block) for e in events][:3] == [(STORED, 0), (FREED, 1), (CACHED, 0)]
    evicted = [e for e in events if e.kind == EVICTED]
    assert [(e.block, e.block_hash) for e in evicted] == [(0, pc.hashes(list(range(1, 9)))[0])]
    assert len(queue) == 0


def test_evicted_event_carries_the_hash_and_the_index_forgets_it_in_the_same_step():
    alloc = BlockAllocator(2)
    pc = PrefixCache(alloc, 8)
    seen: list[tuple[BlockEvent, int | None]] = []
    alloc.subscribe({EVICTED}, handler=lambda e: seen.append((e, alloc.block_with_hash(e.block_hash))))
    seq = SequenceCache(_NullPool(), alloc, pc)
    seq.advance([7] * 8)
    h = alloc.hash_of(0)
    seq.free()
    assert alloc.block_with_hash(h) == 0 and 0 in pc
    alloc.allocate(2)  # block 1 is free, block 0 is evicted
    assert [(e.kind, e.block, e.block_hash) for e, _ in seen] == [(EVICTED, 0, h)]
    assert seen[0][1] is None  # when the handler ran, the index had already dropped the hash
    assert 0 not in pc and len(pc) == 0 and alloc.evictions == 1


def test_a_handler_sees_an_evicted_block_before_the_allocation_returns():
    """Write-back consumers read the evicted block's bytes: they must still be the cached content."""
    kv = PagedKV(SPEC, 2)
    snapshots: list[torch.Tensor] = []
    kv.allocator.subscribe({EVICTED}, handler=lambda e: snapshots.append(kv.pool.block(e.block).clone()))
    seq = _written(kv, list(range(1, 9)), fill=3.0)
    seq.free()
    late = _written(kv, list(range(16)), fill=-1.0)  # evicts block 0 and overwrites it
    assert len(snapshots) == 1 and torch.all(snapshots[0] == 3.0)
    assert torch.all(kv.pool.block(late.block_table[1]) == -1.0)


def test_a_sequence_frees_its_tail_first_so_the_prefix_is_evicted_last():
    alloc = BlockAllocator(4)
    pc = PrefixCache(alloc, 8)
    seq = SequenceCache(_NullPool(), alloc, pc)
    seq.reserve(32, list(range(32)))  # 4 full blocks, all indexed
    seq.mark_written()
    table = list(seq.block_table)
    seq.free()
    assert alloc.cached_blocks() == table[::-1]  # least recently used first: the tail
    alloc.allocate(1)
    assert table[-1] not in pc and all(b in pc for b in table[:-1])


def test_lookup_hashes_each_block_once_per_sequence(monkeypatch):
    kv = PagedKV(SPEC, 32)
    ids = list(range(80))
    _written(kv, ids[:48]).free()  # 6 blocks cached
    calls = {"n": 0}
    real = hashlib.blake2b

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(prefix_module.hashlib, "blake2b", counting)
    seq = kv.start_from_prefix(ids)  # lookup: every full block but the last token's (9), 6 of them hits
    assert seq.num_tokens == 48
    kv_ = torch.zeros(1, 32, 4)
    for layer in range(SPEC.num_layers):
        seq.append(layer, kv_, kv_, ids[48:] if layer == 0 else None)  # blocks 6..9 become full
    assert calls["n"] == 9 + 1  # the lookup hashes blocks 0..8 once; registration only block 9, the new one
    kv.check()


def test_a_lookup_under_another_salt_is_hashed_again_when_adopted():
    kv = PagedKV(SPEC, 16)
    ids = list(range(24))
    _written(kv, ids[:16]).free()
    hit = kv.prefix_cache.lookup(ids)  # salt None: 2 blocks
    seq = kv.new_sequence(cache_salt="tenant-b")
    seq.adopt_prefix(hit, ids)
    seq.reserve(8, ids[16:])  # block 2 is registered under tenant-b's chain, not the unsalted one
    seq.mark_written()
    assert kv.prefix_cache.hashes(ids, "tenant-b")[2] == kv.allocator.hash_of(seq.block_table[2])


def test_match_prefix_verifies_token_ids_against_a_hash_collision():
    alloc = BlockAllocator(4)
    [block] = alloc.allocate(1)
    assert alloc.cache_block(block, b"h" * 16, list(range(1, 9)))
    assert alloc.match_prefix([b"h" * 16], [9] * 8 + [0], 8) == []  # same hash, other tokens: a miss
    assert alloc.match_prefix([b"h" * 16], [*range(1, 9), 0], 8) == [block] and alloc.refcount[block] == 2


def test_uncache_if_refuses_a_block_revived_or_rehashed_meanwhile():
    alloc = BlockAllocator(2)
    [block] = alloc.allocate(1)
    alloc.cache_block(block, b"a" * 16, [0] * 8)
    assert not alloc.uncache_if(block, b"a" * 16)  # active: not ours to drop
    alloc.free(block)
    assert not alloc.uncache_if(block, b"b" * 16)  # another hash
    queue = alloc.subscribe({REMOVED, FREED})
    assert alloc.uncache_if(block, b"a" * 16)
    assert [(e.kind, e.block) for e in queue.drain()] == [(REMOVED, block), (FREED, block)]
    assert alloc.num_free == 2 and alloc.block_with_hash(b"a" * 16) is None


def test_refused_calls_change_nothing():
    alloc = BlockAllocator(3)
    blocks = alloc.allocate(2)
    alloc.free(blocks[1])  # free now
    before = (list(alloc.refcount), list(alloc.state), alloc.indexed_blocks(), alloc.free_blocks())
    with pytest.raises(InvalidBlockError):
        alloc.cache_blocks([blocks[0], blocks[1]], [b"x" * 16, b"y" * 16], list(range(16)), 8)  # one is free
    with pytest.raises(ShapeError):
        alloc.cache_blocks([blocks[0]], [b"x" * 16, b"y" * 16], list(range(16)), 8)
    with pytest.raises(InvalidArgumentError):
        alloc.subscribe({"nonsense"})
    assert (list(alloc.refcount), list(alloc.state), alloc.indexed_blocks(), alloc.free_blocks()) == before


def test_a_closed_subscription_gets_nothing_and_bounded_queues_count_drops():
    alloc = BlockAllocator(8)
    bounded = alloc.subscribe({FREED}, maxlen=2)
    closed = alloc.subscribe({FREED})
    closed.close()
    alloc.free_many(alloc.allocate(3))
    assert len(closed) == 0
    assert [e.block for e in bounded.drain()] == [1, 2] and bounded.dropped == 1


def test_metrics_time_allocations_through_events_without_replacing_allocate():
    kv = PagedKV(SPEC, 8)
    metrics = PagedMetrics(kv)
    assert "allocate" not in vars(kv.allocator)  # the method is the class's own, not a wrapper
    _written(kv, list(range(10)))
    text = metrics.exposition()
    assert "memos_kv_allocate_seconds_count 1.0" in text
    metrics.close()
    _written(kv, list(range(3)))
    assert "memos_kv_allocate_seconds_count 1.0" in metrics.exposition()


def test_tier_write_back_runs_from_the_eviction_event(tmp_path):
    kv = PagedKV(SPEC, 2, fingerprint="m")
    store = TierStore([Tier(HostMemoryBackend(1 << 20))], spec=SPEC, fingerprint="m")
    tm = TierManager(kv, store, min_residency_s=0)
    seq = _written(kv, list(range(5, 13)))
    h = kv.allocator.hash_of(seq.block_table[0])
    seq.free()
    _written(kv, list(range(16)))  # evicts the cached block: it is written back first
    assert tm.counts["write_backs"] == 1 and store.locate(h.hex()) == "host"
    tm.close()
    assert kv.tier_manager is None


def test_no_private_attribute_is_read_across_modules():
    """The modules this redesign touched reach other objects only through public methods and events."""
    allowed = {("memos_ref/paged/events.py", "queue"), ("memos_ref/paged/sequence_cow.py", "child")}  # same class
    files = [
        "memos_ref/paged/allocator.py",
        "memos_ref/paged/events.py",
        "memos_ref/paged/free_list.py",
        "memos_ref/paged/indexing.py",
        "memos_ref/paged/prefix_index.py",
        "memos_ref/paged/prefix.py",
        "memos_ref/paged/sequence.py",
        "memos_ref/paged/sequence_cow.py",
        "memos_ref/paged/sequence_state.py",
        "memos_ref/paged/sequence_tokens.py",
        "memos_ref/paged/sequence_windows.py",
        "memos_ref/paged/sequence_writes.py",
        "memos_ref/paged/store.py",
        "memos_ref/paged/check.py",
        "memos_ref/metrics.py",
        "memos_ref/tiering/manager.py",
        "memos_ref/bench/allocator.py",
    ]
    found = []
    for rel in files:
        for node in ast.walk(ast.parse((ROOT / rel).read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                base = node.value.id if isinstance(node.value, ast.Name) else None
                if base not in ("self", "cls") and (rel, base) not in allowed:
                    found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    assert found == []


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 9)), min_size=1, max_size=25))
def test_advance_is_reserve_then_mark_written(ops):
    """The short decode path of ``advance`` leaves exactly the state ``reserve`` + ``mark_written`` leaves."""

    def run(fused: bool):
        kv = PagedKV(SPEC, 64)
        seqs = [kv.new_sequence() for _ in range(3)]
        token = 0
        for which, n in ops:
            seq = seqs[which]
            for _ in range(n):  # one token at a time (the short path), sometimes sharing a tail via fork
                ids = [token % 5]
                token += 1
                if fused:
                    seq.advance(ids)
                else:
                    seq.reserve(1, ids)
                    seq.mark_written()
            if which == 2 and seq.num_tokens:
                seqs[2] = seq.fork()
                seq.free()
        kv.check()
        return [(s.block_table, s.token_ids, s.num_registered) for s in seqs], kv.allocator.indexed_blocks()

    assert run(True) == run(False)


class _NullPool:
    def __init__(self) -> None:
        self.spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=1, block_size=8)

    def copy_block(self, src: int, dst: int) -> None:
        pass


# ---------------------------------------------------------------------------------------------- hot paths (issue 15)
def _counting(monkeypatch, module, name: str) -> dict[str, int]:
    calls = {"n": 0}
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_admit_validates_the_prompt_once_and_hashes_each_block_once(monkeypatch):
    import memos_ref.paged.sequence_cow as cow_module
    import memos_ref.paged.sequence_tokens as tokens_module

    kv = PagedKV(SPEC, 32)
    ids = list(range(80))
    _written(kv, ids[:48]).free()  # 6 blocks cached
    expected = kv.prefix_cache.hashes([*ids, *range(8)])  # 11 full blocks
    # every module of the sequence that validates ids (reserve/advance, adopt_prefix) and the prefix cache
    checks = [_counting(monkeypatch, m, "check_token_ids") for m in (prefix_module, tokens_module, cow_module)]
    checks.append(_counting(monkeypatch, tokens_module, "pack_token_ids"))  # the check that also packs (admit)
    hashes = _counting(monkeypatch, prefix_module.hashlib, "blake2b")
    seq = kv.new_sequence()
    assert seq.admit(ids) == range(48, 80)  # 6 blocks reused, 4 new
    assert sum(c["n"] for c in checks) == 1  # validated once (lookup + adopt_prefix + advance: three times)
    assert hashes["n"] == 10  # the lookup hashes blocks 0..8; registration only block 9, the last token's
    assert kv.prefix_cache.stats()["prefix_hit_tokens"] == 48
    assert [kv.allocator.hash_of(b) for b in seq.block_table] == expected[:10]
    for token in range(8):
        seq.append_token(token)
    assert hashes["n"] == 11 and sum(c["n"] for c in checks) == 1  # one new full block, one more link
    assert kv.allocator.hash_of(seq.block_table[-1]) == expected[10]
    kv.check()


class _CountingLock:
    def __init__(self, lock) -> None:
        self.lock, self.entered = lock, 0

    def __enter__(self):
        self.entered += 1
        return self.lock.__enter__()

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)


def test_append_token_calls_the_allocator_only_when_a_block_fills_or_starts(monkeypatch):
    kv = PagedKV(SPEC, 8)
    seq = kv.new_sequence()
    seq.admit([1, 2, 3])
    calls = {name: _counting(monkeypatch, kv.allocator, name) for name in ("allocate", "cache_block", "cache_blocks")}
    lock = seq._lock = _CountingLock(seq._lock)
    for token in range(4):  # positions 3..6: inside the private tail
        assert seq.append_token(token) == 3 + token
    assert [c["n"] for c in calls.values()] == [0, 0, 0] and lock.entered == 0
    seq.append_token(9)  # position 7 fills block 0: hashed and indexed
    assert [c["n"] for c in calls.values()] == [0, 1, 0] and kv.allocator.hash_of(seq.block_table[0]) is not None
    seq.append_token(9)  # position 8 starts block 1
    assert [c["n"] for c in calls.values()] == [1, 1, 0] and seq.num_blocks == 2
    assert seq.token_ids == [1, 2, 3, 0, 1, 2, 3, 9, 9] and seq.layer_tokens == [9, 9]
    fork = seq.fork()  # a shared tail: the next token is copied on write, through the general path
    seq.append_token(4)
    assert seq.block_table[1] != fork.block_table[1] and seq.cow_copies == 1
    kv.check()


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(-1, 2**63 - 1), max_size=70), st.sampled_from([1, 4, 16]), st.binary(max_size=3))
def test_iter_block_hashes_is_the_chain_of_hash_block(ids, block_size, extra):
    """The packed-once hashing equals hashing block by block (same bytes, same chain, partial tail unhashed)."""
    chain, parent = [], b""
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = prefix_module.hash_block(parent, ids[start : start + block_size], extra)
        chain.append(parent)
    assert list(prefix_module.iter_block_hashes(ids, block_size, extra)) == chain


def test_admit_packs_the_prompt_once_and_the_index_verifies_blocks_by_their_packed_ids(monkeypatch):
    """The prompt is validated and packed by one call (pack_token_ids), the lookup hashes and verifies those
    bytes, and the index keeps each block's ids packed (tokens_of unpacks them). A forged entry under a
    matching hash with other ids is still refused (the collision check stays)."""
    from array import array

    import memos_ref.paged.sequence_tokens as tokens_module

    kv = PagedKV(SPEC, 32)
    ids = list(range(40))
    _written(kv, ids[:24]).free()  # 3 blocks cached
    packs = _counting(monkeypatch, tokens_module, "pack_token_ids")  # where admit looks it up
    arrays = _counting(monkeypatch, prefix_module, "array")  # every packing in the prefix module (hashes, lookup)
    seq = kv.new_sequence()
    assert seq.admit(ids) == range(24, 40) and packs["n"] == 1 and arrays["n"] == 1  # packed once
    for i, block in enumerate(seq.block_table[:5]):
        assert kv.allocator.tokens_by_block[block] == array("q", ids[i * 8 : (i + 1) * 8]).tobytes()
        assert kv.allocator.tokens_of(block) == tuple(ids[i * 8 : (i + 1) * 8])
    # a collision: block 0's hash now claims other ids -> no hit, with or without packed bytes
    kv.allocator.tokens_by_block[seq.block_table[0]] = array("q", [7] * 8).tobytes()
    chain = kv.prefix_cache.hashes(ids[:32])
    assert kv.allocator.match_prefix(chain, ids, 8) == []
    assert kv.allocator.match_prefix(chain, ids, 8, packed=array("q", ids).tobytes()) == []
    assert kv.allocator.take_cached(chain[0], ids[:8]) is None
    assert kv.allocator.take_cached(chain[1], [2**70] * 8) is None  # unpackable ids match nothing


_ID = st.one_of(
    st.integers(-3, 2**64), st.booleans(), st.floats(allow_nan=False, width=16), st.sampled_from([-1, 2**63 - 1])
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_ID, max_size=12), st.booleans())
def test_pack_token_ids_accepts_and_refuses_exactly_what_check_token_ids_does(ids, long):
    """The one-pass check admit uses: same ids back, same error class, and the packed bytes of those ids."""
    from array import array

    ids = ids * (60 if long else 1)  # long prompts take the vectorised minimum
    try:
        want = prefix_module.check_token_ids("t", ids)
    except Exception as exc:
        with pytest.raises(type(exc)):
            prefix_module.pack_token_ids("t", ids)
        return
    got, packed = prefix_module.pack_token_ids("t", ids)
    assert got == want and all(type(t) is int for t in got) and packed == array("q", want).tobytes()
    assert got is not ids  # a copy: the caller's list stays the caller's
