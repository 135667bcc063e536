"""Metrics of the paged KV memory, exposed in Prometheus text format through ``prometheus_client``.

Gauges are read from the memory at scrape time (nothing to keep in sync): blocks total / active / cached /
free, slot utilization (filled token slots over the slots of held blocks — seed 000 §5.3's block
utilization), prefix queries and hits *in tokens* (only tokens actually reused count as hits). Allocation
latency is a histogram fed by the allocator's ``allocated`` events (no wrapper around ``allocate``).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from memos_ref.paged.allocator import ALLOCATED, BlockEvent
from memos_ref.paged.store import PagedKV

__all__ = ["PagedMetrics"]


class _PagedCollector:
    def __init__(self, kv: PagedKV, prefix: str) -> None:
        self.kv, self.prefix = kv, prefix

    def collect(self):
        stats = self.kv.stats()
        p = self.prefix
        helps = {
            "total": "KV blocks in the pool",
            "active": "KV blocks held by at least one sequence",
            "cached": "KV blocks held by nobody but kept for prefix reuse (evictable)",
            "free": "KV blocks on the free list",
        }
        for state, text in helps.items():
            yield GaugeMetricFamily(f"{p}_blocks_{state}", text, value=stats[f"blocks_{state}"])
        yield GaugeMetricFamily(
            f"{p}_slot_utilization", "filled token slots / slots of held blocks", value=stats["slot_utilization"]
        )
        yield CounterMetricFamily(
            f"{p}_evictions", "cached blocks evicted for new allocations", value=stats["evictions"]
        )
        if "prefix_query_tokens" in stats:
            yield CounterMetricFamily(
                f"{p}_prefix_query_tokens",
                "prompt tokens looked up in the prefix cache",
                value=stats["prefix_query_tokens"],
            )
            yield CounterMetricFamily(
                f"{p}_prefix_hit_tokens",
                "prompt tokens reused from the prefix cache (not recomputed)",
                value=stats["prefix_hit_tokens"],
            )


class PagedMetrics:
    """Prometheus metrics for one :class:`PagedKV` (its own registry, so several can coexist)."""

    def __init__(self, kv: PagedKV, prefix: str = "memos_kv") -> None:
        self.kv = kv
        self.registry = CollectorRegistry()
        self.registry.register(_PagedCollector(kv, prefix))
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

    def exposition(self) -> str:
        """The Prometheus text exposition (what a ``/metrics`` endpoint serves)."""
        return generate_latest(self.registry).decode()

    def snapshot(self) -> dict[str, Any]:
        """The same figures as a dict."""
        return self.kv.stats()
