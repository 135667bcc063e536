"""Eviction policies: one priority function each (higher = keep longer), as SGLang's radix cache does.

A block's history is a :class:`BlockHistory` — the times it was used, its use count, its kind (what segment it
belongs to) and whether it is pinned. The tier manager evicts the lowest priority first; pinned blocks are
never candidates.

* ``lru`` — the last use;
* ``lru_k`` — seed 001 §2.2: ``Σ 1/(now − tᵢ)`` over the last K uses (K = 2 by default): recent *and* repeated;
* ``lfu`` — the use count;
* ``hybrid`` — seed 002 §4.2: ``(1 + 0.1·count) / (1 + age/1000)``;
* ``priority`` — by kind (system prompt > tools and memories > turns), then LRU.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from memos_ref.errors import ConfigError, check_type

__all__ = ["KIND_RANK", "POLICIES", "BlockHistory", "priority_function"]

#: Rank of a block's kind for the ``priority`` policy (unknown kinds rank as turns).
KIND_RANK = {"system": 3, "tools": 2, "memory": 2, "turn": 1}


@dataclass
class BlockHistory:
    """What a policy may look at for one block."""

    uses: deque[float] = field(default_factory=lambda: deque(maxlen=8))
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


def _lfu(h: BlockHistory, now: float) -> float:
    return h.count + (h.last / 1e12 if h.uses else 0.0)  # ties broken by recency


def _hybrid(h: BlockHistory, now: float) -> float:
    return (1 + 0.1 * h.count) / (1 + max(0.0, now - h.last) / 1000.0)


def _priority(h: BlockHistory, now: float) -> float:
    return KIND_RANK.get(h.kind, 1) * 1e12 + h.last


POLICIES: dict[str, Callable[[BlockHistory, float], float]] = {
    "lru": _lru,
    "lru_k2": _lru_k(2),
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
