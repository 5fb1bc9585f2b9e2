"""What one exposed metric is: name, type, labels, help text (and a histogram's buckets)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

__all__ = ("MetricKind", "MetricSpec", "counter", "gauge", "histogram")


class MetricKind(enum.StrEnum):
    """The Prometheus type of a metric."""

    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class MetricSpec:
    """One exposed metric: its name, type, labels and help text.

    Attributes:
        name: the name with its prefix; a counter's samples add ``_total``.
        kind: counter, gauge or histogram.
        documentation: the help text.
        labels: the label names, in order.
        buckets: a histogram's upper bounds (``+Inf`` last).
    """

    name: str
    kind: MetricKind
    documentation: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = ()

    @property
    def samples(self) -> tuple[str, ...]:
        """The sample names Prometheus shows for it."""
        if self.kind is MetricKind.COUNTER:
            return (f"{self.name}_total",)
        if self.kind is MetricKind.HISTOGRAM:
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)


def counter(prefix: str, name: str, doc: str, *labels: str) -> MetricSpec:
    base = name[: -len("_total")] if name.endswith("_total") else name
    return MetricSpec(f"{prefix}_{base}", MetricKind.COUNTER, doc, labels)


def gauge(prefix: str, name: str, doc: str, *labels: str) -> MetricSpec:
    return MetricSpec(f"{prefix}_{name}", MetricKind.GAUGE, doc, labels)


def histogram(
    prefix: str, name: str, doc: str, label: str, buckets: tuple[float, ...]
) -> MetricSpec:
    return MetricSpec(f"{prefix}_{name}", MetricKind.HISTOGRAM, doc, (label,), (*buckets, math.inf))
