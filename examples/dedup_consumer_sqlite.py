"""Exactly-once effects with a real consumer: SQLite holds the balance *and* the dedup marks.

Each payment is published twice with the same ``message_id`` (what a publisher
republish after a lost confirm, or a redelivery, looks like to a consumer).
The handler credits the account with ``SQLiteDedupStore.run_once``: the credit
and the message's *done* mark commit in one transaction. The consumer uses the
same store for its own claim/complete step, so the second copy is acked and
skipped before the handler runs. Had the process died between the commit and
the ack, the redelivered copy would find the id done, and a copy racing past
the claim (a lease that expired) is refused by ``run_once`` with
``AlreadyProcessed``, which the consumer acks as a duplicate.

    python examples/dedup_consumer_sqlite.py   # RELIABLE_MQ_URL picks the broker
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import tempfile
import uuid
from pathlib import Path

import aio_pika
from prometheus_client import CollectorRegistry
from pydantic import BaseModel

from reliable_mq import ReliablePublisher
from reliable_mq.consumer import ReliableConsumer
from reliable_mq.dedup import SQLiteDedupStore
from reliable_mq.delivery import Delivery
from reliable_mq.topology import delete_topology

URL = os.environ.get("RELIABLE_MQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
PAYMENTS = 200


class Payment(BaseModel):
    account: int
    amount: int


def balance(path: Path) -> int:
    with sqlite3.connect(path) as conn:
        (value,) = conn.execute("SELECT balance FROM account WHERE id = 1").fetchone()
    return int(value)


async def main() -> None:
    queue = f"example-payments-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bank.db"
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE account (id INTEGER PRIMARY KEY, balance INTEGER)")
            conn.execute("INSERT INTO account VALUES (1, 0)")

        store = SQLiteDedupStore(path, retention=24 * 3600)
        consumer = ReliableConsumer(URL, dedup=store, registry=CollectorRegistry())

        @consumer.handler(queue)
        async def on_payment(payment: Payment, delivery: Delivery) -> None:
            def credit(conn: sqlite3.Connection) -> None:
                conn.execute(
                    "UPDATE account SET balance = balance + ? WHERE id = ?",
                    (payment.amount, payment.account),
                )

            # Effect and done mark in one transaction. AlreadyProcessed (another
            # copy committed first) propagates: the consumer acks it as a duplicate.
            await store.run_once(delivery.message_id, credit)

        try:
            async with consumer:
                async with ReliablePublisher(URL, registry=CollectorRegistry()) as publisher:
                    for copy in range(2):
                        for n in range(PAYMENTS):
                            await publisher.enqueue(
                                Payment(account=1, amount=1),
                                routing_key=queue,
                                message_id=f"payment-{n}",
                            )
                        if copy == 0:
                            await publisher.flush()
                    await publisher.flush()
                async with asyncio.timeout(15):
                    while consumer.stats().duplicates < PAYMENTS:
                        await asyncio.sleep(0.05)
                stats = consumer.stats()
        finally:
            connection = await aio_pika.connect(URL)
            async with connection:
                await delete_topology(await connection.channel(), consumer.topology(queue))
            await store.close()

        total = balance(path)
        print(f"deliveries: {stats.delivered}, applied: {stats.acked}, skipped: {stats.duplicates}")
        print(f"balance: {total} (expected {PAYMENTS}: each payment credited once)")
        assert total == PAYMENTS


if __name__ == "__main__":
    asyncio.run(main())
