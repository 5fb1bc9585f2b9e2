"""The objects that count: one per publisher, consumed queue, connection or outbox relay.

Plain Python numbers, changed on the hot path with ``+= 1``; read by the
component's ``stats()`` and, at a scrape, by the collector
(`reliable_mq.metrics._export`).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from typing import Any, ClassVar, Protocol

__all__ = (
    "DEFAULT_EXCHANGE_LABEL",
    "ConnectionMetrics",
    "ExchangeMetrics",
    "Exporter",
    "Histogram",
    "OutboxMetrics",
    "PublisherMetrics",
    "QueueMetrics",
    "Reporting",
    "Sample",
    "exchange_label",
)

DEFAULT_EXCHANGE_LABEL = "amq.default"


def exchange_label(exchange: str) -> str:
    """The label value for an exchange (the nameless default exchange gets a name)."""
    return exchange or DEFAULT_EXCHANGE_LABEL


class Histogram:
    """Observations counted per bucket in plain Python (exposed cumulatively at a scrape)."""

    __slots__ = ("bounds", "buckets", "child", "sum")

    def __init__(self, bounds: tuple[float, ...], child: Any = None) -> None:
        self.bounds = bounds
        self.buckets = [0] * len(bounds)
        """Observations per bucket (not cumulative)."""
        self.sum = 0.0
        self.child = child
        """The multiprocess-mode prometheus_client child that also gets each observation."""

    @property
    def count(self) -> int:
        return sum(self.buckets)

    def observe(self, value: float) -> None:
        """Count one observation (seconds)."""
        self.buckets[bisect_left(self.bounds, value)] += 1
        self.sum += value
        if self.child is not None:
            self.child.observe(value)

    def add(self, other: Histogram) -> None:
        """Add ``other``'s observations to these."""
        for index, count in enumerate(other.buckets):
            self.buckets[index] += count
        self.sum += other.sum


Sample = tuple[str, tuple[str, ...], "float | Histogram"]
"""``(Metrics field, label values, value)``: what a metrics object reports."""


class Exporter(Protocol):
    """Where a metrics object's numbers go (`reliable_mq.metrics._export.Hub`)."""

    @property
    def mirrored(self) -> bool:
        """Multiprocess mode: changes are also pushed to prometheus_client's files."""
        ...

    def bounds(self, field: str) -> tuple[float, ...]:
        """The bucket bounds of histogram ``field`` (``+Inf`` last)."""
        ...

    def mirror(self, field: str, labels: tuple[str, ...]) -> Any:
        """Multiprocess mode: the prometheus_client child of ``field`` and ``labels``
        (None otherwise)."""
        ...


class Reporting:
    """A metrics object: reports its samples; in multiprocess mode, feeds the files."""

    __slots__ = ("__weakref__", "_exporter", "_pushed")

    GAUGES: ClassVar[frozenset[str]] = frozenset()
    """The fields it reports that are gauges (the others are counters or histograms)."""

    def __init__(self, exporter: Exporter) -> None:
        self._exporter = exporter
        self._pushed: dict[tuple[str, tuple[str, ...]], float] = {}

    def samples(self) -> Iterator[Sample]:
        """Every number it holds, as ``(Metrics field, label values, value)``."""
        raise NotImplementedError

    def _histogram(self, field: str, labels: tuple[str, ...]) -> Histogram:
        exporter = self._exporter
        return Histogram(exporter.bounds(field), exporter.mirror(field, labels))

    def flush(self) -> None:
        """Multiprocess mode: push what changed to the files; otherwise nothing to do."""
        exporter = self._exporter
        if not exporter.mirrored:
            return
        pushed = self._pushed
        for field, labels, value in self.samples():
            if isinstance(value, Histogram):
                continue  # observed as it happens
            key = (field, labels)
            if field in self.GAUGES:
                if pushed.get(key) != value:
                    exporter.mirror(field, labels).set(value)
                    pushed[key] = value
            else:
                delta = value - pushed.get(key, 0.0)
                if delta:
                    exporter.mirror(field, labels).inc(delta)
                    pushed[key] = value


class ExchangeMetrics:
    """One publisher's counts for one exchange (kept by its `PublisherMetrics`).

    Attributes:
        published: messages accepted (encoded and handed over).
        confirmed: messages the broker confirmed.
        nacked: ``basic.nack`` received for an attempt.
        returned: mandatory messages returned as unroutable.
        republished: messages sent again, by reason.
        failed: messages that ended in an error, by the error's class name.
        latency: time from an attempt to its confirm.
    """

    __slots__ = (
        "confirmed",
        "failed",
        "label",
        "latency",
        "nacked",
        "published",
        "republished",
        "returned",
    )

    def __init__(self, label: str, latency: Histogram) -> None:
        self.label = label
        self.published = 0
        self.confirmed = 0
        self.nacked = 0
        self.returned = 0
        self.republished: dict[str, int] = {}
        self.failed: dict[str, int] = {}
        self.latency = latency

    def republish(self, reason: str) -> None:
        self.republished[reason] = self.republished.get(reason, 0) + 1

    def failure(self, error: str) -> None:
        self.failed[error] = self.failed.get(error, 0) + 1


class PublisherMetrics(Reporting):
    """Everything one publisher counts; read by its ``stats()`` and by Prometheus.

    Attributes:
        name: the ``publisher`` label (its connection's name).
        in_flight: messages holding a window slot (set by the publisher).
        window_size: the window (``max_in_flight``), once started.
    """

    __slots__ = ("exchanges", "in_flight", "name", "window_size")

    GAUGES = frozenset({"in_flight", "window_size"})

    def __init__(self, exporter: Exporter, name: str) -> None:
        super().__init__(exporter)
        self.name = name
        self.in_flight = 0
        self.window_size: int | None = None
        self.exchanges: dict[str, ExchangeMetrics] = {}

    def for_exchange(self, exchange: str) -> ExchangeMetrics:
        """The counts of ``exchange`` (made on first use; keep the result on a hot path)."""
        counts = self.exchanges.get(exchange)
        if counts is None:
            label = exchange_label(exchange)
            latency = self._histogram("confirm_latency", (label,))
            counts = self.exchanges[exchange] = ExchangeMetrics(label, latency)
        return counts

    def total(self, what: str) -> int:
        """``published``, ``confirmed``, ``nacked``, ``returned``, ``republished`` or
        ``failed``, over every exchange."""
        total = 0
        for counts in list(self.exchanges.values()):
            value = getattr(counts, what)
            total += sum(value.values()) if isinstance(value, dict) else value
        return total

    def samples(self) -> Iterator[Sample]:
        name = (self.name,)
        yield "in_flight", name, self.in_flight
        if self.window_size is not None:
            yield "window_size", name, self.window_size
        for counts in list(self.exchanges.values()):
            label = (counts.label,)
            yield "published", label, counts.published
            yield "confirmed", label, counts.confirmed
            yield "nacked", label, counts.nacked
            yield "returned", label, counts.returned
            yield "confirm_latency", label, counts.latency
            for reason, count in list(counts.republished.items()):
                yield "republished", (counts.label, reason), count
            for error, count in list(counts.failed.items()):
                yield "publish_failed", (counts.label, error), count


_DEDUP_EVENTS = ("no_message_id", "busy", "store_unavailable", "complete_failed", "release_failed")
_OUTCOMES = ("acked", "retried", "dead_lettered", "requeued", "stale", "duplicate", "deferred")


class QueueMetrics(Reporting):
    """Everything one consumed queue counts; read by the consumer's ``stats()`` and by
    Prometheus.

    Get one with [`Metrics.for_queue`][reliable_mq.metrics.Metrics.for_queue].

    Attributes:
        queue: the ``queue`` label.
        delivered: deliveries received.
        redelivered: deliveries flagged redelivered.
        acked, retried, dead_lettered, requeued, stale, duplicate, deferred: deliveries
            by outcome (``consumed_messages_total``).
        rejected: deliveries the handler nacked without requeue.
        ack_frames: ``basic.ack`` frames sent.
        handlers_running: handlers running now.
        dead_letter_reasons: messages dead-lettered, by reason.
        fallbacks: copies that could not be published as built, by the rung taken.
        dedup_events: de-duplication events, by event.
        duration: handler run times (a batch handler's: one per batch).
        batch_sizes: deliveries per call of a batch handler.
    """

    __slots__ = (
        "ack_frames",
        "acked",
        "batch_sizes",
        "dead_letter_reasons",
        "dead_lettered",
        "dedup_events",
        "deferred",
        "delivered",
        "duplicate",
        "duration",
        "fallbacks",
        "handlers_running",
        "queue",
        "redelivered",
        "rejected",
        "requeued",
        "retried",
        "stale",
    )

    GAUGES = frozenset({"in_progress"})

    def __init__(self, exporter: Exporter, queue: str) -> None:
        super().__init__(exporter)
        self.queue = queue
        self.delivered = self.redelivered = 0
        self.acked = self.retried = self.dead_lettered = self.requeued = 0
        self.stale = self.duplicate = self.deferred = self.rejected = 0
        self.ack_frames = 0
        self.handlers_running = 0
        self.dead_letter_reasons: dict[str, int] = {}
        self.fallbacks: dict[str, int] = {}
        self.dedup_events: dict[str, int] = dict.fromkeys(_DEDUP_EVENTS, 0)
        self.duration = self._histogram("handler_duration", (queue,))
        self.batch_sizes = self._histogram("batch_size", (queue,))

    def handler_ended(self, seconds: float) -> None:
        """Count one handler run of ``seconds`` (`Histogram.observe`, inlined: once per delivery)."""
        duration = self.duration
        duration.buckets[bisect_left(duration.bounds, seconds)] += 1
        duration.sum += seconds
        if duration.child is not None:
            duration.child.observe(seconds)

    def dead_letter_reason(self, reason: str) -> None:
        """Count one message dead-lettered for ``reason``."""
        self.dead_letter_reasons[reason] = self.dead_letter_reasons.get(reason, 0) + 1

    def fallback(self, rung: str) -> None:
        """Count one copy that could not be published as built, by the rung taken."""
        self.fallbacks[rung] = self.fallbacks.get(rung, 0) + 1

    def dedup_event(self, event: str) -> None:
        """Count one de-duplication event."""
        self.dedup_events[event] = self.dedup_events.get(event, 0) + 1

    @property
    def fallback_count(self) -> int:
        return sum(self.fallbacks.values())

    def samples(self) -> Iterator[Sample]:
        queue = (self.queue,)
        for outcome in _OUTCOMES:
            yield "deliveries", (self.queue, outcome), getattr(self, outcome)
        yield "redeliveries", queue, self.redelivered
        yield "duplicates_skipped", queue, self.duplicate
        yield "stale_settles", queue, self.stale
        yield "ack_batches", queue, self.ack_frames
        yield "in_progress", queue, self.handlers_running
        yield "handler_duration", queue, self.duration
        yield "batch_size", queue, self.batch_sizes
        for event, count in list(self.dedup_events.items()):
            yield "dedup_events", (self.queue, event), count
        for reason, count in list(self.dead_letter_reasons.items()):
            yield "dead_lettered", (self.queue, reason), count
        for rung, count in list(self.fallbacks.items()):
            yield "settle_fallbacks", (self.queue, rung), count


class ConnectionMetrics(Reporting):
    """One connection's state and recoveries.

    Attributes:
        name: the ``connection`` label.
        up: 1 while the connection is open, else 0.
        recoveries: connections re-established after a loss.
    """

    __slots__ = ("name", "recoveries", "up")

    GAUGES = frozenset({"connection_up"})

    def __init__(self, exporter: Exporter, name: str) -> None:
        super().__init__(exporter)
        self.name = name
        self.up = 0
        self.recoveries = 0

    def set_up(self, up: bool) -> None:
        self.up = int(up)
        self.flush()

    def recovered(self) -> None:
        self.recoveries += 1
        self.flush()

    def samples(self) -> Iterator[Sample]:
        name = (self.name,)
        yield "connection_up", name, self.up
        yield "connection_recoveries", name, self.recoveries


class OutboxMetrics(Reporting):
    """One outbox relay's backlog and dispatches.

    Attributes:
        table: the ``table`` label.
        pending: rows committed and not yet confirmed (at the last measurement).
        oldest_age: age of the oldest pending row (seconds, at the last measurement).
        dispatched: rows published and confirmed.
        failed: failed dispatches, by outcome (``retry``, ``deferred``, ``dead``).
        batch_latency: time from claiming a batch to committing its outcomes.
    """

    __slots__ = ("batch_latency", "dispatched", "failed", "oldest_age", "pending", "table")

    GAUGES = frozenset({"outbox_pending", "outbox_oldest_age"})

    def __init__(self, exporter: Exporter, table: str) -> None:
        super().__init__(exporter)
        self.table = table
        self.pending = 0
        self.oldest_age = 0.0
        self.dispatched = 0
        self.failed: dict[str, int] = dict.fromkeys(("retry", "deferred", "dead"), 0)
        self.batch_latency = self._histogram("outbox_batch_latency", (table,))

    def samples(self) -> Iterator[Sample]:
        table = (self.table,)
        yield "outbox_pending", table, self.pending
        yield "outbox_oldest_age", table, self.oldest_age
        yield "outbox_dispatched", table, self.dispatched
        yield "outbox_batch_latency", table, self.batch_latency
        for outcome, count in list(self.failed.items()):
            yield "outbox_failed", (self.table, outcome), count
