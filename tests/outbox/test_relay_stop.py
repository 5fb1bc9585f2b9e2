"""Issue 19, item 10: the relay's stop line reports the backlog as it is then, not as it was.

The backlog is measured every ``stats_interval`` (5 s); a relay that measured
``pending=1`` before publishing that row used to log ``pending=1`` at stop
while ``outbox status`` said 0. Real private PostgreSQL, a real SQLite file,
the shared broker.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from reliable_mq.outbox import OutboxRelay, RelaySettings, add, add_sync, schema_sql
from reliable_mq.outbox.admin import create_schema, outbox_status
from tests.support.amqp import drain_queue
from tests.support.private_postgres import PrivatePostgres, running_private_postgres

pytestmark = pytest.mark.rabbitmq


@pytest.fixture
async def table(pg: PrivatePostgres) -> AsyncIterator[str]:
    name = f"outbox_{uuid.uuid4().hex[:8]}"
    await create_schema(pg.dsn, table=name)
    yield name
    async with await psycopg.AsyncConnection.connect(pg.dsn, autocommit=True) as conn:
        await conn.execute(f"DROP TABLE {name}")


async def _until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def _run_then_stop(
    make: Callable[[], OutboxRelay], rows: int
) -> tuple[OutboxRelay, list[dict[str, Any]]]:
    """Run a relay until it dispatched ``rows``, stop and close it; its ``outbox_relay_stopped``
    events (made inside ``capture_logs``: the relay's logger is bound when it is made)."""
    with capture_logs() as logs:
        relay = make()
        async with relay:
            running = asyncio.ensure_future(relay.run())
            try:
                await _until(lambda: relay.stats().dispatched == rows, 30, "the relay")
            finally:
                relay.stop()
                await asyncio.wait_for(running, 10)
    return relay, [e for e in logs if e["event"] == "outbox_relay_stopped"]


def _relay(database: str, url: str, table: str) -> OutboxRelay:
    return OutboxRelay(
        database,
        url,
        settings=RelaySettings(poll_interval=0.1, stats_interval=60),
        table=table,
        registry=CollectorRegistry(),
    )


class TestStopLine:
    async def test_postgres_logs_the_backlog_at_stop(
        self, pg: PrivatePostgres, table: str, broker_url: str, queue: str
    ) -> None:
        """One row measured pending, then published: the stop line says 0, as `status` does."""
        async with await psycopg.AsyncConnection.connect(pg.dsn) as conn:
            await add(conn, b"x", routing_key=queue, table=table)
            await conn.commit()
        relay, [stopped] = await _run_then_stop(lambda: _relay(pg.dsn, broker_url, table), 1)
        assert (await outbox_status(pg.dsn, table=table)).pending == 0
        assert stopped["pending"] == 0, stopped
        assert stopped["dispatched"] == 1
        assert relay.stats().pending == 0
        assert len(await drain_queue(broker_url, queue, idle_timeout=0.3)) == 1

    async def test_sqlite_logs_the_backlog_at_stop(
        self, tmp_path: Path, broker_url: str, queue: str
    ) -> None:
        """The same through an SQLite file."""
        path = tmp_path / "app.db"
        conn = sqlite3.connect(path)
        for statement in schema_sql("sqlite"):
            conn.execute(statement)
        add_sync(conn, b"x", routing_key=queue)
        add_sync(conn, b"y", routing_key=queue)
        conn.commit()
        _, [stopped] = await _run_then_stop(
            lambda: _relay(str(path), broker_url, "reliable_mq_outbox"), 2
        )
        assert stopped["pending"] == 0, stopped
        assert (await outbox_status(path)).pending == 0
        conn.close()
        assert len(await drain_queue(broker_url, queue, idle_timeout=0.3)) == 2

    async def test_a_dead_database_at_stop_says_unknown_and_does_not_hang(
        self, broker_url: str, queue: str
    ) -> None:
        """The server killed while the relay runs: close() returns within its bound, pending=None."""
        with running_private_postgres() as server:
            await create_schema(server.dsn)
            async with await psycopg.AsyncConnection.connect(server.dsn) as conn:
                await add(conn, b"x", routing_key=queue)
                await conn.commit()
            with capture_logs() as logs:
                relay = _relay(server.dsn, broker_url, "reliable_mq_outbox")
                async with relay:
                    running = asyncio.ensure_future(relay.run())
                    await _until(lambda: relay.stats().dispatched == 1, 30, "the row")
                    server.kill()
                    relay.stop()
                    await asyncio.wait_for(running, 10)
                    started = time.monotonic()
                closed_in = time.monotonic() - started
        [stopped] = [e for e in logs if e["event"] == "outbox_relay_stopped"]
        assert stopped["pending"] is None and stopped["oldest_age"] is None, stopped
        assert closed_in < 10, closed_in
        await drain_queue(broker_url, queue, idle_timeout=0.3)
