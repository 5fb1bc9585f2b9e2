"""A consumer process for the de-duplication tests: shared Redis store, effects in Redis.

Run as ``python -m tests.support.dedup_worker '<json config>'``. It consumes one
queue with a :class:`RedisDedupStore` and applies each message's effect as
``HINCRBY <effects_key> <message_id> 1`` in Redis, so several processes can be
checked for "every id applied exactly once". SIGTERM stops it gracefully; it
then prints its :class:`ConsumerStats` as JSON on stdout.

Config keys: ``url``, ``queue``, ``redis_url``, ``prefix`` (the store's key
prefix), ``effects_key``, optional ``lease`` (seconds), ``retry_delay``,
``prefetch``, ``name`` (connection name), and ``hang_id`` with ``started_key``:
the handler for that id sets ``started_key`` and then hangs (to be killed).
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from reliable_mq import ConnectionSettings
from reliable_mq.consumer import ReliableConsumer
from reliable_mq.dedup.redis import RedisDedupStore
from reliable_mq.delivery import Delivery


async def main(config: dict[str, Any]) -> None:
    store = RedisDedupStore(config["redis_url"], prefix=config["prefix"])
    effects = aioredis.Redis.from_url(config["redis_url"])
    overrides: dict[str, Any] = {"prefetch": config.get("prefetch", 100)}
    if "lease" in config:
        overrides["dedup_lease"] = config["lease"]
    if "retry_delay" in config:
        overrides["retry_delays"] = (config["retry_delay"],)
    consumer = ReliableConsumer(
        ConnectionSettings(
            url=SecretStr(config["url"]),
            connection_name=config.get("name", "dedup-worker"),
            reconnect_initial_delay=0.1,
            reconnect_max_delay=0.5,
        ),
        dedup=store,
        registry=CollectorRegistry(),
        **overrides,
    )
    hang_id = config.get("hang_id")
    effects_key = config["effects_key"]

    @consumer.handler(config["queue"])
    async def handle(delivery: Delivery) -> None:
        if delivery.message_id == hang_id:
            await effects.set(config["started_key"], "1")
            await asyncio.sleep(3600)  # killed here
        await effects.hincrby(effects_key, delivery.message_id, 1)

    try:
        await consumer.run()
    finally:
        await store.close()
        await effects.aclose()
    sys.stdout.write(json.dumps(consumer.stats()._asdict()) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
