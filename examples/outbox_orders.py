"""Exactly-once effects from one database to another through RabbitMQ: outbox, relay, inbox.

* Service A commits an order *and* its ``order.created`` event in one
  transaction (``outbox.add``). One order is rolled back: its event never
  leaves the database.
* The relay publishes committed events with confirms and deletes each row
  only once the broker confirmed it.
* Service B applies each event (a row in ``shipments``) and its inbox mark in
  one transaction (``PostgresDedupStore.run_once``); a second copy of an event
  (here: the relay's batch sent again, as after a relay crash) is acked and
  skipped.

    python examples/outbox_orders.py   # RELIABLE_MQ_URL, RELIABLE_MQ_OUTBOX_DSN pick the servers
"""

from __future__ import annotations

import asyncio
import os
import uuid
from typing import Any

import aio_pika
import psycopg
from prometheus_client import CollectorRegistry

from reliable_mq import ReliableConsumer, ReliablePublisher
from reliable_mq.dedup.postgres import PostgresDedupStore
from reliable_mq.delivery import Delivery
from reliable_mq.outbox import OutboxRelay, RelaySettings, add
from reliable_mq.outbox.admin import create_schema
from reliable_mq.topology import delete_topology

URL = os.environ.get("RELIABLE_MQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
DSN = os.environ.get("RELIABLE_MQ_OUTBOX_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
ORDERS = 20


async def service_a(tables: dict[str, str], queue: str) -> None:
    """Each order and its event in one transaction; order 13 is rolled back."""
    async with await psycopg.AsyncConnection.connect(DSN) as conn:
        for n in range(ORDERS):
            try:
                async with conn.transaction():
                    await conn.execute(
                        f"INSERT INTO {tables['orders']} (id, customer) VALUES (%s, %s)",
                        (n, f"c{n % 3}"),
                    )
                    await add(
                        conn,
                        {"order_id": n, "customer": f"c{n % 3}"},
                        routing_key=queue,
                        message_id=f"order-{n}-created",
                        ordering_key=f"c{n % 3}",  # one customer's events stay in order
                        table=tables["outbox"],
                    )
                    if n == 13:
                        raise RuntimeError("payment declined")
            except RuntimeError:
                print(f"service A: order {n} rolled back (its event is gone with it)")


async def main() -> None:
    suffix = uuid.uuid4().hex[:8]
    tables = {name: f"example_{name}_{suffix}" for name in ("orders", "outbox", "shipments")}
    queue = f"example-orders-{suffix}"
    await create_schema(DSN, table=tables["outbox"])
    async with await psycopg.AsyncConnection.connect(DSN, autocommit=True) as conn:
        await conn.execute(f"CREATE TABLE {tables['orders']} (id int PRIMARY KEY, customer text)")
        await conn.execute(f"CREATE TABLE {tables['shipments']} (order_id int, customer text)")

    inbox = PostgresDedupStore(DSN, table=f"example_inbox_{suffix}")
    consumer = ReliableConsumer(URL, dedup=None, concurrency=1, registry=CollectorRegistry())

    @consumer.handler(queue)
    async def service_b(event: dict[str, Any], delivery: Delivery) -> None:
        async def ship(conn: psycopg.AsyncConnection[Any]) -> None:
            await conn.execute(
                f"INSERT INTO {tables['shipments']} VALUES (%s, %s)",
                (event["order_id"], event["customer"]),
            )

        # Effect and inbox mark commit together; a copy raises AlreadyProcessed,
        # which the consumer acks as a duplicate.
        await inbox.run_once(delivery.message_id, ship)

    registry = CollectorRegistry()
    try:
        async with consumer:
            await service_a(tables, queue)
            async with ReliablePublisher(URL, registry=registry) as publisher:
                relay = OutboxRelay(
                    DSN,
                    publisher,
                    table=tables["outbox"],
                    settings=RelaySettings(poll_interval=0.2),
                    registry=registry,
                )
                async with relay:
                    while await relay.run_once():
                        pass
                # A relay that died after its confirms but before its delete sends
                # its batch again: simulate that copy for the first five events.
                for n in range(5):
                    await publisher.publish(
                        {"order_id": n, "customer": f"c{n % 3}"},
                        routing_key=queue,
                        message_id=f"order-{n}-created",
                    )
                print(f"relay: {relay.stats().dispatched} events published and confirmed")
            async with asyncio.timeout(30):
                while consumer.stats().delivered < ORDERS - 1 + 5 or consumer.stats().in_progress:
                    await asyncio.sleep(0.05)
            stats = consumer.stats()
        async with await psycopg.AsyncConnection.connect(DSN) as conn:
            cursor = await conn.execute(
                f"SELECT count(*), count(DISTINCT order_id) FROM {tables['shipments']}"
            )
            shipped, distinct = await cursor.fetchone() or (0, 0)
        print(f"service B: {shipped} shipments, {stats.duplicates} duplicate events skipped")
        assert shipped == distinct == ORDERS - 1, (shipped, distinct)
    finally:
        await inbox.close()
        async with await psycopg.AsyncConnection.connect(DSN, autocommit=True) as conn:
            for table in (*tables.values(), f"example_inbox_{suffix}"):
                await conn.execute(f"DROP TABLE IF EXISTS {table}")
        connection = await aio_pika.connect(URL)
        async with connection:
            await delete_topology(await connection.channel(), consumer.topology(queue))


if __name__ == "__main__":
    asyncio.run(main())
