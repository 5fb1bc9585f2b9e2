"""``outbox.add()`` through every accepted connection, inside the caller's transaction only."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import psycopg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from reliable_mq import InvalidBody, InvalidMessage, MessageTooLarge
from reliable_mq.outbox import NotInTransaction, UnsupportedConnection, add, add_sync, schema_sql
from reliable_mq.outbox.admin import create_schema
from tests.support.private_postgres import PrivatePostgres


@pytest.fixture
async def table(pg: PrivatePostgres) -> AsyncIterator[str]:
    name = f"outbox_{uuid.uuid4().hex[:8]}"
    await create_schema(pg.dsn, table=name)
    yield name
    async with await psycopg.AsyncConnection.connect(pg.dsn, autocommit=True) as conn:
        await conn.execute(f"DROP TABLE {name}")


async def rows(dsn: str, table: str) -> list[tuple[Any, ...]]:
    """The table as another connection sees it (committed rows only)."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cursor = await conn.execute(
            f"SELECT message_id, exchange, routing_key, ordering_key, body, properties, state"
            f" FROM {table} ORDER BY id"
        )
        return list(await cursor.fetchall())


Writer = Callable[[str, str, bool], Awaitable[None]]


def _sa_url(pg: PrivatePostgres, driver: str) -> str:
    return f"postgresql+{driver}://postgres@127.0.0.1:{pg.port}/postgres"


async def _psycopg_async(pg: PrivatePostgres, table: str, mid: str, commit: bool) -> None:
    async with await psycopg.AsyncConnection.connect(pg.dsn) as conn:
        await add(conn, b"x", routing_key="rk", message_id=mid, table=table, ordering_key="k")
        assert await rows(pg.dsn, table) == []  # not visible before the caller's commit
        await (conn.commit() if commit else conn.rollback())


async def _psycopg_sync(pg: PrivatePostgres, table: str, mid: str, commit: bool) -> None:
    with psycopg.connect(pg.dsn) as conn:
        add_sync(conn, b"x", routing_key="rk", message_id=mid, table=table)
        await add(conn, b"y", routing_key="rk", message_id=mid + "-2", table=table)
        conn.commit() if commit else conn.rollback()


async def _asyncpg(pg: PrivatePostgres, table: str, mid: str, commit: bool) -> None:
    conn = await asyncpg.connect(pg.dsn)
    try:
        tx = conn.transaction()
        await tx.start()
        await add(conn, b"x", routing_key="rk", message_id=mid, table=table, ordering_key="k")
        await (tx.commit() if commit else tx.rollback())
    finally:
        await conn.close()


async def _sa_async(pg: PrivatePostgres, table: str, mid: str, commit: bool, driver: str) -> None:
    engine = create_async_engine(_sa_url(pg, driver))
    try:
        async with AsyncSession(engine) as session:
            await add(
                session, b"x", routing_key="rk", message_id=mid, table=table, ordering_key="k"
            )
            await (session.commit() if commit else session.rollback())
    finally:
        await engine.dispose()


async def _sa_sync(pg: PrivatePostgres, table: str, mid: str, commit: bool) -> None:
    engine = create_engine(_sa_url(pg, "psycopg"))
    try:
        with Session(engine) as session:
            add_sync(session, b"x", routing_key="rk", message_id=mid, table=table)
            session.commit() if commit else session.rollback()
        with engine.connect() as connection:
            add_sync(connection, b"x", routing_key="rk", message_id=mid + "-2", table=table)
            connection.commit() if commit else connection.rollback()
    finally:
        engine.dispose()


WRITERS: dict[str, Callable[..., Awaitable[None]]] = {
    "psycopg-async": _psycopg_async,
    "psycopg-sync": _psycopg_sync,
    "asyncpg": _asyncpg,
    "sqlalchemy-async-psycopg": lambda *a: _sa_async(*a, driver="psycopg"),
    "sqlalchemy-async-asyncpg": lambda *a: _sa_async(*a, driver="asyncpg"),
    "sqlalchemy-sync": _sa_sync,
}


class TestAddInTheCallersTransaction:
    @pytest.mark.parametrize("kind", sorted(WRITERS))
    async def test_commit_writes_and_rollback_does_not(
        self, kind: str, pg: PrivatePostgres, table: str
    ) -> None:
        """A committed add() is one pending row per event; a rolled-back one leaves nothing."""
        await WRITERS[kind](pg, table, "rolled-back", False)
        assert await rows(pg.dsn, table) == []
        await WRITERS[kind](pg, table, "m1", True)
        found = await rows(pg.dsn, table)
        assert found, kind
        assert {r[0] for r in found} <= {"m1", "m1-2"}
        message_id, exchange, routing_key, _, body, properties, state = found[0]
        assert (message_id, exchange, routing_key, state) == ("m1", "", "rk", "pending")
        assert bytes(body) == b"x"
        assert properties["content_type"] == "application/octet-stream"

    async def test_sqlite3_connection(self, tmp_path: Path) -> None:
        """The standard library's sqlite3 works too; its implicit transaction is the caller's."""
        path = tmp_path / "app.db"
        conn = sqlite3.connect(path)
        for statement in schema_sql("sqlite"):
            conn.execute(statement)
        conn.commit()
        add_sync(conn, {"a": 1}, routing_key="rk", message_id="s1", headers={"h": "v"})
        conn.rollback()
        mid = add_sync(conn, {"a": 1}, routing_key="rk", headers={"h": "v"})
        conn.commit()
        body, props = conn.execute("SELECT body, properties FROM reliable_mq_outbox").fetchone()
        assert json.loads(body) == {"a": 1}
        assert json.loads(props)["headers"] == {"h": "v"}
        assert conn.execute("SELECT message_id FROM reliable_mq_outbox").fetchall() == [(mid,)]
        conn.close()

    async def test_sqlalchemy_sqlite(self, tmp_path: Path) -> None:
        engine = create_engine(f"sqlite:///{tmp_path / 'sa.db'}")
        with engine.begin() as connection:
            for statement in schema_sql("sqlite"):
                connection.execute(text(statement))
        with Session(engine) as session:
            await add(session, "text body", routing_key="rk", message_id="sa1")
            session.commit()
        with engine.connect() as connection:
            found = connection.execute(
                text("SELECT message_id, body FROM reliable_mq_outbox")
            ).all()
        assert [(m, bytes(b)) for m, b in found] == [("sa1", b"text body")]
        engine.dispose()

    async def test_same_key_writers_commit_in_id_order(
        self, pg: PrivatePostgres, table: str
    ) -> None:
        """A second transaction writing the same ordering key waits for the first's commit."""
        first = await psycopg.AsyncConnection.connect(pg.dsn)
        second = await psycopg.AsyncConnection.connect(pg.dsn)
        try:
            await add(
                first, b"1", routing_key="rk", message_id="first", ordering_key="K", table=table
            )
            blocked = asyncio.ensure_future(
                add(
                    second,
                    b"2",
                    routing_key="rk",
                    message_id="second",
                    ordering_key="K",
                    table=table,
                )
            )
            await asyncio.sleep(0.5)
            assert not blocked.done(), "the second writer of key K did not wait"
            await first.commit()
            await asyncio.wait_for(blocked, 10)
            await second.commit()
        finally:
            await first.close()
            await second.close()
        assert [r[0] for r in await rows(pg.dsn, table)] == ["first", "second"]


class TestRefused:
    async def test_autocommit_without_transaction(
        self, pg: PrivatePostgres, table: str, tmp_path: Path
    ) -> None:
        """No open transaction: NotInTransaction, and nothing written."""
        async with await psycopg.AsyncConnection.connect(pg.dsn, autocommit=True) as conn:
            with pytest.raises(NotInTransaction):
                await add(conn, b"x", routing_key="rk", table=table)
            async with conn.transaction():
                await add(conn, b"x", routing_key="rk", table=table, message_id="in-tx")
        raw = await asyncpg.connect(pg.dsn)
        try:
            with pytest.raises(NotInTransaction):
                await add(raw, b"x", routing_key="rk", table=table)
        finally:
            await raw.close()
        lite = sqlite3.connect(tmp_path / "a.db", isolation_level=None)
        with pytest.raises(NotInTransaction):
            add_sync(lite, b"x", routing_key="rk")
        lite.close()
        assert [r[0] for r in await rows(pg.dsn, table)] == ["in-tx"]

    async def test_unsupported_connections(self, pg: PrivatePostgres) -> None:
        with pytest.raises(UnsupportedConnection, match="cannot write through"):
            await add(object(), b"x", routing_key="rk")
        async with await psycopg.AsyncConnection.connect(pg.dsn) as conn:
            with pytest.raises(UnsupportedConnection, match="await add"):
                add_sync(conn, b"x", routing_key="rk")
        assert issubclass(UnsupportedConnection, TypeError)

    @pytest.mark.parametrize(
        ("kwargs", "error", "match"),
        [
            ({"body": b"x" * 2001, "max_body": 2000}, MessageTooLarge, "2001 bytes"),
            ({"body": {"v": float("nan")}}, InvalidBody, "cannot encode"),
            ({"body": object()}, InvalidBody, "cannot encode"),
            ({"routing_key": 42}, InvalidMessage, "routing_key must be a str, not int"),
            ({"routing_key": b"rk"}, InvalidMessage, "routing_key must be a str"),
            ({"routing_key": "r" * 256}, InvalidMessage, "longer than 255"),
            ({"exchange": None}, InvalidMessage, "exchange must be a str"),
            ({"ordering_key": "a\x00b"}, InvalidMessage, "NUL"),
            ({"message_id": ""}, InvalidMessage, "must not be empty"),
            ({"headers": {"v": float("inf")}}, InvalidMessage, "not a finite number"),
            ({"headers": {"v": object()}}, InvalidMessage, "not an AMQP header value"),
            ({"headers": {"v": "a\x00"}}, InvalidMessage, "NUL"),
            ({"headers": {1: "v"}}, InvalidMessage, "str keys"),
        ],
    )
    async def test_hostile_input_is_a_typed_error_and_the_transaction_lives(
        self, pg: PrivatePostgres, table: str, kwargs: dict[str, Any], error: type, match: str
    ) -> None:
        """Bad input raises before any SQL runs, so the caller's transaction can still commit."""
        call: dict[str, Any] = {"body": b"ok", "routing_key": "rk", "table": table, **kwargs}
        body = call.pop("body")
        async with await psycopg.AsyncConnection.connect(pg.dsn) as conn:
            with pytest.raises(error, match=match):
                await add(conn, body, **call)
            await add(conn, b"fine", routing_key="rk", table=table, message_id="after")
            await conn.commit()
        assert [r[0] for r in await rows(pg.dsn, table)] == ["after"]

    def test_table_names_are_identifiers(self) -> None:
        with pytest.raises(ValueError, match="identifier"):
            schema_sql("postgres", "x; DROP TABLE y")
        with pytest.raises(ValueError, match="identifier"):
            asyncio.run(add(object(), b"x", routing_key="rk", table="Robert'); --"))
