"""The outbox and inbox under real faults, judged by the loss oracle.

Each scenario ends with 0 lost (every committed order reaches service B),
0 phantom (no rolled-back order is ever published), 0 duplicate effects at the
inbox, and every ordering key's effects in commit order. PostgreSQL is a
private server of this module; the broker restart uses a private RabbitMQ node.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import psycopg
import pytest
from prometheus_client import CollectorRegistry

from reliable_mq import PublisherSettings, ReliableConsumer
from reliable_mq.outbox import OutboxRelay, RelaySettings, add
from reliable_mq.outbox.admin import create_schema, outbox_status
from reliable_mq.testing import TCPProxy
from tests.faults.harness import connection
from tests.outbox.scenario import OutboxSystem, kill, read_line, worker
from tests.support.amqp import drain_queue
from tests.support.private_postgres import PrivatePostgres

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]


@contextlib.asynccontextmanager
async def running_relay(
    system: OutboxSystem,
    url: str,
    *,
    dsn: str | None = None,
    batch_size: int = 50,
    batch_sizes: list[int] | None = None,
) -> AsyncIterator[OutboxRelay]:
    """An OutboxRelay running in this process until the block ends.

    ``batch_sizes`` gets the number of confirmed rows of each batch.
    """
    relay = OutboxRelay(
        dsn or system.dsn,
        connection(url, "outbox-relay"),
        settings=RelaySettings(
            batch_size=batch_size, poll_interval=0.2, publish_timeout=20, reconnect_delay_max=0.5
        ),
        publisher_settings=PublisherSettings(publish_timeout=20, max_attempts=1000),
        table=system.outbox,
        registry=CollectorRegistry(),
        on_dispatched=None if batch_sizes is None else lambda rows: batch_sizes.append(len(rows)),
    )
    async with relay:
        task = asyncio.ensure_future(relay.run())
        try:
            yield relay
        finally:
            relay.stop()
            await asyncio.wait_for(task, 30)


@contextlib.asynccontextmanager
async def running_consumer(
    system: OutboxSystem, url: str, *, dsn: str | None = None
) -> AsyncIterator[ReliableConsumer]:
    consumer, store = system.consumer(url, dsn=dsn)
    await consumer.start()
    try:
        yield consumer
    finally:
        await consumer.stop(grace=5)
        await store.close()


async def finish(system: OutboxSystem, url: str) -> None:
    """Every committed order applied; then the oracle's verdict must be clean."""
    applied = await system.wait_applied(timeout=90)
    verdict = await system.verdict(url)
    assert applied, f"not every committed order was applied: {verdict.describe()}"
    assert verdict.ok, verdict.describe()
    assert verdict.rolled_back == 0 or not verdict.phantoms


@pytest.fixture
async def system(pg: PrivatePostgres, broker_url: str, request: Any) -> AsyncIterator[OutboxSystem]:
    made = OutboxSystem(pg.dsn, broker_url, request.node.name[5:30])
    await made.setup()
    yield made
    await made.teardown()


class TestOutboxFaults:
    async def test_app_killed_right_after_commit(
        self, system: OutboxSystem, broker_url: str
    ) -> None:
        """Service A SIGKILLed mid-stream: every order it committed is published, nothing else."""
        async with running_consumer(system, broker_url), running_relay(system, broker_url):
            writer = system.writer_process(2000)
            try:
                for _ in range(150):
                    await read_line(writer, "committed ")
            finally:
                kill(writer)  # right after a commit; the next transaction dies open
            await system.write(60, start=5000)  # a rollback every 7th: phantoms must not appear
            await finish(system, broker_url)
        assert len(await system.committed()) >= 150 + 50

    async def test_relay_killed_between_publish_and_delete(
        self, system: OutboxSystem, broker_url: str
    ) -> None:
        """A relay SIGKILLed after its confirms, before its delete: republished, deduped, in order."""
        await system.write(200)
        async with running_consumer(system, broker_url) as consumer:
            relay = worker(
                "relay",
                {"dsn": system.dsn, "url": broker_url, "system": system.config(), "batch_size": 50},
            )
            try:
                line = await read_line(relay, "published ")
            finally:
                kill(relay)
            assert int(line.split()[1]) > 0
            async with running_relay(system, broker_url):
                await finish(system, broker_url)
            # The killed batch went out twice; the inbox dropped the second copies.
            assert consumer.stats().duplicates >= 1

    async def test_postgres_connection_cut(
        self, system: OutboxSystem, broker_url: str, pg: PrivatePostgres
    ) -> None:
        """The relay's database connections cut again and again mid-stream."""
        async with TCPProxy("127.0.0.1", pg.port) as proxy:
            relay_dsn = f"postgresql://postgres@127.0.0.1:{proxy.port}/postgres"
            async with (
                running_consumer(system, broker_url),
                running_relay(system, broker_url, dsn=relay_dsn, batch_size=20) as relay,
            ):
                writing = asyncio.ensure_future(system.write(400, keys=50, unkeyed_every=5))
                cuts = 0
                while not writing.done() or cuts < 4:
                    await asyncio.sleep(random.uniform(0.2, 0.5))
                    cuts += await proxy.cut() > 0
                    if cuts > 30:
                        break
                await writing
                await finish(system, broker_url)
                assert relay.stats().outages >= 1, relay.stats()

    async def test_two_relays_race(self, system: OutboxSystem, broker_url: str) -> None:
        """Two relays on one table: each row dispatched exactly once, order per key kept.

        50 keys and unkeyed rows, a backlog first and more written while they
        run, so both relays claim full batches of many keys at once.
        """
        await system.write(300, keys=50, unkeyed_every=5)
        sizes: list[int] = []
        async with running_consumer(system, broker_url) as consumer:
            async with running_relay(system, broker_url, batch_size=20, batch_sizes=sizes) as first:
                async with running_relay(
                    system, broker_url, batch_size=20, batch_sizes=sizes
                ) as second:
                    await system.write(300, start=300, keys=50, unkeyed_every=5)
                    await finish(system, broker_url)
                    stats = (first.stats(), second.stats())
        committed = len(await system.committed())
        dispatched = tuple(s.dispatched for s in stats)
        assert sum(dispatched) == committed, dispatched
        assert min(dispatched) > 0, f"one relay did all the work: {dispatched}"
        assert consumer.stats().duplicates == 0
        # Real batches: full ones, not the 4 rows a batch of 4 keys can hold.
        assert max(sizes) == 20 and sum(1 for n in sizes if n > 4) >= 5, sizes

    async def test_inbox_connection_cut(
        self, system: OutboxSystem, broker_url: str, pg: PrivatePostgres
    ) -> None:
        """Service B's inbox connections cut again and again mid-stream: each effect applied once.

        A cut can land mid-effect (rolled back, retried) or during the commit
        (outcome unknown: the retry finds the id done and skips it).
        """
        await system.write(100, keys=50, unkeyed_every=5)
        # Paced by progress, not by the clock: cut k waits until the inbox has acked
        # CUT_AT[k] events and then for a live inbox connection to cut (a cut that
        # finds none is tried again), and events keep coming until every cut is
        # done, so each one lands mid-stream however fast or slow the machine is.
        # (A cutter on a timer counted only the cuts that happened to find a
        # connection, and how many did was up to the schedule.)
        cut_at = (10, 40, 70, 100, 130, 160, 190, 220)
        cuts_done = asyncio.Event()

        async def keep_writing() -> None:  # events keep coming while the cuts go on
            for chunk in range(1, 200):
                if chunk > 10 and cuts_done.is_set():
                    return
                await system.write(30, start=100 * chunk, keys=50, unkeyed_every=5)
                await asyncio.sleep(0.2)

        async with TCPProxy("127.0.0.1", pg.port) as proxy:
            inbox_dsn = f"postgresql://postgres@127.0.0.1:{proxy.port}/postgres"
            async with (
                running_relay(system, broker_url, batch_size=50),
                running_consumer(system, broker_url, dsn=inbox_dsn) as consumer,
            ):
                cuts = 0

                async def cutter() -> None:
                    nonlocal cuts
                    for threshold in cut_at:
                        while consumer.stats().acked < threshold or not await proxy.cut():
                            await asyncio.sleep(0.02)
                        cuts += 1
                    cuts_done.set()

                writing = asyncio.ensure_future(keep_writing())
                try:
                    await asyncio.wait_for(cutter(), 120)
                finally:
                    cuts_done.set()
                await writing
                await finish(system, broker_url)
            connections = proxy.connections_total
        # Each cut dropped live inbox connections, so the store connected at least as often.
        assert cuts == len(cut_at) and connections >= cuts, (cuts, connections)

    async def test_consumer_killed_between_effect_and_ack(
        self, system: OutboxSystem, broker_url: str
    ) -> None:
        """Service B SIGKILLed after its effect committed, before the ack: applied once."""
        await system.write(150)
        async with running_relay(system, broker_url):
            config = {"dsn": system.dsn, "url": broker_url, "system": system.config()}
            victim = worker("consumer", config, env={"OUTBOX_TEST_PAUSE_AFTER_EFFECT": "o000050"})
            try:
                await read_line(victim, "applied o000050")
            finally:
                kill(victim)
            async with running_consumer(system, broker_url) as consumer:
                await finish(system, broker_url)
                assert consumer.stats().duplicates >= 1  # the redelivered o000050


@pytest.mark.private_broker
async def test_private_broker_restarted(pg: PrivatePostgres, private_broker: Any) -> None:
    """The broker node restarts mid-stream: relay and consumer recover; nothing lost or doubled."""
    url = private_broker.url
    system = OutboxSystem(pg.dsn, url, "broker-restart")
    await system.setup()
    try:
        async with running_consumer(system, url), running_relay(system, url, batch_size=20):
            writing = asyncio.ensure_future(system.write(300, rollback_every=5))
            while system.written < 100:
                await asyncio.sleep(0.05)
            await asyncio.to_thread(private_broker.restart)
            await writing
            await finish(system, url)
    finally:
        await system.teardown()


@pytest.mark.private_broker
async def test_broker_outage_burns_no_attempts(pg: PrivatePostgres, private_broker: Any) -> None:
    """The broker node is down for many retry rounds: nothing is dead-lettered, all goes out after.

    ``max_attempts=2`` and a fast retry schedule: had the outage counted, every
    row claimed during it would be dead within a second.
    """
    url = private_broker.url
    table, queue = f"outage_{uuid.uuid4().hex[:8]}", f"outage-{uuid.uuid4().hex[:8]}"
    await create_schema(pg.dsn, table=table)
    connection_ = await aio_pika.connect(url, timeout=10)
    async with connection_:
        await (await connection_.channel()).declare_queue(queue, durable=True)
    written: list[str] = []
    enough = asyncio.Event()
    registry = CollectorRegistry()

    async def writer() -> None:
        """Service A, all along: 10 keys and unkeyed rows."""
        async with await psycopg.AsyncConnection.connect(pg.dsn) as conn:
            for n in itertools.count():
                if enough.is_set():
                    return
                mid, key = f"w{n:05d}", f"k{n % 10}" if n % 3 else None
                async with conn.transaction():
                    await add(
                        conn, b"x", routing_key=queue, message_id=mid, ordering_key=key, table=table
                    )
                written.append(mid)
                await asyncio.sleep(0.01)

    relay = OutboxRelay(
        pg.dsn,
        connection(url, "outbox-outage"),
        settings=RelaySettings(
            batch_size=50,
            poll_interval=0.2,
            publish_timeout=1.0,
            max_attempts=2,
            retry_backoff_initial=0.05,
            retry_backoff_max=0.1,
            reconnect_delay_max=0.3,
        ),
        publisher_settings=PublisherSettings(unavailable_timeout=0.5, publish_timeout=1.0),
        table=table,
        registry=registry,
    )
    try:
        async with relay:
            running = asyncio.ensure_future(relay.run())
            writing = asyncio.ensure_future(writer())
            try:
                while relay.stats().dispatched < 50:
                    assert not running.done() and not writing.done()
                    await asyncio.sleep(0.05)
                await asyncio.to_thread(private_broker.stop)
                await asyncio.sleep(6)  # many claim rounds against a dead broker
                during = relay.stats()
                assert during.dead == 0 and during.broker_outages >= 3, during
                assert during.deferred > 0, during
                await asyncio.to_thread(private_broker.start)
                await asyncio.sleep(1)
                enough.set()
                await writing
                status = await outbox_status(pg.dsn, table=table)
                deadline = time.monotonic() + 60
                while status.pending or status.dead:
                    assert status.dead == 0, status
                    assert time.monotonic() < deadline, (status, relay.stats())
                    await asyncio.sleep(0.2)
                    status = await outbox_status(pg.dsn, table=table)
            finally:
                enough.set()
                await asyncio.gather(writing, return_exceptions=True)
                relay.stop()
                await asyncio.wait_for(running, 30)
            stats = relay.stats()
        assert stats.dead == 0 and stats.retried == 0, stats
        failed = "reliable_mq_outbox_failed_rows_total"
        for outcome, count in (("deferred", stats.deferred), ("retry", 0), ("dead", 0)):
            assert registry.get_sample_value(failed, {"table": table, "outcome": outcome}) == count
        drained = await drain_queue(url, queue, idle_timeout=1.0)
        assert {m.message_id for m in drained} == set(written)
    finally:
        if not private_broker.is_running():
            await asyncio.to_thread(private_broker.start)
        async with await psycopg.AsyncConnection.connect(pg.dsn, autocommit=True) as conn:
            await conn.execute(f"DROP TABLE IF EXISTS {table}")
