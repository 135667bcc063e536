"""Prometheus metrics of the tiers, read from the tier manager at scrape time.

Gauges: device utilization, device blocks held, blocks and bytes per tier, the swap rate (seed 000 §5.3:
several swaps a second means the watermarks are too aggressive), degraded (per tier). Counters: blocks and bytes
swapped out and in, write-backs on eviction, tokens reloaded and recomputed, damaged copies, reload decisions.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from memos_ref.tiering.manager import TierManager

__all__ = ["TierMetrics"]

_COUNTERS = {
    "swap_out_blocks": "blocks moved from the device to a tier",
    "swap_out_bytes": "raw KV bytes moved from the device to a tier",
    "swap_in_blocks": "blocks reloaded from a tier to the device",
    "swap_in_bytes": "raw KV bytes reloaded from a tier",
    "write_backs": "cached blocks written to a tier when the allocator evicted them",
    "reloaded_tokens": "prompt tokens restored from a tier instead of recomputed",
    "recomputed_tokens": "tokens recomputed when a suspended session resumed",
    "decided_reload": "requests where reloading was estimated cheaper than recomputing",
    "decided_recompute": "requests where recomputing was estimated cheaper than reloading",
    "reload_failed": "reloads that ended early (a damaged copy or an unreachable tier)",
}


class _Collector:
    def __init__(self, tm: TierManager, prefix: str) -> None:
        self.tm, self.prefix = tm, prefix

    def collect(self):
        stats, p = self.tm.stats(), self.prefix
        yield GaugeMetricFamily(
            f"{p}_device_utilization", "(active + cached) / total device blocks", value=stats["device_utilization"]
        )
        yield GaugeMetricFamily(
            f"{p}_swap_rate", "blocks swapped per second over the last 10 s", value=stats["swap_rate_per_s"]
        )
        for name, text in _COUNTERS.items():
            yield CounterMetricFamily(f"{p}_{name}", text, value=stats.get(name, 0))
        blocks = GaugeMetricFamily(f"{p}_tier_blocks", "blocks held by a tier", labels=["tier"])
        size = GaugeMetricFamily(f"{p}_tier_bytes", "bytes held by a tier (encoded)", labels=["tier"])
        corrupt = CounterMetricFamily(
            f"{p}_tier_corrupt", "damaged or foreign copies found (read as misses)", labels=["tier"]
        )
        degraded = GaugeMetricFamily(f"{p}_tier_degraded", "1 while a tier is unreachable", labels=["tier"])
        for tier, t in stats["tiers"].items():
            blocks.add_metric([tier], t.get("blocks", 0))
            size.add_metric([tier], t.get("bytes", 0))
            corrupt.add_metric([tier], t.get("corrupt", 0))
            degraded.add_metric([tier], t.get("degraded", 0))
        yield from (blocks, size, corrupt, degraded)


class TierMetrics:
    """Prometheus metrics for one :class:`TierManager` (its own registry)."""

    def __init__(self, tm: TierManager, prefix: str = "memos_tier") -> None:
        self.tm = tm
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(tm, prefix))

    def exposition(self) -> str:
        return generate_latest(self.registry).decode()
