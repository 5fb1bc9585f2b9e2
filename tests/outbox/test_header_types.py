"""Issue 19, item 10: an outbox header keeps its type through storage, or ``add()`` refuses it.

A float header used to be stored as JSON ``1e+19``; PostgreSQL's jsonb keeps
numbers as ``numeric`` and gives back ``10000000000000000000``, an int that
does not fit an AMQP long, so the row went dead at publish; ``2.5e18`` arrived
as an int. These tests write through a real private PostgreSQL and a real
SQLite file, relay to the shared broker and compare each header's value and
type as a consumer reads them.
"""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from prometheus_client import CollectorRegistry

from reliable_mq import InvalidMessage
from reliable_mq.outbox import OutboxRelay, RelaySettings, add, add_sync, schema_sql
from reliable_mq.outbox.admin import create_schema, outbox_status
from tests.support.amqp import drain_queue
from tests.support.private_postgres import PrivatePostgres

pytestmark = pytest.mark.rabbitmq

HEADERS: dict[str, Any] = {
    "amount": 1e19,
    "large": 2.5e18,
    "huge": -1.7976931348623157e308,
    "tiny": 5e-324,
    "small": 1.5e-7,
    "whole": 3.0,
    "pi": 3.141592653589793,
    "int_max": 2**63 - 1,
    "int_min": -(2**63),
    "flag": True,
    "none": None,
    "text": "1e19",
    "nested": {"f": 1e16, "list": [1e17, 2, 0.5, {"deep": 1e300}]},
}


def _typed(value: Any) -> Any:
    """``value`` with the type of every number spelled out (1 and 1.0 differ)."""
    if isinstance(value, dict):
        return {key: _typed(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_typed(item) for item in value]
    return (type(value).__name__, value)


@pytest.fixture
async def table(pg: PrivatePostgres) -> AsyncIterator[str]:
    name = f"outbox_{uuid.uuid4().hex[:8]}"
    await create_schema(pg.dsn, table=name)
    yield name
    async with await psycopg.AsyncConnection.connect(pg.dsn, autocommit=True) as conn:
        await conn.execute(f"DROP TABLE {name}")


def _relay(dsn: str, url: str, table: str) -> OutboxRelay:
    return OutboxRelay(
        dsn,
        url,
        settings=RelaySettings(poll_interval=0.2),
        table=table,
        registry=CollectorRegistry(),
    )


async def _relay_all(dsn: str, url: str, table: str) -> None:
    async with _relay(dsn, url, table) as relay:
        while await relay.run_once():
            pass
        stats = relay.stats()
        assert (stats.dispatched, stats.dead) == (1, 0)


class TestHeaderTypes:
    async def test_postgres_keeps_floats_floats(
        self, pg: PrivatePostgres, table: str, broker_url: str, queue: str
    ) -> None:
        """jsonb storage: every header arrives with its value and its type; nothing goes dead."""
        async with await psycopg.AsyncConnection.connect(pg.dsn) as conn:
            await add(conn, b"x", routing_key=queue, headers=HEADERS, table=table)
            await conn.commit()
        await _relay_all(pg.dsn, broker_url, table)
        [message] = await drain_queue(broker_url, queue, idle_timeout=0.5)
        assert _typed(dict(message.headers)) == _typed(HEADERS)
        assert (await outbox_status(pg.dsn, table=table)).dead == 0

    async def test_sqlite_keeps_floats_floats(
        self, tmp_path: Path, broker_url: str, queue: str
    ) -> None:
        """The same headers through an SQLite file."""
        path = tmp_path / "app.db"
        conn = sqlite3.connect(path)
        for statement in schema_sql("sqlite"):
            conn.execute(statement)
        add_sync(conn, b"x", routing_key=queue, headers=HEADERS)
        conn.commit()
        conn.close()
        await _relay_all(str(path), broker_url, "reliable_mq_outbox")
        [message] = await drain_queue(broker_url, queue, idle_timeout=0.5)
        assert _typed(dict(message.headers)) == _typed(HEADERS)

    @pytest.mark.parametrize(
        ("headers", "match"),
        [
            ({"n": 2**63}, r"headers\['n'\]: 9223372036854775808 does not fit"),
            ({"n": -(2**63) - 1}, r"headers\['n'\]: -9223372036854775809 does not fit"),
            ({"outer": {"n": 10**20}}, r"headers\['outer'\]\['n'\]: 10{20} does not fit"),
            ({"l": [1, 2**64]}, r"headers\['l'\]\[1\]: 18446744073709551616 does not fit"),
            ({"k" * 129: 1}, "is 129 bytes of UTF-8; the limit is 128"),
            ({"outer": {1: "v"}}, "header names must be str"),
            ({"d": b"bytes"}, r"headers\['d'\]: a bytes is not a JSON value"),
        ],
    )
    async def test_add_refuses_what_could_never_be_published(
        self, pg: PrivatePostgres, table: str, tmp_path: Path, headers: Any, match: str
    ) -> None:
        """A header AMQP cannot carry is InvalidMessage at add(), naming it, on both backends."""
        async with await psycopg.AsyncConnection.connect(pg.dsn) as conn:
            with pytest.raises(InvalidMessage, match=match):
                await add(conn, b"x", routing_key="rk", headers=headers, table=table)
            await conn.rollback()
        lite = sqlite3.connect(tmp_path / "refuse.db")
        for statement in schema_sql("sqlite"):
            lite.execute(statement)
        with pytest.raises(InvalidMessage, match=match):
            add_sync(lite, b"x", routing_key="rk", headers=headers)
        lite.close()
