"""Publish throughput: reliable_mq streaming vs raw aio-pika, in one run.

Every variant publishes the same persistent 256-byte messages to its own fresh
durable queue on the same broker. Ratios are against raw aio-pika pipelined
confirms with the same window; compare only figures from one run (rates drift
by 25% or more between runs on shared machines).

    python bench/publish.py [--messages 20000] [--window 1000] [--rounds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable

import aio_pika
from prometheus_client import CollectorRegistry

from reliable_mq import PublisherSettings, ReliablePublisher

URL = "amqp://guest:guest@127.0.0.1:5672/"
BODY = b"x" * 256


async def raw_naive(queue: str, count: int, window: int) -> None:
    """aio-pika, awaiting each confirm before the next publish."""
    connection = await aio_pika.connect(URL)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = channel.default_exchange
        for index in range(count):
            message = aio_pika.Message(
                BODY, delivery_mode=aio_pika.DeliveryMode.PERSISTENT, message_id=str(index)
            )
            await exchange.publish(message, routing_key=queue)


async def raw_pipelined(queue: str, count: int, window: int) -> None:
    """aio-pika with confirms, ``window`` publishes in flight (semaphore)."""
    connection = await aio_pika.connect(URL)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = channel.default_exchange
        slots = asyncio.Semaphore(window)

        async def one(index: int) -> None:
            async with slots:
                message = aio_pika.Message(
                    BODY, delivery_mode=aio_pika.DeliveryMode.PERSISTENT, message_id=str(index)
                )
                await exchange.publish(message, routing_key=queue)

        await asyncio.gather(*(one(index) for index in range(count)))


async def raw_unconfirmed(queue: str, count: int, window: int) -> None:
    """aio-pika without confirms (the fire-and-forget ceiling; not loss-proof)."""
    connection = await aio_pika.connect(URL)
    async with connection:
        channel = await connection.channel(publisher_confirms=False)
        exchange = channel.default_exchange
        for index in range(count):
            message = aio_pika.Message(
                BODY, delivery_mode=aio_pika.DeliveryMode.PERSISTENT, message_id=str(index)
            )
            await exchange.publish(message, routing_key=queue)
        # the clock stops when the queue holds everything, so the figure is comparable
        await wait_for_depth(channel, queue, count)


async def wait_for_depth(channel: aio_pika.abc.AbstractChannel, queue: str, count: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        declared = await channel.declare_queue(queue, durable=True, passive=True)
        depth = declared.declaration_result.message_count
        if depth >= count:
            return
        await asyncio.sleep(0.005)
    raise SystemExit(f"{queue}: holds {depth}, expected {count}")


async def reliable_gather(queue: str, count: int, window: int) -> None:
    """reliable_mq: ``count`` concurrent publish() calls, ``window`` in flight."""
    settings = PublisherSettings(max_in_flight=window)
    async with ReliablePublisher(URL, settings=settings, registry=CollectorRegistry()) as publisher:
        await asyncio.gather(*(publisher.publish(BODY, routing_key=queue) for _ in range(count)))


async def reliable_enqueue(queue: str, count: int, window: int) -> None:
    """reliable_mq: a producer loop calling enqueue(), then one flush()."""
    settings = PublisherSettings(max_in_flight=window)
    async with ReliablePublisher(URL, settings=settings, registry=CollectorRegistry()) as publisher:
        for _ in range(count):
            await publisher.enqueue(BODY, routing_key=queue)
        await publisher.flush()


VARIANTS: dict[str, Callable[[str, int, int], Awaitable[None]]] = {
    "raw aio-pika naive (await each confirm)": raw_naive,
    "raw aio-pika pipelined confirms": raw_pipelined,
    "raw aio-pika no confirms": raw_unconfirmed,
    "reliable_mq publish() x gather": reliable_gather,
    "reliable_mq enqueue() + flush()": reliable_enqueue,
}
BASELINE = "raw aio-pika pipelined confirms"


async def measure(
    name: str, run: Callable[[str, int, int], Awaitable[None]], count: int, window: int
) -> float:
    queue = f"bench-publish-{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect(URL)
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, durable=True)
        # the naive loop is ~10x slower: give it fewer messages, report the rate
        n = max(count // 10, 500) if run is raw_naive else count
        started = time.perf_counter()
        await run(queue, n, window)
        seconds = time.perf_counter() - started
        await wait_for_depth(channel, queue, n)
        await declared.delete(if_unused=False, if_empty=False)
    return n / seconds


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--window", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=1, help="repeat and report the median")
    args = parser.parse_args()
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, run in VARIANTS.items():
            rates[name].append(await measure(name, run, args.messages, args.window))
    medians = {name: statistics.median(values) for name, values in rates.items()}
    base = medians[BASELINE]
    print(
        f"publish: {args.messages} persistent 256-byte messages, durable queue, "
        f"window {args.window}, {args.rounds} round(s), median"
    )
    print(f"{'variant':<42} {'msgs/s':>10} {'vs pipelined':>13}")
    for name, rate in medians.items():
        print(f"{name:<42} {rate:>10,.0f} {rate / base:>12.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
