"""Eviction policies: one priority function each (higher = keep longer), as SGLang's radix cache does.

A block's history is a :class:`BlockHistory` — the times it was used, its use count, its kind (what segment it
belongs to) and whether it is pinned. The tier manager evicts the lowest priority first; pinned blocks are
never candidates.

* ``lru`` — the last use;
* ``lru_2`` / ``lru_3`` — LRU-K (O'Neil, O'Neil and Weikum, SIGMOD 1993): evict the block whose K-th most recent
  *uncorrelated* reference is oldest (the largest backward K-distance); a block used fewer than K times has an
  infinite distance and goes first (oldest last use first among those). That is what makes LRU-K resist scans:
  a block read once by a scan never outranks a block used K times. References closer than the correlated
  reference period (``crp``, in the clock's units) to the previous one count as one reference, as in the paper;
  a block referenced within the last ``crp`` is not a candidate. LRU-K learns only if a block's history outlives
  its eviction (the paper's retained information period): keep the :class:`BlockHistory` of evicted blocks;
* ``recency_sum_2`` / ``recency_sum_3`` — seed 001 §2.2's score ``Σ 1/(now − tᵢ)`` over the last K uses, which
  the seed calls "LRU-K" but is another policy: dominated by the most recent use, it behaves like LRU;
* ``lfu`` — the use count;
* ``hybrid`` — seed 002 §4.2: ``(1 + 0.1·count) / (1 + age/1000)``;
* ``priority`` — by kind (system prompt > tools and memories > turns), then LRU.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from memos_ref.errors import ConfigError, check_type

__all__ = ["HISTORY", "KIND_RANK", "POLICIES", "BlockHistory", "lru_k", "lru_k_history", "priority_function"]

#: Rank of a block's kind for the ``priority`` policy (unknown kinds rank as turns).
KIND_RANK = {"system": 3, "tools": 2, "memory": 2, "turn": 1}


#: How many of a block's most recent uses are kept (LRU-K replays them to find its K-th uncorrelated reference).
HISTORY = 32

#: An LRU-K score that no block with K uncorrelated references reaches (clock values stay far below 1e12).
_NEVER = -1e12


@dataclass
class BlockHistory:
    """What a policy may look at for one block."""

    uses: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))
    count: int = 0
    kind: str = "turn"
    pinned: bool = False

    def touch(self, now: float) -> None:
        self.uses.append(now)
        self.count += 1

    @property
    def last(self) -> float:
        return self.uses[-1] if self.uses else float("-inf")


def _lru(h: BlockHistory, now: float) -> float:
    return h.last


def _lru_k(k: int) -> Callable[[BlockHistory, float], float]:
    def score(h: BlockHistory, now: float) -> float:
        recent = list(h.uses)[-k:]
        return sum(1.0 / max(now - t, 1e-3) for t in recent)

    return score


def lru_k_history(uses: Iterable[float], k: int, crp: float = 0.0) -> tuple[list[float], float]:
    """LRU-K's ``HIST`` (the times of the K most recent uncorrelated references, newest first) and ``LAST`` after
    replaying ``uses`` (ascending times) — the paper's update rule: a reference more than ``crp`` after ``LAST``
    is uncorrelated and closes the previous correlated period, whose length shifts the older history forward."""
    hist: list[float] = []
    last = float("-inf")
    for t in uses:
        if not hist:
            hist, last = [t], t
        elif t - last > crp:
            period = last - hist[0]
            hist = [t, *(h + period for h in hist)][:k]
            last = t
        else:
            last = t
    return hist, last


def _kth_distinct(uses: deque[float], k: int) -> float | None:
    """The K-th most recent distinct time in ``uses`` (ascending), or None: LRU-K's ``HIST(p, K)`` when
    ``crp`` is 0 (equal times are one reference), without replaying the history."""
    seen, prev = 0, None
    for t in reversed(uses):
        if t != prev:
            seen, prev = seen + 1, t
            if seen == k:
                return t
    return None


def _lru_k_true(k: int, crp: float = 0.0) -> Callable[[BlockHistory, float], float]:
    if crp == 0:

        def fast(h: BlockHistory, now: float) -> float:
            kth = _kth_distinct(h.uses, k)
            return _NEVER + h.last if kth is None else kth

        return fast

    def score(h: BlockHistory, now: float) -> float:
        hist, last = lru_k_history(h.uses, k, crp)
        if crp > 0 and now - last <= crp:
            return -_NEVER + last  # inside its correlated period: not a candidate (kept)
        if len(hist) < k:
            return _NEVER + last  # infinite backward K-distance: first to go, least recently used first
        return hist[k - 1]  # larger = the K-th most recent reference is newer = keep longer

    return score


def lru_k(k: int, crp: float = 0.0) -> Callable[[BlockHistory, float], float]:
    """The LRU-K priority function for any ``k`` ≥ 1 and correlated reference period ``crp`` ≥ 0 (``lru_k(1)``
    is LRU). Higher = keep longer, like every entry of :data:`POLICIES`."""
    check_type("k", k, int)
    if not 1 <= k <= HISTORY:
        raise ConfigError(f"LRU-K: expected 1 <= k <= {HISTORY} (uses kept per block), got k={k}")
    if not isinstance(crp, int | float) or isinstance(crp, bool) or not 0 <= crp < float("inf"):
        raise ConfigError(f"LRU-K: expected a finite correlated reference period crp >= 0, got {crp!r}")
    return _lru_k_true(k, float(crp))


def _lfu(h: BlockHistory, now: float) -> float:
    return h.count + (h.last / 1e12 if h.uses else 0.0)  # ties broken by recency


def _hybrid(h: BlockHistory, now: float) -> float:
    return (1 + 0.1 * h.count) / (1 + max(0.0, now - h.last) / 1000.0)


def _priority(h: BlockHistory, now: float) -> float:
    return KIND_RANK.get(h.kind, 1) * 1e12 + h.last


POLICIES: dict[str, Callable[[BlockHistory, float], float]] = {
    "lru": _lru,
    "lru_2": _lru_k_true(2),
    "lru_3": _lru_k_true(3),
    "recency_sum_2": _lru_k(2),
    "recency_sum_3": _lru_k(3),
    "lru_k2": _lru_k(2),  # old name of recency_sum_2, until its callers move
    "lru_k3": _lru_k(3),
    "lfu": _lfu,
    "hybrid": _hybrid,
    "priority": _priority,
}


def priority_function(policy: str) -> Callable[[BlockHistory, float], float]:
    """The priority function of a policy by name."""
    check_type("policy", policy, str)
    if policy not in POLICIES:
        raise ConfigError(f"unknown eviction policy {policy!r}: expected one of {sorted(POLICIES)}")
    return POLICIES[policy]
