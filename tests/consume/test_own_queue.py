"""Bring your own queue: a work queue another application declared, used as it is."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import pytest
import structlog
from prometheus_client import CollectorRegistry

from reliable_mq import (
    ConsumerError,
    Delivery,
    ReliableConsumer,
    ReliablePublisher,
    Retry,
)
from reliable_mq.topology import QueueCheck, QueueTopology, delete_topology, prepare_topology
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(120)]


@pytest.fixture(name="own_queue")
async def _own_queue(broker_url: str) -> AsyncIterator[str]:
    """A plain durable queue (no dead-letter arguments) holding 3 messages, as another app made it."""
    name = f"own-{uuid.uuid4().hex[:10]}"
    connection = await aio_pika.connect(broker_url)
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(name, durable=True)
        for n in range(3):
            await channel.default_exchange.publish(
                aio_pika.Message(f'{{"n": {n}}}'.encode(), message_id=f"old-{n}"),
                routing_key=name,
            )
    yield name
    connection = await aio_pika.connect(broker_url)
    async with connection:
        channel = await connection.channel()
        await delete_topology(channel, QueueTopology(name, retry_delays=(0.2,)))


def _consumer(url: str, **overrides: Any) -> ReliableConsumer:
    return ReliableConsumer(url, registry=CollectorRegistry(), retry_delays=(0.2,), **overrides)


async def _queue_depth(url: str, name: str) -> int:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(name, passive=True)
        return int(declared.declaration_result.message_count or 0)


async def _queue_exists(url: str, name: str) -> bool:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        try:
            await channel.declare_queue(name, passive=True)
        except aio_pika.exceptions.ChannelNotFoundEntity:
            return False
        return True


class TestExistingQueue:
    async def test_used_as_it_is_with_retries_and_one_warning(
        self, broker_url: str, own_queue: str
    ) -> None:
        """Default options: side queues declared, the queue adopted, a failed message retried."""
        consumer = _consumer(broker_url)
        seen: list[tuple[int, int]] = []

        @consumer.handler(own_queue)
        async def handler(body: dict[str, int], delivery: Delivery) -> None:
            seen.append((body["n"], delivery.attempt))
            if body["n"] == 1 and delivery.attempt == 1:
                raise Retry("once")

        with structlog.testing.capture_logs() as logs:
            async with consumer:
                await wait_until(lambda: len(seen) == 4, timeout=30)
        assert sorted(seen) == [(0, 1), (1, 1), (1, 2), (2, 1)]
        warnings = [e for e in logs if e["log_level"] == "warning"]
        assert [e["event"] for e in warnings] == ["queue_used_as_is"]
        detail = warnings[0]["detail"]
        assert "no dead-letter exchange" in detail and f"{own_queue}.dlq" in detail
        assert "rabbitmqctl set_policy" in detail
        assert "never rejects" in detail and "cannot see it" in detail  # policies are invisible
        started = [e for e in logs if e["event"] == "consuming"]
        assert len(started) == 1 and started[0]["log_level"] == "info"
        assert started[0]["prefetch"] == 200 and started[0]["messages"] == 3
        assert await _queue_exists(broker_url, f"{own_queue}.dlq")
        assert await _queue_exists(broker_url, f"{own_queue}.retry.0.2s")

    async def test_prepare_topology_reports_the_difference(
        self, broker_url: str, own_queue: str
    ) -> None:
        """The check names the broker's reason and the missing safety net."""
        connection = await aio_pika.connect(broker_url)
        async with connection:
            check = await prepare_topology(
                connection, QueueTopology(own_queue, retry_delays=(0.2,))
            )
        assert check.adopted and check.messages == 3
        assert "x-dead-letter-exchange" in check.difference
        assert "dropped" in check.missing
        assert check.arguments == {}  # a plain durable queue: learnt, nothing there

    async def test_declared_queue_is_not_adopted(self, broker_url: str) -> None:
        """A fresh name gets the whole set with the consumer's arguments: nothing to warn about."""
        name = f"fresh-{uuid.uuid4().hex[:10]}"
        topology = QueueTopology(name, retry_delays=(0.2,))
        connection = await aio_pika.connect(broker_url)
        async with connection:
            try:
                check = await prepare_topology(connection, topology)
                again = await prepare_topology(connection, topology)
            finally:
                await delete_topology(await connection.channel(), topology)
        assert not check.adopted and not again.adopted
        assert check.warning(topology) == ""


async def _check_queue_made_with(
    url: str, *, durable: bool = True, **arguments: Any
) -> tuple[QueueCheck, QueueTopology]:
    """Declare a queue as another application would, then let prepare_topology adopt it."""
    name = f"own-{uuid.uuid4().hex[:10]}"
    topology = QueueTopology(name, retry_delays=(0.2,))
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(name, durable=durable, arguments=arguments)
        try:
            check = await prepare_topology(connection, topology)
        finally:
            await delete_topology(await connection.channel(), topology)
    return check, topology


class TestAdoptedArguments:
    """The broker names one differing argument per refusal; the rest are learnt."""

    async def test_limits_hide_no_missing_dead_letter_exchange(self, broker_url: str) -> None:
        """A TTL and a length limit (the broker names the TTL first): the missing DLX is found."""
        check, topology = await _check_queue_made_with(
            broker_url, **{"x-message-ttl": 60_000, "x-max-length": 1_000}
        )
        assert check.adopted and "x-message-ttl" in check.difference
        assert check.arguments == {"x-message-ttl": 60_000, "x-max-length": 1_000}
        assert "no dead-letter exchange" in check.missing
        assert "length limit pushes out" in check.missing and "x-message-ttl" in check.missing
        assert f"dropped instead of reaching {topology.dead_letter_queue}" in check.missing

    async def test_its_own_dead_letter_exchange_is_named(self, broker_url: str) -> None:
        """A queue dead-lettering elsewhere: rejected messages go there, not to the DLQ."""
        check, topology = await _check_queue_made_with(
            broker_url,
            **{"x-dead-letter-exchange": "ops", "x-dead-letter-routing-key": "parked"},
        )
        assert check.arguments == {
            "x-dead-letter-exchange": "ops",
            "x-dead-letter-routing-key": "parked",
        }
        assert "dead-letters to exchange 'ops' with routing key 'parked'" in check.missing
        assert f"not to {topology.dead_letter_queue}" in check.missing
        assert "no dead-letter exchange" not in check.missing

    async def test_a_transient_queue_is_named(self, broker_url: str) -> None:
        check, _ = await _check_queue_made_with(broker_url, durable=False)
        assert check.arguments == {}
        assert "not durable" in check.missing and "no dead-letter exchange" in check.missing

    async def test_an_unpublishable_retry_is_requeued_never_rejected(
        self, broker_url: str, own_queue: str
    ) -> None:
        """Its retry queue gone, a failed message of an adopted queue comes back.

        On a queue the consumer declared, the last resort would be a reject that
        the broker dead-letters to the DLQ; the adopted queue has no dead-letter
        exchange, so a reject would drop the message: it is requeued instead.
        """
        consumer = _consumer(broker_url, fallback_delay=0.1)
        seen: list[tuple[str, int]] = []
        go = asyncio.Event()

        @consumer.handler(own_queue)
        async def handler(body: bytes, delivery: Delivery) -> None:
            await go.wait()
            seen.append((delivery.message_id or "", delivery.attempt))
            if delivery.message_id == "old-1":
                raise Retry("needs a retry queue")

        connection = await aio_pika.connect(broker_url)
        async with connection, consumer:
            await (await connection.channel()).queue_delete(f"{own_queue}.retry.0.2s")
            go.set()
            await wait_until(lambda: seen.count(("old-1", 1)) >= 2, timeout=30)
        assert seen.count(("old-0", 1)) == 1 and seen.count(("old-2", 1)) == 1
        assert await _queue_depth(broker_url, own_queue) == 1  # old-1, back in its queue
        assert await _queue_depth(broker_url, f"{own_queue}.dlq") == 0


class TestDeclareFalse:
    async def test_missing_retry_queues_fail_start_with_a_clear_message(
        self, broker_url: str, own_queue: str
    ) -> None:
        """declare=False without retry queues: start() fails, naming them and the fix."""
        consumer = _consumer(broker_url)

        @consumer.handler(own_queue, declare=False)
        async def handler(body: bytes) -> None:
            raise AssertionError("must not run")

        with pytest.raises(ConsumerError) as caught:
            await consumer.start()
        await consumer.stop()
        text = str(caught.value)
        assert f"{own_queue}.retry.0.2s" in text and f"{own_queue}.dlq" in text
        assert f"reliable-mq topology {own_queue} --retry-delays 0.2" in text
        assert not await _queue_exists(broker_url, f"{own_queue}.dlq")  # nothing created

    async def test_missing_work_queue_fails_start(self, broker_url: str) -> None:
        consumer = _consumer(broker_url)
        name = f"absent-{uuid.uuid4().hex[:10]}"

        @consumer.handler(name, declare=False)
        async def handler(body: bytes) -> None: ...

        with pytest.raises(ConsumerError, match="does not exist"):
            await consumer.start()
        await consumer.stop()
        assert not await _queue_exists(broker_url, name)

    async def test_with_the_set_declared_first_it_consumes_and_retries(
        self, broker_url: str, own_queue: str
    ) -> None:
        """Side queues made ahead (as `reliable-mq topology` does): declare=False works."""
        connection = await aio_pika.connect(broker_url)
        async with connection:
            await prepare_topology(connection, QueueTopology(own_queue, retry_delays=(0.2,)))
        consumer = _consumer(broker_url)
        seen: list[int] = []

        @consumer.handler(own_queue, declare=False)
        async def handler(body: bytes, delivery: Delivery) -> None:
            seen.append(delivery.attempt)
            if delivery.attempt == 1:
                raise Retry("again")

        async with consumer:
            await wait_until(lambda: len(seen) == 6, timeout=30)
            await asyncio.sleep(0.3)
        assert sorted(seen) == [1, 1, 1, 2, 2, 2]


async def test_declare_topology_from_a_url(broker_url: str) -> None:
    """declare_topology(URL, name) makes the consumer's default set; a publish then routes."""
    from reliable_mq import declare_topology

    name = f"url-{uuid.uuid4().hex[:10]}"
    await declare_topology(broker_url, name)
    try:
        async with ReliablePublisher(broker_url, registry=CollectorRegistry()) as publisher:
            await publisher.publish(b"x", routing_key=name)
        assert await _queue_exists(broker_url, f"{name}.retry.30s")
    finally:
        connection = await aio_pika.connect(broker_url)
        async with connection:
            await delete_topology(await connection.channel(), QueueTopology(name))


async def test_an_error_raised_to_the_caller_is_not_logged_as_a_warning(broker_url: str) -> None:
    """PublishUnroutable reaches the caller; the log says it at debug level only."""
    from reliable_mq import PublishUnroutable

    with structlog.testing.capture_logs() as logs:
        async with ReliablePublisher(broker_url, registry=CollectorRegistry()) as publisher:
            with pytest.raises(PublishUnroutable):
                await publisher.publish(b"x", routing_key=f"nobody-{uuid.uuid4().hex[:8]}")
    failed = [e for e in logs if e["event"] == "publish_failed"]
    assert [e["log_level"] for e in failed] == ["debug"]
    assert not [e for e in logs if e["log_level"] in ("warning", "error")]
