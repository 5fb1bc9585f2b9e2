"""The outbox table: its DDL for PostgreSQL and SQLite, and the states of a row.

One table holds every event written by ``outbox.add()``. The relay finds
each ordering key's oldest pending row through a partial index on
``(ordering_key, id) WHERE state = 'pending'`` (one probe per key, however
many rows a key has; unkeyed rows sit together under NULL in ``id`` order), so
the index stays as small as the backlog however large the table's history.
Rows the relay dispatched are deleted at once by default (or kept as ``sent``
for a while); rows the broker refused for good stay as ``dead``, with their
reason in ``last_error``, until the cleanup removes them.
"""

from __future__ import annotations

import enum

from .._sql import check_table_name as _check_table_name

__all__ = (
    "DEFAULT_TABLE",
    "Dialect",
    "RowState",
    "check_table_name",
    "notify_channel",
    "schema_sql",
)

DEFAULT_TABLE = "reliable_mq_outbox"
"""The table's name unless you choose another (also the NOTIFY channel's)."""


class Dialect(enum.StrEnum):
    """The database behind an outbox table."""

    POSTGRES = "postgres"
    """PostgreSQL 11+: ``FOR UPDATE SKIP LOCKED`` claims and ``LISTEN/NOTIFY`` wake-ups."""

    SQLITE = "sqlite"
    """SQLite 3.24+: claims with a lease under SQLite's single writer lock; polling only."""


class RowState(enum.StrEnum):
    """Where an outbox row is in its life."""

    PENDING = "pending"
    """Committed by the application and not yet confirmed by the broker."""

    SENT = "sent"
    """Confirmed by the broker; kept only when ``RelaySettings.keep_sent`` is above 0."""

    DEAD = "dead"
    """Refused for good (unroutable, too large, refused): ``last_error`` says why."""


def check_table_name(table: str) -> str:
    """`reliable_mq._sql.check_table_name` for an outbox table.

    Raises:
        ValueError: the name is not a plain lower-case identifier.
    """
    return _check_table_name(table, what="outbox table")


def notify_channel(table: str) -> str:
    """The ``LISTEN/NOTIFY`` channel of a table (its name, dots as underscores)."""
    return check_table_name(table).replace(".", "_")


def _index_name(table: str, suffix: str) -> str:
    return f"{table.rsplit('.', 1)[-1]}_{suffix}"


def schema_sql(dialect: Dialect | str, table: str = DEFAULT_TABLE) -> list[str]:
    """The statements that create the outbox table, its indexes (and its NOTIFY trigger).

    Every statement is idempotent (``IF NOT EXISTS`` / ``OR REPLACE``); run
    them from your migration tool, or let ``reliable-mq outbox init`` do it.
    """
    table = check_table_name(table)
    if Dialect(dialect) is Dialect.SQLITE:
        return _sqlite_schema(table)
    return _postgres_schema(table)


def _postgres_schema(table: str) -> list[str]:
    pending = _index_name(table, "pending_key")
    done = _index_name(table, "done")
    function = f"{table}_notify"
    trigger = _index_name(table, "notify")
    channel = notify_channel(table)
    return [
        f"""CREATE TABLE IF NOT EXISTS {table} (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id    text NOT NULL,
    exchange      text NOT NULL DEFAULT '',
    routing_key   text NOT NULL,
    ordering_key  text,
    body          bytea NOT NULL,
    properties    jsonb NOT NULL DEFAULT '{{}}',
    state         text NOT NULL DEFAULT 'pending'
                  CHECK (state IN ('pending', 'sent', 'dead')),
    attempts      integer NOT NULL DEFAULT 0,
    created_at    timestamptz NOT NULL DEFAULT now(),
    available_at  timestamptz NOT NULL DEFAULT '-infinity',
    done_at       timestamptz,
    last_error    text
)""",
        # The relay's claim: each key's oldest pending row, and unkeyed rows in id
        # order (under NULL). Partial, so it holds the backlog only; dispatched
        # rows leave it as soon as they are deleted.
        f"CREATE INDEX IF NOT EXISTS {pending} ON {table} (ordering_key, id) "
        "WHERE state = 'pending'",
        # The cleanup's scan: sent and dead rows by age.
        f"CREATE INDEX IF NOT EXISTS {done} ON {table} (done_at) WHERE state <> 'pending'",
        f"""CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('{channel}', '');
    RETURN NULL;
END
$$""",
        f"DROP TRIGGER IF EXISTS {trigger} ON {table}",
        # Once per statement; PostgreSQL also folds equal notifications of one
        # transaction into one, delivered at commit (never for a rollback).
        f"CREATE TRIGGER {trigger} AFTER INSERT ON {table} "
        f"FOR EACH STATEMENT EXECUTE FUNCTION {function}()",
        # A queue table churns: vacuum it after 1,000 dead tuples or 2%,
        # whichever is more, without the default cost throttle.
        f"ALTER TABLE {table} SET (autovacuum_vacuum_scale_factor = 0.02, "
        "autovacuum_vacuum_threshold = 1000, autovacuum_vacuum_cost_delay = 1, "
        "autovacuum_analyze_scale_factor = 0.05)",
    ]


def _sqlite_schema(table: str) -> list[str]:
    if "." in table:
        raise ValueError(f"an SQLite outbox table name cannot name a schema: {table!r}")
    return [
        f"""CREATE TABLE IF NOT EXISTS {table} (
    id            INTEGER PRIMARY KEY,
    message_id    TEXT NOT NULL,
    exchange      TEXT NOT NULL DEFAULT '',
    routing_key   TEXT NOT NULL,
    ordering_key  TEXT,
    body          BLOB NOT NULL,
    properties    TEXT NOT NULL DEFAULT '{{}}',
    state         TEXT NOT NULL DEFAULT 'pending',
    attempts      INTEGER NOT NULL DEFAULT 0,
    created_at    REAL NOT NULL,
    available_at  REAL NOT NULL DEFAULT 0,
    claimed_by    TEXT,
    claimed_until REAL NOT NULL DEFAULT 0,
    done_at       REAL,
    last_error    TEXT
)""",
        f"CREATE INDEX IF NOT EXISTS {_index_name(table, 'pending_key')} ON {table} "
        "(ordering_key, id) WHERE state = 'pending'",
        f"CREATE INDEX IF NOT EXISTS {_index_name(table, 'done')} ON {table} (done_at) "
        "WHERE state <> 'pending'",
    ]
