"""The metrics HTTP endpoint, scraped for real after real traffic."""

from __future__ import annotations

import asyncio
import socket
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from reliable_mq import ConnectionSettings, PublisherSettings, ReliablePublisher
from reliable_mq.metrics_server import start_metrics_server, stop_metrics_server

pytestmark = pytest.mark.rabbitmq


@pytest.fixture(name="endpoint")
def _endpoint(registry: CollectorRegistry) -> Iterator[str]:
    """The registry served on a free port; the URL of its /metrics page."""
    server, thread = start_metrics_server(0, registry=registry)
    try:
        yield f"http://127.0.0.1:{server.server_port}/metrics"
    finally:
        stop_metrics_server(server, thread)


async def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Fetch ``url`` over HTTP and index every sample by name and labels."""

    def fetch() -> str:
        with urllib.request.urlopen(url, timeout=5) as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/plain")
            text: str = response.read().decode()
            return text

    text = await asyncio.to_thread(fetch)
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def publisher(url: str, registry: CollectorRegistry, name: str, window: int) -> ReliablePublisher:
    return ReliablePublisher(
        ConnectionSettings(url=url, connection_name=name),
        settings=PublisherSettings(max_in_flight=window),
        registry=registry,
    )


class TestMetricsEndpoint:
    async def test_scraped_values_match_the_traffic(
        self, broker_url: str, queue: str, registry: CollectorRegistry, endpoint: str
    ) -> None:
        """Published, confirmed and latency counts on the HTTP page equal what was sent."""
        async with publisher(broker_url, registry, "scrape", 64) as pub:
            results = await asyncio.gather(
                *(pub.publish({"n": n}, routing_key=queue) for n in range(300))
            )
            samples = await scrape(endpoint)
        assert len({r.message_id for r in results}) == 300
        exchange = (("exchange", "amq.default"),)
        assert samples[("reliable_mq_published_messages_total", exchange)] == 300
        assert samples[("reliable_mq_confirmed_messages_total", exchange)] == 300
        assert samples[("reliable_mq_confirm_latency_seconds_count", exchange)] == 300
        latency_sum = samples[("reliable_mq_confirm_latency_seconds_sum", exchange)]
        assert latency_sum == pytest.approx(sum(r.confirm_latency for r in results), rel=1e-6)
        inf_bucket = (("exchange", "amq.default"), ("le", "+Inf"))
        assert samples[("reliable_mq_confirm_latency_seconds_bucket", inf_bucket)] == 300
        assert samples[("reliable_mq_nacked_messages_total", exchange)] == 0
        label = (("publisher", "scrape.publisher"),)
        assert samples[("reliable_mq_publisher_in_flight_messages", label)] == 0
        assert samples[("reliable_mq_publisher_window_size_messages", label)] == 64
        assert samples[("reliable_mq_connection_up", (("connection", "scrape.publisher"),))] == 1

    async def test_two_publishers_share_one_registry(
        self, broker_url: str, queue: str, registry: CollectorRegistry, endpoint: str
    ) -> None:
        """Two publishers on one registry add up instead of clashing, each with its own gauges."""
        async with (
            publisher(broker_url, registry, "first", 10) as first,
            publisher(broker_url, registry, "second", 20) as second,
        ):
            await asyncio.gather(
                *(first.publish(b"a", routing_key=queue) for _ in range(120)),
                *(second.publish(b"b", routing_key=queue) for _ in range(80)),
            )
            samples = await scrape(endpoint)
        exchange = (("exchange", "amq.default"),)
        assert samples[("reliable_mq_published_messages_total", exchange)] == 200
        assert samples[("reliable_mq_confirmed_messages_total", exchange)] == 200
        assert samples[("reliable_mq_confirm_latency_seconds_count", exchange)] == 200
        window = "reliable_mq_publisher_window_size_messages"
        assert samples[(window, (("publisher", "first.publisher"),))] == 10
        assert samples[(window, (("publisher", "second.publisher"),))] == 20

    def test_stop_frees_the_port(self, registry: CollectorRegistry) -> None:
        """After stop_metrics_server the port can be bound again."""
        server, thread = start_metrics_server(0, registry=registry)
        port = server.server_port
        stop_metrics_server(server, thread)
        assert not thread.is_alive()
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))

    def test_rejects_a_bad_port(self) -> None:
        """A port outside 0-65535 is refused before anything is bound."""
        with pytest.raises(ValueError, match="port"):
            start_metrics_server(70_000)
