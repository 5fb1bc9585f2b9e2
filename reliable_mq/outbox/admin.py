"""Outbox chores for the CLI and for migrations: create the table, look at it, revive dead rows.

Each function opens its own short connection (PostgreSQL through psycopg,
SQLite through the standard library) and raises ``OutboxUnavailable`` with
the DSN's password redacted when the database cannot be used.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ._dsn import dialect_of, error_text, sqlite_path
from ._schema import DEFAULT_TABLE, Dialect, RowState, check_table_name, schema_sql
from .errors import OutboxUnavailable

__all__ = (
    "DeadRow",
    "OutboxStatus",
    "cleanup",
    "create_schema",
    "dead_rows",
    "outbox_status",
    "requeue_dead",
)


@dataclass(frozen=True, slots=True)
class OutboxStatus:
    """What an outbox table holds now."""

    pending: int
    oldest_pending_age: float
    sent: int
    dead: int


@dataclass(frozen=True, slots=True)
class DeadRow:
    """A row the relay moved to ``dead``, with its reason."""

    id: int
    message_id: str
    exchange: str
    routing_key: str
    ordering_key: str | None
    attempts: int
    last_error: str


Statement = tuple[str, Sequence[Any]]

_INIT_LOCK = 0x726D_716F_7574_626F  # "rmqoutbo" in ASCII: the schema-creation lock key


async def create_schema(database: str | os.PathLike[str], *, table: str = DEFAULT_TABLE) -> None:
    """Create the outbox table, its indexes (and NOTIFY trigger) if missing: idempotent."""
    dialect = dialect_of(database)
    statements: list[Statement] = [(s, ()) for s in schema_sql(dialect, check_table_name(table))]
    if dialect is Dialect.POSTGRES:
        # Two processes running init at once would collide in the catalogs.
        statements.insert(0, ("SELECT pg_advisory_xact_lock(%s)", (_INIT_LOCK,)))
    await _execute(database, statements)


async def outbox_status(
    database: str | os.PathLike[str], *, table: str = DEFAULT_TABLE
) -> OutboxStatus:
    """Count rows per state and measure the oldest pending row's age (seconds)."""
    table = check_table_name(table)
    if dialect_of(database) is Dialect.SQLITE:
        age = "((julianday('now') - 2440587.5) * 86400.0 - min(created_at))"
    else:
        age = "extract(epoch FROM now() - min(created_at))::float8"
    query = f"SELECT state, count(*), {age} FROM {table} GROUP BY state"
    (rows,) = await _execute(database, [(query, ())])
    counts = {str(state): (int(n), float(a or 0)) for state, n, a in rows}
    pending = counts.get(RowState.PENDING.value, (0, 0.0))
    return OutboxStatus(
        pending=pending[0],
        oldest_pending_age=max(0.0, pending[1]),
        sent=counts.get(RowState.SENT.value, (0, 0.0))[0],
        dead=counts.get(RowState.DEAD.value, (0, 0.0))[0],
    )


async def dead_rows(
    database: str | os.PathLike[str], *, table: str = DEFAULT_TABLE, limit: int = 100
) -> list[DeadRow]:
    """The oldest ``limit`` dead rows, with the reason each was refused."""
    table = check_table_name(table)
    mark = "?" if dialect_of(database) is Dialect.SQLITE else "%s"
    query = (
        "SELECT id, message_id, exchange, routing_key, ordering_key, attempts, last_error "
        f"FROM {table} WHERE state = 'dead' ORDER BY id LIMIT {mark}"
    )
    (rows,) = await _execute(database, [(query, (limit,))])
    return [DeadRow(int(r[0]), r[1], r[2], r[3], r[4], int(r[5]), r[6] or "") for r in rows]


async def requeue_dead(
    database: str | os.PathLike[str],
    *,
    table: str = DEFAULT_TABLE,
    ids: Sequence[int] | None = None,
) -> int:
    """Make dead rows pending again (all, or those in ``ids``); return how many.

    A revived row keeps its id, so it goes out before newer rows of its
    ordering key that are still pending.
    """
    table = check_table_name(table)
    sqlite = dialect_of(database) is Dialect.SQLITE
    available = "0" if sqlite else "'-infinity'"
    query = (
        f"UPDATE {table} SET state = 'pending', done_at = NULL, attempts = 0, "
        f"available_at = {available} WHERE state = 'dead'"
    )
    params: tuple[Any, ...] = ()
    if ids is not None:
        if not ids:
            return 0
        if sqlite:
            query += f" AND id IN ({','.join('?' * len(ids))})"
            params = tuple(int(i) for i in ids)
        else:
            query += " AND id = ANY(%s::bigint[])"
            params = ([int(i) for i in ids],)
    (rows,) = await _execute(database, [(query + " RETURNING id", params)])
    return len(rows)


async def cleanup(
    database: str | os.PathLike[str],
    *,
    table: str = DEFAULT_TABLE,
    keep_sent: float = 0.0,
    keep_dead: float | None = 7 * 86_400.0,
    batch: int = 1000,
) -> int:
    """Delete ``sent`` rows older than ``keep_sent`` seconds and ``dead`` rows older than
    ``keep_dead`` (never if None), ``batch`` rows per transaction; return how many."""
    table = check_table_name(table)
    sqlite = dialect_of(database) is Dialect.SQLITE
    total = 0
    for state, keep in ((RowState.SENT, keep_sent), (RowState.DEAD, keep_dead)):
        if keep is None:
            continue
        while True:
            if sqlite:
                query = (
                    f"DELETE FROM {table} WHERE id IN (SELECT id FROM {table} WHERE state = ?"
                    " AND done_at < ? ORDER BY done_at LIMIT ?) RETURNING id"
                )
                params: tuple[Any, ...] = (state.value, time.time() - keep, batch)
            else:
                query = (
                    f"DELETE FROM {table} WHERE id IN (SELECT id FROM {table} WHERE state = %s"
                    " AND done_at < now() - make_interval(secs => %s) ORDER BY done_at"
                    " LIMIT %s FOR UPDATE SKIP LOCKED) RETURNING id"
                )
                params = (state.value, float(keep), batch)
            (rows,) = await _execute(database, [(query, params)])
            total += len(rows)
            if len(rows) < batch:
                break
    return total


async def _execute(
    database: str | os.PathLike[str], statements: list[Statement]
) -> list[list[tuple[Any, ...]]]:
    """Run ``statements`` in one transaction on a short-lived connection; their rows."""
    if dialect_of(database) is Dialect.SQLITE:
        return await asyncio.to_thread(_execute_sqlite, sqlite_path(database), statements)
    import psycopg  # noqa: PLC0415 (the postgres extra)

    results: list[list[tuple[Any, ...]]] = []
    try:
        async with await psycopg.AsyncConnection.connect(
            os.fspath(database), connect_timeout=10
        ) as conn:
            async with conn.transaction():
                for query, params in statements:
                    cursor = await conn.execute(query.encode(), params)
                    results.append(await cursor.fetchall() if cursor.description else [])
    except psycopg.Error as exc:
        raise OutboxUnavailable(f"PostgreSQL: {error_text(exc)}") from None
    return results


def _execute_sqlite(
    path: os.PathLike[str], statements: list[Statement]
) -> list[list[tuple[Any, ...]]]:
    try:
        conn = sqlite3.connect(path, timeout=10, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            results = [conn.execute(query, params).fetchall() for query, params in statements]
            conn.execute("COMMIT")
            return results
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise OutboxUnavailable(f"SQLite outbox {os.fspath(path)!r}: {exc}") from None
