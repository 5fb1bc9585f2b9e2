"""Metrics counted once, in plain Python, and exposed by a collector at scrape time.

No broker: the objects are driven by hand, and what a registry shows is
compared with what prometheus_client's own metrics show for the same events.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.multiprocess import MultiProcessCollector

from reliable_mq.metrics import MetricKind, Metrics

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(registry: CollectorRegistry, prefix: str = "reliable_mq_") -> Samples:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for metric in registry.collect()
        for sample in metric.samples
        if sample.name.startswith(prefix) and not sample.name.endswith("_created")
    }


class _Owner:
    """Something whose life a metrics object follows."""


class TestExposition:
    def test_the_same_as_prometheus_clients_own_metrics(self) -> None:
        """Counters, gauges and every histogram bucket, sum and count: what a scrape shows
        equals what prometheus_client's Counter/Gauge/Histogram show for the same events."""
        ours, theirs = CollectorRegistry(), CollectorRegistry()
        spec = Metrics.describe()
        queue = Metrics.on(ours).for_queue("q")
        duration = spec.handler_duration
        their_duration = Histogram(
            duration.name, "d", duration.labels, buckets=duration.buckets, registry=theirs
        )
        deliveries = Counter(spec.deliveries.name, "d", spec.deliveries.labels, registry=theirs)
        running = Gauge(spec.in_progress.name, "d", spec.in_progress.labels, registry=theirs)
        for seconds in [0.0, 0.0005, 0.001, 0.003, 0.3, 2.0, 299.0, 300.0, 301.0, 1e9]:
            queue.handler_ended(seconds)
            their_duration.labels("q").observe(seconds)
        queue.acked += 7
        deliveries.labels("q", "acked").inc(7)
        queue.handlers_running = 3
        running.labels("q").set(3)
        mine, expected = samples(ours), samples(theirs)
        assert {key: mine.get(key) for key in expected} == expected
        assert (
            mine[("reliable_mq_consumed_messages_total", (("outcome", "retried"), ("queue", "q")))]
            == 0
        )

    def test_every_spec_is_exposed_with_its_type(self) -> None:
        registry = CollectorRegistry()
        metrics = Metrics.on(registry)
        families = {family.name: family.type for family in registry.collect()}
        for spec in metrics.specs().values():
            assert families[spec.name] == spec.kind.value
        assert {spec.kind for spec in metrics.specs().values()} == set(MetricKind)

    def test_one_registry_one_collector(self) -> None:
        """Metrics.on() twice on one registry: the same object, registered once."""
        registry = CollectorRegistry()
        assert Metrics.on(registry) is Metrics.on(registry)
        assert Metrics.on(registry, "other") is not Metrics.on(registry)
        assert len(list(registry.collect())) == 2 * len(Metrics.describe().specs())

    def test_describe_counts_nothing(self) -> None:
        with pytest.raises(TypeError, match=r"Metrics\.on"):
            Metrics.describe().for_queue("q")


class TestSharing:
    def test_two_consumers_of_one_queue_add_up(self) -> None:
        """Counts and gauges of two objects with the same labels are summed, not overwritten."""
        registry = CollectorRegistry()
        first = Metrics.on(registry).for_queue("q")
        second = Metrics.on(registry).for_queue("q")
        first.handlers_running, second.handlers_running = 2, 3
        first.acked, second.acked = 4, 5
        assert registry.get_sample_value("reliable_mq_handlers_in_progress", {"queue": "q"}) == 5
        labels = {"queue": "q", "outcome": "acked"}
        assert registry.get_sample_value("reliable_mq_consumed_messages_total", labels) == 9

    def test_connection_up_is_one_while_any_is_up(self) -> None:
        registry = CollectorRegistry()
        metrics = Metrics.on(registry)
        first, second = metrics.for_connection("c"), metrics.for_connection("c")
        first.set_up(True)
        second.set_up(True)
        assert registry.get_sample_value("reliable_mq_connection_up", {"connection": "c"}) == 1
        first.set_up(False)
        assert registry.get_sample_value("reliable_mq_connection_up", {"connection": "c"}) == 1
        second.set_up(False)
        assert registry.get_sample_value("reliable_mq_connection_up", {"connection": "c"}) == 0

    def test_an_owner_gone_keeps_its_totals_and_drops_its_gauges(self) -> None:
        """Counters and histograms never go backwards when a component is collected."""
        registry = CollectorRegistry()
        owner = _Owner()
        publisher = Metrics.on(registry).for_publisher("p", owner=owner)
        exchange = publisher.for_exchange("")
        exchange.confirmed += 3
        exchange.latency.observe(0.002)
        publisher.in_flight = 2
        later = Metrics.on(registry).for_publisher("p").for_exchange("")
        later.confirmed += 1
        labels = {"exchange": "amq.default"}
        assert registry.get_sample_value("reliable_mq_confirmed_messages_total", labels) == 4
        del owner, publisher, exchange
        gc.collect()
        assert registry.get_sample_value("reliable_mq_confirmed_messages_total", labels) == 4
        assert registry.get_sample_value("reliable_mq_confirm_latency_seconds_count", labels) == 1
        gauge = registry.get_sample_value(
            "reliable_mq_publisher_in_flight_messages", {"publisher": "p"}
        )
        assert gauge == 0  # only the live one's


class TestCountedOnce:
    def test_stats_totals_are_the_exposed_counts(self) -> None:
        """A publisher's stats() totals and Prometheus read the same numbers."""
        registry = CollectorRegistry()
        publisher = Metrics.on(registry).for_publisher("p")
        default, other = publisher.for_exchange(""), publisher.for_exchange("x")
        default.published, other.published = 5, 2
        default.republish("nack")
        other.republish("nack")
        other.failure("PublishTimeout")
        assert publisher.total("published") == 7
        assert publisher.total("republished") == 2 and publisher.total("failed") == 1
        exposed = samples(registry)
        assert exposed[("reliable_mq_published_messages_total", (("exchange", "x"),))] == 2
        key = (("error", "PublishTimeout"), ("exchange", "x"))
        assert exposed[("reliable_mq_publish_failures_total", key)] == 1


def test_multiprocess_mode_reaches_the_files(tmp_path: Path) -> None:
    """With PROMETHEUS_MULTIPROC_DIR set (``reliable-mq run``'s workers), what a process
    counts reaches the files its parent sums: counters and gauges at flush(), histograms
    as they are observed; two processes add up."""
    script = textwrap.dedent(
        """
        import sys
        from reliable_mq.metrics import Metrics
        metrics = Metrics.on()
        queue = metrics.for_queue("q")
        queue.acked += int(sys.argv[1])
        queue.handler_ended(0.02)
        queue.handlers_running = 1
        queue.flush()
        queue.acked += 1
        queue.flush()
        queue.flush()  # nothing new: adds nothing
        """
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for acked in ("2", "5"):
        subprocess.run([sys.executable, "-c", script, acked], check=True, env=env, cwd=ROOT)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))  # type: ignore[no-untyped-call]
    labels = {"queue": "q", "outcome": "acked"}
    assert registry.get_sample_value("reliable_mq_consumed_messages_total", labels) == 9
    count = registry.get_sample_value("reliable_mq_handler_duration_seconds_count", {"queue": "q"})
    assert count == 2
    running = [
        sample.value
        for family in registry.collect()
        for sample in family.samples
        if sample.name == "reliable_mq_handlers_in_progress"
    ]
    assert running == [1, 1]  # one per process (a pid label each)
