"""The relay's SQLite side: rows claimed with a lease, on one worker thread.

SQLite has one writer at a time, so a batch cannot hold its lock while the
relay waits for confirms (the application could not write meanwhile). A claim
is a short ``BEGIN IMMEDIATE`` transaction that stamps the chosen rows with
this relay's name and a lease end; finishing is a second short transaction.
If the relay dies, its rows are claimable again when the lease ends. Several
relays on one file never dispatch a row twice while each finishes its batches
within the lease. SQLite has no notifications: the relay polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from ._backend import Backlog, OutboxRow, RowOutcome, RowResult
from ._schema import check_table_name
from .errors import OutboxError, OutboxUnavailable

__all__ = ("SQLiteBackend",)

T = TypeVar("T")

_COLUMNS = (
    "id, message_id, exchange, routing_key, ordering_key, body, properties, attempts, created_at"
)

# As in PostgreSQL: the heads of up to ? ordering keys from a cursor, one probe
# of the (ordering_key, id) pending index per key, then the oldest unkeyed rows.
_HEADS = (
    "WITH RECURSIVE keys(k, n) AS ("
    " SELECT (SELECT min(ordering_key) FROM {t} WHERE state = 'pending'{start}), 1"
    " UNION ALL"
    " SELECT (SELECT min(ordering_key) FROM {t} WHERE state = 'pending'"
    " AND ordering_key > keys.k), keys.n + 1 FROM keys WHERE keys.n < ? AND keys.k IS NOT NULL"
    ") SELECT (SELECT min(id) FROM {t} WHERE state = 'pending' AND ordering_key = keys.k),"
    " k, n FROM keys WHERE k IS NOT NULL"
)
_UNKEYED = (
    "SELECT id FROM {t} WHERE state = 'pending' AND ordering_key IS NULL"
    " ORDER BY ordering_key, id LIMIT ?"
)


class SQLiteBackend:
    """A [Backend][reliable_mq.outbox._backend.Backend] on an SQLite file."""

    def __init__(
        self,
        path: Path,
        *,
        table: str,
        owner: str,
        scan_limit: int,
        lease: float,
        keep_sent: float,
        retry_backoff: tuple[float, float],
        busy_timeout: float = 10.0,
    ) -> None:
        self._path = path
        self._table = check_table_name(table)
        self._owner = owner
        self._scan_limit = scan_limit
        self._lease = lease
        self._keep_sent = keep_sent
        self._retry_backoff = retry_backoff
        self._busy_timeout = busy_timeout
        self._conn: sqlite3.Connection | None = None
        self._claimed: list[int] = []
        self._after: str | None = None
        """The key the last claim's scan stopped at; the next one goes on after it."""
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="reliable_mq-outbox-sqlite")

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, fn, *args)
        except sqlite3.Error as exc:
            raise OutboxUnavailable(f"SQLite outbox {str(self._path)!r}: {exc}") from exc

    # -- connection (worker thread) --------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            if not self._path.exists():
                raise OutboxError(f"SQLite database {str(self._path)!r} does not exist")
            conn = sqlite3.connect(self._path, timeout=self._busy_timeout, isolation_level=None)
            found = conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (self._table,)
            ).fetchone()
            if found is None:
                conn.close()
                raise OutboxError(
                    f"table {self._table!r} does not exist: run `reliable-mq outbox init`"
                )
            self._conn = conn
        return self._conn

    def _transaction(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        conn = self._connection()
        conn.execute("BEGIN IMMEDIATE")
        try:
            result = fn(conn)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return result

    # -- Backend ------------------------------------------------------------------------

    async def open(self) -> None:
        await self._call(self._connection)

    async def close(self) -> None:
        with contextlib.suppress(OutboxError):
            await self.abandon()
        await self.reset()
        self._executor.shutdown(wait=False)

    async def reset(self) -> None:
        def close() -> None:
            conn, self._conn = self._conn, None
            if conn is not None:
                conn.close()

        await asyncio.get_running_loop().run_in_executor(self._executor, close)

    @property
    def listening(self) -> bool:
        return False

    async def claim(self, limit: int) -> list[OutboxRow]:
        rows: list[OutboxRow] = await self._call(
            self._transaction, lambda conn: self._claim(conn, limit)
        )
        self._claimed = [row.id for row in rows]
        return rows

    def _claim(self, conn: sqlite3.Connection, limit: int) -> list[OutboxRow]:
        """Candidates (key heads from the cursor, oldest unkeyed rows), then the due, free ones.

        A head leased to another relay, or backing off, is skipped and its key
        with it: the key's next row is no candidate while its head is pending.
        """
        now = time.time()
        t = self._table
        candidates = self._candidates(conn)
        if not candidates:
            return []
        records = conn.execute(
            f"SELECT {_COLUMNS} FROM {t} WHERE id IN (SELECT value FROM json_each(?))"
            " AND state = 'pending' AND available_at <= ? AND claimed_until <= ?"
            " ORDER BY id LIMIT ?",
            (json.dumps(candidates), now, now, limit),
        ).fetchall()
        ids = [record[0] for record in records]
        if ids:
            conn.execute(
                f"UPDATE {t} SET claimed_by = ?, claimed_until = ? "
                f"WHERE id IN ({','.join('?' * len(ids))})",
                (self._owner, now + self._lease, *ids),
            )
        return [_row(record) for record in records]

    def _candidates(self, conn: sqlite3.Connection) -> list[int]:
        keys = self._scan_limit
        ids, visited, last = self._heads(conn, self._after, keys)
        ids += [r[0] for r in conn.execute(_UNKEYED.format(t=self._table), (keys,))]
        if visited == keys:
            self._after = last
        elif self._after is not None:  # the last key passed: wrap around to the first
            more, wrapped, last = self._heads(conn, None, keys - visited)
            ids += more
            self._after = last if wrapped == keys - visited else None
        return sorted(set(ids))

    def _heads(
        self, conn: sqlite3.Connection, after: str | None, keys: int
    ) -> tuple[list[int], int, str | None]:
        """Head ids, how many keys the scan visited, and the last key it visited."""
        start = "" if after is None else " AND ordering_key > ?"
        params: tuple[Any, ...] = (keys,) if after is None else (after, keys)
        ids: list[int] = []
        visited, last = 0, None
        query = _HEADS.format(t=self._table, start=start)
        for row_id, key, n in conn.execute(query, params):
            ids.append(int(row_id))
            if n > visited:
                visited, last = int(n), key
        return ids, visited, last

    async def finish(self, results: list[RowResult]) -> None:
        await self._call(self._transaction, lambda conn: self._finish(conn, results))
        self._claimed = []

    def _finish(self, conn: sqlite3.Connection, results: list[RowResult]) -> None:
        now = time.time()
        t = self._table
        initial, ceiling = self._retry_backoff
        for result in results:
            row = result.row
            if result.outcome is RowOutcome.CONFIRMED:
                if self._keep_sent > 0:
                    conn.execute(
                        f"UPDATE {t} SET state = 'sent', done_at = ?, claimed_by = NULL,"
                        " claimed_until = 0 WHERE id = ?",
                        (now, row.id),
                    )
                else:
                    conn.execute(f"DELETE FROM {t} WHERE id = ?", (row.id,))
            elif result.outcome is RowOutcome.DEFERRED:  # as it was, unclaimed
                conn.execute(
                    f"UPDATE {t} SET claimed_by = NULL, claimed_until = 0 WHERE id = ?", (row.id,)
                )
            elif result.outcome is RowOutcome.DEAD:
                conn.execute(
                    f"UPDATE {t} SET state = 'dead', done_at = ?, last_error = ?,"
                    " attempts = attempts + 1, claimed_by = NULL, claimed_until = 0 WHERE id = ?",
                    (now, result.reason, row.id),
                )
            else:
                delay = min(initial * 2**row.attempts, ceiling)
                conn.execute(
                    f"UPDATE {t} SET last_error = ?, attempts = attempts + 1, available_at = ?,"
                    " claimed_by = NULL, claimed_until = 0 WHERE id = ?",
                    (result.reason, now + delay, row.id),
                )

    async def abandon(self) -> None:
        ids, self._claimed = self._claimed, []
        if not ids or self._conn is None:
            return

        def release(conn: sqlite3.Connection) -> None:
            conn.execute(
                f"UPDATE {self._table} SET claimed_by = NULL, claimed_until = 0 "
                f"WHERE claimed_by = ? AND id IN ({','.join('?' * len(ids))})",
                (self._owner, *ids),
            )

        await self._call(self._transaction, release)

    def forget_notifications(self) -> None:
        self._wake.clear()

    def wake(self) -> None:
        """Wake a waiting relay now (an in-process hint; SQLite has no notifications)."""
        self._wake.set()

    async def wait_for_work(self, timeout: float) -> bool:
        try:
            async with asyncio.timeout(timeout):
                await self._wake.wait()
        except TimeoutError:
            return False
        return True

    async def backlog(self) -> Backlog:
        def count() -> tuple[int, float | None]:
            record = (
                self._connection()
                .execute(
                    f"SELECT count(*), min(created_at) FROM {self._table} WHERE state = 'pending'"
                )
                .fetchone()
            )
            return int(record[0]), record[1]

        pending, oldest = await self._call(count)
        return Backlog(pending, max(0.0, time.time() - oldest) if oldest is not None else 0.0)

    async def cleanup(self, *, keep_sent: float, keep_dead: float | None, batch: int) -> int:
        total = 0
        for state, keep in (("sent", keep_sent), ("dead", keep_dead)):
            if keep is None:
                continue
            while True:
                cutoff = time.time() - keep

                def delete(
                    conn: sqlite3.Connection, state: str = state, cutoff: float = cutoff
                ) -> int:
                    return conn.execute(
                        f"DELETE FROM {self._table} WHERE id IN (SELECT id FROM {self._table}"
                        " WHERE state = ? AND done_at < ? ORDER BY done_at LIMIT ?)",
                        (state, cutoff, batch),
                    ).rowcount

                deleted = await self._call(self._transaction, delete)
                total += deleted
                if deleted < batch:
                    break
        return total


def _row(record: tuple[Any, ...]) -> OutboxRow:
    try:
        properties = json.loads(record[6])
    except (TypeError, ValueError):
        properties = {}
    return OutboxRow(
        id=int(record[0]),
        message_id=record[1],
        exchange=record[2],
        routing_key=record[3],
        ordering_key=record[4],
        body=bytes(record[5]),
        properties=properties if isinstance(properties, dict) else {},
        attempts=int(record[7]),
        created_at=float(record[8]),
    )
