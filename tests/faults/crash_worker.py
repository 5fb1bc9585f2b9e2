"""A consumer process for the consumer-crash scenario: effects in an SQLite file.

Run as ``python -m tests.faults.crash_worker '<json config>'``. It consumes one
queue and applies each message's effect as a row in the ``effects`` table,
committed together with the message's *done* mark
(:meth:`SQLiteDedupStore.run_once`), so a copy that comes back after a crash
finds it done. Every delivery is appended to ``deliveries`` (one id a line).

With ``crash_after`` set, the handler of that many-th effect touches
``marker`` after committing its effect and then hangs, unacked, until the
test SIGKILLs the process. SIGTERM stops it gracefully; it then writes its
:class:`ConsumerStats` as JSON to ``stats``.

Config keys: ``url``, ``queue``, ``db``, ``deliveries``, ``stats``,
``prefetch``, ``lease``, optional ``crash_after`` and ``marker``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import sys
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from reliable_mq import ConnectionSettings, ConsumerSettings
from reliable_mq.consumer import ReliableConsumer
from reliable_mq.dedup import AlreadyProcessed, SQLiteDedupStore
from reliable_mq.delivery import Delivery
from tests.faults.harness import LIBRARY_DEDUP


async def main(config: dict[str, Any]) -> None:
    store = SQLiteDedupStore(config["db"])
    settings: dict[str, Any] = {
        "prefetch": config["prefetch"],
        "retry_delays": (0.2,),
        "max_attempts": 1000,
        "shutdown_grace": 5.0,
    }
    extra: dict[str, Any] = {}
    if LIBRARY_DEDUP:
        settings["dedup_lease"] = config["lease"]
        extra["dedup"] = store
    consumer = ReliableConsumer(
        ConnectionSettings(
            url=SecretStr(config["url"]),
            connection_name=f"crash-worker-{os.getpid()}",
            reconnect_initial_delay=0.1,
            reconnect_max_delay=0.5,
        ),
        settings=ConsumerSettings(**settings),
        registry=CollectorRegistry(),
        **extra,
    )
    log = os.open(config["deliveries"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    crash_after = config.get("crash_after")
    applied = 0
    pid = os.getpid()

    @consumer.handler(config["queue"])
    async def handle(delivery: Delivery) -> None:
        nonlocal applied
        mid = delivery.message_id
        os.write(log, f"{mid}\n".encode())

        def effect(conn: sqlite3.Connection) -> None:
            conn.execute("INSERT INTO effects (message_id, pid) VALUES (?, ?)", (mid, pid))

        try:
            await store.run_once(mid, effect)
        except AlreadyProcessed:
            return  # another copy committed first: ack and skip
        applied += 1
        if crash_after is not None and applied == crash_after:
            _write(config["marker"], "")
            await asyncio.sleep(3600)  # effect committed, ack never sent: SIGKILLed here

    await consumer.run()
    _write(config["stats"], json.dumps(consumer.stats()._asdict()))
    await store.close()


def _write(path: str, text: str) -> None:
    Path(path).write_text(text)


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
