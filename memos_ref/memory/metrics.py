"""Prometheus metrics for a short-term memory backend, read from its ``stats()`` at scrape time.

Counters: ``{prefix}_hits``, ``_misses``, ``_sets``, ``_deletes``, ``_expirations``, ``_evictions{reason}``,
``_computations`` (single-flight computes), ``_errors`` (remote backend failures) and ``_errors_by_kind{kind}``
(``refused``, ``timeout``, ``oom``, ``readonly``, ``wrongtype``, ``moved``, ...), ``_corrupt``; gauges: ``_entries``,
``_bytes`` and ``_degraded`` (1 while a remote backend is unreachable). A counter a backend cannot know
(Redis does not report per-namespace expirations) is left out rather than reported as zero.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import Metric

from memos_ref.memory.backend import CacheBackend
from memos_ref.promutil import ScrapeExporter, counter, gauge

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
_GAUGES = (
    ("size", "entries", "live entries"),
    ("bytes", "bytes", "bytes held (JSON values + keys)"),
    ("degraded", "degraded", "1 while the backend is unreachable"),
)


class MemoryMetrics(ScrapeExporter):
    """Prometheus metrics for one backend (its own registry). ``exposition()`` is what ``/metrics`` serves."""

    def __init__(self, backend: CacheBackend, prefix: str = "memos_memory") -> None:
        self.backend = backend
        super().__init__(prefix)

    def families(self) -> Iterator[Metric]:
        stats, who = self.backend.stats(), self.backend.name
        labels = ["backend"]
        for name, text in _COUNTERS.items():
            if name in stats:
                yield counter(self.name(name), text, labels=labels, samples=[([who], stats[name])])
        yield counter(
            self.name("evictions"),
            "entries evicted to fit a limit",
            labels=[*labels, "reason"],
            samples=[([who, reason], stats.get(name, 0)) for name, reason in _EVICTIONS.items()],
        )
        kinds = sorted(k for k in stats if k.startswith("errors_"))
        if kinds:
            yield counter(
                self.name("errors_by_kind"),
                "failed calls by error kind",
                labels=[*labels, "kind"],
                samples=[([who, name[len("errors_") :]], stats[name]) for name in kinds],
            )
        for name, metric, text in _GAUGES:
            if name in stats:
                yield gauge(self.name(metric), text, labels=labels, samples=[([who], stats[name])])
