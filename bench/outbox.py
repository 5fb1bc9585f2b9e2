"""Outbox relay throughput against direct streaming, and commit-to-confirm latency.

In one run, against the local broker and a PostgreSQL server:

1. direct: ``ReliablePublisher.enqueue()`` streaming N persistent messages
   (the same window), the baseline;
2. relay: the same N messages committed as outbox rows first (not timed), then
   drained by one ``OutboxRelay``; the ratio relay / direct is the figure
   (target >= 0.7);
3. latency at low load: one event committed every ``--interval`` seconds
   while the relay runs; time from the commit returning to the relay's delete
   commit (which follows the confirm), with ``LISTEN/NOTIFY`` and then with
   polling only (``--poll``);
4. one hot ordering key: ``--hot-key`` rows of a single key committed first,
   then drained by a running relay (``run()``); a key's rows go one per batch,
   so this is the rate of one claim-publish-confirm-commit round trip.

    .venv/bin/python bench/outbox.py --messages 20000 --latency-events 300
    .venv/bin/python bench/outbox.py --messages 200 --latency-events 10 --hot-key 50   # smoke

``--dsn`` (default ``$RELIABLE_MQ_OUTBOX_DSN`` or the local server on 5432)
gets tables of its own, dropped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid
from collections.abc import Sequence

import aio_pika
import psycopg
from prometheus_client import CollectorRegistry

from reliable_mq import PublisherSettings, ReliablePublisher
from reliable_mq.outbox import OutboxRelay, OutboxRow, RelaySettings, add
from reliable_mq.outbox.admin import create_schema

BODY = b"x" * 256


async def direct(url: str, queue: str, count: int, window: int) -> float:
    async with ReliablePublisher(
        url, settings=PublisherSettings(max_in_flight=window), registry=CollectorRegistry()
    ) as publisher:
        started = time.perf_counter()
        for _ in range(count):
            await publisher.enqueue(BODY, routing_key=queue)
        await publisher.flush()
        return count / (time.perf_counter() - started)


async def fill(dsn: str, table: str, queue: str, count: int) -> None:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        for start in range(0, count, 1000):
            async with conn.transaction():
                for _ in range(min(1000, count - start)):
                    await add(conn, BODY, routing_key=queue, table=table)


async def relay_rate(
    dsn: str, url: str, table: str, count: int, window: int, batch: int, lanes: int
) -> float:
    """``run()``, as deployed, until ``count`` rows are confirmed and deleted."""
    until = Until(count)
    relay = OutboxRelay(
        dsn,
        url,
        settings=RelaySettings(batch_size=batch, lanes=lanes, listen=False),
        publisher_settings=PublisherSettings(max_in_flight=window),
        table=table,
        registry=CollectorRegistry(),
        on_dispatched=until,
    )
    return count / await until.run(relay)


class Until:
    """An ``on_dispatched`` observer that times a relay's ``run()`` until ``count`` rows are out."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.dispatched = 0
        self.done = asyncio.Event()

    def __call__(self, rows: Sequence[OutboxRow]) -> None:
        self.dispatched += len(rows)
        if self.dispatched >= self.count:
            self.done.set()

    async def run(self, relay: OutboxRelay) -> float:
        """Seconds from ``run()`` to the last row's commit (then the relay is stopped)."""
        async with relay:
            started = time.perf_counter()
            running = asyncio.ensure_future(relay.run())
            finished = asyncio.ensure_future(self.done.wait())
            await asyncio.wait((running, finished), return_when=asyncio.FIRST_COMPLETED)
            finished.cancel()
            seconds = time.perf_counter() - started
            relay.stop()
            await running  # re-raises what ended run() early
            assert self.dispatched == self.count, relay.stats()
        return seconds


async def latency(
    dsn: str,
    url: str,
    table: str,
    queue: str,
    events: int,
    interval: float,
    listen: bool,
    poll: float,
) -> list[float]:
    committed: dict[str, float] = {}
    latencies: list[float] = []

    def dispatched(rows: Sequence[OutboxRow]) -> None:
        now = time.perf_counter()
        latencies.extend(
            now - committed[row.message_id] for row in rows if row.message_id in committed
        )

    relay = OutboxRelay(
        dsn,
        url,
        settings=RelaySettings(listen=listen, poll_interval=poll if not listen else 1.0),
        table=table,
        registry=CollectorRegistry(),
        on_dispatched=dispatched,
    )
    async with relay:
        running = asyncio.ensure_future(relay.run())
        await asyncio.sleep(0.5)
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            for n in range(events):
                mid = f"lat-{listen}-{n}"
                async with conn.transaction():
                    await add(conn, BODY, routing_key=queue, message_id=mid, table=table)
                committed[mid] = time.perf_counter()
                await asyncio.sleep(interval)
        deadline = time.monotonic() + 30
        while len(latencies) < events and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        relay.stop()
        await running
    return latencies


async def hot_key_rate(dsn: str, url: str, table: str, queue: str, count: int) -> float:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        async with conn.transaction():
            for _ in range(count):
                await add(conn, BODY, routing_key=queue, ordering_key="hot", table=table)
    until = Until(count)
    relay = OutboxRelay(dsn, url, table=table, registry=CollectorRegistry(), on_dispatched=until)
    return count / await until.run(relay)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * 1000


async def purge(url: str, queue: str) -> None:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, durable=True)
        await declared.purge()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--url", default=os.environ.get("RELIABLE_MQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
    )
    parser.add_argument(
        "--dsn",
        default=os.environ.get(
            "RELIABLE_MQ_OUTBOX_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
    )
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--window", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=1000, help="relay batch size")
    parser.add_argument("--lanes", type=int, default=RelaySettings().lanes, help="relay lanes")
    parser.add_argument("--latency-events", type=int, default=300)
    parser.add_argument("--interval", type=float, default=0.02, help="seconds between events")
    parser.add_argument("--poll", type=float, default=0.1, help="poll interval without NOTIFY")
    parser.add_argument("--hot-key", type=int, default=2000, help="rows of one ordering key")
    args = parser.parse_args()

    suffix = uuid.uuid4().hex[:8]
    table, queue = f"bench_outbox_{suffix}", f"bench-outbox-{suffix}"
    await create_schema(args.dsn, table=table)
    await purge(args.url, queue)
    try:
        rate_direct = await direct(args.url, queue, args.messages, args.window)
        await purge(args.url, queue)
        rate_relay: dict[int, float] = {}
        for lanes in (1, args.lanes):
            await fill(args.dsn, table, queue, args.messages)
            rate_relay[lanes] = await relay_rate(
                args.dsn, args.url, table, args.messages, args.window, args.batch, lanes
            )
            await purge(args.url, queue)
        notify = await latency(
            args.dsn, args.url, table, queue, args.latency_events, args.interval, True, args.poll
        )
        polling = await latency(
            args.dsn, args.url, table, queue, args.latency_events, args.interval, False, args.poll
        )
        await purge(args.url, queue)
        hot = await hot_key_rate(args.dsn, args.url, table, queue, args.hot_key)
    finally:
        async with await psycopg.AsyncConnection.connect(args.dsn, autocommit=True) as conn:
            await conn.execute(f"DROP TABLE IF EXISTS {table}")
        connection = await aio_pika.connect(args.url)
        async with connection:
            await (await connection.channel()).queue_delete(queue)

    print(f"messages={args.messages} body=256B persistent window={args.window} batch={args.batch}")
    print(f"direct ReliablePublisher streaming: {rate_direct:10,.0f} msg/s")
    for lanes, rate in rate_relay.items():
        label = f"outbox relay, {lanes} lane{'s' if lanes > 1 else ''}:"
        print(f"{label:<36}{rate:10,.0f} msg/s  ({rate / rate_direct:.2f}x)")
    for label, values in (("NOTIFY", notify), (f"polling {args.poll}s", polling)):
        print(
            f"commit-to-confirm {label:>14}: p50 {percentile(values, 0.5):7.1f} ms  "
            f"p99 {percentile(values, 0.99):7.1f} ms  (n={len(values)}, mean "
            f"{statistics.fmean(values) * 1000:.1f} ms)"
        )
    print(f"one ordering key ({args.hot_key} rows):   {hot:10,.0f} rows/s")


if __name__ == "__main__":
    asyncio.run(main())
