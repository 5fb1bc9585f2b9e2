"""Prometheus collectors, created on the registry the caller passes.

Nothing is registered at import time. Collectors are cached per
``(registry, prefix)``, so two publishers in one process share them instead of
clashing with "Duplicated timeseries". Labels are low-cardinality on purpose:
exchange, queue, outcome, reason, never message ids or routing keys.
"""

from __future__ import annotations

import math
import threading
import weakref
from bisect import bisect_left
from dataclasses import dataclass, fields
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

__all__ = (
    "DEFAULT_EXCHANGE_LABEL",
    "ExchangeMetrics",
    "Metrics",
    "QueueMetrics",
    "exchange_label",
)

DEFAULT_EXCHANGE_LABEL = "amq.default"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_HANDLER_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


def exchange_label(exchange: str) -> str:
    """The label value for an exchange (the nameless default exchange gets a name)."""
    return exchange or DEFAULT_EXCHANGE_LABEL


@dataclass(frozen=True)
class Metrics:
    """Every reliable_mq collector; get one with `Metrics.on()`."""

    published: Counter
    confirmed: Counter
    nacked: Counter
    returned: Counter
    republished: Counter
    publish_failed: Counter
    in_flight: Gauge
    window_size: Gauge
    confirm_latency: Histogram
    connection_recoveries: Counter
    connection_up: Gauge
    deliveries: Counter
    redeliveries: Counter
    handler_duration: Histogram
    in_progress: Gauge
    duplicates_skipped: Counter
    dedup_events: Counter
    dead_lettered: Counter
    stale_settles: Counter
    ack_batches: Counter
    settle_fallbacks: Counter
    outbox_pending: Gauge
    outbox_oldest_age: Gauge
    outbox_dispatched: Counter
    outbox_failed: Counter
    outbox_batch_latency: Histogram

    @classmethod
    def on(cls, registry: CollectorRegistry | None = None, prefix: str = "reliable_mq") -> Metrics:
        """Return the collectors for ``registry`` (default: the global one), creating them once."""
        registry = REGISTRY if registry is None else registry
        with _LOCK:
            per_registry = _CACHE.setdefault(registry, {})
            metrics = per_registry.get(prefix)
            if metrics is None:
                metrics = per_registry[prefix] = cls._create(registry, prefix)
            return metrics

    @classmethod
    def _create(cls, registry: CollectorRegistry, prefix: str) -> Metrics:
        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(f"{prefix}_{name}", doc, labels, registry=registry)

        def gauge(name: str, doc: str, *labels: str) -> Gauge:
            return Gauge(f"{prefix}_{name}", doc, labels, registry=registry)

        return cls(
            published=counter(
                "published_messages_total", "Messages accepted by publish().", "exchange"
            ),
            confirmed=counter(
                "confirmed_messages_total", "Messages the broker confirmed (basic.ack).", "exchange"
            ),
            nacked=counter(
                "nacked_messages_total", "basic.nack received for a message attempt.", "exchange"
            ),
            returned=counter(
                "returned_messages_total", "Mandatory messages returned as unroutable.", "exchange"
            ),
            republished=counter(
                "republished_messages_total",
                "Messages sent again (reason: nack, connection_lost, confirm_timeout).",
                "exchange",
                "reason",
            ),
            publish_failed=counter(
                "publish_failures_total",
                "publish() calls that ended in an error, by error.",
                "exchange",
                "error",
            ),
            in_flight=gauge(
                "publisher_in_flight_messages", "Messages holding a window slot.", "publisher"
            ),
            window_size=gauge(
                "publisher_window_size_messages",
                "The in-flight window (max_in_flight).",
                "publisher",
            ),
            confirm_latency=Histogram(
                f"{prefix}_confirm_latency_seconds",
                "Time from sending an attempt to its confirm.",
                ("exchange",),
                buckets=_LATENCY_BUCKETS,
                registry=registry,
            ),
            connection_recoveries=counter(
                "connection_recoveries_total",
                "Connections re-established after a loss.",
                "connection",
            ),
            connection_up=gauge(
                "connection_up", "1 while the connection is open, else 0.", "connection"
            ),
            deliveries=counter(
                "consumed_messages_total",
                "Deliveries by outcome (acked, retried, dead_lettered, duplicate, deferred, "
                "requeued, stale).",
                "queue",
                "outcome",
            ),
            redeliveries=counter(
                "redelivered_messages_total", "Deliveries flagged redelivered.", "queue"
            ),
            handler_duration=Histogram(
                f"{prefix}_handler_duration_seconds",
                "Time spent in the user handler.",
                ("queue",),
                buckets=_HANDLER_BUCKETS,
                registry=registry,
            ),
            in_progress=gauge("handlers_in_progress", "Deliveries inside a handler now.", "queue"),
            duplicates_skipped=counter(
                "duplicates_skipped_total", "Deliveries acked without running the handler.", "queue"
            ),
            dedup_events=counter(
                "dedup_events_total",
                "De-duplication events (no_message_id, busy, store_unavailable, "
                "complete_failed, release_failed).",
                "queue",
                "event",
            ),
            dead_lettered=counter(
                "dead_lettered_messages_total", "Messages sent to the DLQ.", "queue", "reason"
            ),
            stale_settles=counter(
                "stale_settles_total",
                "Acks/nacks dropped because the delivery's channel had died.",
                "queue",
            ),
            ack_batches=counter(
                "ack_batches_total", "basic.ack frames sent (multiple or single).", "queue"
            ),
            settle_fallbacks=counter(
                "settle_fallbacks_total",
                "Retry/DLQ/deferral copies that could not be published as built, by the rung "
                "taken instead (trimmed_copy, broker_dead_letter, requeue_later).",
                "queue",
                "rung",
            ),
            outbox_pending=gauge(
                "outbox_pending_rows", "Outbox rows committed and not yet confirmed.", "table"
            ),
            outbox_oldest_age=gauge(
                "outbox_oldest_pending_age_seconds",
                "Age of the oldest pending outbox row: the relay's lag.",
                "table",
            ),
            outbox_dispatched=counter(
                "outbox_dispatched_rows_total", "Outbox rows published and confirmed.", "table"
            ),
            outbox_failed=counter(
                "outbox_failed_rows_total",
                "Outbox row dispatches that failed (outcome: retry, deferred, dead).",
                "table",
                "outcome",
            ),
            outbox_batch_latency=Histogram(
                f"{prefix}_outbox_batch_seconds",
                "Time from claiming an outbox batch to committing its outcomes.",
                ("table",),
                buckets=_LATENCY_BUCKETS,
                registry=registry,
            ),
        )

    def for_queue(self, queue: str) -> QueueMetrics:
        """The labelled children of one consumed queue (``labels()`` is slow on a hot path)."""
        return QueueMetrics(self, queue)

    def collectors(self) -> list[object]:
        """All collectors, for documentation and tests."""
        return [getattr(self, field.name) for field in fields(self)]

    def for_exchange(self, exchange: str) -> ExchangeMetrics:
        """The publisher's labelled children for one exchange (cache the result)."""
        return ExchangeMetrics(self, exchange)


class ExchangeMetrics:
    """The per-exchange children of the publisher's collectors.

    The two per-message counters are counted in plain ints and added to
    Prometheus by [flush][reliable_mq.metrics.ExchangeMetrics.flush] (the
    publisher calls it every 50 ms and when a burst ends): a locked ``inc()``
    per message was a visible share of the hot path.
    """

    __slots__ = (
        "confirmed",
        "failed",
        "label",
        "latency",
        "metrics",
        "nacked",
        "pending_confirmed",
        "pending_published",
        "published",
        "republished",
        "returned",
    )

    def __init__(self, metrics: Metrics, exchange: str) -> None:
        label = exchange_label(exchange)
        self.metrics = metrics
        self.label = label
        self.published = metrics.published.labels(label)
        self.confirmed = metrics.confirmed.labels(label)
        self.nacked = metrics.nacked.labels(label)
        self.returned = metrics.returned.labels(label)
        self.latency = metrics.confirm_latency.labels(label)
        self.republished: dict[str, Counter] = {}
        self.failed: dict[str, Counter] = {}
        self.pending_published = 0
        self.pending_confirmed = 0

    def flush(self) -> None:
        """Add the counts kept in plain ints to their counters."""
        if self.pending_published:
            self.published.inc(self.pending_published)
            self.pending_published = 0
        if self.pending_confirmed:
            self.confirmed.inc(self.pending_confirmed)
            self.pending_confirmed = 0

    def republish(self, reason: str) -> None:
        child = self.republished.get(reason)
        if child is None:
            child = self.republished[reason] = self.metrics.republished.labels(self.label, reason)
        child.inc()

    def failure(self, error: str) -> None:
        child = self.failed.get(error)
        if child is None:
            child = self.failed[error] = self.metrics.publish_failed.labels(self.label, error)
        child.inc()


_DEDUP_EVENTS = ("no_message_id", "busy", "store_unavailable", "complete_failed", "release_failed")


class QueueMetrics:
    """The consumer's collectors for one queue, labelled once.

    Get one with [`Metrics.for_queue`][reliable_mq.metrics.Metrics.for_queue].

    What changes once per delivery on the common path is kept in plain Python
    (``pending_acked``, ``handlers_running``, handler durations counted per
    histogram bucket) and added to Prometheus by
    [flush][reliable_mq.metrics.QueueMetrics.flush], which the consumer calls
    periodically and when it stops: a locked ``inc()``/``observe()`` per
    delivery was a visible share of the consumer's hot path.
    """

    __slots__ = (
        "_bounds",
        "_buckets",
        "_duration_sum",
        "_flushed_running",
        "_observed",
        "ack_batches",
        "acked",
        "dead_lettered",
        "dedup_events",
        "deferred",
        "duplicate",
        "duplicates_skipped",
        "duration",
        "handlers_running",
        "in_progress",
        "metrics",
        "pending_acked",
        "queue",
        "redeliveries",
        "requeued",
        "retried",
        "stale",
        "stale_settles",
    )

    def __init__(self, metrics: Metrics, queue: str) -> None:
        self.metrics = metrics
        self.queue = queue
        deliveries = metrics.deliveries
        self.acked = deliveries.labels(queue, "acked")
        self.retried = deliveries.labels(queue, "retried")
        self.dead_lettered = deliveries.labels(queue, "dead_lettered")
        self.requeued = deliveries.labels(queue, "requeued")
        self.stale = deliveries.labels(queue, "stale")
        self.duplicate = deliveries.labels(queue, "duplicate")
        self.deferred = deliveries.labels(queue, "deferred")
        self.duplicates_skipped = metrics.duplicates_skipped.labels(queue)
        self.redeliveries = metrics.redeliveries.labels(queue)
        self.duration = metrics.handler_duration.labels(queue)
        self.in_progress = metrics.in_progress.labels(queue)
        self.stale_settles = metrics.stale_settles.labels(queue)
        self.ack_batches = metrics.ack_batches.labels(queue)
        self.dedup_events: dict[str, Counter] = {
            event: metrics.dedup_events.labels(queue, event) for event in _DEDUP_EVENTS
        }
        self.pending_acked = 0
        """Acks decided since the last flush."""
        self.handlers_running = 0
        """Handlers running now (the gauge gets it at the next flush)."""
        self._flushed_running = 0
        self._bounds = _bucket_bounds(self.duration)
        self._buckets = [0] * len(self._bounds)
        self._duration_sum = 0.0
        self._observed = 0

    def handler_ended(self, seconds: float) -> None:
        """Count one handler run of ``seconds`` (observed at the next flush)."""
        bounds = self._bounds
        if bounds:
            self._buckets[bisect_left(bounds, seconds)] += 1
            self._duration_sum += seconds
            self._observed += 1
        else:  # a prometheus_client without the histogram layout we add to
            self.duration.observe(seconds)

    def flush(self) -> None:
        """Add what was counted in plain Python to the Prometheus children."""
        if self.pending_acked:
            self.acked.inc(self.pending_acked)
            self.pending_acked = 0
        running = self.handlers_running
        if running != self._flushed_running:
            self.in_progress.inc(running - self._flushed_running)
            self._flushed_running = running
        if self._observed:
            # What Histogram.observe() does per value, once per bucket.
            child: Any = self.duration
            child._sum.inc(self._duration_sum)
            buckets = self._buckets
            for index, count in enumerate(buckets):
                if count:
                    child._buckets[index].inc(count)
                    buckets[index] = 0
            self._duration_sum = 0.0
            self._observed = 0

    def dead_letter_reason(self, reason: str) -> None:
        """Count one message dead-lettered for ``reason``."""
        self.metrics.dead_lettered.labels(self.queue, reason).inc()

    def fallback(self, rung: str) -> None:
        """Count one copy that could not be published as built, by the rung taken."""
        self.metrics.settle_fallbacks.labels(self.queue, rung).inc()


def _bucket_bounds(child: Any) -> tuple[float, ...]:
    """The upper bounds of a histogram child whose buckets `QueueMetrics.flush` can add to.

    Empty if this prometheus_client lays its histograms out otherwise: then every
    duration is observed at once, as before.
    """
    bounds = tuple(getattr(child, "_upper_bounds", ()))
    buckets = getattr(child, "_buckets", ())
    sum_value = getattr(child, "_sum", None)
    if not bounds or len(buckets) != len(bounds) or not hasattr(sum_value, "inc"):
        return ()
    if bounds[-1] != math.inf or not all(hasattr(bucket, "inc") for bucket in buckets):
        return ()
    return bounds


_LOCK = threading.Lock()
_CACHE: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, Metrics]] = (
    weakref.WeakKeyDictionary()
)
