"""The inbox: a de-duplication store in PostgreSQL, shared by every consumer on every host.

Each message id is one row of ``reliable_mq_dedup``: ``owner`` and a lease end
while claimed, ``owner IS NULL`` and a retention end once done. A claim is one
upsert that succeeds only over a missing or expired row, so two consumers
never hold one id at once (the Redis store's claim/lease semantics, with the
database's clock as the one clock).

Exactly-once effects: when the handler writes its effect into the same
database, [run_once][reliable_mq.dedup.postgres.PostgresDedupStore.run_once]
commits the effect and the *done* mark in one transaction, so a consumer
killed after the commit but before its ack cannot apply it twice:

```python
async def credit(conn: psycopg.AsyncConnection) -> None:
    await conn.execute("UPDATE account SET balance = balance + 10 WHERE id = 1")

await store.run_once(delivery.message_id, credit)  # AlreadyProcessed: ack and skip
```

For many messages at once, `run_once_batch` marks a batch's ids and commits
them with the effect in one transaction; the effect gets only the new ones.

Needs the ``postgres`` extra (from a clone: ``pip install '.[postgres]'``).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar

try:
    import psycopg
    from psycopg import sql
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    from .._extras import missing_extra

    raise ImportError(missing_extra("PostgresDedupStore needs psycopg 3", "postgres")) from exc

from .._sql import check_table_name, error_text
from ._batch import BatchResult, HasMessageId, Item, check_batch, split
from .base import AlreadyProcessed, ClaimResult, DedupStoreUnavailable

__all__ = ("PostgresDedupStore",)

T = TypeVar("T")

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS {t} ("
    " message_id text PRIMARY KEY,"
    " owner text,"  # NULL once done
    " expires_at timestamptz NOT NULL"  # lease end while claimed, retention end once done
    ")",
    "CREATE INDEX IF NOT EXISTS {i} ON {t} (expires_at)",
)
# One round trip: the upsert claims a missing or expired id; the outer SELECT
# sees the row as it was before (done or busy) when the upsert did nothing.
_CLAIM = (
    "WITH claimed AS ("
    " INSERT INTO {t} AS d (message_id, owner, expires_at)"
    " VALUES (%(id)s, %(owner)s, clock_timestamp() + make_interval(secs => %(lease)s))"
    " ON CONFLICT (message_id) DO UPDATE SET owner = excluded.owner, expires_at = excluded.expires_at"
    " WHERE d.expires_at <= clock_timestamp() RETURNING 1)"
    " SELECT (SELECT count(*) FROM claimed), (SELECT owner IS NULL FROM {t} WHERE message_id = %(id)s)"
)
_MARK_DONE = (
    "INSERT INTO {t} AS d (message_id, owner, expires_at)"
    " VALUES (%(id)s, NULL, clock_timestamp() + make_interval(secs => %(keep)s))"
    " ON CONFLICT (message_id) DO UPDATE SET owner = NULL, expires_at = excluded.expires_at"
)
# Refuses an id another transaction already made done (and still remembers).
_MARK_DONE_ONCE = _MARK_DONE + " WHERE d.owner IS NOT NULL OR d.expires_at <= clock_timestamp()"
# A batch's marks in one statement: one array parameter, so no limit on the
# batch's size. The ids come sorted, so two batches sharing ids lock them in
# one order: the later waits for the earlier's commit, and never deadlocks.
_MARK_BATCH_ONCE = (
    "INSERT INTO {t} AS d (message_id, owner, expires_at)"
    " SELECT u.id, NULL, clock_timestamp() + make_interval(secs => %(keep)s)"
    " FROM unnest(CAST(%(ids)s AS text[])) AS u(id)"
    " ON CONFLICT (message_id) DO UPDATE SET owner = NULL, expires_at = excluded.expires_at"
    " WHERE d.owner IS NOT NULL OR d.expires_at <= clock_timestamp()"
    " RETURNING d.message_id"
)
_SCHEMA_LOCK = 0x726D_7164_6564_7570  # "rmqdedup" in ASCII: the schema-creation lock key
_RELEASE = "DELETE FROM {t} WHERE message_id = %(id)s AND owner = %(owner)s"
_PURGE = (
    "DELETE FROM {t} WHERE message_id IN (SELECT message_id FROM {t}"
    " WHERE expires_at <= clock_timestamp() LIMIT 1000 FOR UPDATE SKIP LOCKED)"
)


_TEMPLATES = {"done_once": _MARK_DONE_ONCE, "batch_once": _MARK_BATCH_ONCE}


class _EffectFailed(Exception):
    """Carries an exception from a ``run_once`` effect past the store-error mapping."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class PostgresDedupStore:
    """A [DedupStore][reliable_mq.dedup.DedupStore] (and inbox) in PostgreSQL.

    Args:
        dsn: a libpq URL or keyword string (its password is never shown).
        table: the table, created on first use (``reliable_mq_dedup``).
        retention: seconds a done id is remembered.
        pool_size: connections kept open at most (calls beyond wait their turn).
        connect_timeout: seconds to wait for a connection before a call fails.
        statement_timeout: seconds one store statement may run before it fails.
        purge_interval: seconds between deletions of expired rows.
    """

    def __init__(
        self,
        dsn: str,
        *,
        table: str = "reliable_mq_dedup",
        retention: float = 7 * 86_400,
        pool_size: int = 4,
        connect_timeout: float = 5.0,
        statement_timeout: float = 10.0,
        purge_interval: float = 60.0,
    ) -> None:
        if retention <= 0:
            raise ValueError("retention must be positive")
        if pool_size < 1:
            raise ValueError("pool_size must be at least 1")
        self.table = check_table_name(table, what="dedup table")
        self.retention = float(retention)
        self._dsn = dsn
        self._sql = {
            name: sql.SQL(text).format(
                t=sql.SQL(self.table), i=sql.Identifier(self.table.replace(".", "_") + "_expires")
            )
            for name, text in (
                ("claim", _CLAIM),
                ("done", _MARK_DONE),
                ("done_once", _MARK_DONE_ONCE),
                ("batch_once", _MARK_BATCH_ONCE),
                ("release", _RELEASE),
                ("purge", _PURGE),
                ("schema0", _SCHEMA[0]),
                ("schema1", _SCHEMA[1]),
            )
        }
        self._connect_timeout = connect_timeout
        self._statement_timeout = statement_timeout
        self._purge_interval = purge_interval
        self._next_purge = 0.0
        self._idle: list[psycopg.AsyncConnection[Any]] = []
        self._slots = asyncio.Semaphore(pool_size)
        self._schema_ready = False
        self._schema_lock = asyncio.Lock()
        self._closed = False

    # -- DedupStore -----------------------------------------------------------------

    async def claim(self, message_id: str, *, owner: str, lease: float) -> ClaimResult:
        """Claim ``message_id`` (see [DedupStore.claim][reliable_mq.dedup.DedupStore.claim])."""
        if lease <= 0:
            raise ValueError("lease must be positive")
        params = {"id": message_id, "owner": owner, "lease": float(lease)}
        async with self._connection() as conn:
            await self._maybe_purge(conn)
            cursor = await conn.execute(self._sql["claim"], params)
            record = await cursor.fetchone()
        assert record is not None
        claimed, done = record
        if claimed:
            return ClaimResult.CLAIMED
        return ClaimResult.DONE if done else ClaimResult.BUSY

    async def complete(self, message_id: str, *, owner: str) -> None:
        """Mark ``message_id`` done (see [DedupStore.complete][reliable_mq.dedup.DedupStore.complete])."""
        async with self._connection() as conn:
            await conn.execute(self._sql["done"], {"id": message_id, "keep": self.retention})

    async def release(self, message_id: str, *, owner: str) -> None:
        """Drop ``owner``'s claim (see [DedupStore.release][reliable_mq.dedup.DedupStore.release])."""
        async with self._connection() as conn:
            await conn.execute(self._sql["release"], {"id": message_id, "owner": owner})

    async def close(self) -> None:
        """Close every connection; later calls raise ``DedupStoreUnavailable``."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            with contextlib.suppress(psycopg.Error, OSError):
                await conn.close()

    # -- the inbox ---------------------------------------------------------------------

    async def run_once(
        self, message_id: str, effect: Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]]
    ) -> T:
        """Run ``await effect(conn)`` and mark ``message_id`` done in one transaction.

        ``effect`` gets a connection of the store's pool inside an open
        transaction; it must not commit or roll back. If it raises, nothing is
        kept and its exception propagates unchanged.

        Raises:
            AlreadyProcessed: another copy already committed (nothing was kept).
            DedupStoreUnavailable: the database failed (nothing was kept, or the
                commit's outcome is unknown: a redelivery then finds it done or not).
        """
        try:
            async with self._connection() as conn, conn.transaction():
                try:
                    result = await effect(conn)
                except BaseException as exc:
                    raise _EffectFailed(exc) from exc
                await self._mark_once(conn, message_id)
                return result
        except _EffectFailed as failed:
            raise failed.error from None

    async def run_once_batch(
        self,
        items: Iterable[Item],
        effect: Callable[[psycopg.AsyncConnection[Any], list[Item]], Awaitable[T]],
    ) -> BatchResult[T]:
        """Mark a batch's ids done and run ``await effect(conn, new)`` in one transaction.

        ``items`` are message ids or deliveries (anything with a
        ``message_id``); an id repeated in the batch counts once. One
        statement marks every id not done yet; ``effect`` then gets the
        connection, inside the open transaction, and only the items of those
        ids, in batch order. The effect's writes and the marks commit
        together: after a crash either both are there or neither. If no id is
        new, ``effect`` does not run. It must not commit or roll back; if it
        raises, nothing is kept (no mark either) and its exception propagates
        unchanged.

        A copy of an id in flight in another transaction (another consumer)
        makes this call wait for that commit, then leaves the id out (or, if
        that transaction rolled back, takes it): copies never run together.

        Raises:
            InvalidBatch: an id is not a non-empty ``str`` of at most 255
                bytes (checked before anything is written).
            DedupStoreUnavailable: the database failed. Nothing was kept, or
                the commit's outcome is unknown: running the batch again
                applies exactly what is missing.
        """
        kept, ids = check_batch(items)
        if not ids:
            return BatchResult((), (), None)
        value: T | None = None
        try:
            async with self._connection() as conn, conn.transaction():
                new = await self._mark_batch(conn, ids)
                todo, ran, done = split(kept, ids, new)
                if todo:
                    try:
                        value = await effect(conn, todo)
                    except BaseException as exc:
                        raise _EffectFailed(exc) from exc
        except _EffectFailed as failed:
            raise failed.error from None
        return BatchResult(ran, done, value)

    async def mark_done_in(self, connection: Any, message_id: str) -> None:
        """Mark ``message_id`` done inside ``connection``'s open transaction.

        For handlers that write their effect through their own connection to
        this database: a psycopg 3 ``AsyncConnection``, or a SQLAlchemy
        ``AsyncSession``/``AsyncConnection``. Commit or roll back stays yours.
        The table must exist (any store call creates it).

        Raises:
            AlreadyProcessed: another transaction already marked it done; roll back.
            TypeError: ``connection`` is none of those.
        """
        params = {"id": message_id, "keep": self.retention}
        rowcount, _ = await self._execute_in(connection, "done_once", params, returning=False)
        if rowcount == 0:
            raise AlreadyProcessed(message_id)

    async def mark_batch_done_in(
        self, connection: Any, items: Iterable[str | HasMessageId]
    ) -> list[str]:
        """Mark a batch's ids done inside ``connection``'s open transaction.

        The batch form of `mark_done_in`, for the same connections. Write the
        effect for the returned ids only, then commit: the marks and the
        effect commit together. Ids another transaction holds make it wait
        for that commit, as in `run_once_batch`.

        Returns:
            The ids that were not done yet, in batch order, each once.

        Raises:
            InvalidBatch: an id is not a non-empty ``str`` of at most 255
                bytes (checked before anything is written).
            TypeError: ``connection`` is none of those.
        """
        _, ids = check_batch(items)
        _is_psycopg(connection, "mark_batch_done_in")
        if not ids:
            return []
        params = {"ids": sorted(ids), "keep": self.retention}
        _, rows = await self._execute_in(connection, "batch_once", params, returning=True)
        _, ran, _ = split(ids, ids, rows)
        return list(ran)

    async def _execute_in(
        self, connection: Any, name: str, params: Mapping[str, object], *, returning: bool
    ) -> tuple[int, list[str]]:
        """Run one of the store's statements on a caller's connection: rowcount and ids."""
        if _is_psycopg(connection, "mark_batch_done_in" if returning else "mark_done_in"):
            cursor = await connection.execute(self._sql[name], params)
            rows = await cursor.fetchall() if returning else []
            return cursor.rowcount, [row[0] for row in rows]
        from sqlalchemy import text  # noqa: PLC0415 (the caller uses SQLAlchemy)

        query = _TEMPLATES[name].format(t=self.table)
        for key in params:
            query = query.replace(f"%({key})s", f":{key}")
        result = await connection.execute(text(query), dict(params))
        found = [row[0] for row in result.fetchall()] if returning else []
        return result.rowcount, found

    async def _mark_batch(self, conn: psycopg.AsyncConnection[Any], ids: list[str]) -> list[str]:
        params = {"ids": sorted(ids), "keep": self.retention}
        cursor = await conn.execute(self._sql["batch_once"], params)
        return [row[0] for row in await cursor.fetchall()]

    async def _mark_once(self, conn: psycopg.AsyncConnection[Any], message_id: str) -> None:
        cursor = await conn.execute(
            self._sql["done_once"], {"id": message_id, "keep": self.retention}
        )
        if cursor.rowcount == 0:
            raise AlreadyProcessed(message_id)

    # -- connections ----------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A pooled autocommit connection; database errors become ``DedupStoreUnavailable``."""
        if self._closed:
            raise DedupStoreUnavailable("the dedup store is closed")
        async with self._slots:
            conn = self._idle.pop() if self._idle else None
            healthy = True
            try:
                if conn is None or conn.closed:
                    conn = await self._connect()
                yield conn
            except psycopg.Error as exc:
                healthy = False
                raise DedupStoreUnavailable(f"PostgreSQL dedup store: {error_text(exc)}") from None
            except BaseException:
                healthy = conn is not None and not conn.closed and _idle_in(conn)
                raise
            finally:
                if conn is not None:
                    if healthy and not self._closed and not conn.closed and _idle_in(conn):
                        self._idle.append(conn)
                    else:
                        with contextlib.suppress(psycopg.Error, OSError):
                            await conn.close()

    async def _connect(self) -> psycopg.AsyncConnection[Any]:
        conn = await psycopg.AsyncConnection.connect(
            self._dsn,
            autocommit=True,
            connect_timeout=max(1, round(self._connect_timeout)),
            application_name="reliable-mq-dedup",
        )
        try:
            millis = round(self._statement_timeout * 1000)
            await conn.execute(f"SET statement_timeout = {millis}")
            if not self._schema_ready:
                await self._create_schema(conn)
        except BaseException:
            await conn.close()
            raise
        return conn

    async def _create_schema(self, conn: psycopg.AsyncConnection[Any]) -> None:
        # Concurrent CREATE ... IF NOT EXISTS can still collide in the catalogs
        # (or deadlock): one creator at a time, across every process.
        async with self._schema_lock, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            await conn.execute(self._sql["schema0"])
            await conn.execute(self._sql["schema1"])
        self._schema_ready = True

    async def _maybe_purge(self, conn: psycopg.AsyncConnection[Any]) -> None:
        now = time.monotonic()
        if now >= self._next_purge:
            self._next_purge = now + self._purge_interval
            await conn.execute(self._sql["purge"])


def _is_psycopg(connection: object, method: str) -> bool:
    """True for a psycopg ``AsyncConnection``, False for SQLAlchemy's async session or connection.

    Raises:
        TypeError: ``connection`` is neither.
    """
    if isinstance(connection, psycopg.AsyncConnection):
        return True
    sa = sys.modules.get("sqlalchemy.ext.asyncio")
    if sa is not None and isinstance(connection, sa.AsyncSession | sa.AsyncConnection):
        return False
    raise TypeError(
        f"{method}() takes a psycopg AsyncConnection or a SQLAlchemy "
        f"AsyncSession/AsyncConnection, not {type(connection).__name__}"
    )


def _idle_in(conn: psycopg.AsyncConnection[Any]) -> bool:
    """True if no transaction is left open on ``conn`` (safe to reuse)."""
    return int(conn.info.transaction_status) == 0
