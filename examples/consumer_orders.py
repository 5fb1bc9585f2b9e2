"""Consume orders with a typed handler: retries, a poison message, a malformed body.

Declares ``orders-example-<random>`` with its retry queues and DLQ, publishes
five valid orders, one poison order (its handler always fails) and one body
that is not JSON, then runs a :class:`ReliableConsumer` until the valid orders
are processed and the two bad ones are in the DLQ, prints a summary and
deletes the queues. Short retry delays keep it quick:

    python examples/consumer_orders.py [--url amqp://...]

Afterwards, ``reliable-mq dlq list QUEUE`` shows such dead letters (run it
with ``--keep`` to leave the queues in place).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import uuid

import aio_pika
from pydantic import BaseModel

from reliable_mq import (
    ConsumerSettings,
    Delivery,
    QueueTopology,
    ReliableConsumer,
    ReliablePublisher,
    declare_topology,
)
from reliable_mq.topology import delete_topology

RETRY_DELAYS = (0.2, 0.5)
POISON_ID = 13


class Order(BaseModel):
    order_id: int
    item: str
    quantity: int


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--url", default=os.environ.get("RELIABLE_MQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
    )
    parser.add_argument("--keep", action="store_true", help="do not delete the queues")
    args = parser.parse_args()

    queue = f"orders-example-{uuid.uuid4().hex[:8]}"
    topology = QueueTopology(queue=queue, retry_delays=RETRY_DELAYS)
    connection = await aio_pika.connect(args.url)
    async with connection:
        channel = await connection.channel()
        await declare_topology(channel, topology)
        try:
            await run(args.url, topology)
        finally:
            if not args.keep:
                await delete_topology(channel, topology)


async def run(url: str, topology: QueueTopology) -> None:
    queue = topology.queue
    async with ReliablePublisher(url) as publisher:
        for order_id in (1, 2, 3, 4, 5, POISON_ID):
            order = Order(order_id=order_id, item="book", quantity=order_id)
            await publisher.publish(order, routing_key=queue, message_id=f"order-{order_id}")
        await publisher.publish(
            b"{not json", routing_key=queue, message_id="order-bad", content_type="application/json"
        )

    processed: list[int] = []
    attempts: dict[int, int] = {}
    consumer = ReliableConsumer(
        url, settings=ConsumerSettings(prefetch=20, max_attempts=3, retry_delays=RETRY_DELAYS)
    )

    @consumer.handler(queue)
    async def on_order(order: Order, delivery: Delivery) -> None:
        attempts[order.order_id] = delivery.attempt
        if order.order_id == POISON_ID:
            raise RuntimeError("payment gateway rejected the card")  # retried, then the DLQ
        processed.append(order.order_id)  # returning acks the delivery

    async with consumer:  # starts consuming; stops gracefully on exit
        async with asyncio.timeout(15):
            while len(processed) < 5 or consumer.stats().dead_lettered < 2:
                await asyncio.sleep(0.05)
    stats = consumer.stats()

    # Look at the dead letters (and take them out of the DLQ).
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        dlq = await channel.declare_queue(topology.dead_letter_queue, passive=True)
        dead: list[str] = []
        while (message := await dlq.get(fail=False)) is not None:
            headers = message.headers or {}
            reason = headers.get("x-reliable-mq-reason")
            error = headers.get("x-reliable-mq-error-message")
            dead.append(f"{message.message_id}: {reason!s} ({error!s})")
            await message.ack()

    print(f"processed orders: {sorted(processed)}")
    print(f"poison order attempts: {attempts[POISON_ID]}")
    print(f"dead-lettered: {len(dead)}")
    for line in sorted(dead):
        print(f"  {line}")
    print(
        f"consumer stats: delivered={stats.delivered} acked={stats.acked} "
        f"retried={stats.retried} dead_lettered={stats.dead_lettered}"
    )
    assert sorted(processed) == [1, 2, 3, 4, 5]
    assert len(dead) == 2


if __name__ == "__main__":
    asyncio.run(main())
