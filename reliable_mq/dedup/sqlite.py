"""A store in an SQLite file: survives restarts, shared by processes on one host.

Each call runs on one worker thread per store, so the event loop never blocks
on disk. Claims are a single upsert inside ``BEGIN IMMEDIATE``: SQLite's write
lock makes them atomic across every process that opens the file (WAL mode lets
readers go on meanwhile). Times are wall-clock, since processes share them.

Exactly-once effects: when a handler writes its effect into the same database,
`SQLiteDedupStore.run_once()` (or `mark_done_in()` on
your own connection) commits the effect and the *done* mark together, so a
crash after the commit but before the ack cannot apply it twice:

```python
def add_to_balance(conn: sqlite3.Connection) -> None:
    conn.execute("UPDATE account SET balance = balance + 10 WHERE id = 1")

try:
    await store.run_once(delivery.message_id, add_to_balance)
except AlreadyProcessed:
    pass  # another copy committed first: ack and skip
```

"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Literal, TypeVar

from ._batch import BatchResult, HasMessageId, Item, check_batch, split
from .base import AlreadyProcessed, ClaimResult, DedupStoreUnavailable

__all__ = ("SQLiteDedupStore",)

T = TypeVar("T")

_TABLE = "reliable_mq_dedup"
_SCHEMA = (
    f"CREATE TABLE IF NOT EXISTS {_TABLE} ("
    " message_id TEXT PRIMARY KEY,"
    " owner TEXT,"  # NULL once done
    " expires_at REAL NOT NULL"  # lease end while claimed, retention end once done
    ") WITHOUT ROWID",
    f"CREATE INDEX IF NOT EXISTS {_TABLE}_expires ON {_TABLE}(expires_at)",
)
_CLAIM = (
    f"INSERT INTO {_TABLE} (message_id, owner, expires_at) VALUES (?, ?, ?) "
    "ON CONFLICT (message_id) DO UPDATE SET owner = excluded.owner, "
    f"expires_at = excluded.expires_at WHERE {_TABLE}.expires_at <= ?"
)
_MARK_DONE = (
    f"INSERT INTO {_TABLE} (message_id, owner, expires_at) VALUES (?, NULL, ?) "
    "ON CONFLICT (message_id) DO UPDATE SET owner = NULL, expires_at = excluded.expires_at"
)
# Like _MARK_DONE, but refuses an id another transaction already made done.
_MARK_DONE_ONCE = _MARK_DONE + f" WHERE {_TABLE}.owner IS NOT NULL OR {_TABLE}.expires_at <= ?"
_PURGE = (
    f"DELETE FROM {_TABLE} WHERE message_id IN "
    f"(SELECT message_id FROM {_TABLE} WHERE expires_at <= ? LIMIT 1000)"
)


class _EffectFailed(Exception):
    """Carries an exception from a ``run_once`` effect past the store-error mapping."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class SQLiteDedupStore:
    """A [`DedupStore`][reliable_mq.dedup.DedupStore] in an SQLite file.

    Args:
        path: the database file; created if missing. It may be the handlers'
            own database (the table is ``reliable_mq_dedup``).
        retention: seconds a done id is remembered.
        busy_timeout: seconds to wait for another process's write lock before
            the call fails with ``DedupStoreUnavailable``.
        synchronous: ``"NORMAL"`` survives a process crash; ``"FULL"`` also a
            power loss, at an fsync per call.
        purge_interval: seconds between deletions of expired rows.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        retention: float = 3600,
        busy_timeout: float = 5.0,
        synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
        purge_interval: float = 60.0,
    ) -> None:
        if retention <= 0:
            raise ValueError("retention must be positive")
        if synchronous not in ("NORMAL", "FULL"):
            raise ValueError("synchronous must be 'NORMAL' or 'FULL'")
        self.path = os.fspath(path)
        self.retention = float(retention)
        self._busy_timeout = busy_timeout
        self._synchronous = synchronous
        self._purge_interval = purge_interval
        self._next_purge = 0.0
        self._conn: sqlite3.Connection | None = None
        self._closed = False
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="reliable_mq-dedup-sqlite")

    async def claim(self, message_id: str, *, owner: str, lease: float) -> ClaimResult:
        """Claim ``message_id`` (see `DedupStore.claim()`)."""
        if lease <= 0:
            raise ValueError("lease must be positive")
        return await self._call(self._claim, message_id, owner, lease)

    async def complete(self, message_id: str, *, owner: str) -> None:
        """Mark ``message_id`` done (see `DedupStore.complete()`)."""
        await self._call(self._complete, message_id)

    async def release(self, message_id: str, *, owner: str) -> None:
        """Drop ``owner``'s claim (see `DedupStore.release()`)."""
        await self._call(self._release, message_id, owner)

    async def run_once(self, message_id: str, effect: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``effect(conn)`` and mark ``message_id`` done in one transaction.

        ``effect`` runs on the store's worker thread inside ``BEGIN IMMEDIATE``;
        it must not commit or roll back. If it raises, nothing is kept and its
        exception propagates unchanged (an SQL error in the effect is the
        handler's, not the store's).

        Raises:
            AlreadyProcessed: another copy already committed (nothing was kept).
            DedupStoreUnavailable: the database failed (nothing was kept).
        """
        return await self._call(self._run_once, message_id, effect)

    async def run_once_batch(
        self,
        items: Iterable[Item],
        effect: Callable[[sqlite3.Connection, list[Item]], T],
    ) -> BatchResult[T]:
        """Mark a batch's ids done and run ``effect(conn, new)`` in one transaction.

        ``items`` are message ids or deliveries (anything with a
        ``message_id``); an id repeated in the batch counts once. Inside
        ``BEGIN IMMEDIATE`` on the store's worker thread, every id not done
        yet is marked; ``effect`` then gets the connection and only the items
        of those ids, in batch order, and everything commits together. If no
        id is new, ``effect`` does not run. It must not commit or roll back;
        if it raises, nothing is kept (no mark either) and its exception
        propagates unchanged.

        Raises:
            InvalidBatch: an id is not a non-empty ``str`` of at most 255
                bytes (checked before anything is written).
            DedupStoreUnavailable: the database failed (nothing was kept).
        """
        kept, ids = check_batch(items)
        if not ids:
            return BatchResult((), (), None)
        return await self._call(self._run_once_batch, kept, ids, effect)

    def mark_batch_done_in(
        self, connection: sqlite3.Connection, items: Iterable[str | HasMessageId]
    ) -> list[str]:
        """Mark a batch's ids done inside ``connection``'s current transaction.

        The batch form of `mark_done_in`: write the effect for the returned
        ids only, then commit both. It starts a transaction if none is open;
        commit or roll back stays yours.

        Returns:
            The ids that were not done yet, in batch order, each once.

        Raises:
            InvalidBatch: an id is not a non-empty ``str`` of at most 255
                bytes (checked before anything is written).
        """
        _, ids = check_batch(items)
        if not ids:
            return []
        if not connection.in_transaction:
            connection.execute("BEGIN IMMEDIATE")
        for statement in _SCHEMA:
            connection.execute(statement)
        _, ran, _ = split(ids, ids, self._mark_batch(connection, ids))
        return list(ran)

    def mark_done_in(self, connection: sqlite3.Connection, message_id: str) -> None:
        """Mark ``message_id`` done inside ``connection``'s current transaction.

        For handlers that manage their own connection to this database file:
        call it next to the effect's writes, then commit both. It starts a
        transaction if none is open; commit or roll back stays yours.

        Raises:
            AlreadyProcessed: another transaction already marked it done; roll back.
        """
        if not connection.in_transaction:
            connection.execute("BEGIN IMMEDIATE")
        for statement in _SCHEMA:
            connection.execute(statement)
        now = time.time()
        cursor = connection.execute(_MARK_DONE_ONCE, (message_id, now + self.retention, now))
        if cursor.rowcount == 0:
            raise AlreadyProcessed(message_id)

    async def close(self) -> None:
        """Close the connection and the worker thread."""
        if self._closed:
            return
        self._closed = True
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._close)
        self._executor.shutdown(wait=False)

    async def _call(self, fn: Callable[..., T], *args: object) -> T:
        if self._closed:
            raise DedupStoreUnavailable("the dedup store is closed")
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, fn, *args)
        except _EffectFailed as failed:
            raise failed.error from None
        except sqlite3.Error as exc:
            raise DedupStoreUnavailable(f"SQLite dedup store {self.path!r}: {exc}") from exc

    # Everything below runs on the worker thread.

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            conn = sqlite3.connect(self.path, timeout=self._busy_timeout, isolation_level=None)
            try:
                self._set_up(conn)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def _set_up(self, conn: sqlite3.Connection) -> None:
        """Switch to WAL and create the table, retrying while another process does too.

        Changing the journal mode takes an exclusive lock and SQLite answers
        "database is locked" at once instead of honouring the busy timeout, so
        two processes opening a new file together would otherwise fail.
        """
        give_up = time.monotonic() + self._busy_timeout
        while True:
            try:
                conn.execute("PRAGMA journal_mode = WAL")
                conn.execute(f"PRAGMA synchronous = {self._synchronous}")
                for statement in _SCHEMA:
                    conn.execute(statement)
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > give_up:
                    raise
                time.sleep(0.01)

    def _transaction(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        conn = self._connection()
        conn.execute("BEGIN IMMEDIATE")
        try:
            result = fn(conn)
            if not conn.in_transaction:
                raise RuntimeError("the transaction was ended inside the dedup store")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return result

    def _claim(self, message_id: str, owner: str, lease: float) -> ClaimResult:
        now = time.time()
        if now >= self._next_purge:
            self._next_purge = now + self._purge_interval
            self._transaction(lambda conn: conn.execute(_PURGE, (now,)))

        def claim(conn: sqlite3.Connection) -> ClaimResult:
            cursor = conn.execute(_CLAIM, (message_id, owner, now + lease, now))
            if cursor.rowcount == 1:
                return ClaimResult.CLAIMED
            row = conn.execute(
                f"SELECT owner FROM {_TABLE} WHERE message_id = ?", (message_id,)
            ).fetchone()
            return ClaimResult.DONE if row is not None and row[0] is None else ClaimResult.BUSY

        return self._transaction(claim)

    def _complete(self, message_id: str) -> None:
        conn = self._connection()
        conn.execute(_MARK_DONE, (message_id, time.time() + self.retention))

    def _release(self, message_id: str, owner: str) -> None:
        conn = self._connection()
        conn.execute(
            f"DELETE FROM {_TABLE} WHERE message_id = ? AND owner = ?", (message_id, owner)
        )

    def _run_once(self, message_id: str, effect: Callable[[sqlite3.Connection], T]) -> T:
        def both(conn: sqlite3.Connection) -> T:
            try:
                result = effect(conn)
            except Exception as exc:
                raise _EffectFailed(exc) from exc
            now = time.time()
            cursor = conn.execute(_MARK_DONE_ONCE, (message_id, now + self.retention, now))
            if cursor.rowcount == 0:
                raise AlreadyProcessed(message_id)
            return result

        return self._transaction(both)

    def _mark_batch(self, conn: sqlite3.Connection, ids: list[str]) -> list[str]:
        """Mark each id not done yet (one statement each: no parameter limit); the new ones."""
        now = time.time()
        keep = now + self.retention
        return [
            message_id
            for message_id in ids
            if conn.execute(_MARK_DONE_ONCE, (message_id, keep, now)).rowcount == 1
        ]

    def _run_once_batch(
        self,
        items: list[Item],
        ids: list[str],
        effect: Callable[[sqlite3.Connection, list[Item]], T],
    ) -> BatchResult[T]:
        def both(conn: sqlite3.Connection) -> BatchResult[T]:
            todo, ran, done = split(items, ids, self._mark_batch(conn, ids))
            if not todo:
                return BatchResult(ran, done, None)
            try:
                value = effect(conn, todo)
            except Exception as exc:
                raise _EffectFailed(exc) from exc
            return BatchResult(ran, done, value)

        return self._transaction(both)

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
