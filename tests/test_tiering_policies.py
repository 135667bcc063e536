"""Policy and prefetch simulation (exact counts worked out by hand), the Markov predictor, and the tier
manager's prefetch."""

from __future__ import annotations

import itertools

import pytest
import torch

from memos_ref.errors import ConfigError
from memos_ref.session import SessionLayout
from memos_ref.tiering.policies import BlockHistory, priority_function
from memos_ref.tiering.simulate import MarkovPredictor, Request, requests_from_trace, simulate
from memos_ref.traces import make_trace


def req(t: float, session: str, first_token: int, blocks: int) -> Request:
    return Request(t, session, [first_token + i for i in range(16 * blocks)], ["turn"] * blocks)


def test_simulation_counts_by_hand():
    # device of 2 blocks; A = blocks a1 a2, B = b1 b2; then A again
    reqs = [req(0, "A", 0, 2), req(1, "B", 100, 2), req(2, "A", 0, 2)]
    r = simulate(reqs, device_blocks=2, policy="lru", bytes_per_block=1000)
    # A: 2 misses. B: 2 misses, evicting a1 then a2 to the tier. A again: a1 and a2 come back from the tier,
    # evicting b1 and b2 to it.
    assert (r["prompt_tokens"], r["recomputed_tokens"], r["swap_in_blocks"], r["swap_out_blocks"]) == (96, 64, 2, 4)
    assert r["hit_rate"] == pytest.approx(32 / 96) and r["device_hit_rate"] == 0.0
    assert r["bytes_moved"] == 6 * 1000
    lost = simulate(reqs, device_blocks=2, policy="lru", tier=False)
    assert lost["recomputed_tokens"] == 96 and lost["hit_rate"] == 0.0  # without a tier, evicted means gone


def test_frequency_keeps_a_hot_block_through_a_scan():
    hot = [req(t, "H", 0, 1) for t in (0, 1, 2)]
    scan = [req(3, "S1", 500, 1), req(3.5, "S2", 700, 1)]
    reqs = [*hot, *scan, req(4, "H", 0, 1)]
    lru = simulate(reqs, device_blocks=2, policy="lru", tier=False)
    lfu = simulate(reqs, device_blocks=2, policy="lfu", tier=False)
    assert lru["recomputed_tokens"] == 16 * 4  # H, S1, S2, and H again (LRU evicted it for S2)
    assert lfu["recomputed_tokens"] == 16 * 3  # LFU kept H (3 uses) and evicted S1


def test_policy_functions():
    h = BlockHistory()
    for t in (1.0, 2.0, 3.0):
        h.touch(t)
    assert priority_function("lru")(h, 10.0) == 3.0
    assert priority_function("lru_k2")(h, 10.0) == pytest.approx(1 / 8 + 1 / 7)  # the last two uses
    assert priority_function("lru_k3")(h, 10.0) == pytest.approx(1 / 9 + 1 / 8 + 1 / 7)
    assert priority_function("hybrid")(h, 1003.0) == pytest.approx(1.3 / 2.0)
    sys_block, turn_block = BlockHistory(kind="system"), BlockHistory(kind="turn")
    sys_block.touch(0.0)
    turn_block.touch(100.0)
    assert priority_function("priority")(sys_block, 200.0) > priority_function("priority")(turn_block, 200.0)
    with pytest.raises(ConfigError, match="unknown eviction policy"):
        priority_function("random")


def test_markov_predictor():
    p = MarkovPredictor(window=5, threshold=0.6)
    for s in ["A", "B", "A", "B", "A", "C", "A", "B", "A", "B"]:
        p.observe(s)
    assert p.predict("A") == "B"  # A -> B, B, C, B, B (window 5): 4/5 >= 0.6
    assert p.predict("C") == "A" and p.predict("Z") is None
    q = MarkovPredictor(window=2, threshold=0.6)
    for s in ["A", "B", "A", "C"]:
        q.observe(s)
    assert q.predict("A") is None  # B and C: 1/2 < 0.6


def test_requests_from_trace_follow_the_sessions():
    events = make_trace("tool_heavy", scale=0.3)
    reqs = requests_from_trace(events, layout=SessionLayout())
    assert len(reqs) == sum(e.kind in ("user", "tool_result", "generate") for e in events)
    first = reqs[0]
    assert first.kinds[0] == "system" and len(first.kinds) == len(first.token_ids) // 16
    later = [r for r in reqs if r.session == first.session]
    assert all(len(b.token_ids) >= len(a.token_ids) for a, b in itertools.pairwise(later) if b.t >= a.t)


def test_tier_manager_prefetch_brings_blocks_up_without_counting_a_request():
    from test_tiering_manager import make, write_sequence

    kv, _store, tm, clock = make(min_residency_s=0)
    ids = list(range(300, 364))  # 8 full blocks
    seq, _ = write_sequence(kv, ids)
    seq.free()
    tm.low, tm.high = 0.05, 0.1
    clock.now += 1
    tm.step()
    queries = kv.prefix_cache.stats()["prefix_queries"]
    assert tm.prefetch([*ids, 0], max_blocks=4) == 4  # four blocks come back, cached, before the request
    assert kv.prefix_cache.stats()["prefix_queries"] == queries
    swapped_in = tm.counts["swap_in_blocks"]
    again = kv.start_from_prefix([*ids, 0])
    assert again.num_tokens == 64
    assert tm.counts["swap_in_blocks"] - swapped_in == 8 - 4 - 1  # only what was neither prefetched nor kept
    assert torch.is_tensor(kv.pool.block(again.block_table[0]))
