"""Bounds under load: the window caps unconfirmed messages, memory and tasks stay flat."""

from __future__ import annotations

import asyncio
import gc
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from reliable_mq import ConnectionSettings, Message, PublisherSettings, ReliablePublisher
from reliable_mq.testing import TCPProxy
from tests.conftest import proxied_url
from tests.support.amqp import drain_queue
from tests.support.proc import rss_bytes
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(300)]


def conn(url: str) -> ConnectionSettings:
    return ConnectionSettings(
        url=url,  # type: ignore[arg-type]
        connection_name=f"bounds-{uuid.uuid4().hex[:6]}",
        reconnect_initial_delay=0.02,
        reconnect_max_delay=0.2,
    )


async def test_100k_messages_stay_inside_the_window_and_memory_is_flat(
    broker_url: str, queue: str
) -> None:
    """100,000 publishes with a window of 1,000: never more unconfirmed, RSS grows < 50 MB."""
    settings = PublisherSettings(max_in_flight=1000)
    body = b"x" * 256
    async with ReliablePublisher(
        conn(broker_url), settings=settings, registry=CollectorRegistry()
    ) as publisher:
        for _ in range(5000):  # warm up allocators and caches
            await publisher.enqueue(body, routing_key=queue)
        await publisher.flush()
        gc.collect()
        baseline = rss_bytes()
        peak = baseline
        for index in range(100_000):
            await publisher.enqueue(body, routing_key=queue)
            assert publisher.in_flight <= 1000
            if index % 5000 == 0:
                peak = max(peak, rss_bytes())
        await publisher.flush(timeout=120)
        stats = publisher.stats()
    assert stats.max_in_flight_seen <= 1000
    assert stats.confirmed == 105_000
    growth = peak - baseline
    assert growth < 50 * 1024 * 1024, f"RSS grew by {growth / 1e6:.1f} MB"


async def test_publish_many_of_100k_keeps_memory_flat(broker_url: str, queue: str) -> None:
    """publish_many() of 100,000 with a window of 1,000: the input is read lazily, never more
    than the window unconfirmed, RSS grows < 50 MB."""
    settings = PublisherSettings(max_in_flight=1000)
    body = b"x" * 256
    total = 100_000
    async with ReliablePublisher(
        conn(broker_url), settings=settings, registry=CollectorRegistry()
    ) as publisher:
        await publisher.publish_many(Message(body, routing_key=queue) for _ in range(5000))
        gc.collect()
        baseline = rss_bytes()
        peak = baseline
        most_in_flight = 0

        def source() -> Iterator[Message]:
            nonlocal peak, most_in_flight
            for index in range(total):
                most_in_flight = max(most_in_flight, publisher.in_flight)
                if index % 5000 == 0:
                    peak = max(peak, rss_bytes())
                yield Message(body, routing_key=queue)

        result = await asyncio.wait_for(publisher.publish_many(source()), 180)
        peak = max(peak, rss_bytes())
        stats = publisher.stats()
    assert result.confirmed == total and not result.failures
    assert most_in_flight <= 1000 and stats.max_in_flight_seen <= 1000
    growth = peak - baseline
    assert growth < 50 * 1024 * 1024, f"RSS grew by {growth / 1e6:.1f} MB"


async def test_fifty_reconnects_leave_no_tasks_behind(broker_url: str, queue: str) -> None:
    """Every cut is recovered; the number of asyncio tasks does not grow with reconnects."""
    async with TCPProxy("127.0.0.1", 5672) as proxy:
        async with ReliablePublisher(
            conn(proxied_url(proxy)),
            settings=PublisherSettings(max_in_flight=200),
            registry=CollectorRegistry(),
        ) as publisher:
            await publisher.publish(b"warm", routing_key=queue)
            tasks_before = len(asyncio.all_tasks())
            results: list[Any] = []
            for _ in range(50):
                batch = [
                    asyncio.ensure_future(publisher.publish(b"x", routing_key=queue))
                    for _ in range(40)
                ]
                await asyncio.sleep(0.01)
                before = publisher.stats().channel_generation
                assert await proxy.cut() == 1
                results += await asyncio.wait_for(asyncio.gather(*batch), 30)
                await wait_until(lambda b=before: publisher.stats().channel_generation > b)
            # closed channels' background closers may take a moment to finish
            for _ in range(100):
                tasks_after = len(asyncio.all_tasks())
                if tasks_after <= tasks_before:
                    break
                await asyncio.sleep(0.05)
            leftover = sorted(t.get_name() for t in asyncio.all_tasks())
            generation = publisher.stats().channel_generation
    assert generation >= 51
    assert tasks_after <= tasks_before, f"tasks grew {tasks_before}->{tasks_after}: {leftover}"
    ids = {m.message_id for m in await drain_queue(broker_url, queue)}
    assert {r.message_id for r in results} <= ids
