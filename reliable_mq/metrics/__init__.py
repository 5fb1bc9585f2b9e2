"""Prometheus metrics: counted once, in plain Python, read by a collector at scrape time.

Each component counts its own events in one object: a publisher in a
[`PublisherMetrics`][reliable_mq.metrics.PublisherMetrics] (one
[`ExchangeMetrics`][reliable_mq.metrics.ExchangeMetrics] per exchange), each
consumed queue in a [`QueueMetrics`][reliable_mq.metrics.QueueMetrics], each
connection in a [`ConnectionMetrics`][reliable_mq.metrics.ConnectionMetrics], an
outbox relay in an [`OutboxMetrics`][reliable_mq.metrics.OutboxMetrics]. The
same numbers serve the component's ``stats()`` and Prometheus: the hot path is
a plain ``+= 1``, never a lock. A collector (prometheus_client's public
``Collector`` protocol), registered once per registry and prefix, reads every
live object when the registry is scraped and sums those with the same labels.

Nothing is registered at import time. Two publishers or consumers on one
registry share the collector instead of clashing with "Duplicated timeseries".
When a component is garbage collected, its counters and histograms are kept
(added to the totals of their labels), so totals never go backwards; its gauges
go. Labels are low-cardinality on purpose: exchange, queue, outcome, reason,
never message ids or routing keys.

Under prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set,
as ``reliable-mq run`` does for its workers), a collector's values never reach
the files the parent process sums. There, each object also feeds ordinary
prometheus_client metrics (not registered anywhere: their values go to the
files): counters and gauges by their change at each ``flush()``, which every
component calls periodically and when it stops, histograms at each observation.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, fields

from prometheus_client import REGISTRY, CollectorRegistry

from ._counts import (
    DEFAULT_EXCHANGE_LABEL,
    ConnectionMetrics,
    ExchangeMetrics,
    Histogram,
    OutboxMetrics,
    PublisherMetrics,
    QueueMetrics,
    exchange_label,
)
from ._export import Hub
from ._spec import MetricKind, MetricSpec, counter, gauge, histogram

__all__ = (
    "DEFAULT_EXCHANGE_LABEL",
    "ConnectionMetrics",
    "ExchangeMetrics",
    "Histogram",
    "MetricKind",
    "MetricSpec",
    "Metrics",
    "OutboxMetrics",
    "PublisherMetrics",
    "QueueMetrics",
    "exchange_label",
)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_HANDLER_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
_BATCH_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)


@dataclass(frozen=True, eq=False)
class Metrics:
    """Every reliable_mq metric under one prefix, on one registry; get it with `Metrics.on()`.

    Each field describes one exposed metric. The objects that count are made by
    `for_publisher`, `for_queue`, `for_connection` and `for_outbox`.
    """

    published: MetricSpec
    confirmed: MetricSpec
    nacked: MetricSpec
    returned: MetricSpec
    republished: MetricSpec
    publish_failed: MetricSpec
    in_flight: MetricSpec
    window_size: MetricSpec
    confirm_latency: MetricSpec
    connection_recoveries: MetricSpec
    connection_up: MetricSpec
    deliveries: MetricSpec
    redeliveries: MetricSpec
    handler_duration: MetricSpec
    batch_size: MetricSpec
    in_progress: MetricSpec
    duplicates_skipped: MetricSpec
    dedup_events: MetricSpec
    dead_lettered: MetricSpec
    stale_settles: MetricSpec
    ack_batches: MetricSpec
    settle_fallbacks: MetricSpec
    outbox_pending: MetricSpec
    outbox_oldest_age: MetricSpec
    outbox_dispatched: MetricSpec
    outbox_failed: MetricSpec
    outbox_batch_latency: MetricSpec

    @classmethod
    def on(cls, registry: CollectorRegistry | None = None, prefix: str = "reliable_mq") -> Metrics:
        """The metrics of ``registry`` (default: the global one), registered there once."""
        registry = REGISTRY if registry is None else registry
        with _LOCK:
            per_registry = _CACHE.setdefault(registry, {})
            metrics = per_registry.get(prefix)
            if metrics is None:
                metrics = cls.describe(prefix)
                hub = Hub(metrics.specs())
                object.__setattr__(metrics, "_hub", hub)
                registry.register(hub)
                per_registry[prefix] = metrics
            return metrics

    @classmethod
    def describe(cls, prefix: str = "reliable_mq") -> Metrics:
        """The metric descriptions alone (not registered anywhere: for docs and tests)."""
        return cls(
            published=counter(
                prefix, "published_messages_total", "Messages accepted by publish().", "exchange"
            ),
            confirmed=counter(
                prefix,
                "confirmed_messages_total",
                "Messages the broker confirmed (basic.ack).",
                "exchange",
            ),
            nacked=counter(
                prefix,
                "nacked_messages_total",
                "basic.nack received for a message attempt.",
                "exchange",
            ),
            returned=counter(
                prefix,
                "returned_messages_total",
                "Mandatory messages returned as unroutable.",
                "exchange",
            ),
            republished=counter(
                prefix,
                "republished_messages_total",
                "Messages sent again (reason: nack, connection_lost, confirm_timeout).",
                "exchange",
                "reason",
            ),
            publish_failed=counter(
                prefix,
                "publish_failures_total",
                "publish() calls that ended in an error, by error.",
                "exchange",
                "error",
            ),
            in_flight=gauge(
                prefix,
                "publisher_in_flight_messages",
                "Messages holding a window slot.",
                "publisher",
            ),
            window_size=gauge(
                prefix,
                "publisher_window_size_messages",
                "The in-flight window (max_in_flight).",
                "publisher",
            ),
            confirm_latency=histogram(
                prefix,
                "confirm_latency_seconds",
                "Time from sending an attempt to its confirm.",
                "exchange",
                _LATENCY_BUCKETS,
            ),
            connection_recoveries=counter(
                prefix,
                "connection_recoveries_total",
                "Connections re-established after a loss.",
                "connection",
            ),
            connection_up=gauge(
                prefix, "connection_up", "1 while the connection is open, else 0.", "connection"
            ),
            deliveries=counter(
                prefix,
                "consumed_messages_total",
                "Deliveries by outcome (acked, retried, dead_lettered, duplicate, deferred, "
                "requeued, stale).",
                "queue",
                "outcome",
            ),
            redeliveries=counter(
                prefix,
                "redelivered_messages_total",
                "Deliveries flagged redelivered.",
                "queue",
            ),
            handler_duration=histogram(
                prefix,
                "handler_duration_seconds",
                "Time spent in the user handler.",
                "queue",
                _HANDLER_BUCKETS,
            ),
            batch_size=histogram(
                prefix,
                "handler_batch_size",
                "Deliveries per call of a batch handler.",
                "queue",
                _BATCH_BUCKETS,
            ),
            in_progress=gauge(
                prefix, "handlers_in_progress", "Deliveries inside a handler now.", "queue"
            ),
            duplicates_skipped=counter(
                prefix,
                "duplicates_skipped_total",
                "Deliveries acked without running the handler.",
                "queue",
            ),
            dedup_events=counter(
                prefix,
                "dedup_events_total",
                "De-duplication events (no_message_id, busy, store_unavailable, "
                "complete_failed, release_failed).",
                "queue",
                "event",
            ),
            dead_lettered=counter(
                prefix,
                "dead_lettered_messages_total",
                "Messages sent to the DLQ.",
                "queue",
                "reason",
            ),
            stale_settles=counter(
                prefix,
                "stale_settles_total",
                "Acks/nacks dropped because the delivery's channel had died.",
                "queue",
            ),
            ack_batches=counter(
                prefix,
                "ack_batches_total",
                "basic.ack frames sent (multiple or single).",
                "queue",
            ),
            settle_fallbacks=counter(
                prefix,
                "settle_fallbacks_total",
                "Retry/DLQ/deferral copies that could not be published as built, by the rung "
                "taken instead (trimmed_copy, broker_dead_letter, requeue_later).",
                "queue",
                "rung",
            ),
            outbox_pending=gauge(
                prefix,
                "outbox_pending_rows",
                "Outbox rows committed and not yet confirmed.",
                "table",
            ),
            outbox_oldest_age=gauge(
                prefix,
                "outbox_oldest_pending_age_seconds",
                "Age of the oldest pending outbox row: the relay's lag.",
                "table",
            ),
            outbox_dispatched=counter(
                prefix,
                "outbox_dispatched_rows_total",
                "Outbox rows published and confirmed.",
                "table",
            ),
            outbox_failed=counter(
                prefix,
                "outbox_failed_rows_total",
                "Outbox row dispatches that failed (outcome: retry, deferred, dead).",
                "table",
                "outcome",
            ),
            outbox_batch_latency=histogram(
                prefix,
                "outbox_batch_seconds",
                "Time from claiming an outbox batch to committing its outcomes.",
                "table",
                _LATENCY_BUCKETS,
            ),
        )

    def specs(self) -> dict[str, MetricSpec]:
        """Every metric by its field name, in order."""
        return {field.name: getattr(self, field.name) for field in fields(self)}

    def _registered(self) -> Hub:
        hub: Hub | None = getattr(self, "_hub", None)
        if hub is None:
            raise TypeError("metrics made by Metrics.describe() count nothing: use Metrics.on()")
        return hub

    def for_publisher(self, name: str, *, owner: object | None = None) -> PublisherMetrics:
        """The counts of one publisher (``name``: its ``publisher`` label).

        ``owner``: when it is garbage collected, the counts' totals are kept and
        its gauges dropped (default: kept as long as the registry).
        """
        hub = self._registered()
        return hub.add(PublisherMetrics(hub, name), owner)

    def for_queue(self, queue: str, *, owner: object | None = None) -> QueueMetrics:
        """The counts of one consumed queue (see `for_publisher` for ``owner``)."""
        hub = self._registered()
        return hub.add(QueueMetrics(hub, queue), owner)

    def for_connection(self, name: str, *, owner: object | None = None) -> ConnectionMetrics:
        """The state of one connection (see `for_publisher` for ``owner``)."""
        hub = self._registered()
        return hub.add(ConnectionMetrics(hub, name), owner)

    def for_outbox(self, table: str, *, owner: object | None = None) -> OutboxMetrics:
        """The counts of one outbox relay (see `for_publisher` for ``owner``)."""
        hub = self._registered()
        return hub.add(OutboxMetrics(hub, table), owner)


_LOCK = threading.Lock()
_CACHE: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, Metrics]] = (
    weakref.WeakKeyDictionary()
)
