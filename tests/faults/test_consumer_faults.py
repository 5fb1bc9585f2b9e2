"""Consumer-side faults: a consumer process SIGKILLed between effect and ack; poison messages."""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from reliable_mq import PublisherSettings, ReliablePublisher
from reliable_mq.delivery import Delivery
from reliable_mq.testing import LossOracle
from reliable_mq.topology import QueueTopology
from tests.faults.harness import (
    EffectSink,
    Scenario,
    Workload,
    connection,
    declare,
    delete,
    describe,
    drain_all,
    fault_consumer,
    new_queue,
    skipped_by_consumer,
    wait_for,
)
from tests.support.private_node import PrivateBroker

pytestmark = [pytest.mark.private_broker, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]


async def publish_all(url: str, oracle: LossOracle, queue: str, count: int, **kw: Any) -> Workload:
    """Publish ``count`` messages with confirms (no faults here); returns the workload."""
    async with ReliablePublisher(
        connection(url, "crash-publisher"),
        settings=PublisherSettings(max_in_flight=1000),
        registry=CollectorRegistry(),
    ) as publisher:
        work = Workload(publisher, oracle, queue, timeout=60, **kw)
        await work.stream(min_messages=count, max_messages=count)
        await work.settle()
    return work


async def spawn(config: dict[str, Any]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.faults.crash_worker", json.dumps(config), cwd=ROOT
    )


def read_text(path: str | Path) -> str:
    return Path(path).read_text()


def effect_counts(db: Path) -> dict[str, int]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT message_id, COUNT(*) FROM effects GROUP BY message_id")
        return dict(rows.fetchall())


class TestConsumerFaults:
    async def test_consumer_killed_between_effect_and_ack(
        self, fault_node: PrivateBroker, tmp_path: Path
    ) -> None:
        """SIGKILL a consumer whose effects are committed but not acked; a second one finishes.

        The broker redelivers every unacked delivery; the effects live in an
        SQLite file with the dedup marks, so no effect is applied twice.
        """
        url = fault_node.url
        oracle = LossOracle()
        scenario = Scenario("consumer crash", oracle)
        queue = new_queue("consumer-crash")
        topology = QueueTopology(queue=queue, retry_delays=(0.2,))
        await declare(url, topology)
        db = tmp_path / "effects.db"
        with sqlite3.connect(db) as conn:
            conn.execute("CREATE TABLE effects (message_id TEXT NOT NULL, pid INTEGER NOT NULL)")
        work = await publish_all(url, oracle, queue, 3000)
        assert len(work.confirmed) == 3000
        base: dict[str, Any] = {
            "url": url,
            "queue": queue,
            "db": str(db),
            "deliveries": str(tmp_path / "deliveries.txt"),
            "prefetch": 100,
            "lease": 3.0,
        }
        marker = tmp_path / "crashing"
        first = await spawn(
            {**base, "crash_after": 1000, "marker": str(marker), "stats": str(tmp_path / "a.json")}
        )
        try:
            assert await wait_for(marker.exists, 60), (
                "the first consumer never reached its crash point"
            )
            await asyncio.sleep(0.2)  # let its neighbours finish their effects, unacked
            first.send_signal(signal.SIGKILL)
            assert await first.wait() == -signal.SIGKILL
            scenario.faults += 1
            applied_at_crash = len(effect_counts(db))
            stats = tmp_path / "b.json"
            second = await spawn({**base, "stats": str(stats)})
            try:
                done = await wait_for(lambda: len(effect_counts(db)) >= 3000, 90)
            finally:
                second.send_signal(signal.SIGTERM)
                await asyncio.wait_for(second.wait(), 30)
        finally:
            if first.returncode is None:
                first.kill()
                await first.wait()
        assert done, f"only {len(effect_counts(db))} of 3000 effects"
        oracle.delivered_many(read_text(base["deliveries"]).split())
        for mid, count in effect_counts(db).items():
            for _ in range(count):
                oracle.applied(mid)
        await drain_all(url, topology, oracle)
        await delete(url, topology)
        second_stats = json.loads(read_text(stats))
        verdict = scenario.report(
            republished=work.publisher.stats().republished,
            max_in_flight=work.publisher.stats().max_in_flight_seen,
            max_unacked=second_stats["max_in_progress"],
            unresolved=work.unresolved,
            skipped_duplicates=second_stats.get("duplicates", 0),
        )
        assert verdict.ok, describe(verdict, work)
        assert 1000 <= applied_at_crash < 3000
        assert verdict.effects == 3000

    async def test_poison_messages_end_in_the_dlq(self, fault_node: PrivateBroker) -> None:
        """Poison messages among good ones: every good one applied once, every poison one
        dead-lettered after max_attempts, with its reason headers."""
        url = fault_node.url
        oracle = LossOracle()
        scenario = Scenario("poison messages", oracle)
        queue = new_queue("poison")
        topology = QueueTopology(queue=queue, retry_delays=(0.2,))
        await declare(url, topology)
        poison_ids = {f"m{i:07d}" for i in range(0, 3000, 50)}

        def is_poison(delivery: Delivery) -> bool:
            return delivery.body.startswith(b"poison")

        sink = EffectSink(oracle, poison=is_poison)
        consumer = fault_consumer(connection(url, "poison-consumer"), queue, sink, max_attempts=3)
        await consumer.start()
        try:
            async with ReliablePublisher(
                connection(url, "poison-publisher"), registry=CollectorRegistry()
            ) as publisher:
                work = Workload(
                    publisher,
                    oracle,
                    queue,
                    timeout=60,
                    body=lambda i: b"poison" if f"m{i:07d}" in poison_ids else b"good",
                )
                await work.stream(min_messages=3000, max_messages=3000)
                await work.settle()
            good = work.confirmed - poison_ids
            await wait_for(
                lambda: good <= sink.applied and consumer.stats().dead_lettered >= len(poison_ids),
                60,
            )
            await consumer.stop(grace=5)
        finally:
            await consumer.stop(grace=1)
        drained = await drain_all(url, topology, oracle)
        await delete(url, topology)
        stats = consumer.stats()
        scenario.faults = len(poison_ids)
        verdict = scenario.report(
            republished=stats.retried + stats.dead_lettered,
            max_in_flight=publisher.stats().max_in_flight_seen,
            max_unacked=max(sink.max_unacked, stats.max_in_progress),
            unresolved=work.unresolved,
            skipped_duplicates=skipped_by_consumer(stats),
        )
        assert verdict.ok, describe(verdict, work)
        assert good <= sink.applied
        assert not sink.applied & poison_ids
        dead = drained[topology.dead_letter_queue]
        assert {m.message_id for m in dead} == poison_ids
        for message in dead:
            assert message.headers["x-reliable-mq-reason"] == "max_attempts"
            assert message.headers["x-reliable-mq-attempts"] == 3
        assert not drained[queue], "the work queue still held messages"
