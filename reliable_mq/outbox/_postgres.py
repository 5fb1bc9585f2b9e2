"""The relay's PostgreSQL side: ``FOR UPDATE SKIP LOCKED`` claims held across the confirms.

A batch is one transaction on the relay's work connection: the claim locks its
rows, the relay publishes them and waits for every confirm, then the same
transaction deletes (or marks) them and commits. Other relays skip the locked
rows, so they never dispatch the same row while this relay is alive. If the
relay dies, PostgreSQL rolls the transaction back when its connection goes,
and the rows are claimable again at once; the ones already confirmed are
published a second time with the same ``message_id`` (a duplicate the inbox
drops, never a loss). ``idle_in_transaction_session_timeout`` ends a batch
whose relay hangs.

A second connection, in autocommit, ``LISTEN``s on the table's channel; a
background task turns notifications into an event. Connection poolers in
transaction mode drop ``LISTEN``: the relay polls as well, every
``poll_interval`` seconds, whatever happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

try:
    import psycopg
    from psycopg import sql
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    from .._extras import missing_extra

    raise ImportError(missing_extra("the PostgreSQL outbox needs psycopg 3", "postgres")) from exc

from ._backend import Backlog, OutboxRow, RowOutcome, RowResult
from ._dsn import error_text
from ._schema import notify_channel
from .errors import OutboxError, OutboxUnavailable

__all__ = ("PostgresBackend", "connect")

_COLUMNS = (
    "id, message_id, exchange, routing_key, ordering_key, body, properties, attempts, "
    "extract(epoch FROM created_at)::float8"
)

# The heads of up to %(keys)s ordering keys, in key order from a cursor: a loose
# index scan over (ordering_key, id) WHERE state = 'pending', one index probe per
# key however many rows a key has. A key's head is its oldest pending row,
# whether it is free, locked by another relay or backing off: only a free head
# is claimed, so a key never has two rows out at once.
_HEADS = (
    "WITH RECURSIVE heads(k, id, n) AS ("
    " (SELECT ordering_key, id, 1 FROM {t} WHERE state = 'pending' AND {start}"
    " ORDER BY ordering_key, id LIMIT 1)"
    " UNION ALL"
    " SELECT next.ordering_key, next.id, heads.n + 1 FROM heads CROSS JOIN LATERAL"
    " (SELECT ordering_key, id FROM {t} WHERE state = 'pending' AND ordering_key > heads.k"
    " ORDER BY ordering_key, id LIMIT 1) AS next WHERE heads.n < %(keys)s"
    ") SELECT id, k, n FROM heads"
)
# The newest id among the oldest %(unkeyed)s unkeyed pending rows (ordered by the
# same index: the key is NULL), as one row with n = 0: the claim takes unkeyed
# rows up to that id, so thousands of candidate ids never travel to the client
# and back (that round trip cost more than the rest of a claim).
_UNKEYED = (
    " UNION ALL SELECT max(u.id), NULL, 0 FROM (SELECT id FROM {t} WHERE state = 'pending'"
    " AND ordering_key IS NULL ORDER BY ordering_key, id LIMIT %(unkeyed)s) AS u"
)


async def connect(
    dsn: str, *, application_name: str, timeout: float
) -> psycopg.AsyncConnection[Any]:
    """An autocommit connection; errors become ``OutboxUnavailable`` with the DSN redacted."""
    try:
        return await psycopg.AsyncConnection.connect(
            dsn,
            autocommit=True,
            connect_timeout=max(1, round(timeout)),
            application_name=application_name,
        )
    except psycopg.Error as exc:
        raise OutboxUnavailable(f"cannot connect to PostgreSQL: {error_text(exc)}") from None


class PostgresBackend:
    """A [Backend][reliable_mq.outbox._backend.Backend] on PostgreSQL through psycopg 3."""

    def __init__(
        self,
        dsn: str,
        *,
        table: str,
        scan_limit: int,
        listen: bool,
        keep_sent: float,
        retry_backoff: tuple[float, float],
        transaction_timeout: float,
        connect_timeout: float = 10.0,
        application_name: str = "reliable-mq-outbox-relay",
    ) -> None:
        self._dsn = dsn
        self._table_name = table
        self._table = sql.SQL(table)
        self._channel = notify_channel(table)
        self._scan_limit = scan_limit
        self._listen = listen
        self._keep_sent = keep_sent
        self._retry_backoff = retry_backoff
        self._transaction_timeout = transaction_timeout
        self._connect_timeout = connect_timeout
        self._application_name = application_name
        self._work: psycopg.AsyncConnection[Any] | None = None
        self._listener: psycopg.AsyncConnection[Any] | None = None
        self._listen_task: asyncio.Task[None] | None = None
        self._notified = asyncio.Event()
        self._in_batch = False
        self._next_listen = 0.0
        self._after: str | None = None
        """The key the last claim's scan stopped at; the next one goes on after it."""

    # -- connections ----------------------------------------------------------------

    async def open(self) -> None:
        if self._work is None:
            work = await connect(
                self._dsn, application_name=self._application_name, timeout=self._connect_timeout
            )
            try:
                millis = round(self._transaction_timeout * 1000)
                await work.execute(f"SET idle_in_transaction_session_timeout = {millis}")
                cursor = await work.execute("SELECT to_regclass(%s)", (self._table_name,))
                found = await cursor.fetchone()
            except psycopg.Error as exc:
                await work.close()
                raise OutboxUnavailable(f"PostgreSQL: {error_text(exc)}") from None
            if found is None or found[0] is None:
                await work.close()
                raise OutboxError(
                    f"table {self._table_name!r} does not exist: run `reliable-mq outbox init`"
                )
            self._work = work
        if self._listen and not self.listening:
            now = asyncio.get_running_loop().time()
            if now >= self._next_listen:  # at most every few seconds after a failure
                self._next_listen = now + 5.0
                await self._start_listening()

    async def _start_listening(self) -> None:
        await self._stop_listening()
        listener = await connect(
            self._dsn,
            application_name=f"{self._application_name}-listen",
            timeout=self._connect_timeout,
        )
        try:
            await listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
        except psycopg.Error as exc:
            await listener.close()
            raise OutboxUnavailable(f"PostgreSQL LISTEN failed: {error_text(exc)}") from None
        self._listener = listener
        self._notified.set()  # rows may have come while nobody listened
        self._listen_task = asyncio.get_running_loop().create_task(
            self._listen_loop(listener), name="reliable_mq:outbox:listen"
        )

    async def _listen_loop(self, listener: psycopg.AsyncConnection[Any]) -> None:
        # Ends when the connection fails; the relay then polls until open() listens again.
        with contextlib.suppress(psycopg.Error):
            async for _ in listener.notifies():
                self._notified.set()

    async def _stop_listening(self) -> None:
        task, self._listen_task = self._listen_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, psycopg.Error):
                await task
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(psycopg.Error, OSError):
                await listener.close()

    async def close(self) -> None:
        await self.abandon()
        await self.reset()

    async def reset(self) -> None:
        self._in_batch = False
        self._next_listen = 0.0
        await self._stop_listening()
        work, self._work = self._work, None
        if work is not None:
            with contextlib.suppress(psycopg.Error, OSError):
                await work.close()

    @property
    def listening(self) -> bool:
        return self._listen_task is not None and not self._listen_task.done()

    def _conn(self) -> psycopg.AsyncConnection[Any]:
        if self._work is None:
            raise OutboxUnavailable("the relay's PostgreSQL connection is not open")
        return self._work

    async def _run(
        self, query: sql.SQL | sql.Composed, params: Any = None
    ) -> psycopg.AsyncCursor[Any]:
        try:
            cursor: psycopg.AsyncCursor[Any] = await self._conn().execute(query, params)
            return cursor
        except psycopg.Error as exc:
            raise OutboxUnavailable(f"PostgreSQL: {error_text(exc)}") from None

    # -- batches ----------------------------------------------------------------------

    async def claim(self, limit: int) -> list[OutboxRow]:
        """Two steps in one transaction: pick candidates, then lock the oldest free ones.

        The candidates are the head of each of up to ``scan_limit`` ordering
        keys (from where the last claim stopped, wrapping around, so a key with
        a long backlog never hides the others) and the oldest ``scan_limit``
        unkeyed rows. A per-key ``DISTINCT ON`` or ``GROUP BY`` cannot be
        combined with ``FOR UPDATE``, hence the second step: it locks the
        oldest ``limit`` candidates still pending, due and not locked by
        another relay (``SKIP LOCKED``). A head another relay holds is skipped,
        and with it its key: the key's next row is no candidate while its head
        is pending.
        """
        await self._run(sql.SQL("BEGIN"))
        self._in_batch = True
        heads, unkeyed_up_to = await self._candidates()
        rows: list[OutboxRow] = []
        if heads or unkeyed_up_to is not None:
            cursor = await self._run(
                sql.SQL(
                    "SELECT " + _COLUMNS + " FROM {t} WHERE state = 'pending'"
                    " AND available_at <= now() AND (id = ANY(%(heads)s::bigint[])"
                    " OR (ordering_key IS NULL AND id <= %(unkeyed)s::bigint))"
                    " ORDER BY id LIMIT %(limit)s FOR UPDATE SKIP LOCKED"
                ).format(t=self._table),
                {"heads": heads, "unkeyed": unkeyed_up_to, "limit": limit},
            )
            rows = [_row(record) for record in await cursor.fetchall()]
        if not rows:
            await self._end("COMMIT")
        return rows

    async def _candidates(self) -> tuple[list[int], int | None]:
        """The ids of the keys' heads, and the newest unkeyed id a claim may take."""
        keys = self._scan_limit
        heads, unkeyed_up_to, visited, last = await self._heads(self._after, keys, unkeyed=keys)
        if visited == keys:
            self._after = last
        elif self._after is not None:  # the last key passed: wrap around to the first
            more, _, wrapped, last = await self._heads(None, keys - visited, unkeyed=0)
            heads.extend(more)
            self._after = last if wrapped == keys - visited else None
        return sorted(set(heads)), unkeyed_up_to

    async def _heads(
        self, after: str | None, keys: int, *, unkeyed: int
    ) -> tuple[list[int], int | None, int, str | None]:
        """Head ids, the unkeyed bound (``unkeyed`` > 0), keys visited, the last key visited."""
        start = "ordering_key IS NOT NULL" if after is None else "ordering_key > %(after)s"
        text = _HEADS.replace("{start}", start) + (_UNKEYED if unkeyed else "")
        cursor = await self._run(
            sql.SQL(text).format(t=self._table),
            {"after": after, "keys": keys, "unkeyed": unkeyed},
        )
        ids: list[int] = []
        unkeyed_up_to: int | None = None
        visited, last = 0, None
        for row_id, key, n in await cursor.fetchall():
            if n == 0:  # the unkeyed bound (NULL when there is no unkeyed row)
                unkeyed_up_to = None if row_id is None else int(row_id)
                continue
            ids.append(int(row_id))
            if n > visited:
                visited, last = int(n), key
        return ids, unkeyed_up_to, visited, last

    async def finish(self, results: list[RowResult]) -> None:
        confirmed = [r.row.id for r in results if r.outcome is RowOutcome.CONFIRMED]
        if confirmed:
            if self._keep_sent > 0:
                query = sql.SQL(
                    "UPDATE {t} SET state = 'sent', done_at = now() WHERE id = ANY(%s::bigint[])"
                ).format(t=self._table)
            else:
                query = sql.SQL("DELETE FROM {t} WHERE id = ANY(%s::bigint[])").format(
                    t=self._table
                )
            await self._run(query, (confirmed,))
        # DEFERRED rows are left as they were: the commit unlocks them.
        failed = [r for r in results if r.outcome in (RowOutcome.RETRY, RowOutcome.DEAD)]
        if failed:
            initial, ceiling = self._retry_backoff
            await self._run(
                sql.SQL(
                    "UPDATE {t} AS o SET attempts = o.attempts + 1, last_error = f.reason,"
                    " state = CASE WHEN f.dead THEN 'dead' ELSE 'pending' END,"
                    " done_at = CASE WHEN f.dead THEN now() END,"
                    " available_at = CASE WHEN f.dead THEN o.available_at ELSE now() +"
                    " make_interval(secs => least(%s * power(2, o.attempts), %s)) END"
                    " FROM unnest(%s::bigint[], %s::text[], %s::bool[]) AS f(id, reason, dead)"
                    " WHERE o.id = f.id"
                ).format(t=self._table),
                (
                    initial,
                    ceiling,
                    [r.row.id for r in failed],
                    [r.reason for r in failed],
                    [r.outcome is RowOutcome.DEAD for r in failed],
                ),
            )
        await self._end("COMMIT")

    async def abandon(self) -> None:
        if self._in_batch and self._work is not None:
            with contextlib.suppress(OutboxUnavailable):
                await self._end("ROLLBACK")
        self._in_batch = False

    async def _end(self, command: str) -> None:
        self._in_batch = False
        await self._run(sql.SQL(command))

    # -- waiting, counting, cleaning ----------------------------------------------------

    def forget_notifications(self) -> None:
        self._notified.clear()

    async def wait_for_work(self, timeout: float) -> bool:
        try:
            async with asyncio.timeout(timeout):
                await self._notified.wait()
        except TimeoutError:
            return False
        return True

    async def backlog(self) -> Backlog:
        cursor = await self._run(
            sql.SQL(
                "SELECT count(*), coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8"
                " FROM {t} WHERE state = 'pending'"
            ).format(t=self._table)
        )
        record = await cursor.fetchone()
        assert record is not None
        return Backlog(int(record[0]), max(0.0, float(record[1])))

    async def cleanup(self, *, keep_sent: float, keep_dead: float | None, batch: int) -> int:
        total = 0
        for state, keep in (("sent", keep_sent), ("dead", keep_dead)):
            if keep is None:
                continue
            query = sql.SQL(
                "DELETE FROM {t} WHERE id IN (SELECT id FROM {t} WHERE state = {s}"
                " AND done_at < now() - make_interval(secs => %s)"
                " ORDER BY done_at LIMIT %s FOR UPDATE SKIP LOCKED)"
            ).format(t=self._table, s=sql.Literal(state))
            while True:
                cursor = await self._run(query, (keep, batch))
                total += cursor.rowcount
                if cursor.rowcount < batch:
                    break
                await asyncio.sleep(0)  # one short transaction per batch: no long locks
        return total


def _row(record: tuple[Any, ...]) -> OutboxRow:
    properties = record[6]
    if isinstance(properties, str):
        properties = json.loads(properties)
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
