"""Stateful and threaded tests: random allocate / append / fork / truncate / free / prefix-lookup sequences,
with the invariant checker and a content oracle after every step."""

from __future__ import annotations

import contextlib
import random
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from memos_ref.errors import OutOfBlocksError
from memos_ref.paged import PagedKV
from memos_ref.spec import KVSpec

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32, block_size=8)


def kv_values(ids: list[int], start: int, layer: int) -> torch.Tensor:
    """K/V as a function of (token, position, layer) only — so shared prefixes must hold equal values."""
    pos = torch.arange(start, start + len(ids), dtype=torch.float32)
    tok = torch.tensor(ids, dtype=torch.float32)
    base = tok * 1000 + pos + 0.25 * layer  # [n]
    return torch.stack([base, -base], dim=-1)[None]  # [H=1, n, D=2]


def append_tokens(seq, ids: list[int]) -> None:
    for layer in range(SPEC.num_layers):
        values = kv_values(ids, seq.num_tokens if layer == 0 else seq.layer_tokens[layer], layer)
        seq.append(layer, values, -values, ids)


class PagedMachine(RuleBasedStateMachine):
    sequences = Bundle("sequences")

    def __init__(self) -> None:
        super().__init__()
        self.kv = PagedKV(SPEC, 24, fingerprint="stateful")

    @rule(target=sequences, salt=st.sampled_from([None, "t1"]))
    def new(self, salt):
        return self.kv.new_sequence(cache_salt=salt)

    @rule(seq=sequences, ids=st.lists(st.integers(0, 3), min_size=1, max_size=20))
    def append(self, seq, ids):
        if seq._freed:
            return
        table, n = list(seq.block_table), seq.num_tokens
        try:
            append_tokens(seq, ids)
        except OutOfBlocksError:
            assert seq.block_table == table and seq.num_tokens == n

    @rule(target=sequences, seq=sequences)
    def fork(self, seq):
        return seq if seq._freed else seq.fork()

    @rule(seq=sequences, keep=st.floats(0, 1))
    def truncate(self, seq, keep):
        if not seq._freed:
            seq.truncate(int(seq.num_tokens * keep))

    @rule(seq=consumes(sequences))
    def free(self, seq):
        seq.free()

    @rule(target=sequences, seq=sequences, extra=st.lists(st.integers(0, 3), min_size=1, max_size=9))
    def lookup(self, seq, extra):
        ids = [*seq.token_ids, *extra]
        hit = self.kv.start_from_prefix(ids, cache_salt=seq.cache_salt)
        assert hit.num_tokens <= len(ids) - 1 and hit.num_tokens % SPEC.block_size == 0
        with contextlib.suppress(OutOfBlocksError):
            append_tokens(hit, ids[hit.num_tokens :])
        return hit

    @invariant()
    def consistent(self):
        self.kv.check()
        for seq in self.kv.sequences.values():
            for layer in range(SPEC.num_layers):
                k, v = seq.to_dense(layer)
                expected = kv_values(seq.token_ids, 0, layer)
                assert torch.equal(k, expected) and torch.equal(v, -expected), (seq, layer)


TestPagedMachine = PagedMachine.TestCase
TestPagedMachine.settings = settings(max_examples=250, stateful_step_count=30, deadline=None)


def test_threads_share_one_paged_memory():
    kv = PagedKV(SPEC, 128, fingerprint="threads")
    errors: list[BaseException] = []
    prompts = [[1, 2, 3, 0] * 6, [3, 2, 1, 0] * 6]

    def worker(seed: int) -> None:
        rng, mine = random.Random(seed), []
        try:
            for _ in range(250):
                op = rng.random()
                try:
                    if op < 0.3 or not mine:
                        prompt = rng.choice(prompts)
                        seq = kv.start_from_prefix(prompt)
                        append_tokens(seq, prompt[seq.num_tokens :])
                        mine.append(seq)
                    elif op < 0.6:
                        append_tokens(rng.choice(mine), [rng.randint(0, 3) for _ in range(rng.randint(1, 9))])
                    elif op < 0.75:
                        mine.append(rng.choice(mine).fork())
                    elif op < 0.85:
                        seq = rng.choice(mine)
                        seq.truncate(rng.randint(0, seq.num_tokens))
                    else:
                        mine.pop(rng.randrange(len(mine))).free()
                except OutOfBlocksError:
                    if mine:
                        mine.pop(0).free()
            for seq in mine:
                for layer in range(SPEC.num_layers):
                    assert torch.equal(seq.to_dense(layer)[0], kv_values(seq.token_ids, 0, layer))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    kv.check()
    for seq in list(kv.sequences.values()):
        seq.free()
    kv.check()
    assert kv.allocator.num_active == 0


def test_lookups_and_evicting_allocations_do_not_deadlock():
    """A lookup (prefix cache, then allocator) racing an allocation that evicts (allocator, then prefix cache):
    with two locks taken in opposite orders this interleaving deadlocks; it is forced here."""
    kv = PagedKV(SPEC, 8, fingerprint="locks")
    ids = [1, 2, 3, 0] * 8  # 4 full blocks
    seq = kv.new_sequence()
    append_tokens(seq, ids)
    seq.free()  # 4 cached blocks, 4 free
    inside_lookup = threading.Event()
    real_hashes = kv.prefix_cache.hashes

    def slow_hashes(*args, **kwargs):
        inside_lookup.set()  # the lookup holds the prefix cache's lock now
        time.sleep(0.3)  # ...long enough for the allocation below to start evicting
        return real_hashes(*args, **kwargs)

    kv.prefix_cache.hashes = slow_hashes

    def lookup() -> None:
        kv.start_from_prefix([*ids, 1]).free()

    def evicting_allocation() -> None:
        inside_lookup.wait(5)
        with contextlib.suppress(OutOfBlocksError):
            kv.allocator.free_many(kv.allocator.allocate(8))  # needs the cached blocks: evicts

    # daemon threads: a regression fails this test instead of hanging the test run at exit
    threads = [threading.Thread(target=f, daemon=True) for f in (lookup, evicting_allocation)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not any(t.is_alive() for t in threads), "deadlock between the prefix cache and the allocator"
    kv.prefix_cache.hashes = real_hashes
    kv.check()


# ---------------------------------------------------------------------------------------------- fast paths
# issue 15 item 1: ``admit`` (a prompt validated and hashed once) and ``append_token`` (no allocator call inside
# a private tail) must leave exactly the state the general calls leave: lookup + adopt_prefix + reserve +
# mark_written, and reserve(1) + mark_written per token.
_PROMPTS = [[1, 2, 3, 0] * 6, [1, 2, 3, 0] * 4 + [3, 3], [2, 2, 1, 1] * 5, [0, 0] * 4]


def _snapshot(kv: PagedKV, seqs: list, queue) -> tuple:
    alloc = kv.allocator
    events = [(e.kind, e.block, e.block_hash, e.count) for e in queue.drain()]
    return (
        [(s.freed, s.block_table, s.token_ids, s.num_tokens, s.num_registered, s.layer_tokens) for s in seqs],
        list(alloc.refcount),
        bytes(alloc.state),
        alloc.free_blocks(),
        alloc.cached_blocks(),
        alloc.indexed_blocks(),
        {b: alloc.tokens_of(b) for b in alloc.indexed_blocks()},
        alloc.evictions,
        kv.prefix_cache.stats(),
        events,
    )


def _drive(ops: list[tuple[int, int, int]], fast: bool) -> list[tuple]:
    """Run ``ops`` through the fast entry points or the general calls; the snapshot after every op."""
    kv = PagedKV(SPEC, 10, fingerprint="fast-paths")
    queue = kv.allocator.subscribe()
    seqs: list = []
    out = []
    token = 0
    for op, a, b in ops:
        live = [s for s in seqs if not s.freed]
        with contextlib.suppress(OutOfBlocksError):
            if op == 0 or not live:  # a new request
                prompt = _PROMPTS[a % len(_PROMPTS)] + [b % 4] * (b % 3)
                if -(-len(prompt) // SPEC.block_size) > kv.allocator.num_available:
                    raise OutOfBlocksError(0, 0)  # the general calls are not all or nothing: never refuse here
                seq = kv.new_sequence()
                seqs.append(seq)
                if fast:
                    seq.admit(prompt)
                else:
                    seq.adopt_prefix(kv.prefix_cache.lookup(prompt), prompt)
                    seq.reserve(len(prompt) - seq.num_tokens, prompt[seq.num_tokens :])
                    seq.mark_written()
            elif op == 1:  # decode a few tokens, one at a time (often ending mid-block)
                seq = live[a % len(live)]
                for _ in range(b if b > 12 else b % 4):
                    token += 1
                    if fast:
                        seq.append_token(token % 4)
                    else:
                        seq.reserve(1, [token % 4])
                        seq.mark_written()
            elif op == 2:
                seqs.append(live[a % len(live)].fork())
            elif op == 3:
                seq = live[a % len(live)]
                seq.truncate(seq.num_tokens * (b % 4) // 4)
            else:
                live[a % len(live)].free()
        kv.check()
        out.append(_snapshot(kv, seqs, queue))
    return out


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 7), st.integers(0, 20)), min_size=1, max_size=25))
def test_admit_and_append_token_leave_the_state_of_the_general_calls(ops):
    """Refcounts, free and LRU order, the hash index, evictions, hit statistics and every event, op by op."""
    assert _drive(ops, fast=True) == _drive(ops, fast=False)


def test_admit_out_of_blocks_changes_nothing():
    """admit is all or nothing: refused before any reference is taken, any hit counted or any LRU order moved."""
    kv = PagedKV(SPEC, 6, fingerprint="fast-paths")
    first = kv.new_sequence()
    first.admit([1, 2, 3, 0] * 6)  # 3 blocks, all cached after the free
    head = first.block_table[:2]
    first.free()
    kv.new_sequence().admit([5] * 17)  # the 3 free blocks
    queue = kv.allocator.subscribe()
    seq = kv.new_sequence()
    before = _snapshot(kv, [seq], queue)
    with pytest.raises(OutOfBlocksError) as info:
        seq.admit([1, 2, 3, 0] * 6 + [9] * 9)  # 5 blocks: 3 cached prefix blocks revived, 2 more, 0 left
    assert info.value.needed == 2 and info.value.available == 0
    assert _snapshot(kv, [seq], queue) == before and seq.num_tokens == 0
    assert seq.admit([1, 2, 3, 0] * 4 + [7]) == range(16, 17)  # still usable: 2 blocks reused, 1 evicted
    assert seq.block_table[:2] == head
    kv.check()
