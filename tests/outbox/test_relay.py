"""OutboxRelay against a private PostgreSQL (and SQLite) and the shared broker."""

from __future__ import annotations

import asyncio
import contextlib
import re
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aio_pika
import psycopg
import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from reliable_mq import PublisherSettings
from reliable_mq.cli import main
from reliable_mq.errors import (
    ClosedError,
    PublishAborted,
    PublishGaveUp,
    PublishOutcomeUnknown,
    PublishTimeout,
    PublishUnavailable,
    ReliableMQError,
)
from reliable_mq.outbox import (
    OutboxError,
    OutboxRelay,
    OutboxRow,
    OutboxUnavailable,
    RelaySettings,
    RowOutcome,
    add,
    add_sync,
    schema_sql,
)
from reliable_mq.outbox._backend import RowResult
from reliable_mq.outbox._postgres import PostgresBackend
from reliable_mq.outbox.admin import create_schema, dead_rows, outbox_status, requeue_dead
from reliable_mq.testing import TCPProxy
from tests.support import pika_client
from tests.support.amqp import drain_queue
from tests.support.private_postgres import PrivatePostgres

pytestmark = pytest.mark.rabbitmq

SECRET = "s3cret-Pw-xyzzy"


@pytest.fixture
async def table(pg: PrivatePostgres) -> AsyncIterator[str]:
    name = f"outbox_{uuid.uuid4().hex[:8]}"
    await create_schema(pg.dsn, table=name)
    yield name
    async with await psycopg.AsyncConnection.connect(pg.dsn, autocommit=True) as conn:
        await conn.execute(f"DROP TABLE {name}")


async def write(dsn: str, table: str, events: list[dict[str, Any]]) -> None:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        for event in events:
            options = dict(event)
            body = options.pop("body", b"x")
            await add(conn, body, table=table, **options)
        await conn.commit()


def relay_for(
    dsn: str, url: str, table: str, registry: CollectorRegistry | None = None, **settings: Any
) -> OutboxRelay:
    publisher_settings = settings.pop("publisher_settings", None)
    return OutboxRelay(
        dsn,
        url,
        settings=RelaySettings(**{"poll_interval": 0.2, **settings}),
        publisher_settings=publisher_settings,
        table=table,
        registry=registry or CollectorRegistry(),
    )


async def drain_all(relay: OutboxRelay) -> None:
    while await relay.run_once():
        pass


class TestDispatch:
    async def test_rows_are_published_with_their_properties_then_deleted(
        self, pg: PrivatePostgres, table: str, broker_url: str, queue: str
    ) -> None:
        await write(
            pg.dsn,
            table,
            [
                {
                    "body": {"n": n},
                    "routing_key": queue,
                    "message_id": f"m{n}",
                    "headers": {"tenant": "t1", "n": n},
                    "correlation_id": "c1",
                    "message_type": "order.created",
                }
                for n in range(5)
            ],
        )
        registry = CollectorRegistry()
        async with relay_for(pg.dsn, broker_url, table, registry) as relay:
            await drain_all(relay)
            assert relay.stats().dispatched == 5
        drained = await drain_queue(broker_url, queue, settled=True)
        assert [m.message_id for m in drained] == [f"m{n}" for n in range(5)]
        assert drained[0].headers == {"tenant": "t1", "n": 0}
        assert (await outbox_status(pg.dsn, table=table)).pending == 0
        assert await _rows(pg.dsn, table) == 0  # deleted, not kept
        value = registry.get_sample_value(
            "reliable_mq_outbox_dispatched_rows_total", {"table": table}
        )
        assert value == 5

    async def test_every_property_add_takes_reaches_the_message(
        self, pg: PrivatePostgres, table: str, broker_url: str, queue: str
    ) -> None:
        """content_encoding and user_id (issue 19) and an empty content type, kept empty,
        as another client (pika) reads them."""
        await write(
            pg.dsn,
            table,
            [
                {
                    "body": b"x",
                    "routing_key": queue,
                    "message_id": "m1",
                    "content_type": "",
                    "content_encoding": "gzip",
                    "correlation_id": "",
                    "message_type": "order.created",
                    "user_id": "guest",
                }
            ],
        )
        async with relay_for(pg.dsn, broker_url, table) as relay:
            await drain_all(relay)
        (message,) = await asyncio.to_thread(pika_client.get_all, broker_url, queue)
        got = message.properties
        assert (got["message_id"], got["content_type"], got["content_encoding"]) == (
            "m1",
            "",
            "gzip",
        )
        assert (got["correlation_id"], got["message_type"], got["user_id"]) == (
            "",
            "order.created",
            "guest",
        )

    async def test_poison_rows_go_dead_and_never_block_their_key(
        self, pg: PrivatePostgres, table: str, broker_url: str, queue: str
    ) -> None:
        """Unroutable, too large and refused rows are dead with a reason; the key goes on."""
        await write(
            pg.dsn,
            table,
            [
                {"routing_key": f"nobody-{queue}", "message_id": "unroutable", "ordering_key": "K"},
                {
                    "body": b"x" * 5000,
                    "routing_key": queue,
                    "message_id": "large",
                    "ordering_key": "K",
                },
                {
                    "routing_key": queue,
                    "exchange": f"missing-{queue}",
                    "message_id": "refused",
                    "ordering_key": "K",
                },
                {"routing_key": queue, "message_id": "after", "ordering_key": "K"},
            ],
        )
        registry = CollectorRegistry()
        async with relay_for(
            pg.dsn,
            broker_url,
            table,
            registry,
            publisher_settings=PublisherSettings(max_message_size=1000),
        ) as relay:
            await drain_all(relay)
            assert relay.stats().dead == 3
        reasons = {row.message_id: row.last_error for row in await dead_rows(pg.dsn, table=table)}
        assert reasons["unroutable"].startswith("PublishUnroutable")
        assert reasons["large"].startswith("MessageTooLarge")
        assert reasons["refused"].startswith(("ExchangeNotFound", "PublishRefused"))
        drained = await drain_queue(broker_url, queue, settled=True)
        assert [m.message_id for m in drained] == ["after"]
        dead = registry.get_sample_value(
            "reliable_mq_outbox_failed_rows_total", {"table": table, "outcome": "dead"}
        )
        assert dead == 3
        # Requeued after the cause is fixed (here: nothing fixed, they die again).
        assert await requeue_dead(pg.dsn, table=table, ids=[]) == 0
        assert await requeue_dead(pg.dsn, table=table) == 3
        assert (await outbox_status(pg.dsn, table=table)).pending == 3

    async def test_one_row_per_key_per_batch_in_order(
        self, pg: PrivatePostgres, table: str, broker_url: str, queue: str
    ) -> None:
        """A key's rows go one per batch, in id order; unkeyed rows go together."""
        events = [
            {"routing_key": queue, "message_id": f"{key}{n}", "ordering_key": key}
            for n in range(3)
            for key in ("a", "b")
        ] + [{"routing_key": queue, "message_id": f"free{n}"} for n in range(4)]
        await write(pg.dsn, table, events)
        async with relay_for(pg.dsn, broker_url, table) as relay:
            sizes = []
            while handled := await relay.run_once():
                sizes.append(handled)
        assert sizes == [6, 2, 2]
        drained = [m.message_id for m in await drain_queue(broker_url, queue, settled=True)]
        for key in ("a", "b"):
            assert [m for m in drained if m and m.startswith(key)] == [
                f"{key}{n}" for n in range(3)
            ]

    async def test_notify_wakes_the_relay_long_before_the_poll(
        self, pg: PrivatePostgres, table: str, broker_url: str, queue: str
    ) -> None:
        async with relay_for(pg.dsn, broker_url, table, poll_interval=60) as relay:
            running = asyncio.ensure_future(relay.run())
            try:
                await asyncio.sleep(0.3)  # idle, waiting
                started = time.monotonic()
                await write(pg.dsn, table, [{"routing_key": queue, "message_id": "wake"}])
                while relay.stats().dispatched < 1:
                    assert time.monotonic() - started < 20, "NOTIFY did not wake the relay"
                    await asyncio.sleep(0.02)
            finally:
                relay.stop()
                await asyncio.wait_for(running, 10)

    async def test_a_dropped_listen_connection_falls_back_to_polling_then_listens_again(
        self, pg: PrivatePostgres, table: str, broker_url: str, queue: str
    ) -> None:
        """The LISTEN backend is terminated (as a pooler or a failover would): rows still go
        out within ``poll_interval``, and the relay LISTENs again on a new connection."""
        poll = 1.0
        async with relay_for(pg.dsn, broker_url, table, poll_interval=poll) as relay:
            backend: Any = relay._backend
            wakes: list[tuple[float, bool]] = []
            wait_for_work = backend.wait_for_work

            async def recorded(timeout: float) -> bool:
                notified: bool = await wait_for_work(timeout)
                wakes.append((time.monotonic(), notified))
                return notified

            backend.wait_for_work = recorded
            running = asyncio.ensure_future(relay.run())
            try:
                assert backend.listening
                first = await _listener_pid(pg.dsn, relay)
                await _terminate(pg.dsn, first)
                deadline = time.monotonic() + 5
                while backend.listening:  # the listen task ends with its connection
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.02)
                written = time.monotonic()
                await write(pg.dsn, table, [{"routing_key": queue, "message_id": "polled"}])
                while relay.stats().dispatched < 1:
                    assert time.monotonic() - written < poll + 1.5, "not found by polling"
                    await asyncio.sleep(0.02)
                deadline = time.monotonic() + 15
                while not backend.listening:  # open() LISTENs again (at most every 5 s)
                    assert time.monotonic() < deadline, "the relay never listened again"
                    await asyncio.sleep(0.05)
                second = await _listener_pid(pg.dsn, relay)
                assert second != first
                await asyncio.sleep(0.3)  # let the wake-up that listening again causes pass
                written = time.monotonic()
                await write(pg.dsn, table, [{"routing_key": queue, "message_id": "notified"}])
                while relay.stats().dispatched < 2:
                    assert time.monotonic() - written < poll + 1.5
                    await asyncio.sleep(0.02)
                # Woken by the notification, not by the poll (a poll returns False).
                assert any(notified for at, notified in wakes if at >= written), wakes[-3:]
            finally:
                relay.stop()
                await asyncio.wait_for(running, 10)
        drained = await drain_queue(broker_url, queue, idle_timeout=0.5)
        assert [m.message_id for m in drained] == ["polled", "notified"]

    async def test_polling_alone_finds_rows(
        self, pg: PrivatePostgres, table: str, broker_url: str, queue: str
    ) -> None:
        async with relay_for(pg.dsn, broker_url, table, listen=False, poll_interval=0.1) as relay:
            running = asyncio.ensure_future(relay.run())
            try:
                await write(pg.dsn, table, [{"routing_key": queue, "message_id": "poll"}])
                deadline = time.monotonic() + 20
                while relay.stats().dispatched < 1:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
            finally:
                relay.stop()
                await asyncio.wait_for(running, 10)

    async def test_kept_rows_are_cleaned_up_in_batches(
        self, pg: PrivatePostgres, table: str, broker_url: str, queue: str
    ) -> None:
        await write(pg.dsn, table, [{"routing_key": queue} for _ in range(10)])
        async with relay_for(
            pg.dsn, broker_url, table, keep_sent=1.0, cleanup_batch=3, cleanup_interval=3600
        ) as relay:
            await drain_all(relay)
            assert (await outbox_status(pg.dsn, table=table)).sent == 10
            assert await relay.cleanup() == 0  # too young (1 s: room for a loaded machine)
            await asyncio.sleep(1.1)
            assert await relay.cleanup() == 10
        assert await _rows(pg.dsn, table) == 0
        await drain_queue(broker_url, queue, idle_timeout=0.3)


class TestFairness:
    async def test_a_hot_key_never_stalls_the_other_keys(
        self, pg: PrivatePostgres, table: str, broker_url: str, queue: str
    ) -> None:
        """5,000 rows of one key, then 200 rows over 50 keys: the 50 keys go out in the first batches.

        Each claim takes the hot key's head and the head of every other key,
        so the other keys' four rows each are out after four batches, long
        before the hot key drains; every key keeps its order.
        """
        async with await psycopg.AsyncConnection.connect(pg.dsn) as conn:
            await conn.execute(
                f"INSERT INTO {table} (message_id, routing_key, ordering_key, body)"
                " SELECT 'hot-' || lpad(n::text, 5, '0'), %s, 'hot', '\\x00'"
                " FROM generate_series(0, 4999) AS n",
                (queue,),
            )
            await conn.commit()
        await write(
            pg.dsn,
            table,
            [
                {
                    "routing_key": queue,
                    "message_id": f"k{n % 50:02d}-{n // 50}",
                    "ordering_key": f"k{n % 50:02d}",
                }
                for n in range(200)
            ],
        )
        batch_of: dict[str, int] = {}

        def dispatched(rows: Sequence[OutboxRow]) -> None:
            number = len({*batch_of.values()}) + 1
            batch_of.update((row.message_id, number) for row in rows)

        relay = OutboxRelay(
            pg.dsn,
            broker_url,
            settings=RelaySettings(batch_size=500, poll_interval=0.2),
            table=table,
            registry=CollectorRegistry(),
            on_dispatched=dispatched,
        )
        others = {f"k{n % 50:02d}-{n // 50}" for n in range(200)}
        async with relay:
            running = asyncio.ensure_future(relay.run())
            try:
                deadline = time.monotonic() + 30
                while not others <= batch_of.keys():
                    assert time.monotonic() < deadline, relay.stats()
                    await asyncio.sleep(0.01)
            finally:
                relay.stop()
                await asyncio.wait_for(running, 10)
        assert max(batch_of[mid] for mid in others) <= 4, sorted(batch_of.values())[-5:]
        hot_out = sum(1 for mid in batch_of if mid.startswith("hot-"))
        assert hot_out < 100  # the hot key is far from drained
        drained = [
            m.message_id or "" for m in await drain_queue(broker_url, queue, idle_timeout=0.5)
        ]
        by_key: dict[str, list[str]] = {}
        for mid in drained:
            by_key.setdefault(mid.split("-")[0], []).append(mid)
        assert by_key.pop("hot") == [f"hot-{n:05d}" for n in range(hot_out)]
        assert len(by_key) == 50
        for key, mids in by_key.items():
            assert mids == [f"{key}-{n}" for n in range(4)], mids

    async def test_two_relays_never_hold_one_key_at_once(
        self, pg: PrivatePostgres, table: str, broker_url: str
    ) -> None:
        """While one relay's batch holds a key's head, another relay claims nothing of that key."""
        events: list[dict[str, Any]] = [
            {"routing_key": "rk", "message_id": f"{key}{n}", "ordering_key": key}
            for n in range(3)
            for key in ("a", "b", "c")
        ]
        events += [{"routing_key": "rk", "message_id": f"u{n}"} for n in range(4)]
        await write(pg.dsn, table, events)
        first, second = _backend(pg.dsn, table), _backend(pg.dsn, table)
        try:
            await first.open()
            await second.open()
            held = await first.claim(2)  # a0, b0: the two oldest heads
            assert [r.message_id for r in held] == ["a0", "b0"]
            taken = await second.claim(100)  # c0 and the unkeyed rows; nothing of a or b
            assert sorted(r.message_id for r in taken) == ["c0", "u0", "u1", "u2", "u3"]
            await first.finish([RowResult(r, RowOutcome.CONFIRMED) for r in held])
            await second.abandon()
            again = await second.claim(100)  # a and b's next rows now; c0 was given back
            assert sorted(r.message_id for r in again) == ["a1", "b1", "c0", "u0", "u1", "u2", "u3"]
            await second.abandon()
        finally:
            await first.close()
            await second.close()

    async def test_keys_beyond_one_scan_are_reached_in_turn(
        self, pg: PrivatePostgres, table: str
    ) -> None:
        """More keys than ``scan_limit``: each claim goes on from the last key seen, wrapping."""
        await write(
            pg.dsn,
            table,
            [
                {"routing_key": "rk", "message_id": f"k{n}", "ordering_key": f"k{n}"}
                for n in range(5)
            ],
        )
        backend = _backend(pg.dsn, table, scan_limit=2)
        try:
            await backend.open()
            seen = []
            for _ in range(4):
                rows = await backend.claim(10)
                seen.append(sorted(r.ordering_key or "" for r in rows))
                await backend.abandon()
            assert seen == [["k0", "k1"], ["k2", "k3"], ["k0", "k4"], ["k1", "k2"]]
        finally:
            await backend.close()


class _PeakRelay(OutboxRelay):
    """Counts batches publishing at once; the first waits (up to 2 s) for a second one."""

    in_flight = peak = batches = 0
    overlap: asyncio.Event | None = None

    async def _publish_rows(self, rows: list[OutboxRow]) -> list[RowResult]:
        if self.overlap is None:
            self.overlap = asyncio.Event()
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        if self.in_flight > 1:
            self.overlap.set()
        first, self.batches = not self.batches, self.batches + 1
        try:
            if first:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(2):
                        await self.overlap.wait()
            return await super()._publish_rows(rows)
        finally:
            self.in_flight -= 1


class TestLanes:
    @pytest.mark.parametrize("lanes", [1, 2])
    async def test_lanes_overlap_batches_and_dispatch_each_row_once_in_key_order(
        self, pg: PrivatePostgres, table: str, broker_url: str, queue: str, lanes: int
    ) -> None:
        """``lanes`` batches publish at once (never more); each row goes out once, keys in order."""
        events: list[dict[str, Any]] = [
            {"routing_key": queue, "message_id": f"{key}-{n}", "ordering_key": key}
            for n in range(5)
            for key in ("a", "b", "c")
        ]
        events += [{"routing_key": queue, "message_id": f"u-{n}"} for n in range(600)]
        await write(pg.dsn, table, events)
        relay = _PeakRelay(
            pg.dsn,
            broker_url,
            settings=RelaySettings(batch_size=100, lanes=lanes, poll_interval=0.2),
            table=table,
            registry=CollectorRegistry(),
        )
        async with relay:
            running = asyncio.ensure_future(relay.run())
            try:
                deadline = time.monotonic() + 30
                while relay.stats().dispatched < len(events):
                    assert time.monotonic() < deadline and not running.done(), relay.stats()
                    await asyncio.sleep(0.02)
            finally:
                relay.stop()
                await asyncio.wait_for(running, 10)
        assert relay.peak == lanes
        assert relay.stats().dispatched == len(events)
        drained = [
            m.message_id or "" for m in await drain_queue(broker_url, queue, idle_timeout=0.5)
        ]
        assert sorted(drained) == sorted(str(e["message_id"]) for e in events)  # each exactly once
        for key in ("a", "b", "c"):
            assert [m for m in drained if m.startswith(f"{key}-")] == [
                f"{key}-{n}" for n in range(5)
            ]
        assert await _rows(pg.dsn, table) == 0


async def refusing_queue(amqp: aio_pika.abc.AbstractChannel) -> aio_pika.abc.AbstractQueue:
    """A queue the broker nacks every publish to (length 0, ``reject-publish``)."""
    return await amqp.declare_queue(
        f"full-{uuid.uuid4().hex[:8]}",
        durable=True,
        arguments={"x-max-length": 0, "x-overflow": "reject-publish"},
    )


class TestAttempts:
    async def test_a_nacked_row_backs_off_then_goes_dead_blocking_only_its_key(
        self,
        pg: PrivatePostgres,
        table: str,
        broker_url: str,
        queue: str,
        amqp: aio_pika.abc.AbstractChannel,
    ) -> None:
        """Real nacks: K's head is retried with a backoff, K's next row waits, other keys go on.

        After ``max_attempts`` nacked dispatches the head is dead with its
        reason, and only then does K's next row go out.
        """
        refusing = await refusing_queue(amqp)
        full = refusing.name
        await write(
            pg.dsn,
            table,
            [
                {"routing_key": full, "message_id": "K1", "ordering_key": "K"},
                {"routing_key": queue, "message_id": "K2", "ordering_key": "K"},
                {"routing_key": queue, "message_id": "L1", "ordering_key": "L"},
                {"routing_key": queue, "message_id": "U1"},
            ],
        )
        registry = CollectorRegistry()
        try:
            async with relay_for(
                pg.dsn,
                broker_url,
                table,
                registry,
                max_attempts=3,
                retry_backoff_initial=0.4,
                retry_backoff_max=0.4,
                publisher_settings=PublisherSettings(max_attempts=1),
            ) as relay:
                assert await relay.run_once() == 3  # K1 (nacked), L1, U1; K2 is not K's head
                assert (relay.stats().dispatched, relay.stats().retried) == (2, 1)
                # K1 backs off; K2 waits behind it; nothing else is there.
                assert await relay.run_once() == 0
                rows = await _pending(pg.dsn, table)
                assert rows["K1"][0] == 1 and rows["K1"][1] > 0.2  # one attempt, due later
                assert rows["K2"] == (0, 0.0)
                running = asyncio.ensure_future(relay.run())
                try:
                    deadline = time.monotonic() + 20
                    while relay.stats().dispatched < 3:
                        assert time.monotonic() < deadline, relay.stats()
                        await asyncio.sleep(0.02)
                finally:
                    relay.stop()
                    await asyncio.wait_for(running, 10)
                stats = relay.stats()
                assert (stats.dead, stats.retried, stats.deferred) == (1, 2, 0), stats
                # Three dispatches in all, a backoff apart: no hot loop.
                assert relay._publisher.stats().nacked == 3
            (dead,) = await dead_rows(pg.dsn, table=table)
            assert (dead.message_id, dead.attempts) == ("K1", 3)
            assert dead.last_error.startswith("gave up after 3 attempts; last: PublishGaveUp")
            drained = [m.message_id for m in await drain_queue(broker_url, queue, idle_timeout=0.5)]
            assert drained == ["L1", "U1", "K2"]
            failed = "reliable_mq_outbox_failed_rows_total"
            for outcome, count in (("retry", 2), ("dead", 1)):
                labels = {"table": table, "outcome": outcome}
                assert registry.get_sample_value(failed, labels) == count, outcome
        finally:
            await refusing.delete(if_unused=False, if_empty=False)

    async def test_unlimited_attempts_keep_a_row_pending(
        self,
        pg: PrivatePostgres,
        table: str,
        broker_url: str,
        amqp: aio_pika.abc.AbstractChannel,
    ) -> None:
        """``max_attempts=None``: a row nacked again and again stays pending."""
        refusing = await refusing_queue(amqp)
        full = refusing.name
        await write(pg.dsn, table, [{"routing_key": full, "message_id": "K1"}])
        try:
            async with relay_for(
                pg.dsn,
                broker_url,
                table,
                max_attempts=None,
                retry_backoff_initial=0.01,
                retry_backoff_max=0.01,
                publisher_settings=PublisherSettings(max_attempts=1),
            ) as relay:
                for _ in range(5):
                    await asyncio.sleep(0.02)
                    await relay.run_once()
                assert relay.stats().dead == 0 and relay.stats().retried >= 4
            assert (await _pending(pg.dsn, table))["K1"][0] >= 4
        finally:
            await refusing.delete(if_unused=False, if_empty=False)


class TestFailureClassification:
    """Which publish failures count as an attempt of the row (no I/O)."""

    @pytest.mark.parametrize(
        ("error", "reachable", "outcome"),
        [
            (PublishGaveUp("nacked", message_id="m", attempts=5), True, RowOutcome.RETRY),
            (PublishGaveUp("nacked", message_id="m", attempts=5), False, RowOutcome.RETRY),
            (PublishTimeout("late", message_id="m", attempts=1), True, RowOutcome.RETRY),
            (PublishOutcomeUnknown("?", message_id="m", attempts=2), True, RowOutcome.RETRY),
            # The connection dropped during the batch, or the message never got out.
            (PublishTimeout("late", message_id="m", attempts=1), False, RowOutcome.DEFERRED),
            (PublishTimeout("late", message_id="m", attempts=0), True, RowOutcome.DEFERRED),
            (PublishUnavailable("down", message_id="m", attempts=0), True, RowOutcome.DEFERRED),
            (PublishUnavailable("down", message_id="m", attempts=3), True, RowOutcome.DEFERRED),
            (PublishAborted("closing", message_id="m", attempts=1), True, RowOutcome.DEFERRED),
            (ClosedError("publisher is closed"), True, RowOutcome.DEFERRED),
        ],
    )
    def test_outcome(
        self, tmp_path: Path, error: ReliableMQError, reachable: bool, outcome: RowOutcome
    ) -> None:
        """Broker outages are deferred uncounted; failures of the message itself count."""
        relay = OutboxRelay(tmp_path / "x.db", "amqp://guest:guest@127.0.0.1:1/")
        assert relay._failed(_row(attempts=0), error, reachable=reachable).outcome is outcome

    def test_the_last_counted_attempt_is_dead(self, tmp_path: Path) -> None:
        """The ``max_attempts``-th counted failure dead-letters; a deferral never does."""
        relay = OutboxRelay(
            tmp_path / "x.db",
            "amqp://guest:guest@127.0.0.1:1/",
            settings=RelaySettings(max_attempts=3),
        )
        nack = PublishGaveUp("nacked", message_id="m", attempts=5)
        assert relay._failed(_row(attempts=1), nack, reachable=True).outcome is RowOutcome.RETRY
        last = relay._failed(_row(attempts=2), nack, reachable=True)
        assert last.outcome is RowOutcome.DEAD
        assert last.reason.startswith("gave up after 3 attempts; last: PublishGaveUp")
        down = PublishUnavailable("down", message_id="m", attempts=0)
        assert relay._failed(_row(attempts=99), down, reachable=False).outcome is (
            RowOutcome.DEFERRED
        )


class TestMetrics:
    async def test_backlog_lag_failures_and_batch_latency_from_a_real_run(
        self,
        pg: PrivatePostgres,
        table: str,
        broker_url: str,
        queue: str,
        amqp: aio_pika.abc.AbstractChannel,
    ) -> None:
        """Every outbox metric, read from the relay's registry while it runs and after."""
        refusing = await refusing_queue(amqp)
        full = refusing.name
        await write(
            pg.dsn,
            table,
            [{"routing_key": queue, "message_id": f"ok{n}"} for n in range(4)]
            + [
                {"routing_key": full, "message_id": "nacked"},
                {"routing_key": f"nobody-{queue}", "message_id": "unroutable"},
            ],
        )
        async with await psycopg.AsyncConnection.connect(pg.dsn, autocommit=True) as conn:
            await conn.execute(f"UPDATE {table} SET created_at = now() - interval '30 seconds'")
        registry = CollectorRegistry()
        labels = {"table": table}

        def sample(name: str, **extra: str) -> float | None:
            return registry.get_sample_value(f"reliable_mq_outbox_{name}", {**labels, **extra})

        seen: list[tuple[float, float]] = []
        try:
            async with relay_for(
                pg.dsn,
                broker_url,
                table,
                registry,
                stats_interval=0.2,
                max_attempts=2,
                retry_backoff_initial=0.3,
                retry_backoff_max=0.3,
                publisher_settings=PublisherSettings(max_attempts=1),
            ) as relay:
                running = asyncio.ensure_future(relay.run())
                try:
                    deadline = time.monotonic() + 20
                    while relay.stats().dead < 2 or sample("pending_rows") != 0:
                        assert time.monotonic() < deadline, (relay.stats(), seen[-3:])
                        seen.append(
                            (sample("pending_rows") or 0, sample("oldest_pending_age_seconds") or 0)
                        )
                        await asyncio.sleep(0.01)
                finally:
                    relay.stop()
                    await asyncio.wait_for(running, 10)
                stats = relay.stats()
        finally:
            await refusing.delete(if_unused=False, if_empty=False)
        # First measured before the first batch: six pending, the oldest 30 s old (the lag).
        first = next(value for value in seen if value != (0, 0))
        assert first[0] == 6 and 30 <= first[1] < 60, seen[:3]
        # The nacked row backing off between its two attempts: one pending, still old.
        assert any(pending == 1 and age >= 30 for pending, age in seen), seen
        assert sample("pending_rows") == 0 and sample("oldest_pending_age_seconds") == 0
        assert (stats.pending, stats.oldest_age) == (0, 0.0)
        assert sample("dispatched_rows_total") == 4
        assert sample("failed_rows_total", outcome="retry") == 1
        assert sample("failed_rows_total", outcome="dead") == 2  # unroutable; out of attempts
        assert sample("failed_rows_total", outcome="deferred") == 0
        batches = sample("batch_seconds_count")
        assert batches == stats.batches >= 2
        assert sample("batch_seconds_bucket", le="+Inf") == batches
        total = sample("batch_seconds_sum")
        assert total is not None and 0 < total < 20
        await drain_queue(broker_url, queue, idle_timeout=0.3)


class TestErrors:
    async def test_missing_table(self, pg: PrivatePostgres, broker_url: str) -> None:
        relay = relay_for(pg.dsn, broker_url, "no_such_outbox")
        with pytest.raises(OutboxError, match="does not exist"):
            await relay.start()
        await relay.close()

    async def test_password_never_in_errors_or_logs(self, broker_url: str) -> None:
        """An unreachable database with a password in its DSN: a typed error, no leak."""
        dsn = f"postgresql://app:{SECRET}@127.0.0.1:1/db?connect_timeout=2"
        relay = relay_for(dsn, broker_url, "reliable_mq_outbox")
        with capture_logs() as logs, pytest.raises(OutboxUnavailable) as info:
            await relay.start()
        await relay.close()
        assert SECRET not in str(info.value) and SECRET not in repr(info.value)
        assert SECRET not in repr(logs)
        keyword = f"host=127.0.0.1 port=1 user=app password={SECRET} connect_timeout=2"
        relay = relay_for(keyword, broker_url, "reliable_mq_outbox")
        with pytest.raises(OutboxUnavailable) as info:
            await relay.start()
        await relay.close()
        assert SECRET not in str(info.value)

    async def test_relay_outlives_a_database_it_cannot_reconnect_to(
        self, pg: PrivatePostgres, table: str, broker_url: str, queue: str
    ) -> None:
        """Connections cut and new ones refused for a while: the relay waits, then goes on."""
        async with TCPProxy("127.0.0.1", pg.port) as proxy:
            dsn = f"postgresql://postgres@127.0.0.1:{proxy.port}/postgres?connect_timeout=2"
            async with relay_for(dsn, broker_url, table, reconnect_delay_max=0.2) as relay:
                running = asyncio.ensure_future(relay.run())
                try:
                    proxy.set_refuse(True)
                    await proxy.cut()
                    # Several reconnects fail meanwhile: waited for, not timed (a fixed
                    # 1.5 s made the count depend on how fast the machine was).
                    deadline = time.monotonic() + 20
                    while relay.stats().outages < 3:
                        assert time.monotonic() < deadline, relay.stats()
                        assert not running.done(), running
                        await asyncio.sleep(0.05)
                    assert not running.done(), running
                    proxy.set_refuse(False)
                    await write(pg.dsn, table, [{"routing_key": queue, "message_id": "back"}])
                    deadline = time.monotonic() + 20
                    while relay.stats().dispatched < 1:
                        assert time.monotonic() < deadline and not running.done()
                        await asyncio.sleep(0.05)
                finally:
                    relay.stop()
                    await asyncio.wait_for(running, 10)
        await drain_queue(broker_url, queue, idle_timeout=0.3)


class TestSQLite:
    async def test_relay_on_sqlite(self, tmp_path: Path, broker_url: str, queue: str) -> None:
        path = tmp_path / "app.db"
        conn = sqlite3.connect(path)
        for statement in schema_sql("sqlite"):
            conn.execute(statement)
        for n in range(4):
            add_sync(
                conn,
                {"n": n},
                routing_key=queue,
                message_id=f"s{n}",
                ordering_key="K" if n < 2 else None,
            )
        add_sync(conn, b"x", routing_key=f"nobody-{queue}", message_id="dead")
        conn.commit()
        async with relay_for(str(path), broker_url, "reliable_mq_outbox") as relay:
            await drain_all(relay)
            assert relay.stats().dispatched == 4 and relay.stats().dead == 1
        drained = [m.message_id for m in await drain_queue(broker_url, queue, settled=True)]
        assert sorted(drained) == ["s0", "s1", "s2", "s3"]
        assert drained.index("s0") < drained.index("s1")
        status = await outbox_status(path)
        assert (status.pending, status.dead) == (0, 1)
        conn.close()

    async def test_a_hot_key_never_stalls_the_other_keys(self, tmp_path: Path) -> None:
        """As in PostgreSQL: every claim takes each key's head, however long the hot key's backlog."""
        from reliable_mq.outbox._sqlite import SQLiteBackend

        path = tmp_path / "hot.db"
        conn = sqlite3.connect(path)
        for statement in schema_sql("sqlite"):
            conn.execute(statement)
        for n in range(3000):
            add_sync(conn, b"x", routing_key="rk", message_id=f"hot-{n}", ordering_key="hot")
        for n in range(20):
            add_sync(
                conn,
                b"x",
                routing_key="rk",
                message_id=f"k{n % 5}-{n // 5}",
                ordering_key=f"k{n % 5}",
            )
        add_sync(conn, b"x", routing_key="rk", message_id="free")
        conn.commit()
        conn.close()
        backend = SQLiteBackend(
            path,
            table="reliable_mq_outbox",
            owner="a",
            scan_limit=100,
            lease=60,
            keep_sent=0,
            retry_backoff=(1, 1),
        )
        try:
            batches = []
            for _ in range(4):
                rows = await backend.claim(100)
                batches.append(sorted(r.message_id for r in rows))
                await backend.finish([RowResult(r, RowOutcome.CONFIRMED) for r in rows])
            assert batches[0] == ["free", "hot-0", "k0-0", "k1-0", "k2-0", "k3-0", "k4-0"]
            for n in range(1, 4):
                assert batches[n] == [f"hot-{n}", *(f"k{k}-{n}" for k in range(5))]
        finally:
            await backend.close()

    async def test_lease_keeps_two_relays_apart(self, tmp_path: Path, broker_url: str) -> None:
        from reliable_mq.outbox._sqlite import SQLiteBackend

        path = tmp_path / "lease.db"
        conn = sqlite3.connect(path)
        for statement in schema_sql("sqlite"):
            conn.execute(statement)
        for n in range(6):
            add_sync(conn, b"x", routing_key="rk", message_id=f"l{n}")
        conn.commit()
        conn.close()
        backends = [
            SQLiteBackend(
                path,
                table="reliable_mq_outbox",
                owner=owner,
                scan_limit=100,
                lease=60,
                keep_sent=0,
                retry_backoff=(1, 1),
            )
            for owner in ("a", "b")
        ]
        try:
            first = await backends[0].claim(4)
            second = await backends[1].claim(4)
            assert {r.message_id for r in first} == {f"l{n}" for n in range(4)}
            assert {r.message_id for r in second} == {"l4", "l5"}
            await backends[0].abandon()
            again = await backends[1].claim(10)
            assert {r.message_id for r in again} == {f"l{n}" for n in range(4)}
        finally:
            for backend in backends:
                await backend.close()


class TestCLI:
    def test_init_status_dead_requeue_cleanup_relay(
        self, pg: PrivatePostgres, broker_url: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        table = f"cli_{uuid.uuid4().hex[:8]}"
        base = ["--dsn", pg.dsn, "--table", table, "--url", broker_url]
        assert main(["outbox", "init", *base]) == 0
        assert main(["outbox", "init", *base]) == 0  # idempotent
        asyncio.run(write(pg.dsn, table, [{"routing_key": f"nobody-{table}", "message_id": "d1"}]))
        assert main(["outbox", "relay", "--once", "--max-attempts", "3", *base]) == 0
        assert main(["outbox", "status", *base]) == 0
        assert main(["outbox", "dead", "--json", *base]) == 0
        assert main(["outbox", "requeue", "--id", "999999", *base]) == 1
        assert main(["outbox", "requeue", "--all", *base]) == 0
        assert main(["outbox", "cleanup", *base]) == 0
        out = capsys.readouterr().out
        assert re.search(r"^dead\s+1$", out, re.MULTILINE), out
        assert '"message_id": "d1"' in out and "PublishUnroutable" in out
        assert "1 row(s) pending again" in out
        asyncio.run(_drop(pg.dsn, table))

    def test_errors_are_one_redacted_line(
        self,
        capsys: pytest.CaptureFixture[str],
        pg: PrivatePostgres,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        dsn = f"postgresql://app:{SECRET}@127.0.0.1:1/db?connect_timeout=2"
        assert main(["outbox", "status", "--dsn", dsn]) == 2
        err = capsys.readouterr().err
        assert SECRET not in err and err.startswith("reliable-mq: error:") and err.count("\n") == 1
        assert main(["outbox", "status", "--dsn", pg.dsn, "--table", "missing_table"]) == 2
        assert "does not exist" in capsys.readouterr().err
        monkeypatch.delenv("RELIABLE_MQ_OUTBOX_DSN", raising=False)
        assert main(["outbox", "status"]) == 2
        assert "no database" in capsys.readouterr().err
        assert main(["outbox", "init", "--print-sql", "postgres"]) == 0
        assert "FOR EACH STATEMENT" in capsys.readouterr().out


async def _rows(dsn: str, table: str) -> int:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cursor = await conn.execute(f"SELECT count(*) FROM {table}")
        row = await cursor.fetchone()
        return int(row[0]) if row else -1


async def _pending(dsn: str, table: str) -> dict[str, tuple[int, float]]:
    """Pending rows by message id: (attempts, seconds until due, 0 if due)."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cursor = await conn.execute(
            f"SELECT message_id, attempts,"
            f" extract(epoch FROM greatest(available_at, now()) - now())::float8"
            f" FROM {table} WHERE state = 'pending'"
        )
        return {mid: (int(n), float(due)) for mid, n, due in await cursor.fetchall()}


async def _listener_pid(dsn: str, relay: OutboxRelay) -> int:
    """The server process of ``relay``'s LISTEN connection."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cursor = await conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE query LIKE 'LISTEN%%'"
            " AND application_name LIKE %s",
            (f"%{relay.name}%",),
        )
        rows = await cursor.fetchall()
        assert len(rows) == 1, rows
        return int(rows[0][0])


async def _terminate(dsn: str, pid: int) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cursor = await conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        assert (await cursor.fetchone()) == (True,)


def _backend(dsn: str, table: str, *, scan_limit: int = 100) -> PostgresBackend:
    return PostgresBackend(
        dsn,
        table=table,
        scan_limit=scan_limit,
        listen=False,
        keep_sent=0,
        retry_backoff=(1, 1),
        transaction_timeout=30,
    )


def _row(*, attempts: int) -> OutboxRow:
    return OutboxRow(
        id=1,
        message_id="m",
        exchange="",
        routing_key="rk",
        ordering_key=None,
        body=b"x",
        properties={},
        attempts=attempts,
        created_at=0.0,
    )


async def _drop(dsn: str, table: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(f"DROP TABLE {table}")
