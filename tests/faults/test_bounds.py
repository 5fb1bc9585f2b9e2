"""Bounds under load (slow tier): the window, prefetch, memory and tasks stay bounded.

The publisher half on the shared broker is in ``tests/publish/test_publisher_bounds.py``;
here publisher and consumer run together against the private node. Outcomes
are kept in bytearrays while memory is measured, so the oracle's own sets do
not count as growth; they are fed to the oracle afterwards.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from reliable_mq import (
    ConsumerSettings,
    PublishError,
    PublisherSettings,
    ReliableConsumer,
    ReliablePublisher,
)
from reliable_mq.delivery import Delivery
from reliable_mq.testing import LossOracle, TCPProxy
from reliable_mq.topology import QueueTopology
from tests.faults.harness import (
    LIBRARY_DEDUP,
    Scenario,
    connection,
    declare,
    delete,
    describe,
    drain_all,
    new_queue,
    unacked_probe,
    wait_for,
)
from tests.support.private_node import PrivateBroker
from tests.support.proc import rss_bytes

pytestmark = [pytest.mark.private_broker, pytest.mark.slow, pytest.mark.timeout(600)]

WINDOW = 1000
PREFETCH = 100


class Ledger:
    """Outcomes by message index, in bytearrays (flat memory), fed to the oracle at the end."""

    def __init__(self, prefix: str, size: int) -> None:
        self.prefix = prefix
        self.size = size
        self.outcome = bytearray(size)  # 0 pending, 1 confirmed, 2 failed
        self.delivered = bytearray(size)  # deliveries to the handler (capped at 255)
        self.effects = bytearray(size)
        self.max_unacked = 0

    def mid(self, index: int) -> str:
        return f"{self.prefix}{index:07d}"

    def index(self, mid: str) -> int:
        return int(mid[len(self.prefix) :])

    def applied_all(self) -> bool:
        return all(self.effects[i] for i in range(self.size) if self.outcome[i] == 1)

    def feed(self, oracle: LossOracle) -> None:
        for i in range(self.size):
            mid = self.mid(i)
            oracle.attempted(mid)
            if self.outcome[i] == 1:
                oracle.confirmed(mid)
            elif self.outcome[i] == 2:
                oracle.failed(mid)
            for _ in range(self.delivered[i]):
                oracle.delivered(mid)
            for _ in range(self.effects[i]):
                oracle.applied(mid)


async def publish_range(
    publisher: ReliablePublisher, ledger: Ledger, queue: str, indexes: range, *, workers: int
) -> None:
    """``workers`` concurrent publishers (one window's worth) over ``indexes``."""
    body = b"x" * 256
    feed = iter(indexes)

    async def worker() -> None:
        for i in feed:
            try:
                await publisher.publish(
                    body, routing_key=queue, message_id=ledger.mid(i), timeout=60
                )
            except PublishError:
                ledger.outcome[i] = 2
            else:
                ledger.outcome[i] = 1

    await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(workers))), 300)


def bounded_consumer(
    conn: Any, queue: str, ledger: Ledger, *, batch: bool = False
) -> ReliableConsumer:
    """A consumer whose effect is idempotent by construction (a byte per id); ``batch``:
    a batch handler of up to 50 deliveries."""
    extra: dict[str, Any] = {"dedup": None} if LIBRARY_DEDUP else {}
    consumer = ReliableConsumer(
        conn,
        settings=ConsumerSettings(prefetch=PREFETCH, retry_delays=(0.2,), max_attempts=1000),
        registry=CollectorRegistry(),
        **extra,
    )
    probe = unacked_probe(consumer, queue)

    async def handle(delivery: Delivery) -> None:
        i = ledger.index(delivery.message_id)
        ledger.delivered[i] = min(255, ledger.delivered[i] + 1)
        ledger.max_unacked = max(ledger.max_unacked, probe())
        if not ledger.effects[i]:
            ledger.effects[i] = 1

    async def handle_many(deliveries: list[Delivery]) -> None:
        for delivery in deliveries:
            await handle(delivery)

    if batch:
        consumer.add_batch_handler(queue, handle_many, max_size=PREFETCH // 2)
    else:
        consumer.add_handler(queue, handle)
    return consumer


class TestBounds:
    @pytest.mark.parametrize("form", ["single", "batch"])
    async def test_100k_messages_window_prefetch_and_memory(
        self, fault_node: PrivateBroker, form: str
    ) -> None:
        """100,000 messages, window 1,000, prefetch 100: bounds hold, RSS grows < 50 MB,
        with a single handler and with a batch handler."""
        url = fault_node.url
        oracle = LossOracle()
        scenario = Scenario("bounds 100k" if form == "single" else "bounds 100k batch", oracle)
        queue = new_queue("bounds")
        topology = QueueTopology(queue=queue, retry_delays=(0.2,))
        await declare(url, topology)
        total = 100_000
        warm = Ledger("w", 5000)
        ledger = Ledger("b", total)
        consumer = bounded_consumer(
            connection(url, "bounds-consumer"), queue, warm, batch=form == "batch"
        )
        publisher = ReliablePublisher(
            connection(url, "bounds-publisher"),
            settings=PublisherSettings(max_in_flight=WINDOW),
            registry=CollectorRegistry(),
        )
        await consumer.start()
        await publisher.start()
        try:
            await publish_range(publisher, warm, queue, range(warm.size), workers=WINDOW)
            assert await wait_for(warm.applied_all, 60)
            # Same handler, the big ledger from now on.
            consumer_ledger = warm
            consumer_ledger.__dict__.update(
                prefix=ledger.prefix,
                size=ledger.size,
                outcome=ledger.outcome,
                delivered=ledger.delivered,
                effects=ledger.effects,
            )
            ledger = consumer_ledger
            gc.collect()
            baseline = peak = rss_bytes()

            async def sample() -> None:
                nonlocal peak
                while True:
                    await asyncio.sleep(0.5)
                    peak = max(peak, rss_bytes())
                    assert publisher.in_flight <= WINDOW

            sampler = asyncio.ensure_future(sample())
            try:
                await publish_range(publisher, ledger, queue, range(total), workers=WINDOW)
                assert await wait_for(ledger.applied_all, 120), "effects missing"
            finally:
                sampler.cancel()
            peak = max(peak, rss_bytes())
            pub_stats = publisher.stats()
            await publisher.close()
            await consumer.stop(grace=5)
        finally:
            await publisher.close(timeout=1)
            await consumer.stop(grace=1)
        con_stats = consumer.stats()
        ledger.feed(oracle)
        await drain_all(url, topology, oracle)
        await delete(url, topology)
        growth = peak - baseline
        verdict = scenario.report(
            republished=pub_stats.republished,
            max_in_flight=pub_stats.max_in_flight_seen,
            max_unacked=max(ledger.max_unacked, con_stats.max_in_progress),
            messages=total,
            note=f"rss_growth_mb={growth / 1e6:.1f}",
        )
        assert verdict.ok, describe(verdict)
        assert verdict.confirmed == total
        assert pub_stats.max_in_flight_seen <= WINDOW
        assert ledger.max_unacked <= PREFETCH
        assert con_stats.max_in_progress <= PREFETCH
        assert growth < 50 * 1024 * 1024, f"RSS grew by {growth / 1e6:.1f} MB"

    async def test_fifty_reconnects_leave_no_tasks_behind(self, fault_node: PrivateBroker) -> None:
        """50 cuts of publisher and consumer links: all recovered, no asyncio task growth."""
        url = fault_node.url
        oracle = LossOracle()
        scenario = Scenario("50 reconnects", oracle)
        queue = new_queue("reconnects")
        topology = QueueTopology(queue=queue, retry_delays=(0.2,))
        await declare(url, topology)
        rounds, per_round = 50, 200
        ledger = Ledger("r", (rounds + 1) * per_round)
        async with (
            TCPProxy("127.0.0.1", fault_node.amqp_port) as pub_proxy,
            TCPProxy("127.0.0.1", fault_node.amqp_port) as con_proxy,
        ):
            consumer = bounded_consumer(
                connection(f"amqp://guest:guest@127.0.0.1:{con_proxy.port}/", "rc-consumer"),
                queue,
                ledger,
            )
            publisher = ReliablePublisher(
                connection(f"amqp://guest:guest@127.0.0.1:{pub_proxy.port}/", "rc-publisher"),
                settings=PublisherSettings(max_in_flight=WINDOW),
                registry=CollectorRegistry(),
            )
            await consumer.start()
            await publisher.start()
            try:
                chunks = itertools.count()
                first = next(chunks)
                await publish_range(publisher, ledger, queue, range(first, per_round), workers=50)
                await asyncio.sleep(0.5)
                gc.collect()
                tasks_before = len(asyncio.all_tasks())
                for n in range(1, rounds + 1):
                    batch = asyncio.ensure_future(
                        publish_range(
                            publisher,
                            ledger,
                            queue,
                            range(n * per_round, (n + 1) * per_round),
                            workers=50,
                        )
                    )
                    await asyncio.sleep(0.02)
                    gen = publisher.stats().channel_generation
                    reopens = consumer.stats().channel_reopens
                    await pub_proxy.cut()
                    await con_proxy.cut()
                    scenario.faults += 1
                    await batch
                    assert await wait_for(
                        lambda g=gen: publisher.stats().channel_generation > g, 10
                    )
                    assert await wait_for(
                        lambda r=reopens: (
                            consumer.stats().channel_reopens > r and consumer.consuming
                        ),
                        10,
                    )
                assert await wait_for(ledger.applied_all, 60), "effects missing"
                tasks_after = len(asyncio.all_tasks())
                for _ in range(100):  # background closers of dead channels finish late
                    gc.collect()
                    tasks_after = len(asyncio.all_tasks())
                    if tasks_after <= tasks_before:
                        break
                    await asyncio.sleep(0.05)
                leftover = sorted(t.get_name() for t in asyncio.all_tasks())
                pub_stats = publisher.stats()
                await publisher.close()
                await consumer.stop(grace=5)
            finally:
                await publisher.close(timeout=1)
                await consumer.stop(grace=1)
        con_stats = consumer.stats()
        ledger.feed(oracle)
        await drain_all(url, topology, oracle)
        await delete(url, topology)
        verdict = scenario.report(
            republished=pub_stats.republished,
            max_in_flight=pub_stats.max_in_flight_seen,
            max_unacked=max(ledger.max_unacked, con_stats.max_in_progress),
            note=f"tasks_before={tasks_before} tasks_after={tasks_after}",
        )
        assert verdict.ok, describe(verdict)
        assert pub_stats.channel_generation >= rounds + 1
        assert con_stats.channel_reopens >= rounds
        assert tasks_after <= tasks_before, f"tasks grew {tasks_before}->{tasks_after}: {leftover}"
