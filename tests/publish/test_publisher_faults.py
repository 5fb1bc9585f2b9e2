"""Destructive faults on a private RabbitMQ node: server-side closes and a broker crash."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import aio_pika
import pytest
from prometheus_client import CollectorRegistry

from reliable_mq import (
    ConnectionSettings,
    PendingPublish,
    PublisherSettings,
    PublishUnroutable,
    ReliablePublisher,
)
from tests.support.amqp import drain_queue
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.private_broker, pytest.mark.timeout(240)]


def settings_for(url: str) -> ConnectionSettings:
    return ConnectionSettings(
        url=url,  # type: ignore[arg-type]
        connection_name=f"fault-{uuid.uuid4().hex[:6]}",
        reconnect_initial_delay=0.1,
        reconnect_max_delay=1.0,
        heartbeat=5,
    )


async def declare(url: str, name: str, **arguments: Any) -> None:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(name, durable=True, arguments=arguments or None)


async def test_close_all_connections_mid_stream(private_broker: Any) -> None:
    """rabbitmqctl close_all_connections twice: every publish confirms, every id arrives.

    Deterministic under load: a producer keeps the window busy until both closes
    have been seen (the channel generation went up each time), so no close can
    land after the stream has already finished.
    """
    url = private_broker.url
    name = f"faults-{uuid.uuid4().hex[:8]}"
    await declare(url, name)
    done = asyncio.Event()
    pending: list[PendingPublish] = []
    async with ReliablePublisher(
        settings_for(url),
        settings=PublisherSettings(max_in_flight=1000),
        registry=CollectorRegistry(),
    ) as publisher:

        async def produce() -> None:
            while not done.is_set():
                n = len(pending)
                pending.append(await publisher.enqueue(b"x", routing_key=name, message_id=f"a{n}"))
                if n % 100 == 0:
                    await asyncio.sleep(0)

        producer = asyncio.create_task(produce())
        for closes in (1, 2):
            generation = publisher.stats().channel_generation
            await wait_until(lambda c=closes: publisher.stats().confirmed >= 1500 * c, timeout=60)
            await asyncio.to_thread(private_broker.close_all_connections, "test")
            await wait_until(
                lambda g=generation: publisher.stats().channel_generation > g, timeout=60
            )
        done.set()
        await asyncio.wait_for(producer, 60)
        results = await asyncio.wait_for(asyncio.gather(*pending), 120)
        assert publisher.stats().channel_generation >= 3
    ids = {m.message_id for m in await drain_queue(url, name)}
    expected = {f"a{i}" for i in range(len(pending))}
    assert {r.message_id for r in results} == ids == expected


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
async def test_broker_crash_and_restart(private_broker: Any, queue_type: str) -> None:
    """kill -9 the node mid-stream, start it again: confirmed messages survive, callers finish."""
    url = private_broker.url
    name = f"crash-{queue_type}-{uuid.uuid4().hex[:8]}"
    await declare(url, name, **({"x-queue-type": "quorum"} if queue_type == "quorum" else {}))
    await asyncio.sleep(2)  # a quorum queue killed within ~1 s of declaration may lose its leader
    settings = PublisherSettings(max_in_flight=500, publish_timeout=120)
    async with ReliablePublisher(
        settings_for(url), settings=settings, registry=CollectorRegistry()
    ) as publisher:
        tasks = [
            asyncio.ensure_future(publisher.publish(b"x", routing_key=name, message_id=f"k{i}"))
            for i in range(4000)
        ]
        await wait_until(lambda: publisher.stats().confirmed >= 1000, timeout=60)
        await asyncio.to_thread(private_broker.kill)
        await asyncio.sleep(1)
        await asyncio.to_thread(private_broker.start)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 150)
    ids = [m.message_id for m in await drain_queue(url, name, idle_timeout=2.0)]
    expected = {f"k{i}" for i in range(4000)}
    assert {r.message_id for r in results} == expected
    assert expected <= set(ids), f"lost {len(expected - set(ids))} confirmed messages"
    assert set(ids) <= expected


async def test_returns_right_after_a_restart_are_retried(private_broker: Any) -> None:
    """A queue declared after the reconnect (as if still recovering) still gets the message.

    Within ``returns_retried_after_reconnect`` of a reconnect, basic.return is retried;
    on the first connection it is final at once.
    """
    url = private_broker.url
    name = f"late-{uuid.uuid4().hex[:8]}"
    async with ReliablePublisher(
        settings_for(url),
        settings=PublisherSettings(publish_timeout=30),
        registry=CollectorRegistry(),
    ) as publisher:
        with pytest.raises(PublishUnroutable):
            await publisher.publish(b"x", routing_key=name)  # first connection: final
        await asyncio.to_thread(private_broker.close_all_connections, "test")
        late = asyncio.ensure_future(publisher.publish(b"y", routing_key=name, message_id="late"))
        await wait_until(lambda: publisher.stats().returned >= 2, timeout=20)
        await declare(url, name)
        result = await asyncio.wait_for(late, 20)
    assert result.attempts >= 2
    assert [m.message_id for m in await drain_queue(url, name)] == ["late"]
