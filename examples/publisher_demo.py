"""Demo: publish through a connection that is cut twice, and lose nothing.

Publishes 5,000 persistent messages with confirms through a TCP proxy, cuts
every connection twice mid-stream, then drains the queue and checks that each
``message_id`` is there: once, or more than once where a republish after a
cut duplicated a message the broker had already taken.

    python examples/publisher_demo.py [--messages 5000] [--url amqp://guest:guest@127.0.0.1:5672/]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
import uuid
from collections import Counter

import aio_pika
from yarl import URL

from reliable_mq import (
    ConnectionSettings,
    PublisherSettings,
    ReliablePublisher,
    configure_logging,
    redact_url,
)
from reliable_mq.testing import TCPProxy


async def drain(url: str, queue: str) -> Counter[str]:
    """Count every message in ``queue`` by message_id, acking as we go."""
    seen: Counter[str] = Counter()
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=500)
        declared = await channel.declare_queue(queue, durable=True, passive=True)
        async with declared.iterator() as messages:
            try:
                while True:
                    message = await asyncio.wait_for(messages.__anext__(), timeout=1.0)
                    seen[message.message_id or "?"] += 1
                    await message.ack()
            except (TimeoutError, StopAsyncIteration):
                pass
    return seen


async def main() -> int:
    parser = argparse.ArgumentParser(description="reliable_mq publisher demo")
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/")
    args = parser.parse_args()
    configure_logging(level="WARNING")
    # aiormq logs each cut with a full traceback; our own connection_lost line says it
    logging.getLogger("aiormq").setLevel(logging.CRITICAL)
    broker = URL(args.url)
    queue = f"reliable_mq_demo_{uuid.uuid4().hex[:8]}"

    setup = await aio_pika.connect(args.url)
    channel = await setup.channel()
    declared = await channel.declare_queue(queue, durable=True)
    print(f"broker {redact_url(broker)}, queue {queue}, {args.messages} messages")

    started = time.perf_counter()
    async with TCPProxy(broker.host or "127.0.0.1", broker.port or 5672) as proxy:
        proxied = broker.with_host("127.0.0.1").with_port(proxy.port)
        settings = ConnectionSettings(
            url=str(proxied),  # type: ignore[arg-type]
            connection_name="reliable_mq-demo",
            reconnect_initial_delay=0.05,
        )
        publisher = ReliablePublisher(settings, settings=PublisherSettings(max_in_flight=500))
        async with publisher:
            ids = [f"demo-{i}" for i in range(args.messages)]
            tasks = [
                asyncio.ensure_future(
                    publisher.publish({"n": i}, routing_key=queue, message_id=mid)
                )
                for i, mid in enumerate(ids)
            ]
            for fraction in (0.3, 0.7):
                while publisher.stats().confirmed < args.messages * fraction:
                    await asyncio.sleep(0.005)
                cut = await proxy.cut()
                print(f"  cut {cut} connection(s) at {publisher.stats().confirmed} confirmed")
            results = await asyncio.gather(*tasks, return_exceptions=True)
            stats = publisher.stats()
    seconds = time.perf_counter() - started
    failures = [r for r in results if isinstance(r, BaseException)]

    seen = await drain(args.url, queue)
    await declared.delete(if_unused=False, if_empty=False)
    await setup.close()

    missing = [mid for mid in ids if seen[mid] == 0]
    unexpected = [mid for mid in seen if mid not in set(ids)]
    duplicated = {mid: n for mid, n in seen.items() if n > 1}
    print(f"published   {stats.published}")
    print(f"confirmed   {stats.confirmed}")
    print(f"republished {stats.republished} (after {stats.channel_generation - 1} channel losses)")
    print(f"failed      {len(failures)}")
    print(f"in queue    {sum(seen.values())} messages, {len(seen)} distinct ids")
    if duplicated:
        extra = sum(n - 1 for n in duplicated.values())
        print(f"duplicates  {len(duplicated)} ids held more than once ({extra} extra copies):")
        print("            republished after a cut; consumers de-duplicate by message_id")
    else:
        print("duplicates  none: every message is in the queue exactly once")
    print(f"missing     {len(missing)}")
    print(f"unexpected  {len(unexpected)}")
    print(f"took        {seconds:.1f}s")
    ok = not missing and not unexpected and not failures
    print("OK: nothing lost" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
