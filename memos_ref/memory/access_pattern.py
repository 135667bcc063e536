"""A seeded access pattern of an agent's short-term memory, and a cache-aside replay that measures hit rates.

What an agent reads (seed 002 §1): a few long-lived hot entries (the user's profile, the current plan, the
conversation summary), read again and again; tool results, written once and read a few times soon after;
and bursts of one-off reads (documents retrieved for one step, never needed again) — the scans that flush an
LRU cache. The mixture is the point: LRU loses the hot entries to scans, LFU keeps stale tool results, the
hybrid score sits between.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memos_ref.errors import InvalidArgumentError, check_index, check_type

__all__ = ["Access", "agent_memory_trace", "replay_hit_rate"]


@dataclass(frozen=True)
class Access:
    t: float  # seconds since the start
    key: str
    kind: str  # "hot", "tool" or "scan"


def agent_memory_trace(
    num_ops: int = 20_000,
    *,
    seed: int = 0,
    num_hot: int = 40,
    p_hot: float = 0.5,
    p_tool: float = 0.4,
    scan_burst: int = 10,
    mean_gap_s: float = 0.05,
) -> list[Access]:
    """``num_ops`` reads: hot keys chosen by a Zipf law; tool results re-read with a preference for the most
    recent; otherwise a burst of ``scan_burst`` one-off document reads."""
    num_ops = check_index("num_ops", num_ops, lo=0)
    check_type("seed", seed, int)
    num_hot = check_index("num_hot", num_hot, lo=1)
    scan_burst = check_index("scan_burst", scan_burst, lo=1)
    for name, p in (("p_hot", p_hot), ("p_tool", p_tool)):
        check_type(name, p, (int, float))
        if not 0 <= p <= 1:
            raise InvalidArgumentError(f"{name} must be a probability in [0, 1], got {p!r}")
    check_type("mean_gap_s", mean_gap_s, (int, float))
    if not mean_gap_s > 0:
        raise InvalidArgumentError(f"mean_gap_s must be > 0, got {mean_gap_s!r}")
    rng = random.Random(seed)
    hot_weights = [1 / (i + 1) for i in range(num_hot)]
    tools: list[str] = []
    out: list[Access] = []
    t, docs = 0.0, 0
    while len(out) < num_ops:
        t += rng.expovariate(1 / mean_gap_s)
        u = rng.random()
        if u < p_hot:
            out.append(Access(t, f"hot:{rng.choices(range(num_hot), hot_weights)[0]}", "hot"))
        elif u < p_hot + p_tool:
            if not tools or rng.random() < 0.3:  # a new tool call
                tools.append(f"tool:{len(tools)}")
                key = tools[-1]
            else:  # re-read a recent result: the k-th most recent with probability ~ 0.5^k
                back = min(len(tools) - 1, int(rng.expovariate(0.7)))
                key = tools[-1 - back]
            out.append(Access(t, key, "tool"))
        else:
            for _ in range(scan_burst):
                docs += 1
                t += 0.001
                out.append(Access(t, f"doc:{docs}", "scan"))
    return out[:num_ops]


def replay_hit_rate(
    get: Callable[[str], Any], set_: Callable[[str, Any], None], trace: list[Access], clock: Any
) -> dict[str, float]:
    """Cache-aside replay: read each key; on a miss, "compute" and store it. ``clock`` has a writable ``now``
    that follows the trace's times. Returns the overall hit rate and the hit rate per kind of access."""
    hits: dict[str, int] = {}
    total: dict[str, int] = {}
    sentinel = object()
    for access in trace:
        clock.now = 1000.0 + access.t
        total[access.kind] = total.get(access.kind, 0) + 1
        if get(access.key, sentinel) is not sentinel:
            hits[access.kind] = hits.get(access.kind, 0) + 1
        else:
            set_(access.key, {"key": access.key, "payload": "x" * 64})
    result = {"hit_rate": sum(hits.values()) / len(trace)}
    for kind in sorted(total):
        result[f"hit_rate_{kind}"] = hits.get(kind, 0) / total[kind]
    return result
