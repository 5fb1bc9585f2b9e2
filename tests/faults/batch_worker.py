"""A consumer process with a batch handler, for the batch-crash scenario: effects in PostgreSQL.

Run as ``python -m tests.faults.batch_worker '<json config>'``. It consumes one
queue with a batch handler over ``list[Delivery]`` and applies each batch's
effect as rows of the ``ledger`` table (one per new message id), committed
together with the ids' *done* marks by
:meth:`PostgresDedupStore.run_once_batch`, so a copy that comes back after a
crash finds its id done. The consumer has no dedup store of its own: the
database is the only thing between a redelivery and a second effect. Every
delivery is appended to ``deliveries`` (one id a line) before its batch runs.

With ``crash_after`` set, the handler of that many-th batch with new ids
touches ``marker`` after committing and then hangs, unacked, until the test
SIGKILLs the process. SIGTERM stops it gracefully; it then writes its
:class:`ConsumerStats` as JSON to ``stats``.

Config keys: ``url``, ``queue``, ``dsn``, ``table``, ``ledger``,
``deliveries``, ``stats``, ``prefetch``, ``max_size``, optional
``crash_after`` and ``marker``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import psycopg
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from reliable_mq import ConnectionSettings, ConsumerSettings
from reliable_mq.consumer import ReliableConsumer
from reliable_mq.dedup.postgres import PostgresDedupStore
from reliable_mq.delivery import Delivery


def ledger_effect(ledger: str) -> Any:
    """The effect: one ledger row per new delivery, inside run_once_batch's transaction."""

    async def effect(conn: psycopg.AsyncConnection[Any], items: list[Delivery]) -> int:
        async with conn.cursor() as cursor:
            await cursor.executemany(
                f"INSERT INTO {ledger} (message_id) VALUES (%s)",
                [(item.message_id,) for item in items],
            )
        return len(items)

    return effect


async def main(config: dict[str, Any]) -> None:
    store = PostgresDedupStore(config["dsn"], table=config["table"])
    consumer = ReliableConsumer(
        ConnectionSettings(
            url=SecretStr(config["url"]),
            connection_name=f"batch-worker-{os.getpid()}",
            reconnect_initial_delay=0.1,
            reconnect_max_delay=0.5,
        ),
        settings=ConsumerSettings(
            prefetch=config["prefetch"],
            retry_delays=(0.2,),
            max_attempts=1000,
            shutdown_grace=5.0,
        ),
        registry=CollectorRegistry(),
        dedup=None,
    )
    log = os.open(config["deliveries"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    crash_after = config.get("crash_after")
    effect = ledger_effect(config["ledger"])
    batches = 0

    @consumer.batch_handler(config["queue"], max_size=config["max_size"], max_wait=0.05)
    async def handle(items: list[Delivery]) -> None:
        nonlocal batches
        os.write(log, "".join(f"{item.message_id}\n" for item in items).encode())
        result = await store.run_once_batch(items, effect)
        if not result.ran:
            return
        batches += 1
        if crash_after is not None and batches == crash_after:
            _write(config["marker"], "")
            await asyncio.sleep(3600)  # effects committed, acks never sent: SIGKILLed here

    await consumer.run()
    _write(config["stats"], json.dumps(consumer.stats()._asdict()))
    await store.close()


def _write(path: str, text: str) -> None:
    Path(path).write_text(text)


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
