"""Faults on the batch path: effects into PostgreSQL through run_once_batch in a batch handler.

Each scenario publishes a few thousand confirmed messages, then a consumer
with a batch handler applies them as rows of a ledger table through
`PostgresDedupStore.run_once_batch` (effect and *done* marks in one
transaction per batch) while a fault strikes mid-batch. The consumers have no
dedup store of their own: the database alone stands between a redelivered
copy and a second effect. The ledger's rows (with repeats) are the applied
effects; the oracle must find nothing lost, nothing unexpected and no effect
applied twice. The five scenarios are issue 22's: the consumer SIGKILLed
mid-batch, the PostgreSQL connection cut mid-commit, an AMQP cut between the
handler's return and its acks, a handler failing 3 of 500, and a handler
raising for its whole batch.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from prometheus_client import CollectorRegistry

from reliable_mq import BatchFailed, ConsumerSettings, ReliableConsumer
from reliable_mq.dedup import BatchResult
from reliable_mq.dedup.postgres import PostgresDedupStore
from reliable_mq.delivery import Delivery
from reliable_mq.headers import REASON_HEADER
from reliable_mq.testing import LossOracle, TCPProxy
from reliable_mq.topology import QueueTopology
from tests.faults.batch_worker import ledger_effect
from tests.faults.harness import (
    Scenario,
    Workload,
    connection,
    declare,
    delete,
    describe,
    drain_all,
    new_queue,
    wait_for,
)
from tests.faults.test_consumer_faults import ROOT, publish_all, read_text
from tests.support.private_node import PrivateBroker
from tests.support.private_postgres import PrivatePostgres, running_private_postgres

pytestmark = [pytest.mark.private_broker, pytest.mark.timeout(120)]

MESSAGES = 2000
MAX_SIZE = 100
PREFETCH = 300

SLOW_COMMIT = """
CREATE TABLE {name} (n int);
CREATE FUNCTION {name}_sleep() RETURNS trigger LANGUAGE plpgsql AS
  $$ BEGIN PERFORM pg_sleep(1.5); RETURN NULL; END $$;
CREATE CONSTRAINT TRIGGER {name}_at_commit AFTER INSERT ON {name}
  DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {name}_sleep();
"""


@pytest.fixture(scope="module", name="pg")
def _pg() -> Iterator[PrivatePostgres]:
    with running_private_postgres() as server:
        yield server


class Tables:
    """A test's inbox (dedup marks) and ledger (effects) tables in the private server."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        suffix = uuid.uuid4().hex[:8]
        self.inbox = f"inbox_{suffix}"
        self.ledger = f"ledger_{suffix}"
        self.slow = f"slow_{suffix}"

    async def execute(self, statement: str) -> list[Any]:
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
            cursor = await conn.execute(statement.encode())
            return await cursor.fetchall() if cursor.description else []

    async def effects(self) -> list[str]:
        """Every ledger row, with repeats: the applied effects."""
        return [row[0] for row in await self.execute(f"SELECT message_id FROM {self.ledger}")]

    async def distinct_effects(self) -> int:
        rows = await self.execute(f"SELECT COUNT(DISTINCT message_id) FROM {self.ledger}")
        return int(rows[0][0])


@pytest.fixture(name="tables")
async def _tables(pg: PrivatePostgres) -> AsyncIterator[Tables]:
    made = Tables(pg.dsn)
    await made.execute(f"CREATE TABLE {made.ledger} (message_id text NOT NULL)")
    await made.execute(SLOW_COMMIT.format(name=made.slow))
    yield made
    await made.execute(
        f"DROP TABLE IF EXISTS {made.ledger}, {made.inbox}, {made.slow};"
        f" DROP FUNCTION {made.slow}_sleep()"
    )


async def spawn(config: dict[str, Any]) -> asyncio.subprocess.Process:
    """A batch worker process (`tests.faults.batch_worker`)."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.faults.batch_worker", json.dumps(config), cwd=ROOT
    )


async def wait_for_effects(tables: Tables, count: int, timeout: float) -> bool:
    """Poll the ledger until ``count`` distinct ids are applied (the oracle judges after)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while await tables.distinct_effects() < count:
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.2)
    return True


async def judge(
    url: str,
    topology: QueueTopology,
    oracle: LossOracle,
    tables: Tables,
    scenario: Scenario,
    work: Workload,
    *,
    messages: int = MESSAGES,
    effects: int = MESSAGES,
    **report: Any,
) -> dict[str, list[Any]]:
    """Drain every queue, count the ledger's rows as effects, report, and assert the verdict."""
    oracle_effects = await tables.effects()
    for mid in oracle_effects:
        oracle.applied(mid)
    drained = await drain_all(url, topology, oracle)
    await delete(url, topology)
    verdict = scenario.report(
        max_in_flight=work.publisher.stats().max_in_flight_seen,
        unresolved=work.unresolved,
        **report,
    )
    assert verdict.ok, describe(verdict, work)
    assert verdict.effects == effects
    assert verdict.distinct_delivered == messages
    return drained


class BatchSink:
    """An in-process batch handler: run_once_batch into the ledger, with a hook per new batch.

    ``hook(n, conn, new)`` runs inside the transaction of the ``n``-th batch with
    new ids (after their rows are written), ``after(n)`` once that batch
    committed. The deliveries of ``poison`` ids are left out of the effect and
    named in a `BatchFailed` (each goes down the retry/DLQ ladder alone).
    """

    def __init__(self, store: PostgresDedupStore, tables: Tables, oracle: LossOracle) -> None:
        self.store = store
        self.oracle = oracle
        self.write = ledger_effect(tables.ledger)
        self.batches = 0
        self.skipped = 0
        self.failed_calls = 0
        self.hook: Any = None
        self.after: Any = None
        self.poison: set[str] = set()

    async def __call__(self, items: list[Delivery]) -> None:
        self.oracle.delivered_many(item.message_id for item in items)
        failures: dict[int | str, BaseException] = {
            item.message_id: ValueError("poison")
            for item in items
            if item.message_id in self.poison
        }
        await self.apply([item for item in items if item.message_id not in failures])
        if failures:
            raise BatchFailed(failures)

    async def apply(self, items: list[Delivery]) -> None:
        async def effect(conn: psycopg.AsyncConnection[Any], new: list[Delivery]) -> int:
            self.batches += 1
            number = self.batches  # batches run concurrently: read it before any await
            await self.write(conn, new)
            if self.hook is not None:
                await self.hook(number, conn, new)
            return number

        try:
            result: BatchResult[int] = await self.store.run_once_batch(items, effect)
        except Exception:
            self.failed_calls += 1
            raise
        self.skipped += len(result.already_done)
        if result.value is not None and self.after is not None:
            self.after(result.value)


def batch_consumer(
    url: str, queue: str, sink: BatchSink, *, max_attempts: int = 50
) -> ReliableConsumer:
    consumer = ReliableConsumer(
        connection(url, "batch-consumer"),
        settings=ConsumerSettings(
            prefetch=PREFETCH,
            max_attempts=max_attempts,
            retry_delays=(0.2,),
            shutdown_grace=5.0,
        ),
        registry=CollectorRegistry(),
        dedup=None,
    )

    async def handle(items: list[Delivery]) -> None:
        await sink(items)

    consumer.add_batch_handler(queue, handle, max_size=MAX_SIZE, max_wait=0.05)
    return consumer


class TestBatchFaults:
    async def test_consumer_killed_mid_batch(
        self, fault_node: PrivateBroker, pg: PrivatePostgres, tables: Tables, tmp_path: Path
    ) -> None:
        """SIGKILL a consumer process holding committed, unacked batches; a second one finishes.

        The broker redelivers every unacked delivery; run_once_batch finds the
        committed ids done and hands the effect only the rest.
        """
        url = fault_node.url
        oracle = LossOracle()
        scenario = Scenario("batch consumer crash", oracle)
        queue = new_queue("batch-crash")
        topology = QueueTopology(queue=queue, retry_delays=(0.2,))
        await declare(url, topology)
        work = await publish_all(url, oracle, queue, MESSAGES)
        assert len(work.confirmed) == MESSAGES
        base: dict[str, Any] = {
            "url": url,
            "queue": queue,
            "dsn": pg.dsn,
            "table": tables.inbox,
            "ledger": tables.ledger,
            "deliveries": str(tmp_path / "deliveries.txt"),
            "prefetch": PREFETCH,
            "max_size": MAX_SIZE,
        }
        marker = tmp_path / "crashing"
        first = await spawn(
            {**base, "crash_after": 5, "marker": str(marker), "stats": str(tmp_path / "a.json")}
        )
        try:
            reached = await wait_for(lambda: marker.exists() or first.returncode is not None, 60)
            assert reached and marker.exists(), "the first consumer never reached its crash"
            await asyncio.sleep(0.2)  # let other batches in flight commit too, unacked
            first.send_signal(signal.SIGKILL)
            assert await first.wait() == -signal.SIGKILL
            scenario.faults += 1
            applied_at_crash = await tables.distinct_effects()
            stats = tmp_path / "b.json"
            second = await spawn({**base, "stats": str(stats)})
            try:
                done = await wait_for_effects(tables, MESSAGES, 60)
            finally:
                second.send_signal(signal.SIGTERM)
                await asyncio.wait_for(second.wait(), 30)
        finally:
            if first.returncode is None:
                first.kill()
                await first.wait()
        assert done, f"only {await tables.distinct_effects()} of {MESSAGES} effects"
        assert 5 <= applied_at_crash < MESSAGES
        oracle.delivered_many(read_text(base["deliveries"]).split())
        second_stats = json.loads(read_text(stats))
        await judge(
            url,
            topology,
            oracle,
            tables,
            scenario,
            work,
            republished=0,
            max_unacked=second_stats["max_in_progress"],
        )
        # The crashed batch's deliveries came back to the second consumer.
        assert oracle.report().broker_duplicates > 0

    async def test_postgres_cut_mid_commit(
        self, fault_node: PrivateBroker, pg: PrivatePostgres, tables: Tables
    ) -> None:
        """The store's connection is cut while COMMIT runs: once after it landed, once before.

        The handler raises `DedupStoreUnavailable`, the whole batch goes down
        the retry ladder, and its copies apply exactly what is missing.
        """
        url = fault_node.url
        oracle = LossOracle()
        scenario = Scenario("batch postgres cut mid-commit", oracle)
        queue = new_queue("batch-pg-cut")
        topology = QueueTopology(queue=queue, retry_delays=(0.2,))
        await declare(url, topology)
        work = await publish_all(url, oracle, queue, MESSAGES)
        async with TCPProxy("127.0.0.1", pg.port) as proxy:
            store = PostgresDedupStore(
                f"postgresql://postgres@127.0.0.1:{proxy.port}/postgres", table=tables.inbox
            )
            sink = BatchSink(store, tables, oracle)
            cuts = {3: False, 8: True}  # batch number: abort (the commit never lands)

            async def hook(n: int, conn: psycopg.AsyncConnection[Any], new: Any) -> None:
                if n not in cuts:
                    return
                if cuts[n]:  # the server notices the lost client within 50 ms, rolls back
                    await conn.execute("SET LOCAL client_connection_check_interval = 50")
                await conn.execute(f"INSERT INTO {tables.slow} VALUES (1)".encode())
                asyncio.get_running_loop().call_later(
                    0.5, lambda: asyncio.ensure_future(proxy.cut())
                )
                scenario.faults += 1

            sink.hook = hook
            consumer = batch_consumer(url, queue, sink)
            await consumer.start()
            try:
                done = await wait_for_effects(tables, MESSAGES, 60)
                await consumer.stop(grace=5)
            finally:
                await consumer.stop(grace=1)
                await store.close()
        assert done, f"only {await tables.distinct_effects()} of {MESSAGES} effects"
        assert scenario.faults == 2
        assert sink.failed_calls >= 2
        assert sink.skipped > 0, "the landed commit's ids never came back"
        stats = consumer.stats()
        await judge(
            url,
            topology,
            oracle,
            tables,
            scenario,
            work,
            republished=stats.retried,
            max_unacked=stats.max_in_progress,
        )

    async def test_amqp_cut_between_handler_return_and_ack(
        self, fault_node: PrivateBroker, pg: PrivatePostgres, tables: Tables
    ) -> None:
        """The consumer's link stalls as a batch handler returns and is cut: its acks never land.

        The broker redelivers the batch on the next channel; run_once_batch
        finds it done, and the copies are acked without a second effect.
        """
        url = fault_node.url
        oracle = LossOracle()
        scenario = Scenario("batch ack cut", oracle)
        queue = new_queue("batch-ack-cut")
        topology = QueueTopology(queue=queue, retry_delays=(0.2,))
        await declare(url, topology)
        work = await publish_all(url, oracle, queue, MESSAGES)
        store = PostgresDedupStore(pg.dsn, table=tables.inbox)
        sink = BatchSink(store, tables, oracle)
        async with TCPProxy("127.0.0.1", fault_node.amqp_port) as proxy:
            cut_batches = {3, 9}
            cutting: list[asyncio.Task[None]] = []

            async def cut() -> None:
                await asyncio.sleep(0.3)  # the acks are written into the stalled link
                await proxy.cut()
                proxy.set_stall(False)

            def after(n: int) -> None:
                if n in cut_batches:
                    proxy.set_stall(True)  # before the handler returns: no ack gets through
                    scenario.faults += 1
                    cutting.append(asyncio.ensure_future(cut()))

            sink.after = after
            consumer = batch_consumer(f"amqp://guest:guest@127.0.0.1:{proxy.port}/", queue, sink)
            await consumer.start()
            try:
                done = await wait_for_effects(tables, MESSAGES, 60)
                await consumer.stop(grace=5)
            finally:
                await consumer.stop(grace=1)
                await store.close()
        assert done, f"only {await tables.distinct_effects()} of {MESSAGES} effects"
        assert scenario.faults == 2
        assert sink.skipped > 0, "no batch whose ack was cut came back"
        stats = consumer.stats()
        await judge(
            url,
            topology,
            oracle,
            tables,
            scenario,
            work,
            republished=stats.retried,
            max_unacked=stats.max_in_progress,
        )

    async def test_three_of_500_fail_the_rest_applied_once(
        self, fault_node: PrivateBroker, pg: PrivatePostgres, tables: Tables
    ) -> None:
        """A handler failing 3 of 500 by name: 497 applied once, the 3 dead-lettered unapplied."""
        url = fault_node.url
        oracle = LossOracle()
        scenario = Scenario("batch 3 of 500 fail", oracle)
        queue = new_queue("batch-three-fail")
        topology = QueueTopology(queue=queue, retry_delays=(0.2,))
        await declare(url, topology)
        work = await publish_all(url, oracle, queue, 500)
        store = PostgresDedupStore(pg.dsn, table=tables.inbox)
        sink = BatchSink(store, tables, oracle)
        sink.poison = {"m0000007", "m0000123", "m0000400"}
        scenario.faults = len(sink.poison)
        consumer = batch_consumer(url, queue, sink, max_attempts=3)
        await consumer.start()
        try:
            done = await wait_for_effects(tables, 497, 30)
            await wait_for(lambda: consumer.stats().dead_lettered >= 3, 30)
            await consumer.stop(grace=5)
        finally:
            await consumer.stop(grace=1)
            await store.close()
        assert done, f"only {await tables.distinct_effects()} of 497 effects"
        stats = consumer.stats()
        drained = await judge(
            url,
            topology,
            oracle,
            tables,
            scenario,
            work,
            messages=500,
            effects=497,
            republished=stats.retried + stats.dead_lettered,
            max_unacked=stats.max_in_progress,
        )
        assert not set(await tables.effects()) & sink.poison
        dead = drained[topology.dead_letter_queue]
        assert {m.message_id for m in dead} == sink.poison
        assert {m.headers[REASON_HEADER] for m in dead} == {"max_attempts"}
        assert (stats.retried, stats.dead_lettered) == (6, 3)

    async def test_every_batch_raising_once_is_applied_once_on_retry(
        self, fault_node: PrivateBroker, pg: PrivatePostgres, tables: Tables
    ) -> None:
        """Each batch's effect raises on a first attempt: nothing kept, every message retried,
        every effect applied once by the retries."""
        url = fault_node.url
        oracle = LossOracle()
        scenario = Scenario("batch raising whole", oracle)
        queue = new_queue("batch-raising")
        topology = QueueTopology(queue=queue, retry_delays=(0.2,))
        await declare(url, topology)
        work = await publish_all(url, oracle, queue, 1000)
        store = PostgresDedupStore(pg.dsn, table=tables.inbox)
        sink = BatchSink(store, tables, oracle)

        async def hook(n: int, conn: psycopg.AsyncConnection[Any], new: list[Delivery]) -> None:
            if any(item.attempt == 1 for item in new):  # rows written, then the effect raises
                scenario.faults += 1
                raise RuntimeError("the effect failed after writing its rows")

        sink.hook = hook
        consumer = batch_consumer(url, queue, sink, max_attempts=10)
        await consumer.start()
        try:
            done = await wait_for_effects(tables, 1000, 30)
            await consumer.stop(grace=5)
        finally:
            await consumer.stop(grace=1)
            await store.close()
        assert done, f"only {await tables.distinct_effects()} of 1000 effects"
        stats = consumer.stats()
        # A batch mixing first attempts with retries fails them all again.
        assert stats.retried >= 1000 and stats.dead_lettered == 0
        assert scenario.faults >= 1000 // MAX_SIZE
        await judge(
            url,
            topology,
            oracle,
            tables,
            scenario,
            work,
            messages=1000,
            effects=1000,
            republished=stats.retried,
            max_unacked=stats.max_in_progress,
        )
