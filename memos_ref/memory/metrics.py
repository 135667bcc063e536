"""Prometheus metrics for a short-term memory backend, read from its ``stats()`` at scrape time.

Counters: ``{prefix}_hits``, ``_misses``, ``_sets``, ``_deletes``, ``_expirations``, ``_evictions{reason}``,
``_computations`` (single-flight computes), ``_errors`` (remote backend failures) and ``_errors_by_kind{kind}``
(``refused``, ``timeout``, ``oom``, ``readonly``, ``wrongtype``, ``moved``, ...), ``_corrupt``; gauges: ``_entries``,
``_bytes`` and ``_degraded`` (1 while a remote backend is unreachable). A counter a backend cannot know
(Redis does not report per-namespace expirations) is left out rather than reported as zero.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from memos_ref.memory.backend import CacheBackend

__all__ = ["MemoryMetrics"]

_COUNTERS = {
    "hits": "lookups that found a live entry",
    "misses": "lookups that found nothing (absent or expired)",
    "sets": "values stored",
    "deletes": "entries deleted by the caller",
    "expirations": "entries removed because their TTL passed",
    "computations": "values computed by get_or_compute (single flight: once per concurrent miss)",
    "negative_hits": "lookups answered by a cached 'nothing found'",
    "errors": "calls that failed (unreachable backend, or an error reply: see _errors_by_kind)",
    "dropped_sets": "writes dropped (backend unreachable, full or read-only)",
    "corrupt": "stored values that could not be read back (not JSON, too large): answered as misses",
}
_EVICTIONS = {"evictions_entries": "entries", "evictions_bytes": "bytes"}


class _Collector:
    def __init__(self, backend: CacheBackend, prefix: str) -> None:
        self.backend, self.prefix = backend, prefix

    def collect(self):
        stats, p = self.backend.stats(), self.prefix
        labels = ["backend"]
        for name, text in _COUNTERS.items():
            if name in stats:
                family = CounterMetricFamily(f"{p}_{name}", text, labels=labels)
                family.add_metric([self.backend.name], stats[name])
                yield family
        evictions = CounterMetricFamily(f"{p}_evictions", "entries evicted to fit a limit", labels=[*labels, "reason"])
        for name, reason in _EVICTIONS.items():
            evictions.add_metric([self.backend.name, reason], stats.get(name, 0))
        yield evictions
        kinds = sorted(k for k in stats if k.startswith("errors_"))
        if kinds:
            by_kind = CounterMetricFamily(f"{p}_errors_by_kind", "failed calls by error kind", labels=[*labels, "kind"])
            for name in kinds:
                by_kind.add_metric([self.backend.name, name[len("errors_") :]], stats[name])
            yield by_kind
        for name, metric, text in (
            ("size", "entries", "live entries"),
            ("bytes", "bytes", "bytes held (JSON values + keys)"),
            ("degraded", "degraded", "1 while the backend is unreachable"),
        ):
            if name in stats:
                gauge = GaugeMetricFamily(f"{p}_{metric}", text, labels=labels)
                gauge.add_metric([self.backend.name], stats[name])
                yield gauge


class MemoryMetrics:
    """Prometheus metrics for one backend (its own registry). ``exposition()`` is what ``/metrics`` serves."""

    def __init__(self, backend: CacheBackend, prefix: str = "memos_memory") -> None:
        self.backend = backend
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(backend, prefix))

    def exposition(self) -> str:
        return generate_latest(self.registry).decode()
