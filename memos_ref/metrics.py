"""Metrics of the paged KV memory, exposed in Prometheus text format through ``prometheus_client``.

Gauges are read from the memory at scrape time (nothing to keep in sync): blocks total / active / cached /
free, slot utilization (filled token slots over the slots of held blocks — seed 000 §5.3's block
utilization), prefix queries and hits *in tokens* (only tokens actually reused count as hits). Allocation
latency is a histogram fed by the allocator's ``allocated`` events (no wrapper around ``allocate``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import Histogram
from prometheus_client.metrics_core import Metric

from memos_ref.paged.allocator import ALLOCATED, BlockEvent
from memos_ref.paged.store import PagedKV
from memos_ref.promutil import ScrapeExporter, counter, gauge

__all__ = ["PagedMetrics"]

_BLOCKS = {
    "total": "KV blocks in the pool",
    "active": "KV blocks held by at least one sequence",
    "cached": "KV blocks held by nobody but kept for prefix reuse (evictable)",
    "free": "KV blocks on the free list",
}
_PREFIX_COUNTERS = {
    "prefix_query_tokens": "prompt tokens looked up in the prefix cache",
    "prefix_hit_tokens": "prompt tokens reused from the prefix cache (not recomputed)",
}


class PagedMetrics(ScrapeExporter):
    """Prometheus metrics for one :class:`PagedKV` (its own registry, so several can coexist)."""

    def __init__(self, kv: PagedKV, prefix: str = "memos_kv") -> None:
        self.kv = kv
        super().__init__(prefix)
        self.alloc_latency = Histogram(
            f"{prefix}_allocate_seconds",
            "time to allocate blocks",
            buckets=(1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 1e-3, 1e-2),
            registry=self.registry,
        )
        # the allocator times each allocate() while someone subscribes to ``allocated``, and hands the event here
        self._events = kv.allocator.subscribe({ALLOCATED}, handler=self._observe)

    def _observe(self, event: BlockEvent) -> None:
        self.alloc_latency.observe(event.seconds)

    def close(self) -> None:
        """Stop observing allocations (the gauges keep reading the memory at scrape time)."""
        self._events.close()

    def families(self) -> Iterator[Metric]:
        stats = self.kv.stats()
        for state, text in _BLOCKS.items():
            yield gauge(self.name(f"blocks_{state}"), text, stats[f"blocks_{state}"])
        yield gauge(
            self.name("slot_utilization"), "filled token slots / slots of held blocks", stats["slot_utilization"]
        )
        yield counter(self.name("evictions"), "cached blocks evicted for new allocations", stats["evictions"])
        for name, text in _PREFIX_COUNTERS.items():
            if name in stats:
                yield counter(self.name(name), text, stats[name])

    def snapshot(self) -> dict[str, Any]:
        """The same figures as a dict."""
        return self.kv.stats()
