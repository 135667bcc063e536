"""``bench cluster``'s throughput part: reads and writes of 32 KiB blocks per second through the cluster tier
(pipelined per node) on a 1-master and a 3-master cluster, rounds interleaved, medians with min-max and the 3/1
ratios with the min-max of the per-round ratios. Re-exported by :mod:`memos_ref.bench.cluster`."""

from __future__ import annotations

import os
import time
from statistics import median
from typing import Any

__all__ = ["throughput"]


def throughput(urls: dict[int, str], rounds: int, blocks: int) -> dict[str, Any]:
    """Reads and writes of 32 KiB blocks per second through the cluster tier (pipelined per node), on clusters of
    1 and 3 masters (``urls``: masters -> url), rounds interleaved so load drifts hit both alike; median and
    min-max per cluster, and the 3/1 ratio of medians with the min-max of the per-round ratios."""
    from memos_ref.tiering.cluster import ClusterTierBackend

    data = os.urandom(32 << 10)
    backends = {m: ClusterTierBackend(u, fingerprint="bench", namespace="tput") for m, u in urls.items()}
    rates: dict[int, dict[str, list[float]]] = {m: {"write": [], "read": []} for m in urls}
    for r in range(rounds):
        for masters, b in backends.items():
            items = {f"r{r}b{i}": data for i in range(blocks)}
            started = time.perf_counter()
            stored = sum(b.put_many(items).values())
            rates[masters]["write"].append(stored / (time.perf_counter() - started))
            started = time.perf_counter()
            got = b.get_many(list(items))
            rates[masters]["read"].append(len(got) / (time.perf_counter() - started))
    out: dict[str, Any] = {"blocks_per_round": blocks, "rounds": rounds, "block_bytes": len(data)}
    for masters, b in backends.items():
        b.clear()
        b.close()
        for op in ("write", "read"):
            xs = rates[masters][op]
            out[f"{op}_blocks_per_s_{masters}m"] = median(xs)
            out[f"{op}_min_max_{masters}m"] = [min(xs), max(xs)]
    if 1 in rates and 3 in rates:
        for op in ("write", "read"):
            ratios = [c / a for a, c in zip(rates[1][op], rates[3][op])]
            out[f"{op}_ratio_3m_over_1m"] = median(rates[3][op]) / median(rates[1][op])
            out[f"{op}_ratio_min_max"] = [min(ratios), max(ratios)]
    return out
