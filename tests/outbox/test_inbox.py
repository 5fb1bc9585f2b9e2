"""PostgresDedupStore: claim/lease semantics, and run_once's effect + done mark in one transaction."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import psycopg
import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from reliable_mq import ReliableConsumer, ReliablePublisher
from reliable_mq.dedup import AlreadyProcessed, ClaimResult, DedupStore, DedupStoreUnavailable
from reliable_mq.dedup.postgres import PostgresDedupStore
from reliable_mq.delivery import Delivery
from reliable_mq.testing import TCPProxy
from tests.support.private_postgres import PrivatePostgres

SECRET = "s3cret-Pw-plugh"


@pytest.fixture
async def store(pg: PrivatePostgres) -> AsyncIterator[PostgresDedupStore]:
    made = PostgresDedupStore(pg.dsn, table=f"inbox_{uuid.uuid4().hex[:8]}")
    yield made
    await made.close()


@pytest.fixture
async def ledger(pg: PrivatePostgres) -> AsyncIterator[str]:
    name = f"ledger_{uuid.uuid4().hex[:8]}"
    async with await psycopg.AsyncConnection.connect(pg.dsn, autocommit=True) as conn:
        await conn.execute(f"CREATE TABLE {name} (message_id text, amount int)")
    yield name
    async with await psycopg.AsyncConnection.connect(pg.dsn, autocommit=True) as conn:
        await conn.execute(f"DROP TABLE {name}")


async def entries(dsn: str, ledger: str) -> list[str]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cursor = await conn.execute(f"SELECT message_id FROM {ledger} ORDER BY message_id")
        return [row[0] for row in await cursor.fetchall()]


class TestClaims:
    async def test_is_a_dedup_store(self, store: PostgresDedupStore) -> None:
        assert isinstance(store, DedupStore)

    async def test_claim_busy_release_done(self, store: PostgresDedupStore) -> None:
        assert await store.claim("m", owner="a", lease=30) is ClaimResult.CLAIMED
        assert await store.claim("m", owner="a", lease=30) is ClaimResult.BUSY
        assert await store.claim("m", owner="b", lease=30) is ClaimResult.BUSY
        await store.release("m", owner="b")  # not b's claim: nothing happens
        assert await store.claim("m", owner="b", lease=30) is ClaimResult.BUSY
        await store.release("m", owner="a")
        assert await store.claim("m", owner="b", lease=30) is ClaimResult.CLAIMED
        await store.complete("m", owner="b")
        assert await store.claim("m", owner="c", lease=30) is ClaimResult.DONE

    async def test_an_expired_lease_can_be_taken_over(self, store: PostgresDedupStore) -> None:
        assert await store.claim("m", owner="dead", lease=0.2) is ClaimResult.CLAIMED
        await asyncio.sleep(0.4)
        assert await store.claim("m", owner="alive", lease=30) is ClaimResult.CLAIMED

    async def test_concurrent_claims_have_one_winner(self, store: PostgresDedupStore) -> None:
        results = await asyncio.gather(
            *(store.claim("race", owner=f"o{n}", lease=30) for n in range(8))
        )
        assert results.count(ClaimResult.CLAIMED) == 1

    async def test_closed_store_is_unavailable(self, pg: PrivatePostgres) -> None:
        store = PostgresDedupStore(pg.dsn, table=f"inbox_{uuid.uuid4().hex[:8]}")
        await store.close()
        with pytest.raises(DedupStoreUnavailable, match="closed"):
            await store.claim("m", owner="a", lease=1)


class TestRunOnce:
    async def test_effect_and_mark_commit_together_once(
        self, store: PostgresDedupStore, pg: PrivatePostgres, ledger: str
    ) -> None:
        async def credit(conn: psycopg.AsyncConnection[Any]) -> str:
            await conn.execute(f"INSERT INTO {ledger} VALUES ('p1', 10)")
            return "credited"

        assert await store.run_once("p1", credit) == "credited"
        with pytest.raises(AlreadyProcessed):
            await store.run_once("p1", credit)
        assert await entries(pg.dsn, ledger) == ["p1"]  # the second effect was rolled back
        assert await store.claim("p1", owner="x", lease=1) is ClaimResult.DONE

    async def test_a_failing_effect_keeps_nothing(
        self, store: PostgresDedupStore, pg: PrivatePostgres, ledger: str
    ) -> None:
        class Boom(Exception):
            pass

        async def half(conn: psycopg.AsyncConnection[Any]) -> None:
            await conn.execute(f"INSERT INTO {ledger} VALUES ('p2', 1)")
            raise Boom

        with pytest.raises(Boom):
            await store.run_once("p2", half)

        async def bad_sql(conn: psycopg.AsyncConnection[Any]) -> None:
            await conn.execute("SELECT * FROM no_such_table_here")

        with pytest.raises(psycopg.errors.UndefinedTable):  # the handler's error, unchanged
            await store.run_once("p2", bad_sql)
        assert await entries(pg.dsn, ledger) == []
        assert await store.claim("p2", owner="x", lease=1) is ClaimResult.CLAIMED

    async def test_racing_copies_apply_once(
        self, store: PostgresDedupStore, pg: PrivatePostgres, ledger: str
    ) -> None:
        """Two copies in flight at once: the second waits on the first's mark, then refuses."""

        async def credit(conn: psycopg.AsyncConnection[Any]) -> None:
            await conn.execute(f"INSERT INTO {ledger} VALUES ('p3', 1)")
            await asyncio.sleep(0.2)

        outcomes = await asyncio.gather(
            *(store.run_once("p3", credit) for _ in range(3)), return_exceptions=True
        )
        assert sum(isinstance(o, AlreadyProcessed) for o in outcomes) == 2
        assert await entries(pg.dsn, ledger) == ["p3"]

    async def test_mark_done_in_the_callers_transaction(
        self, store: PostgresDedupStore, pg: PrivatePostgres, ledger: str
    ) -> None:
        await store.claim("warm-up", owner="x", lease=1)  # creates the table
        async with await psycopg.AsyncConnection.connect(pg.dsn) as conn:
            await conn.execute(f"INSERT INTO {ledger} VALUES ('p4', 1)")
            await store.mark_done_in(conn, "p4")
            await conn.commit()
            with pytest.raises(AlreadyProcessed):
                await store.mark_done_in(conn, "p4")
            await conn.rollback()
        engine = create_async_engine(f"postgresql+psycopg://postgres@127.0.0.1:{pg.port}/postgres")
        try:
            async with AsyncSession(engine) as session:
                await session.execute(text(f"INSERT INTO {ledger} VALUES ('p5', 1)"))
                await store.mark_done_in(session, "p5")
                await session.commit()
                with pytest.raises(AlreadyProcessed):
                    await store.mark_done_in(session, "p5")
        finally:
            await engine.dispose()
        with pytest.raises(TypeError):
            await store.mark_done_in(object(), "p6")
        assert await entries(pg.dsn, ledger) == ["p4", "p5"]


class TestOutages:
    async def test_cut_connections_are_unavailable_then_recover(self, pg: PrivatePostgres) -> None:
        async with TCPProxy("127.0.0.1", pg.port) as proxy:
            store = PostgresDedupStore(
                f"postgresql://postgres@127.0.0.1:{proxy.port}/postgres",
                table=f"inbox_{uuid.uuid4().hex[:8]}",
                connect_timeout=2,
            )
            try:
                assert await store.claim("a", owner="o", lease=30) is ClaimResult.CLAIMED
                await proxy.cut()
                with pytest.raises(DedupStoreUnavailable):
                    await store.claim("b", owner="o", lease=30)
                assert await store.claim("b", owner="o", lease=30) is ClaimResult.CLAIMED
            finally:
                await store.close()

    async def test_password_is_never_shown(self) -> None:
        store = PostgresDedupStore(f"postgresql://app:{SECRET}@127.0.0.1:1/db", connect_timeout=1)
        with pytest.raises(DedupStoreUnavailable) as info:
            await store.claim("m", owner="o", lease=1)
        assert SECRET not in str(info.value) and "\n" not in str(info.value)
        await store.close()


@pytest.mark.rabbitmq
async def test_consumer_with_the_inbox_applies_each_payment_once(
    pg: PrivatePostgres, broker_url: str, ledger: str, queue: str
) -> None:
    """ReliableConsumer(dedup=store) claims; the handler's run_once commits effect + mark."""
    store = PostgresDedupStore(pg.dsn, table=f"inbox_{uuid.uuid4().hex[:8]}")
    consumer = ReliableConsumer(broker_url, dedup=store, registry=CollectorRegistry())

    @consumer.handler(queue)  # adopts the plain queue, declares its retry queues and DLQ
    async def pay(body: dict[str, Any], delivery: Delivery) -> None:
        async def credit(conn: psycopg.AsyncConnection[Any]) -> None:
            await conn.execute(f"INSERT INTO {ledger} VALUES (%s, 1)", (delivery.message_id,))

        await store.run_once(delivery.message_id, credit)

    try:
        async with consumer:
            async with ReliablePublisher(broker_url, registry=CollectorRegistry()) as publisher:
                for copy in range(2):  # the second copies stand for republishes / redeliveries
                    for n in range(20):
                        await publisher.publish({"n": n}, routing_key=queue, message_id=f"pay{n}")
                    async with asyncio.timeout(30):
                        while consumer.stats().delivered < 20 * (copy + 1) or (
                            consumer.stats().in_progress
                        ):
                            await asyncio.sleep(0.05)
            assert consumer.stats().duplicates == 20
    finally:
        await store.close()
        connection = await aio_pika.connect(broker_url)
        async with connection:
            channel = await connection.channel()
            for side in consumer.topology(queue).all_queues[1:]:
                await channel.queue_delete(side)
    assert await entries(pg.dsn, ledger) == sorted(f"pay{n}" for n in range(20))
