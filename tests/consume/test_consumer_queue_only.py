"""A queue consumed alone (``queue_only=True``) and the ``on_channel_lost`` hook.

What ``reliable-mq consume`` is built on: nothing declared, every delivery as it
came, settled by the handler; told when a channel is lost.
"""

from __future__ import annotations

import asyncio
import uuid

import aio_pika
import pytest
from prometheus_client import CollectorRegistry

from reliable_mq import AckPolicy, ConsumerError, Delivery, ReliableConsumer, ReliablePublisher
from reliable_mq.headers import ATTEMPT_HEADER
from reliable_mq.testing import TCPProxy
from tests.conftest import proxied_url
from tests.support.amqp import drain_queue
from tests.support.waiting import wait_until

pytestmark = pytest.mark.rabbitmq


async def _queue_exists(url: str, name: str) -> bool:
    connection = await aio_pika.connect(url)
    async with connection:
        try:
            await (await connection.channel()).declare_queue(name, passive=True)
        except aio_pika.exceptions.ChannelClosed:
            return False
    return True


def _consumer(url: str, **options: object) -> ReliableConsumer:
    return ReliableConsumer(
        url, registry=CollectorRegistry(), dedup=None, handler_timeout=None, **options
    )


class TestQueueOnly:
    async def test_every_delivery_reaches_the_handler_as_it_came(
        self, broker_url: str, queue: str
    ) -> None:
        """A plain queue: nothing declared beside it; a copy past max_attempts and two of
        one message id all reach the handler (neither dead-lettered nor deferred)."""
        async with ReliablePublisher(broker_url, registry=CollectorRegistry()) as publisher:
            await publisher.publish(b"a", routing_key=queue, message_id="same")
            await publisher.publish(b"b", routing_key=queue, message_id="same")
            await publisher.publish(
                b"c", routing_key=queue, message_id="late", headers={ATTEMPT_HEADER: 99}
            )
        seen: list[bytes] = []
        consumer = _consumer(broker_url, max_attempts=3)

        @consumer.handler(queue, ack_policy=AckPolicy.MANUAL, queue_only=True)
        async def take(delivery: Delivery) -> None:
            seen.append(delivery.body)
            await delivery.ack()

        async with consumer:
            await wait_until(lambda: len(seen) == 3)
        assert seen == [b"a", b"b", b"c"]
        assert consumer.stats().acked == 3 and consumer.stats().dead_lettered == 0
        topology = consumer.topology(queue)
        for side in (*topology.retry_queues, topology.dead_letter_queue):
            assert not await _queue_exists(broker_url, side), side
        assert await drain_queue(broker_url, queue) == []

    async def test_a_missing_queue_stops_the_start(self, broker_url: str) -> None:
        consumer = _consumer(broker_url)
        missing = f"missing-{uuid.uuid4().hex[:8]}"

        @consumer.handler(missing, ack_policy=AckPolicy.MANUAL, queue_only=True)
        async def take(delivery: Delivery) -> None: ...

        with pytest.raises(ConsumerError, match="does not exist"):
            await consumer.start()
        assert not await _queue_exists(broker_url, missing)

    def test_only_a_manual_handler_without_dedup(self) -> None:
        consumer = _consumer("amqp://guest:guest@127.0.0.1/")

        async def take(delivery: Delivery) -> None: ...

        with pytest.raises(TypeError, match=r"AckPolicy\.MANUAL"):
            consumer.add_handler("q", take, queue_only=True)
        assert consumer.handlers == ()


class TestChannelLost:
    async def test_the_hook_hears_of_a_cut_and_consuming_goes_on(
        self, broker_url: str, queue: str, proxy: TCPProxy
    ) -> None:
        """A cut connection: the hook is called with the queue's name, the unsettled
        delivery goes back to the queue and comes again on the new channel."""
        lost: list[str] = []
        bodies: list[tuple[bytes, bool]] = []
        consumer = _consumer(proxied_url(proxy), on_channel_lost=lost.append)
        release = asyncio.Event()

        @consumer.handler(queue, ack_policy=AckPolicy.MANUAL, queue_only=True)
        async def take(delivery: Delivery) -> None:
            bodies.append((delivery.body, delivery.redelivered))
            if len(bodies) == 1:
                await release.wait()  # unsettled when the cut comes
            await delivery.ack()

        async with consumer:
            async with ReliablePublisher(broker_url, registry=CollectorRegistry()) as publisher:
                await publisher.publish(b"x", routing_key=queue)
            await wait_until(lambda: len(bodies) == 1)
            await proxy.cut()
            await wait_until(lambda: lost == [queue], timeout=20)
            release.set()
            await wait_until(lambda: len(bodies) == 2, timeout=30)
        assert bodies == [(b"x", False), (b"x", True)]
        assert lost == [queue]  # not called again by stop()
        assert await drain_queue(broker_url, queue) == []
