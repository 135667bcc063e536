"""The one Prometheus mechanism every exporter of the package uses (issue 15: three collectors were three copies).

An exporter reads its figures at scrape time (nothing to keep in sync) and yields metric families built with
:func:`counter` and :func:`gauge`; :class:`ScrapeExporter` owns the registry, registers the collector and serves
the text exposition. :class:`~memos_ref.metrics.PagedMetrics` (the paged pool),
:class:`~memos_ref.memory.MemoryMetrics` (the short-term memory) and
:class:`~memos_ref.tiering.metrics.TierMetrics` (the tiers) are its three users. This module imports nothing
from the package, so every layer may use it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["ScrapeExporter", "counter", "family_types", "gauge"]

#: one labelled sample: its label values (in the family's label order) and its value
Sample = tuple[Sequence[str], float]


def _family(kind: type, name: str, text: str, value: float | None, labels: Sequence[str], samples: Iterable[Sample]):
    if labels:
        family = kind(name, text, labels=list(labels))
        for label_values, sample in samples:
            family.add_metric(list(label_values), sample)
        return family
    return kind(name, text, value=value)


def counter(
    name: str, text: str, value: float | None = None, *, labels: Sequence[str] = (), samples: Iterable[Sample] = ()
) -> CounterMetricFamily:
    """A counter family: one unlabelled ``value``, or ``samples`` of (label values, value) under ``labels``."""
    return _family(CounterMetricFamily, name, text, value, labels, samples)


def gauge(
    name: str, text: str, value: float | None = None, *, labels: Sequence[str] = (), samples: Iterable[Sample] = ()
) -> GaugeMetricFamily:
    """A gauge family: one unlabelled ``value``, or ``samples`` of (label values, value) under ``labels``."""
    return _family(GaugeMetricFamily, name, text, value, labels, samples)


class _Collector:
    """What the registry calls at scrape time: the exporter's families, read fresh."""

    def __init__(self, exporter: ScrapeExporter) -> None:
        self.exporter = exporter

    def collect(self) -> Iterator[Metric]:
        yield from self.exporter.families()


class ScrapeExporter(ABC):
    """Base of every exporter: its own registry (so several coexist), figures read at scrape time.

    Args:
        prefix: the metric name prefix (``{prefix}_hits``, ...).
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(self))

    @abstractmethod
    def families(self) -> Iterator[Metric]:
        """The metric families of one scrape (read from the watched object now)."""

    def name(self, suffix: str) -> str:
        """``{prefix}_{suffix}``."""
        return f"{self.prefix}_{suffix}"

    def exposition(self) -> str:
        """The Prometheus text exposition (what a ``/metrics`` endpoint serves)."""
        return generate_latest(self.registry).decode()


def family_types(exposition: str) -> dict[str, str]:
    """Family name -> type (``counter``, ``gauge``, ``histogram``) of a text exposition (a counter's family
    name is without its ``_total`` suffix, as the exporter named it)."""
    return {family.name: family.type for family in text_string_to_metric_families(exposition)}
