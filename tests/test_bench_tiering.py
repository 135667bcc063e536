"""``bench tiering``'s policy part on the scan-heavy trace: every policy, exact and repeatable counts, LRU-2 ahead
of LRU, the retention comparison, and the README renderer reading the rows it writes."""

from __future__ import annotations

from typing import Any

import pytest

from memos_ref.bench.report import BLOCKS
from memos_ref.bench.tiering import POLICIES, SCAN, scan_policies
from memos_ref.tiering.simulate import scan_trace, simulate

Rows = list[dict[str, Any]]


@pytest.fixture(scope="module")
def scan() -> tuple[Rows, Rows]:
    return scan_policies()


def test_scan_policies_are_exact_repeatable_and_lru_2_beats_lru(scan: tuple[Rows, Rows]) -> None:
    rows, retention = scan
    again = simulate(scan_trace(**SCAN), device_blocks=24, policy="lru_2")  # seeded: the same counts every run
    headline = {r["policy"]: r for r in rows if r["headline"]}
    assert again["device_hit_rate"] == headline["lru_2"]["device_hit_rate"]
    assert set(headline) == set(POLICIES) and {r["device_blocks"] for r in headline.values()} == {24}
    for r in rows:  # the rate is an exact ratio of token counts
        assert r["device_hit_rate"] * r["prompt_tokens"] == r["device_hit_tokens"]
    assert headline["lru_2"]["device_hit_tokens"] > headline["lru"]["device_hit_tokens"]
    assert headline["lru_2"]["device_hit_tokens"] > headline["recency_sum_2"]["device_hit_tokens"]
    kept = {r["policy"]: (r["history_kept"], r["history_forgotten"]) for r in retention}
    assert kept["lru_2"][1] < kept["lru_2"][0] and kept["lru"][0] == kept["lru"][1]
    assert kept["lru_2"][0] == headline["lru_2"]["device_hit_rate"]
    assert SCAN["hot"] * SCAN["hot_blocks"] * 1.5 == 24


def test_the_readme_policy_renderer_takes_the_scan_row(scan: tuple[Rows, Rows]) -> None:
    rows, _ = scan
    agent = {p: 0.5 for p in POLICIES}
    scan = {r["policy"]: round(r["device_hit_rate"], 4) for r in rows if r["headline"]}
    report = {"summary": {"hit_rate_by_policy": {"chat": agent, "scan": scan}}}
    text = BLOCKS["tiering-policies"][1](report)
    assert "| scan |" in text and "LRU-2" in text and f"**{scan['lru_2']:.4f}**" in text
