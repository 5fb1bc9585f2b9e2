"""PrivateBroker: a private node survives kill -9 with its durable data."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import aio_pika
import pytest

from tests.support.amqp import drain_queue
from tests.support.private_node import PrivateBroker, find_rabbitmq_sbin

pytestmark = [
    pytest.mark.private_broker,
    pytest.mark.skipif(find_rabbitmq_sbin() is None, reason="RabbitMQ is not installed"),
]


@pytest.fixture
def broker() -> Iterator[PrivateBroker]:
    node = PrivateBroker()
    try:
        yield node
    finally:
        node.cleanup()


async def test_persistent_message_survives_kill_and_restart(broker: PrivateBroker) -> None:
    await asyncio.to_thread(broker.start)
    assert broker.is_running()
    name = f"test.private.{uuid.uuid4().hex}"

    connection = await aio_pika.connect(broker.url, timeout=10)
    try:
        closed = asyncio.Event()
        connection.close_callbacks.add(lambda *_: closed.set())
        channel = await connection.channel()  # publisher confirms on
        await channel.declare_queue(name, durable=True)
        await channel.default_exchange.publish(
            aio_pika.Message(
                b"keep me",
                message_id="m-1",
                headers={"k": "v"},
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            ),
            routing_key=name,
        )
        assert name in broker.rabbitmqctl("list_queues", "name")

        # Server-side close: the client hears about it.
        await asyncio.to_thread(broker.close_all_connections, "test says bye")
        await asyncio.wait_for(closed.wait(), 10)
    finally:
        await connection.close()

    # The queue's record must be on disk before the crash (see sync_metadata): a
    # kill -9 right after the declare lost the queue in 2 runs of 12 here.
    await asyncio.to_thread(broker.sync_metadata)
    await asyncio.to_thread(broker.kill)
    assert not broker.is_running()
    with pytest.raises((OSError, asyncio.TimeoutError, aio_pika.exceptions.AMQPError)):
        await aio_pika.connect(broker.url, timeout=2)

    await asyncio.to_thread(broker.restart)
    assert broker.is_running()

    drained = await drain_queue(broker.url, name, idle_timeout=0.5)
    assert [(m.message_id, m.body, m.headers) for m in drained] == [("m-1", b"keep me", {"k": "v"})]

    connection = await aio_pika.connect(broker.url, timeout=10)
    try:
        channel = await connection.channel()
        await channel.queue_delete(name)
    finally:
        await connection.close()
