"""The collector: every live metrics object read at a scrape, summed by labels.

Registered once per registry and prefix (prometheus_client's public
``Collector`` protocol). A metrics object whose owner is garbage collected
leaves its counters and histograms behind (added to the totals of their
labels), so totals never go backwards; its gauges go with it. In
multiprocess mode (`Mirror`) each object also feeds ordinary prometheus_client
metrics, whose values go to the files that the parent process sums.
"""

from __future__ import annotations

import math
import os
import threading
import weakref
from collections.abc import Iterable
from typing import Any, TypeVar

from prometheus_client import Counter, Gauge
from prometheus_client import Histogram as PromHistogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from ._counts import Histogram, Reporting
from ._spec import MetricKind, MetricSpec

__all__ = ("Hub", "Mirror")

_MULTIPROCESS_ENV = ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")
_R = TypeVar("_R", bound=Reporting)

_MAX_GAUGES = frozenset({"connection_up"})
"""Gauges whose series with the same labels show the largest value (1 if any
connection of that name is up); the others show the sum."""


class Mirror:
    """Multiprocess mode: plain prometheus_client metrics, registered nowhere, whose
    values go to the files that ``reliable-mq run``'s supervisor sums."""

    def __init__(self, specs: dict[str, MetricSpec]) -> None:
        self._specs = specs
        self._parents: dict[str, Any] = {}
        self._lock = threading.Lock()

    def child(self, field: str, labels: tuple[str, ...]) -> Any:
        with self._lock:
            parent = self._parents.get(field)
            if parent is None:
                spec = self._specs[field]
                name, doc = spec.name, spec.documentation
                if spec.kind is MetricKind.COUNTER:
                    parent = Counter(name, doc, spec.labels, registry=None)
                elif spec.kind is MetricKind.GAUGE:
                    parent = Gauge(name, doc, spec.labels, registry=None)
                else:
                    parent = PromHistogram(
                        name, doc, spec.labels, buckets=spec.buckets, registry=None
                    )
                self._parents[field] = parent
            return parent.labels(*labels)


class Hub(Collector):
    """The collector of one `reliable_mq.metrics.Metrics`: reads every live metrics object
    at a scrape."""

    def __init__(self, specs: dict[str, MetricSpec]) -> None:
        self.specs = specs
        multiprocess = any(os.environ.get(name) for name in _MULTIPROCESS_ENV)
        self._mirror = Mirror(specs) if multiprocess else None
        self._live: set[Reporting] = set()
        self._kept: dict[tuple[str, tuple[str, ...]], float | Histogram] = {}
        """Counters and histograms of objects whose owner is gone."""
        self._lock = threading.RLock()  # a retirement may run in a scrape's thread

    # -- what the metrics objects ask (Exporter) --------------------------------------

    @property
    def mirrored(self) -> bool:
        return self._mirror is not None

    def bounds(self, field: str) -> tuple[float, ...]:
        return self.specs[field].buckets

    def mirror(self, field: str, labels: tuple[str, ...]) -> Any:
        return None if self._mirror is None else self._mirror.child(field, labels)

    # -- life of the metrics objects ----------------------------------------------------

    def add(self, reporting: _R, owner: object | None) -> _R:
        with self._lock:
            self._live.add(reporting)
        if owner is not None:
            weakref.finalize(owner, self._retire, reporting)
        return reporting

    def _retire(self, reporting: Reporting) -> None:
        reporting.flush()
        with self._lock:
            self._live.discard(reporting)
            kept = self._kept
            for field, labels, value in reporting.samples():
                if field in reporting.GAUGES:
                    continue
                key = (field, labels)
                if isinstance(value, Histogram):
                    total = kept.get(key)
                    if not isinstance(total, Histogram):
                        total = kept[key] = Histogram(value.bounds)
                    total.add(value)
                else:
                    previous = kept.get(key, 0.0)
                    assert not isinstance(previous, Histogram)
                    kept[key] = previous + value

    def _gathered(self) -> dict[str, dict[tuple[str, ...], float | Histogram]]:
        gathered: dict[str, dict[tuple[str, ...], float | Histogram]] = {}
        with self._lock:
            live = list(self._live)
            kept = list(self._kept.items())
        for (field, labels), value in kept:
            _merge(gathered.setdefault(field, {}), labels, value, field)
        for reporting in live:
            for field, labels, value in reporting.samples():
                _merge(gathered.setdefault(field, {}), labels, value, field)
        return gathered

    def collect(self) -> Iterable[Metric]:
        gathered = self._gathered()
        for field, spec in self.specs.items():
            yield _family(spec, gathered.get(field, {}))

    def describe(self) -> Iterable[Metric]:
        for spec in self.specs.values():
            yield _family(spec, {})


def _merge(
    into: dict[tuple[str, ...], float | Histogram],
    labels: tuple[str, ...],
    value: float | Histogram,
    field: str,
) -> None:
    previous = into.get(labels)
    if isinstance(value, Histogram):
        total = previous if isinstance(previous, Histogram) else Histogram(value.bounds)
        total.add(value)
        into[labels] = total
    elif previous is None:
        into[labels] = value
    elif field in _MAX_GAUGES:
        into[labels] = max(float(previous), value)  # type: ignore[arg-type]
    else:
        into[labels] = float(previous) + value  # type: ignore[arg-type]


def _le(bound: float) -> str:
    """A bucket bound as prometheus_client writes it: ``0.005``, ``1.0``, ``+Inf``."""
    return "+Inf" if bound == math.inf else repr(float(bound))


def _family(spec: MetricSpec, values: dict[tuple[str, ...], float | Histogram]) -> Metric:
    rows = sorted(values.items(), key=lambda item: item[0])
    if spec.kind is MetricKind.HISTOGRAM:
        histograms = HistogramMetricFamily(spec.name, spec.documentation, labels=spec.labels)
        for labels, value in rows:
            if isinstance(value, Histogram):
                histograms.add_metric(list(labels), _cumulative(value), value.sum)
        return histograms
    family: CounterMetricFamily | GaugeMetricFamily
    if spec.kind is MetricKind.COUNTER:
        family = CounterMetricFamily(spec.name, spec.documentation, labels=spec.labels)
    else:
        family = GaugeMetricFamily(spec.name, spec.documentation, labels=spec.labels)
    for labels, value in rows:
        if not isinstance(value, Histogram):
            family.add_metric(list(labels), value)
    return family


def _cumulative(histogram: Histogram) -> list[tuple[str, float]]:
    """The buckets as Prometheus shows them: each counts every observation up to its bound."""
    cumulative, buckets = 0, []
    for bound, count in zip(histogram.bounds, histogram.buckets, strict=True):
        cumulative += count
        buckets.append((_le(bound), float(cumulative)))
    return buckets
