"""LRU-K as O'Neil, O'Neil and Weikum define it (SIGMOD 1993), beside seed 001's recency sum under its own name."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from memos_ref.errors import ConfigError
from memos_ref.tiering.policies import BlockHistory, lru_k, lru_k_history, priority_function


def _history(*times: float) -> BlockHistory:
    h = BlockHistory()
    for t in times:
        h.touch(t)
    return h


@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=20, unique=True), st.integers(1, 4))
def test_without_a_correlated_period_hist_is_the_last_k_uses(times: list[float], k: int) -> None:
    uses = sorted(times)
    hist, last = lru_k_history(uses, k)
    assert hist == uses[::-1][:k]
    assert last == uses[-1]


def test_correlated_references_count_once_and_shift_the_history() -> None:
    # 0, 1, 2 are one correlated burst (crp 5); 10 is the next reference; the burst lasted 2, so the paper
    # shifts the older reference forward by 2 (HIST(p, 2) = 0 + 2).
    assert lru_k_history([0, 1, 2, 10], 2, crp=5) == ([10, 2], 10)
    assert lru_k_history([0, 1, 2], 2, crp=5) == ([0], 2)  # one uncorrelated reference so far


def test_lru_2_ranks_by_the_second_most_recent_reference() -> None:
    score = priority_function("lru_2")
    twice_long_ago, once_just_now = _history(1, 50), _history(99)
    # LRU keeps the block used just now; LRU-2 keeps the block with two references (its K-distance is finite)
    assert priority_function("lru")(once_just_now, 100) > priority_function("lru")(twice_long_ago, 100)
    assert score(twice_long_ago, 100) > score(once_just_now, 100)
    # among blocks with fewer than K references, the least recently used goes first
    assert score(_history(10), 100) < score(_history(20), 100)
    # two blocks with K references: the newer 2nd-most-recent reference wins, whatever the last one
    assert score(_history(30, 31), 100) > score(_history(20, 99), 100)


def test_a_block_inside_its_correlated_period_is_kept() -> None:
    score = lru_k(2, crp=10)
    assert score(_history(95), 100) > score(_history(10, 50), 100)


def _hot_hit_rate(policy: str, capacity: int = 12, hot: int = 8, scan: int = 20, rounds: int = 30) -> float:
    """A cache of ``capacity`` blocks: every round reads a hot set, then a scan of blocks never seen again. As in
    the paper, a block's reference history outlives its eviction (its "retained information period")."""
    score = priority_function(policy)
    history: dict[str, BlockHistory] = {}
    cache: set[str] = set()
    now, hits, reads = 0.0, 0, 0

    def read(name: str, counted: bool) -> None:
        nonlocal now, hits, reads
        now += 1
        if name in cache:
            hits += counted
        else:
            if len(cache) >= capacity:
                cache.remove(min(cache, key=lambda b: score(history[b], now)))
            cache.add(name)
        reads += counted
        history.setdefault(name, BlockHistory()).touch(now)

    for r in range(rounds):
        for h in range(hot):
            read(f"hot{h}", counted=r > 0)
        for s in range(scan):
            read(f"scan{r}.{s}", counted=False)
    return hits / reads


def test_lru_k_resists_scans_where_lru_and_the_seeds_score_do_not() -> None:
    lru, lru2, seed = (_hot_hit_rate(p) for p in ("lru", "lru_2", "recency_sum_2"))
    assert lru == 0.0  # each 20-block scan flushes the 8 hot blocks from a 12-block cache
    assert lru2 > 0.9  # scanned blocks have one reference: they go before any hot block
    assert seed < 0.1  # Σ 1/(now − t) is dominated by the last use: it behaves like LRU


@pytest.mark.parametrize("k, crp", [(0, 0.0), (33, 0.0), (2, -1.0), (2, float("nan")), (2, float("inf"))])
def test_bad_parameters_are_refused(k: int, crp: float) -> None:
    with pytest.raises(ConfigError, match="LRU-K"):
        lru_k(k, crp)


def test_lru_k1_is_lru() -> None:
    histories = [_history(3, 9), _history(5), _history(1, 2, 7)]
    by_lru = sorted(range(3), key=lambda i: priority_function("lru")(histories[i], 10))
    assert sorted(range(3), key=lambda i: lru_k(1)(histories[i], 10)) == by_lru


@given(st.lists(st.integers(0, 40), min_size=1, max_size=40), st.integers(1, 4), st.integers(40, 60))
def test_the_crp_0_fast_path_ranks_as_the_replayed_history(times: list[int], k: int, now: int) -> None:
    # repeated times are one reference (crp 0 still merges equal times): the fast path must agree with the replay
    h = _history(*sorted(times))
    hist, last = lru_k_history(h.uses, k)
    got = lru_k(k)(h, now)
    if len(hist) >= k:
        assert got == hist[k - 1]
    else:  # infinite backward K-distance: below every finite score, least recently used lowest
        assert got < -1e11 and got - lru_k(k)(_history(last + 1), now) == -1
