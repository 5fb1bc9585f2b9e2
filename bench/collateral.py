"""The damage one bad publish does to other traffic (issue 10, item 3).

A stream of ``--messages`` good messages is published with ``publish_many()``
alone, then again next to a loop that publishes to a missing exchange every
``--every`` seconds. Printed per round: the time of each stream and their
ratio, the refusals the loop got (each an ``ExchangeNotFound``), the
connections, publish channels and exchange-probe channels the publisher opened,
and the duplicate copies found in the queue (drained and counted by ``message_id``).

    python bench/collateral.py [--messages 10000] [--every 0.05] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import statistics
import time
import uuid

import aio_pika
from prometheus_client import CollectorRegistry

from reliable_mq import ExchangeNotFound, Message, ReliablePublisher

URL = "amqp://guest:guest@127.0.0.1:5672/"
BODY = b"x" * 256


async def drain(queue: str) -> collections.Counter[str]:
    """Every message id in ``queue``, with how often it is there."""
    ids: collections.Counter[str] = collections.Counter()
    connection = await aio_pika.connect(URL)
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, durable=True)
        while (message := await declared.get(no_ack=True, fail=False)) is not None:
            ids[message.message_id or ""] += 1
        await declared.delete(if_unused=False, if_empty=False)
    return ids


async def stream(count: int, every: float | None) -> dict[str, float]:
    queue = f"bench-collateral-{uuid.uuid4().hex[:8]}"
    missing = f"missing-{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect(URL)
    async with connection:
        await (await connection.channel()).declare_queue(queue, durable=True)
    refusals = 0
    async with ReliablePublisher(URL, registry=CollectorRegistry()) as publisher:
        done = asyncio.Event()

        async def bad_loop() -> None:
            nonlocal refusals
            while not done.is_set():
                try:
                    await publisher.publish(b"b", routing_key="k", exchange=missing)
                except ExchangeNotFound:
                    refusals += 1
                await asyncio.sleep(every or 0)

        bad = asyncio.ensure_future(bad_loop()) if every else None
        started = time.perf_counter()
        result = await publisher.publish_many(
            Message(BODY, routing_key=queue) for _ in range(count)
        )
        seconds = time.perf_counter() - started
        done.set()
        if bad is not None:
            await bad
        connections = publisher._supervisor.generation
        channels = publisher.stats().channel_generation
        # Probe channels (a 404 closes one); absent before reliable_mq counted them.
        probes = getattr(publisher._engine.exchanges, "channels_opened", float("nan"))
    ids = await drain(queue)
    assert result.confirmed == count and len(ids) == count
    return {
        "seconds": seconds,
        "refusals": refusals,
        "connections": connections,
        "channels": channels,
        "probe_channels": probes,
        "duplicates": sum(ids.values()) - len(ids),
    }


async def main(args: argparse.Namespace) -> None:
    ratios = []
    for round_ in range(1, args.rounds + 1):
        alone = await stream(args.messages, None)
        together = await stream(args.messages, args.every)
        ratio = together["seconds"] / alone["seconds"]
        ratios.append(ratio)
        print(
            f"round {round_}: alone {alone['seconds']:.2f}s, next to a bad publish every "
            f"{args.every * 1000:g} ms {together['seconds']:.2f}s (ratio {ratio:.2f}); "
            f"{together['refusals']:.0f} ExchangeNotFound, {together['connections']:.0f} "
            f"connection(s), {together['channels']:.0f} channel(s), "
            f"{together['probe_channels']:.0f} probe channel(s), "
            f"{together['duplicates']:.0f} duplicate copies"
        )
    print(f"median ratio {statistics.median(ratios):.2f} (target <= 1.5)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--every", type=float, default=0.05)
    parser.add_argument("--rounds", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
