"""run_once_batch / mark_batch_done_in: a batch's marks and its effect commit together, once.

PostgreSQL runs on a private server of this module (the connection-cut tests
go through a TCPProxy in front of it); SQLite on a file per test.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from reliable_mq.dedup import (
    BatchResult,
    ClaimResult,
    DedupStoreUnavailable,
    InvalidBatch,
    SQLiteDedupStore,
)
from reliable_mq.dedup.postgres import PostgresDedupStore
from reliable_mq.testing import TCPProxy
from tests.support.private_postgres import PrivatePostgres, running_private_postgres

PgConn = psycopg.AsyncConnection[Any]


@dataclass(frozen=True)
class Event:
    """A delivery-like item: the effect gets these back, not only their ids."""

    message_id: str
    amount: int = 1


@pytest.fixture(scope="module", name="pg")
def _pg() -> Iterator[PrivatePostgres]:
    with running_private_postgres() as server:
        yield server


@pytest.fixture(name="table")
def _table() -> str:
    return f"inbox_{uuid.uuid4().hex[:8]}"


@pytest.fixture(name="store")
async def _store(pg: PrivatePostgres, table: str) -> AsyncIterator[PostgresDedupStore]:
    made = PostgresDedupStore(pg.dsn, table=table)
    yield made
    await made.close()


@pytest.fixture(name="ledger")
async def _ledger(pg: PrivatePostgres) -> AsyncIterator[str]:
    name = f"ledger_{uuid.uuid4().hex[:8]}"
    async with await psycopg.AsyncConnection.connect(pg.dsn, autocommit=True) as conn:
        await conn.execute(f"CREATE TABLE {name} (message_id text, amount int)")
    yield name
    async with await psycopg.AsyncConnection.connect(pg.dsn, autocommit=True) as conn:
        await conn.execute(f"DROP TABLE {name}")


async def rows(dsn: str, query: str) -> list[str]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cursor = await conn.execute(query)
        return [row[0] for row in await cursor.fetchall()]


async def entries(dsn: str, ledger: str) -> list[str]:
    """Every effect applied, with repeats: the oracle for duplicate effects."""
    return await rows(dsn, f"SELECT message_id FROM {ledger} ORDER BY message_id")


async def marks(dsn: str, table: str) -> list[str]:
    return await rows(dsn, f"SELECT message_id FROM {table} ORDER BY message_id")


def inserter(
    ledger: str, *, sleep: float = 0.0, fail: bool = False, inside: asyncio.Event | None = None
) -> Any:
    """An effect writing one ledger row per new item (optionally slow, or failing after).

    ``inside`` is set once the rows are written, while the transaction is still open.
    """

    async def effect(conn: PgConn, items: list[Event]) -> int:
        async with conn.cursor() as cursor:
            await cursor.executemany(
                f"INSERT INTO {ledger} VALUES (%s, %s)",
                [(item.message_id, item.amount) for item in items],
            )
        if inside is not None:
            inside.set()
        await asyncio.sleep(sleep)
        if fail:
            raise RuntimeError("effect failed")
        return len(items)

    return effect


class TestPostgresRunOnceBatch:
    async def test_effect_gets_only_new_items_and_commits_with_their_marks(
        self, store: PostgresDedupStore, pg: PrivatePostgres, ledger: str
    ) -> None:
        """New items reach the effect once, in batch order; done ones are reported, not rerun."""
        first = [Event("a"), Event("b"), Event("a", 99), Event("c")]
        result = await store.run_once_batch(first, inserter(ledger))
        assert result == BatchResult(ran=("a", "b", "c"), already_done=(), value=3)
        second = [Event("c"), Event("d"), Event("b"), Event("e")]
        result = await store.run_once_batch(second, inserter(ledger))
        assert (result.ran, result.already_done, result.value) == (("d", "e"), ("c", "b"), 2)
        assert await entries(pg.dsn, ledger) == ["a", "b", "c", "d", "e"]
        assert await rows(pg.dsn, f"SELECT amount FROM {ledger} WHERE message_id = 'a'") == [1]
        assert await store.claim("d", owner="x", lease=5) is ClaimResult.DONE

    async def test_nothing_new_runs_no_effect(
        self, store: PostgresDedupStore, pg: PrivatePostgres, ledger: str
    ) -> None:
        calls: list[list[str]] = []

        async def effect(conn: PgConn, ids: list[str]) -> None:
            calls.append(ids)

        await store.run_once_batch(["a", "b"], effect)
        result = await store.run_once_batch(["b", "a", "b"], effect)
        assert result == BatchResult((), ("b", "a"), None) and not result.effect_ran
        assert calls == [["a", "b"]]

    async def test_a_failing_effect_keeps_no_mark(
        self, store: PostgresDedupStore, pg: PrivatePostgres, ledger: str, table: str
    ) -> None:
        """The effect's exception propagates unchanged; its rows and every mark are rolled back."""
        await store.run_once_batch([Event("warm")], inserter(ledger))
        with pytest.raises(RuntimeError, match="effect failed"):
            await store.run_once_batch([Event("x"), Event("y")], inserter(ledger, fail=True))
        assert await marks(pg.dsn, table) == ["warm"]
        result = await store.run_once_batch([Event("x"), Event("y")], inserter(ledger))
        assert result.ran == ("x", "y")
        assert await entries(pg.dsn, ledger) == ["warm", "x", "y"]

    async def test_an_id_claimed_by_the_consumer_is_taken(
        self, store: PostgresDedupStore, pg: PrivatePostgres, ledger: str
    ) -> None:
        """The consumer's own claim (a lease, not done) does not hide the id from the batch."""
        assert await store.claim("m", owner="consumer-1", lease=30) is ClaimResult.CLAIMED
        result = await store.run_once_batch([Event("m")], inserter(ledger))
        assert result.ran == ("m",)
        assert await store.claim("m", owner="other", lease=30) is ClaimResult.DONE


class TestPostgresRacingCopies:
    async def test_a_copy_in_flight_elsewhere_waits_then_is_left_out(
        self, pg: PrivatePostgres, table: str, ledger: str
    ) -> None:
        """Two consumers (two stores) with overlapping batches: the later waits for the commit."""
        one = PostgresDedupStore(pg.dsn, table=table)
        two = PostgresDedupStore(pg.dsn, table=table)
        try:
            await two.claim("warm-up", owner="x", lease=1)  # both pools connected, schema made
            await one.claim("warm-up2", owner="x", lease=1)
            inside = asyncio.Event()
            first = asyncio.create_task(
                one.run_once_batch(
                    [Event(i) for i in "abc"], inserter(ledger, sleep=0.6, inside=inside)
                )
            )
            await inside.wait()  # the first holds a, b and c, uncommitted
            started = time.monotonic()
            second = await two.run_once_batch([Event(i) for i in "bcd"], inserter(ledger))
            waited = time.monotonic() - started
            assert first.done(), "the second committed while the first still ran"
            assert (await first).ran == ("a", "b", "c")
            assert (second.ran, second.already_done) == (("d",), ("b", "c"))
            assert waited >= 0.3
            assert await entries(pg.dsn, ledger) == ["a", "b", "c", "d"]
        finally:
            await one.close()
            await two.close()

    async def test_a_copy_rolled_back_elsewhere_is_taken_over(
        self, pg: PrivatePostgres, table: str, ledger: str
    ) -> None:
        one = PostgresDedupStore(pg.dsn, table=table)
        two = PostgresDedupStore(pg.dsn, table=table)
        try:
            await one.claim("warm-up", owner="x", lease=1)
            inside = asyncio.Event()
            effect = inserter(ledger, sleep=0.5, fail=True, inside=inside)
            first = asyncio.create_task(one.run_once_batch([Event(i) for i in "ab"], effect))
            await inside.wait()
            second = await two.run_once_batch([Event(i) for i in "abc"], inserter(ledger))
            with pytest.raises(RuntimeError):
                await first
            assert second.ran == ("a", "b", "c")
            assert await entries(pg.dsn, ledger) == ["a", "b", "c"]
        finally:
            await one.close()
            await two.close()

    async def test_batches_in_opposite_orders_do_not_deadlock(
        self, pg: PrivatePostgres, table: str, ledger: str
    ) -> None:
        """Marks are taken in id order, so crossing batches queue instead of deadlocking.

        Taken in batch order, this schedule deadlocks every time: the first
        batch queues for row a, the second takes z then queues for a behind
        it; once a is free the first wants z.
        """
        stores = [PostgresDedupStore(pg.dsn, table=table) for _ in range(2)]
        try:
            for store, message_id in zip(stores, "az", strict=True):
                await store.claim(message_id, owner="consumer", lease=60)  # rows a and z exist
            async with await psycopg.AsyncConnection.connect(pg.dsn) as blocker:
                await blocker.execute(f"SELECT 1 FROM {table} WHERE message_id = 'a' FOR UPDATE")
                first = asyncio.create_task(
                    stores[0].run_once_batch([Event("a"), Event("z")], inserter(ledger))
                )
                await lock_waiters(pg, 1)
                second = asyncio.create_task(
                    stores[1].run_once_batch([Event("z"), Event("a")], inserter(ledger))
                )
                await lock_waiters(pg, 2)
                await blocker.commit()
            results = await asyncio.gather(first, second)
            assert [result.ran for result in results] == [("a", "z"), ()]
            assert await entries(pg.dsn, ledger) == ["a", "z"]
        finally:
            for store in stores:
                await store.close()


async def lock_waiters(pg: PrivatePostgres, count: int) -> None:
    """Wait until ``count`` store connections wait on a lock."""
    query = (
        "SELECT count(*)::text FROM pg_stat_activity"
        " WHERE application_name = 'reliable-mq-dedup' AND wait_event_type = 'Lock'"
    )
    async with asyncio.timeout(10):
        while int((await rows(pg.dsn, query))[0]) < count:
            await asyncio.sleep(0.02)


class TestPostgresHostileBatches:
    async def test_empty_batch_does_nothing(self, store: PostgresDedupStore) -> None:
        async def effect(conn: PgConn, ids: list[str]) -> None:
            raise AssertionError("must not run")

        assert await store.run_once_batch([], effect) == BatchResult((), (), None)

    @pytest.mark.parametrize(
        ("bad", "match"),
        [
            (3, "no str message id: int"),
            (None, "no str message id: NoneType"),
            (Event(""), "empty message id"),
            ("x" * 256, "256 bytes"),
            ("é" * 128, "256 bytes"),
            ("nul\x00id", "NUL"),
            (object(), "no str message id: object"),
        ],
    )
    async def test_a_bad_id_anywhere_marks_nothing(
        self, store: PostgresDedupStore, pg: PrivatePostgres, table: str, bad: Any, match: str
    ) -> None:
        """The batch is checked whole before any statement: no partial marks."""
        await store.claim("warm-up", owner="x", lease=60)

        async def effect(conn: PgConn, ids: list[Any]) -> None:
            raise AssertionError("must not run")

        with pytest.raises(InvalidBatch, match=match):
            await store.run_once_batch(["good", bad, "later"], effect)
        async with await psycopg.AsyncConnection.connect(pg.dsn) as conn:
            with pytest.raises(InvalidBatch, match=match):
                await store.mark_batch_done_in(conn, ["good", bad])
        assert await marks(pg.dsn, table) == ["warm-up"]

    async def test_a_bare_string_is_not_a_batch(self, store: PostgresDedupStore) -> None:
        async def effect(conn: PgConn, ids: list[str]) -> None:
            raise AssertionError("must not run")

        with pytest.raises(InvalidBatch, match="not one string"):
            await store.run_once_batch("abc", effect)  # type: ignore[arg-type]

    async def test_longest_ids_and_a_batch_past_the_parameter_limit(
        self, store: PostgresDedupStore, pg: PrivatePostgres, table: str
    ) -> None:
        """255-byte ids pass; 70,000 ids (past 65,535 bind parameters) go in one statement."""
        ids = ["x" * 255, "é" * 127, *(f"bulk-{n}" for n in range(70_000))]
        seen: list[int] = []

        async def effect(conn: PgConn, new: list[str]) -> None:
            seen.append(len(new))

        result = await store.run_once_batch(ids, effect)
        assert len(result.ran) == len(ids) and seen == [len(ids)]
        again = await store.run_once_batch(ids[:3], effect)
        assert again.already_done == tuple(ids[:3])
        assert len(await marks(pg.dsn, table)) == len(ids)


class TestPostgresMarkBatchDoneIn:
    async def test_psycopg_connection(
        self, store: PostgresDedupStore, pg: PrivatePostgres, ledger: str
    ) -> None:
        await store.claim("warm-up", owner="x", lease=1)  # creates the table
        async with await psycopg.AsyncConnection.connect(pg.dsn) as conn:
            new = await store.mark_batch_done_in(conn, ["p1", "p2", "p1"])
            assert new == ["p1", "p2"]
            for message_id in new:
                await conn.execute(f"INSERT INTO {ledger} VALUES (%s, 1)", (message_id,))
            await conn.commit()
            assert await store.mark_batch_done_in(conn, [Event("p2"), Event("p3")]) == ["p3"]
            await conn.rollback()  # p3's mark goes with the caller's rollback
        assert await store.claim("p3", owner="x", lease=1) is ClaimResult.CLAIMED
        assert await entries(pg.dsn, ledger) == ["p1", "p2"]

    @pytest.mark.parametrize("driver", ["psycopg", "asyncpg"])
    async def test_sqlalchemy_session_and_connection(
        self, store: PostgresDedupStore, pg: PrivatePostgres, driver: str
    ) -> None:
        await store.claim("warm-up", owner="x", lease=1)
        engine = create_async_engine(f"postgresql+{driver}://postgres@127.0.0.1:{pg.port}/postgres")
        try:
            async with AsyncSession(engine) as session:
                assert await store.mark_batch_done_in(session, ["s1", "s2"]) == ["s1", "s2"]
                await session.commit()
            async with engine.connect() as conn:
                assert await store.mark_batch_done_in(conn, ["s2", "s3"]) == ["s3"]
                await conn.commit()
        finally:
            await engine.dispose()
        assert await store.claim("s3", owner="x", lease=1) is ClaimResult.DONE

    async def test_anything_else_is_a_type_error(self, store: PostgresDedupStore) -> None:
        with pytest.raises(TypeError, match="mark_batch_done_in"):
            await store.mark_batch_done_in(object(), ["a"])
        with pytest.raises(TypeError, match="mark_batch_done_in"):
            await store.mark_batch_done_in(object(), [])  # even with nothing to mark
        with pytest.raises(TypeError, match="mark_done_in"):
            await store.mark_done_in(object(), "a")


SLOW_COMMIT = """
CREATE TABLE {name} (n int);
CREATE FUNCTION {name}_sleep() RETURNS trigger LANGUAGE plpgsql AS
  $$ BEGIN PERFORM pg_sleep(1.5); RETURN NULL; END $$;
CREATE CONSTRAINT TRIGGER {name}_at_commit AFTER INSERT ON {name}
  DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {name}_sleep();
"""


@pytest.fixture(name="slow_commit")
async def _slow_commit(pg: PrivatePostgres) -> AsyncIterator[str]:
    """A table whose insert makes the transaction's COMMIT take 1.5 s on the server."""
    name = f"slow_{uuid.uuid4().hex[:8]}"
    async with await psycopg.AsyncConnection.connect(pg.dsn, autocommit=True) as conn:
        await conn.execute(SLOW_COMMIT.format(name=name).encode())
    yield name
    async with await psycopg.AsyncConnection.connect(pg.dsn, autocommit=True) as conn:
        await conn.execute(f"DROP TABLE {name}; DROP FUNCTION {name}_sleep()".encode())


class TestConnectionCutMidCommit:
    """The proxy cuts while COMMIT runs on the server; a retry applies exactly what is missing."""

    async def cut_during_commit(
        self, pg: PrivatePostgres, table: str, ledger: str, slow_commit: str, *, abort: bool
    ) -> PostgresDedupStore:
        async with TCPProxy("127.0.0.1", pg.port) as proxy:
            store = PostgresDedupStore(
                f"postgresql://postgres@127.0.0.1:{proxy.port}/postgres", table=table
            )
            write = inserter(ledger)

            async def effect(conn: PgConn, items: list[Event]) -> int:
                if abort:  # the server notices the lost client within 50 ms and rolls back
                    await conn.execute("SET LOCAL client_connection_check_interval = 50")
                await conn.execute(f"INSERT INTO {slow_commit} VALUES (1)")
                loop = asyncio.get_running_loop()
                loop.call_later(0.5, lambda: asyncio.ensure_future(proxy.cut()))
                return int(await write(conn, items))

            with pytest.raises(DedupStoreUnavailable):
                await store.run_once_batch([Event(f"m{n}") for n in range(50)], effect)
            await store.close()
        async with asyncio.timeout(10):  # until the orphaned backend has finished its COMMIT
            while await rows(
                pg.dsn,
                "SELECT pid::text FROM pg_stat_activity"
                " WHERE application_name = 'reliable-mq-dedup' AND state <> 'idle'",
            ):
                await asyncio.sleep(0.1)
        return PostgresDedupStore(pg.dsn, table=table)

    async def test_commit_that_landed_is_not_applied_again(
        self, pg: PrivatePostgres, table: str, ledger: str, slow_commit: str
    ) -> None:
        retry = await self.cut_during_commit(pg, table, ledger, slow_commit, abort=False)
        try:
            assert await entries(pg.dsn, ledger) == sorted(f"m{n}" for n in range(50))
            batch = [Event(f"m{n}") for n in range(60)]  # the same batch and 10 more
            result = await retry.run_once_batch(batch, inserter(ledger))
            assert result.ran == tuple(f"m{n}" for n in range(50, 60))
            assert await entries(pg.dsn, ledger) == sorted(f"m{n}" for n in range(60))
        finally:
            await retry.close()

    async def test_commit_that_did_not_land_is_applied_by_the_retry(
        self, pg: PrivatePostgres, table: str, ledger: str, slow_commit: str
    ) -> None:
        retry = await self.cut_during_commit(pg, table, ledger, slow_commit, abort=True)
        try:
            assert await entries(pg.dsn, ledger) == []
            assert await marks(pg.dsn, table) == []
            batch = [Event(f"m{n}") for n in range(60)]
            result = await retry.run_once_batch(batch, inserter(ledger))
            assert len(result.ran) == 60
            assert await entries(pg.dsn, ledger) == sorted(f"m{n}" for n in range(60))
        finally:
            await retry.close()


def sqlite_ledger(path: Path) -> list[str]:
    with sqlite3.connect(path) as conn:
        return [row[0] for row in conn.execute("SELECT message_id FROM ledger ORDER BY 1")]


def sqlite_insert(conn: sqlite3.Connection, items: list[Event]) -> int:
    conn.executemany(
        "INSERT INTO ledger VALUES (?, ?)", [(item.message_id, item.amount) for item in items]
    )
    return len(items)


@pytest.fixture(name="db")
def _db(tmp_path: Path) -> Path:
    path = tmp_path / "app.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE ledger (message_id TEXT, amount INT)")
    return path


class TestSQLiteRunOnceBatch:
    async def test_effect_gets_only_new_items_and_commits_with_their_marks(self, db: Path) -> None:
        store = SQLiteDedupStore(db)
        try:
            result = await store.run_once_batch([Event(i) for i in "abac"], sqlite_insert)
            assert result == BatchResult(("a", "b", "c"), (), 3)
            result = await store.run_once_batch([Event(i) for i in "cdb"], sqlite_insert)
            assert (result.ran, result.already_done) == (("d",), ("c", "b"))
            assert await store.claim("d", owner="x", lease=1) is ClaimResult.DONE
        finally:
            await store.close()
        assert sqlite_ledger(db) == ["a", "b", "c", "d"]

    async def test_a_failing_effect_keeps_no_mark(self, db: Path) -> None:
        store = SQLiteDedupStore(db)

        def broken(conn: sqlite3.Connection, items: list[Event]) -> None:
            sqlite_insert(conn, items)
            raise KeyError("boom")

        try:
            with pytest.raises(KeyError):
                await store.run_once_batch([Event("a"), Event("b")], broken)
            assert sqlite_ledger(db) == []
            assert (await store.run_once_batch([Event("a")], sqlite_insert)).ran == ("a",)
        finally:
            await store.close()

    async def test_hostile_batches_mark_nothing(self, db: Path) -> None:
        store = SQLiteDedupStore(db)
        try:
            assert await store.run_once_batch([], sqlite_insert) == BatchResult((), (), None)
            for bad in (7, "y" * 256, Event("")):
                with pytest.raises(InvalidBatch):
                    await store.run_once_batch(["ok", bad], sqlite_insert)
            ids = [f"n{n}" for n in range(40_000)]  # past SQLite's 32,766 variables
            result = await store.run_once_batch(ids, lambda conn, new: len(new))
            assert result.value == 40_000
            assert await store.claim("ok", owner="x", lease=1) is ClaimResult.CLAIMED
        finally:
            await store.close()

    async def test_two_stores_on_one_file_apply_each_id_once(self, db: Path) -> None:
        """Two consumers' stores with overlapping batches: BEGIN IMMEDIATE serialises them."""
        stores = [SQLiteDedupStore(db) for _ in range(2)]

        def slow(conn: sqlite3.Connection, items: list[Event]) -> int:
            time.sleep(0.2)
            return sqlite_insert(conn, items)

        try:
            results = await asyncio.gather(
                stores[0].run_once_batch([Event(i) for i in "abc"], slow),
                stores[1].run_once_batch([Event(i) for i in "cbd"], slow),
            )
            assert sorted(len(r.ran) for r in results) == [1, 3]  # one after the other
        finally:
            for store in stores:
                await store.close()
        assert sqlite_ledger(db) == ["a", "b", "c", "d"]

    async def test_mark_batch_done_in_own_connection(self, db: Path) -> None:
        store = SQLiteDedupStore(db)
        conn = sqlite3.connect(db, isolation_level=None)
        try:
            new = store.mark_batch_done_in(conn, ["a", "b", "a"])
            sqlite_insert(conn, [Event(i) for i in new])
            conn.execute("COMMIT")
            assert store.mark_batch_done_in(conn, [Event("b"), Event("c")]) == ["c"]
            conn.execute("ROLLBACK")
            assert store.mark_batch_done_in(conn, []) == []
            with pytest.raises(InvalidBatch):
                store.mark_batch_done_in(conn, [None])  # type: ignore[list-item]
            assert not conn.in_transaction
            assert await store.claim("c", owner="x", lease=1) is ClaimResult.CLAIMED
        finally:
            conn.close()
            await store.close()
        assert sqlite_ledger(db) == ["a", "b"]
