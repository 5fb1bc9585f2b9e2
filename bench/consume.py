"""Consume throughput: raw aio-pika against ReliableConsumer, in one run.

For each mode a durable queue is pre-filled with persistent messages (not
timed), then drained; the rate is measured from the first delivery to the last
one handled (and, with manual acks, acked). Ratios are against raw aio-pika
with one ack per message, the way most consumers are written, and, for the
de-duplication rows, against reliable_mq with de-duplication off.

De-duplication rows: the default in-memory store, an SQLite file (in a
temporary directory) and Redis (``RELIABLE_MQ_BENCH_REDIS``, default
``redis://127.0.0.1:6379/0``; the row is skipped when Redis does not answer).
Every message has its own id, so these rows measure the claim + complete cost
per message, not skipping.

    .venv/bin/python bench/consume.py                 # 20,000 messages per mode
    .venv/bin/python bench/consume.py --messages 5000 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, cast

import aio_pika
import aiormq
from aio_pika.abc import AbstractIncomingMessage
from pamqp.commands import Basic
from prometheus_client import CollectorRegistry

from reliable_mq.consumer import ReliableConsumer
from reliable_mq.dedup import DedupStore, SQLiteDedupStore
from reliable_mq.topology import QueueTopology, declare_topology, delete_topology

URL = os.environ.get("RELIABLE_MQ_BENCH_URL", "amqp://guest:guest@127.0.0.1:5672/")
REDIS_URL = os.environ.get("RELIABLE_MQ_BENCH_REDIS", "redis://127.0.0.1:6379/0")


LAST_CPU: list[float] = []  # client CPU microseconds per message, per measurement


class Clock:
    """First-to-last delivery timing."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.count = 0
        self.first = 0.0
        self.last = 0.0
        self.cpu_first = self.cpu_last = 0.0
        self.done = asyncio.Event()

    def tick(self) -> None:
        now = time.perf_counter()
        if not self.count:
            self.first = now
            self.cpu_first = time.process_time()
        self.count += 1
        if self.count >= self.expected:
            self.last = now
            self.cpu_last = time.process_time()
            self.done.set()

    def rate(self) -> float:
        LAST_CPU.append(1e6 * (self.cpu_last - self.cpu_first) / max(self.count - 1, 1))
        return (self.count - 1) / (self.last - self.first)


async def prefill(queue: str, count: int, size: int, arguments: dict[str, Any]) -> None:
    connection = await aio_pika.connect(URL)
    try:
        channel = await connection.channel(publisher_confirms=True)
        await channel.declare_queue(queue, durable=True, arguments=arguments)
        raw = cast(aiormq.Channel, await channel.get_underlay_channel())
        body = os.urandom(size // 2).hex().encode()[:size]
        props = Basic.Properties(delivery_mode=2, content_type="application/octet-stream")
        for start in range(0, count, 1000):
            await asyncio.gather(
                *(
                    raw.basic_publish(
                        body,
                        routing_key=queue,
                        properties=Basic.Properties(
                            delivery_mode=props.delivery_mode,
                            content_type=props.content_type,
                            message_id=f"m{start + i}",
                        ),
                    )
                    for i in range(min(1000, count - start))
                )
            )
    finally:
        await connection.close()


async def raw_manual(queue: str, count: int, prefetch: int) -> float:
    clock = Clock(count)
    connection = await aio_pika.connect(URL)
    try:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=prefetch)
        amqp_queue = await channel.get_queue(queue)

        async def on_message(message: AbstractIncomingMessage) -> None:
            await message.ack()
            clock.tick()

        await amqp_queue.consume(on_message)
        await clock.done.wait()
    finally:
        await connection.close()
    return clock.rate()


async def raw_auto(queue: str, count: int, prefetch: int) -> float:
    clock = Clock(count)
    connection = await aio_pika.connect(URL)
    try:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=prefetch)
        amqp_queue = await channel.get_queue(queue)

        async def on_message(message: AbstractIncomingMessage) -> None:
            clock.tick()

        await amqp_queue.consume(on_message, no_ack=True)
        await clock.done.wait()
    finally:
        await connection.close()
    return clock.rate()


async def raw_multiple(queue: str, count: int, prefetch: int) -> float:
    """Reference ceiling: ack(multiple=True) every 50th delivery, no per-message work."""
    clock = Clock(count)
    connection = await aio_pika.connect(URL)
    try:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=prefetch)
        amqp_queue = await channel.get_queue(queue)
        seen = 0

        async def on_message(message: AbstractIncomingMessage) -> None:
            nonlocal seen
            seen += 1
            if seen % 50 == 0 or seen == count:
                await message.ack(multiple=True)
            clock.tick()

        await amqp_queue.consume(on_message)
        await clock.done.wait()
    finally:
        await connection.close()
    return clock.rate()


class Unavailable(Exception):
    """A mode's dependency (Redis) is not there: skip the mode."""


async def make_store(kind: str, tmp: str) -> DedupStore | str | None:
    if kind == "off":
        return None
    if kind == "memory":
        return "memory"
    if kind == "sqlite":
        return SQLiteDedupStore(os.path.join(tmp, f"dedup-{uuid.uuid4().hex[:8]}.db"))
    try:
        from reliable_mq.dedup.redis import RedisDedupStore  # noqa: PLC0415 (optional extra)
    except ImportError as exc:
        raise Unavailable(str(exc)) from None
    store = RedisDedupStore(REDIS_URL, prefix=f"reliable_mq:bench:{uuid.uuid4().hex}:")
    try:
        await store.claim("ping", owner="bench", lease=1)
        await store.release("ping", owner="bench")
    except Exception as exc:
        await store.close()
        raise Unavailable(f"Redis at {REDIS_URL}: {exc}") from None
    return store


def reliable(batch_ack: bool, dedup: str = "off") -> Callable[[str, int, int], Awaitable[float]]:
    async def run(queue: str, count: int, prefetch: int) -> float:
        clock = Clock(count)
        with tempfile.TemporaryDirectory() as tmp:
            store = await make_store(dedup, tmp)
            consumer = ReliableConsumer(
                URL,
                prefetch=prefetch,
                batch_ack=batch_ack,
                registry=CollectorRegistry(),
                dedup=store,  # type: ignore[arg-type]
            )

            @consumer.handler(queue)
            async def handler(body: bytes) -> None:
                clock.tick()

            try:
                async with consumer:
                    await clock.done.wait()
            finally:
                if store is not None and not isinstance(store, str):
                    await store.close()
        return clock.rate()

    return run


MODES: dict[str, tuple[Callable[[str, int, int], Awaitable[float]], bool]] = {
    # name: (runner, uses the reliable_mq topology)
    "aio-pika manual ack (per message)": (raw_manual, False),
    "aio-pika auto-ack (no_ack=True)": (raw_auto, False),
    "aio-pika multiple ack every 50 (ref)": (raw_multiple, False),
    "reliable_mq batched acks, no dedup": (reliable(True), True),
    "reliable_mq per-message acks, no dedup": (reliable(False), True),
    "reliable_mq batched, dedup memory": (reliable(True, "memory"), True),
    "reliable_mq batched, dedup SQLite": (reliable(True, "sqlite"), True),
    "reliable_mq batched, dedup Redis": (reliable(True, "redis"), True),
}
BASELINE = "aio-pika manual ack (per message)"
NO_DEDUP = "reliable_mq batched acks, no dedup"


async def measure(name: str, count: int, prefetch: int, size: int) -> float:
    runner, managed = MODES[name]
    queue = f"bench-consume-{uuid.uuid4().hex[:8]}"
    topology = QueueTopology(queue)
    arguments: dict[str, Any] = dict(topology.work_queue_arguments()) if managed else {}
    if managed:
        connection = await aio_pika.connect(URL)
        await declare_topology(await connection.channel(), topology)
        await connection.close()
    await prefill(queue, count, size, arguments)
    try:
        return await runner(queue, count, prefetch)
    finally:
        connection = await aio_pika.connect(URL)
        channel = await connection.channel()
        if managed:
            await delete_topology(channel, topology)
        else:
            await channel.queue_delete(queue)
        await connection.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--prefetch", type=int, default=200)
    parser.add_argument("--size", type=int, default=256, help="body bytes")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds (median)")
    args = parser.parse_args()

    rates: dict[str, list[float]] = {name: [] for name in MODES}
    cpu: dict[str, list[float]] = {name: [] for name in MODES}
    skipped: dict[str, str] = {}
    load_before = os.getloadavg()
    for round_no in range(args.rounds):
        for name in MODES:
            if name in skipped:
                continue
            try:
                rate = await measure(name, args.messages, args.prefetch, args.size)
            except Unavailable as exc:
                skipped[name] = str(exc)
                print(f"skipped {name}: {exc}", flush=True)
                continue
            rates[name].append(rate)
            cpu[name].append(LAST_CPU[-1])
            print(
                f"round {round_no + 1}: {name:<36} {rate:>9,.0f} msgs/s "
                f"{LAST_CPU[-1]:>6.0f} us CPU/msg",
                flush=True,
            )

    base = statistics.median(rates[BASELINE])
    auto = statistics.median(rates["aio-pika auto-ack (no_ack=True)"])
    plain = statistics.median(rates[NO_DEDUP])
    plain_cpu = statistics.median(cpu[NO_DEDUP])
    load_after = os.getloadavg()
    print()
    print(
        f"{args.messages:,} persistent {args.size}-byte messages per mode, prefetch "
        f"{args.prefetch}, median of {args.rounds} round(s); load average "
        f"{load_before[0]:.2f} before, {load_after[0]:.2f} after ({os.cpu_count()} CPUs)"
    )
    print("(CPU: this process's CPU time per message while draining; steadier than msgs/s")
    print(" when other processes share the machine; 'vs no dedup' compares with the")
    print(f" {NO_DEDUP!r} row: rate, then CPU per message)")
    width = max(len(name) for name in MODES)
    print(
        f"{'mode':<{width}} {'msgs/s':>9} {'vs manual':>10} {'vs auto':>8} {'CPU us/msg':>11} "
        f"{'vs no dedup':>12} {'CPU vs no dedup':>16}"
    )
    for name, values in rates.items():
        if not values:
            print(f"{name:<{width}} skipped: {skipped.get(name, 'no data')}")
            continue
        rate = statistics.median(values)
        used = statistics.median(cpu[name])
        extra = ""
        if "dedup" in name and "per-message" not in name:
            extra = f" {rate / plain:>11.2f}x {used / plain_cpu:>15.2f}x"
        print(
            f"{name:<{width}} {rate:>9,.0f} {rate / base:>9.2f}x {rate / auto:>7.2f}x "
            f"{used:>11.0f}{extra}"
        )


if __name__ == "__main__":
    asyncio.run(main())
