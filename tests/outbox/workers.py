"""Processes for the outbox fault tests, to be SIGKILLed: ``python -m tests.outbox.workers ROLE CONFIG``.

* ``writer``: service A; commits ``count`` orders with their events, printing
  ``committed <id>`` right after each commit.
* ``relay``: an OutboxRelay whose batches, once every confirm is in, print
  ``published <n>`` and then wait (``pause_before_delete``), so the test can
  kill it between the publish and the delete.
* ``consumer``: service B (see ``scenario.make_consumer``); with
  ``OUTBOX_TEST_PAUSE_AFTER_EFFECT=<id>`` it prints ``applied <id>`` after that
  id's effect committed and hangs before the ack.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
from prometheus_client import CollectorRegistry

from reliable_mq.outbox import OutboxRelay, RelaySettings, add
from tests.outbox.scenario import KEYS, make_consumer


async def writer(config: dict[str, Any]) -> None:
    system = config["system"]
    async with await psycopg.AsyncConnection.connect(config["dsn"]) as conn:
        for index in range(config["start"], config["start"] + config["count"]):
            mid, key = f"o{index:06d}", f"k{index % KEYS}"
            async with conn.transaction():
                await conn.execute(
                    f"INSERT INTO {system['orders']} VALUES (%s, %s, %s)", (mid, key, index)
                )
                await add(
                    conn,
                    {"id": mid, "key": key, "seq": index},
                    routing_key=system["queue"],
                    message_id=mid,
                    ordering_key=key,
                    table=system["outbox"],
                )
            sys.stdout.write(f"committed {mid}\n")
            sys.stdout.flush()
            await asyncio.sleep(config.get("pause", 0.002))


async def relay(config: dict[str, Any]) -> None:
    system = config["system"]
    settings = RelaySettings(batch_size=config.get("batch_size", 50), poll_interval=0.2)
    async with OutboxRelay(
        config["dsn"],
        config["url"],
        settings=settings,
        table=system["outbox"],
        registry=CollectorRegistry(),
    ) as outbox_relay:
        pause = config.get("pause_before_delete", 3600)
        for lane in outbox_relay._lanes:  # whichever lane's batch comes first
            backend: Any = lane
            backend.finish = _paused(backend.finish, pause)
        await outbox_relay.run()


def _paused(
    finish: Callable[[Any], Awaitable[None]], pause: float
) -> Callable[[Any], Awaitable[None]]:
    async def finish_later(results: Any) -> None:
        sys.stdout.write(f"published {len(results)}\n")
        sys.stdout.flush()
        await asyncio.sleep(pause)
        await finish(results)

    return finish_later


async def consumer(config: dict[str, Any]) -> None:
    service, store = make_consumer(config["dsn"], config["url"], config["system"], name="worker")
    try:
        sys.stdout.write("consuming\n")
        sys.stdout.flush()
        await service.run()
    finally:
        await store.close()


if __name__ == "__main__":
    role, raw = sys.argv[1], sys.argv[2]
    asyncio.run({"writer": writer, "relay": relay, "consumer": consumer}[role](json.loads(raw)))
