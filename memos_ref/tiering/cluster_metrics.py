"""Prometheus metrics of the cluster tier, read from :class:`~memos_ref.tiering.cluster.ClusterTierBackend` at
scrape time through the package's one exporter mechanism (:mod:`memos_ref.promutil`).

Counters: hits, misses, puts, dropped writes, damaged copies, budget refusals and untrusted counters, write
conflicts, redirections followed, exhausted or to an unknown node, rounds skipped on nodes left alone, slot-map
re-reads; rounds, reads and writes per node; errors per node and per kind (``moved``, ``ask``, ``clusterdown``,
``tryagain``, ``refused``, ``timeout``, ``oom``, ``wrongtype``, ``noperm``, …). Gauges: degraded, the slowest call
and the slowest round trip in seconds.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import Metric

from memos_ref.errors import check_type
from memos_ref.promutil import ScrapeExporter, counter, gauge
from memos_ref.tiering.cluster import ClusterTierBackend

__all__ = ["ClusterMetrics"]

_COUNTERS = {
    "hits": "blocks found",
    "misses": "blocks not found, unreadable or unreachable (read as misses)",
    "puts": "blocks stored (or already stored under the same key)",
    "dropped_puts": "writes dropped (refused by a node, a failover, a dead or hung node, the budget)",
    "corrupt": "values whose length or digest disagreed with their metadata",
    "budget_refused": "writes dropped by the tenant's byte budget",
    "redirect_retries": "reads re-sent to the node a MOVED/ASK named (batched per node)",
    "redirect_exhausted": "reads still redirected after the last round of redirections (misses)",
    "redirect_unknown_node": "reads redirected to a node the slot map does not know (misses)",
    "node_down_skips": "rounds not sent: the node is left alone after refusing or timing out",
    "put_conflicts": "writes refused: the key holds other bytes or another type",
    "budget_untrusted": "writes refused: the tenant's usage counter cannot be trusted",
    "slot_map_refreshes": "slot map re-reads after a reply showed it stale",
}


class ClusterMetrics(ScrapeExporter):
    """Prometheus metrics for one :class:`ClusterTierBackend` (its own registry)."""

    def __init__(self, backend: ClusterTierBackend, prefix: str = "memos_cluster") -> None:
        check_type("backend", backend, ClusterTierBackend)
        self.backend = backend
        super().__init__(prefix)

    def families(self) -> Iterator[Metric]:
        b = self.backend
        counts, nodes = dict(b.counts), {n: dict(c) for n, c in b.node_counts.items()}
        for name, text in _COUNTERS.items():
            yield counter(self.name(name), text, counts.get(name, 0))
        for op in ("rounds", "reads", "writes"):
            samples = [([node], c.get(op, 0)) for node, c in sorted(nodes.items())]
            yield counter(self.name(f"node_{op}"), f"{op} per node", labels=["node"], samples=samples)
        errors = [
            ([node, key[len("errors_") :]], v)
            for node, c in sorted(nodes.items())
            for key, v in sorted(c.items())
            if key.startswith("errors_")
        ]
        yield counter(self.name("errors"), "failed calls per node and kind", labels=["node", "kind"], samples=errors)
        yield gauge(self.name("slowest_call_seconds"), "the slowest call so far", b.slowest_call_s)
        yield gauge(self.name("slowest_round_trip_seconds"), "the slowest pipeline to one node", b.slowest_round_trip_s)
        yield gauge(self.name("degraded"), "1 while a node is left alone or no node answers", int(b.degraded))
