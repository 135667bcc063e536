"""The block-level tiering simulator: LRU-K evaluated with the retained history of evicted blocks, on a
scan-heavy trace, against an independent textbook oracle (exact hit counts)."""

from __future__ import annotations

import math
from collections import OrderedDict

import pytest

from memos_ref.errors import ConfigError
from memos_ref.paged.prefix import block_hashes
from memos_ref.tiering.simulate import Request, scan_trace, simulate

BS = 16


# ---------------------------------------------------------------- the oracle: a page-reference string, two caches
def oracle_lru_hits(refs: list[bytes], size: int) -> int:
    """Textbook LRU over a reference string: an OrderedDict, most recent at the end."""
    cache: OrderedDict[bytes, None] = OrderedDict()
    hits = 0
    for p in refs:
        if p in cache:
            hits += 1
            cache.move_to_end(p)
            continue
        if len(cache) >= size:
            cache.popitem(last=False)
        cache[p] = None
    return hits


def oracle_lru2_hits(refs: list[bytes], size: int) -> int:
    """Textbook LRU-2 (crp 0, history kept forever): evict the page whose 2nd most recent reference is oldest;
    pages referenced once have an infinite backward distance and go first, least recently used first."""
    times: dict[bytes, list[int]] = {}
    cache: set[bytes] = set()
    hits = 0
    for now, p in enumerate(refs):
        if p in cache:
            hits += 1
        else:
            if len(cache) >= size:
                once = [q for q in cache if len(times[q]) < 2]
                if once:
                    victim = min(once, key=lambda q: times[q][-1])
                else:
                    victim = min(cache, key=lambda q: times[q][-2])
                cache.remove(victim)
            cache.add(p)
        times.setdefault(p, []).append(now)
    return hits


def one_block_scan(seed: int = 0) -> list[Request]:
    """A scan trace whose prompts are one block each: the simulator's prefix rule is then a plain cache."""
    return scan_trace(hot=6, hot_blocks=1, scan_per_hot=2, scan_blocks=1, rounds=10, seed=seed)


def test_lru_2_beats_lru_on_the_scan_trace_with_the_oracles_exact_counts() -> None:
    reqs = one_block_scan()
    refs = [r.hashes[0] for r in reqs]
    size = 8  # the hot set (6) and room for the scan's current block; each round scans 12 blocks
    got = {p: simulate(reqs, device_blocks=size, policy=p, tier=False) for p in ("lru", "lru_2")}
    lru, lru2 = oracle_lru_hits(refs, size), oracle_lru2_hits(refs, size)
    assert got["lru"]["device_hit_rate"] * got["lru"]["prompt_tokens"] == lru * BS
    assert got["lru_2"]["device_hit_rate"] * got["lru_2"]["prompt_tokens"] == lru2 * BS
    # hot blocks are read 10 times; LRU-2 misses each twice (cold, then as a once-referenced block), LRU flushes
    assert lru2 == 6 * (10 - 2) and lru2 > lru


def test_lru_2_beats_lru_and_the_recency_sum_on_the_default_scan_trace() -> None:
    reqs = scan_trace()
    policies = ("lru", "lru_2", "recency_sum_2")
    rates = {p: simulate(reqs, device_blocks=24, policy=p)["device_hit_rate"] for p in policies}
    assert rates["lru_2"] > rates["lru"] and rates["lru_2"] > rates["recency_sum_2"]
    # the hot share of the prompt tokens is 2 of every 8 blocks: LRU-2 can serve at most a quarter of them
    assert rates["lru_2"] <= 0.25


def test_history_retention_matters_for_lru_2_and_not_for_lru() -> None:
    reqs = scan_trace()
    kept = {p: simulate(reqs, device_blocks=24, policy=p)["device_hit_rate"] for p in ("lru", "lru_2")}
    lost = {p: simulate(reqs, device_blocks=24, policy=p, retained_period=0)["device_hit_rate"] for p in kept}
    assert lost["lru_2"] < kept["lru_2"]  # forgotten at eviction, every returning hot block looks like a scan
    assert lost["lru"] == kept["lru"]  # LRU looks only at the last use
    # a retained period shorter than a hot block's reuse distance (a round: 32 requests) forgets it too
    short = simulate(reqs, device_blocks=24, policy="lru_2", retained_period=4)["device_hit_rate"]
    assert short == lost["lru_2"]


def test_history_retention_against_the_oracle_on_one_block_prompts() -> None:
    reqs = one_block_scan(seed=3)
    refs = [r.hashes[0] for r in reqs]
    forgotten = simulate(reqs, device_blocks=8, policy="lru_2", tier=False, retained_period=0)
    kept = simulate(reqs, device_blocks=8, policy="lru_2", tier=False, retained_period=math.inf)
    assert kept["device_hit_rate"] * kept["prompt_tokens"] == oracle_lru2_hits(refs, 8) * BS
    assert forgotten["device_hit_rate"] < kept["device_hit_rate"]


def test_scan_trace_and_its_simulation_are_deterministic() -> None:
    a, b, c = scan_trace(seed=5), scan_trace(seed=5), scan_trace(seed=6)
    assert [r.hashes for r in a] == [r.hashes for r in b] and [r.session for r in a] == [r.session for r in b]
    assert [r.hashes for r in a] != [r.hashes for r in c]
    assert len({h for r in a for h in r.hashes}) == 8 * 2 + 12 * 8 * 3 * 2  # hot set + every scan block, distinct
    assert simulate(a, device_blocks=24, policy="lru_2") == simulate(b, device_blocks=24, policy="lru_2")


def test_a_recomputed_block_still_on_the_device_evicts_nothing() -> None:
    # X+Y is a two-block prompt whose second block is a system prompt (the priority policy keeps it); when X is
    # evicted and X+Y comes back, X is recomputed and Y, still on the device, is recomputed after it (the prefix
    # broke at X). Y must not make room for itself: W, used since, stays on the device and hits.
    x, y, z, w = ([i] * BS for i in (1, 2, 3, 4))

    def req(t: float, ids: list[int], kinds: list[str]) -> Request:
        return Request(t, "s", ids, kinds, block_hashes(ids, BS))

    reqs = [req(0, x + y, ["turn", "system"]), req(1, z, ["turn"]), req(2, w, ["turn"])]
    reqs += [req(3, x + y, ["turn", "system"]), req(4, w, ["turn"])]
    out = simulate(reqs, device_blocks=3, policy="priority", tier=False)
    assert out["device_hit_rate"] * out["prompt_tokens"] == BS  # W at t=4; before the fix, 0
    assert out["recomputed_tokens"] == out["prompt_tokens"] - BS


@pytest.mark.parametrize("bad", [-1, -0.5, float("nan")])
def test_a_bad_retained_period_is_refused(bad: float) -> None:
    with pytest.raises(ConfigError, match="retained_period"):
        simulate(scan_trace(rounds=1), device_blocks=4, retained_period=bad)


@pytest.mark.parametrize("kw", [{"hot": 0}, {"rounds": 0}, {"scan_blocks": 0}, {"scan_per_hot": -1}])
def test_a_bad_scan_trace_is_refused(kw: dict[str, int]) -> None:
    with pytest.raises(Exception, match=next(iter(kw))):
        scan_trace(**kw)
