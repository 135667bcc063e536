"""Prometheus metrics of the tiers, read from the tier manager at scrape time.

Gauges: device utilization, device blocks held, blocks and bytes per tier, the swap rate (seed 000 §5.3:
several swaps a second means the watermarks are too aggressive), degraded (per tier). Counters: blocks and bytes
swapped out and in, write-backs on eviction, tokens reloaded and recomputed, damaged copies, reload decisions.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import Metric

from memos_ref.promutil import ScrapeExporter, counter, gauge
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


_PER_TIER = (
    (gauge, "tier_blocks", "blocks held by a tier", "blocks"),
    (gauge, "tier_bytes", "bytes held by a tier (encoded)", "bytes"),
    (counter, "tier_corrupt", "damaged or foreign copies found (read as misses)", "corrupt"),
    (gauge, "tier_degraded", "1 while a tier is unreachable", "degraded"),
)


class TierMetrics(ScrapeExporter):
    """Prometheus metrics for one :class:`TierManager` (its own registry)."""

    def __init__(self, tm: TierManager, prefix: str = "memos_tier") -> None:
        self.tm = tm
        super().__init__(prefix)

    def families(self) -> Iterator[Metric]:
        stats = self.tm.stats()
        yield gauge(
            self.name("device_utilization"),
            "(active + cached) / total device blocks",
            stats["device_utilization"],
        )
        yield gauge(self.name("swap_rate"), "blocks swapped per second over the last 10 s", stats["swap_rate_per_s"])
        for name, text in _COUNTERS.items():
            yield counter(self.name(name), text, stats.get(name, 0))
        tiers = stats["tiers"].items()
        for make, name, text, key in _PER_TIER:
            yield make(self.name(name), text, labels=["tier"], samples=[([tier], t.get(key, 0)) for tier, t in tiers])
