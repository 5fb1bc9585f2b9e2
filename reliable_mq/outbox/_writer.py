"""``outbox.add()``: one INSERT through the caller's own connection, inside the caller's transaction.

The writer never opens a connection, never begins or ends a transaction (a
driver that begins one implicitly on the first statement does so, as it
would for the caller's own INSERT), and never commits. The event becomes
visible to the relay exactly when the caller's transaction commits, and
vanishes with it on a rollback: no lost event, no phantom.

Accepted connections (the optional drivers are recognised only if the
application imported them):

* SQLAlchemy 2: ``Session``, ``Connection``, ``AsyncSession``, ``AsyncConnection``
  (PostgreSQL or SQLite engines);
* psycopg 3: ``Connection`` and ``AsyncConnection``;
* asyncpg: ``Connection`` (and a pool's connection proxy);
* the standard library's ``sqlite3.Connection``.

For PostgreSQL an event with an ``ordering_key`` also takes a transaction-level
advisory lock on that key, so two transactions writing the same key commit
their rows in ``id`` order: the order the relay publishes them in.
"""

from __future__ import annotations

import enum
import json
import secrets
import sqlite3
import sys
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._codec import encode_body
from .._publish import encode_headers
from .._tracing import Tracing, stamp_creation
from ..errors import InvalidMessage, MessageTooLarge
from ._json import headers_json
from ._schema import DEFAULT_TABLE, Dialect, check_table_name
from .errors import NotInTransaction, UnsupportedConnection

__all__ = ("DEFAULT_MAX_BODY", "add", "add_sync")

DEFAULT_MAX_BODY = 16 * 1024 * 1024
"""Bytes; a bigger encoded body is refused by ``add()`` (``max_body`` raises or lowers it)."""

_TRACING = Tracing()
"""The global tracer provider, for the ``create`` span of a row (looked at every 2 s)."""

_COLUMNS = ("message_id", "exchange", "routing_key", "ordering_key", "body", "properties")
_PG_TYPES = ("text", "text", "text", "text", "bytea", "jsonb")
_MAX_NAME = 255


class _Kind(enum.Enum):
    SQLITE3 = "sqlite3"
    SA_SYNC = "sqlalchemy"
    SA_ASYNC = "sqlalchemy-async"
    PSYCOPG = "psycopg"
    PSYCOPG_ASYNC = "psycopg-async"
    ASYNCPG = "asyncpg"


@dataclass(frozen=True, slots=True)
class _Row:
    message_id: str
    exchange: str
    routing_key: str
    ordering_key: str | None
    body: bytes
    properties: str

    def values(self) -> tuple[Any, ...]:
        return (
            self.message_id,
            self.exchange,
            self.routing_key,
            self.ordering_key,
            self.body,
            self.properties,
        )


async def add(
    connection: Any,
    body: Any,
    *,
    routing_key: str,
    exchange: str = "",
    message_id: str | None = None,
    ordering_key: str | None = None,
    headers: Mapping[str, Any] | None = None,
    content_type: str | None = None,
    content_encoding: str | None = None,
    correlation_id: str | None = None,
    message_type: str | None = None,
    user_id: str | None = None,
    table: str = DEFAULT_TABLE,
    max_body: int = DEFAULT_MAX_BODY,
) -> str:
    """Write one event into the outbox, inside the caller's open transaction.

    Call it between your business writes and your commit; it commits nothing.
    A sync connection or session is used synchronously (one short INSERT);
    prefer an async one in async code.

    Args:
        connection: the caller's session or connection (see the module docs).
        body: bytes, str, a pydantic model or JSON-able data (as ``publish()``).
        routing_key: the routing key it is published with.
        exchange: the exchange ("" is the default exchange).
        message_id: a stable id (default: a random one); consumers dedupe by it.
        ordering_key: events with the same key are published one after the
            other, in commit order; ``None``: no order is kept.
        headers: AMQP headers (JSON values: str, int, float, bool, None, lists, maps).
            Each value keeps its type through storage: a float is published
            as a float (``1e19`` too), an int as an int. With OpenTelemetry
            tracing on, the caller's trace context is added as a W3C
            ``traceparent`` (and ``tracestate``), unless one is given.
        content_type: overrides the type inferred from the body (``""`` is sent
            as an empty content type).
        content_encoding: the AMQP ``content-encoding`` property (``"gzip"``...).
        correlation_id: the AMQP ``correlation_id`` property.
        message_type: the AMQP ``type`` property.
        user_id: the AMQP ``user-id`` property: RabbitMQ refuses it unless it is
            the relay's user (the row then goes ``dead``).
        table: the outbox table (default ``reliable_mq_outbox``).
        max_body: the largest encoded body accepted, in bytes.

    Returns:
        The event's ``message_id``.

    Raises:
        InvalidMessage: an argument is of the wrong type, too long, or has NUL
            characters; or a header that is not JSON, or that AMQP cannot carry
            (an int beyond 64 bits, a name over 255 bytes), named by its path.
        InvalidBody: the body cannot be encoded (a NaN in JSON data, an object).
        MessageTooLarge: the encoded body is over ``max_body``.
        NotInTransaction: the connection is in autocommit with no transaction open.
        UnsupportedConnection: ``connection`` is none of the accepted types.
    """
    row = _prepare(
        body,
        routing_key=routing_key,
        exchange=exchange,
        message_id=message_id,
        ordering_key=ordering_key,
        headers=headers,
        content_type=content_type,
        content_encoding=content_encoding,
        correlation_id=correlation_id,
        message_type=message_type,
        user_id=user_id,
        max_body=max_body,
    )
    table = check_table_name(table)
    kind = _kind_of(connection)
    if kind is _Kind.SA_ASYNC:
        statement, params = _sqlalchemy_statement(connection, table, row)
        await connection.execute(statement, params)
    elif kind is _Kind.PSYCOPG_ASYNC:
        _check_psycopg_transaction(connection)
        await connection.execute(_postgres_sql(table, row, "psycopg"), _psycopg_params(row))
    elif kind is _Kind.ASYNCPG:
        if not connection.is_in_transaction():
            raise NotInTransaction(
                "asyncpg connection has no open transaction: use `async with conn.transaction():`"
            )
        await connection.execute(_postgres_sql(table, row, "asyncpg"), *row.values())
    else:
        _add_sync(kind, connection, table, row)
    return row.message_id


def add_sync(
    connection: Any,
    body: Any,
    *,
    routing_key: str,
    exchange: str = "",
    message_id: str | None = None,
    ordering_key: str | None = None,
    headers: Mapping[str, Any] | None = None,
    content_type: str | None = None,
    content_encoding: str | None = None,
    correlation_id: str | None = None,
    message_type: str | None = None,
    user_id: str | None = None,
    table: str = DEFAULT_TABLE,
    max_body: int = DEFAULT_MAX_BODY,
) -> str:
    """[add][reliable_mq.outbox.add] for sync code: SQLAlchemy ``Session``/``Connection``,
    psycopg ``Connection`` or ``sqlite3.Connection``.

    Raises:
        UnsupportedConnection: also for an async session or connection (use ``await add()``).
        InvalidMessage, InvalidBody, MessageTooLarge, NotInTransaction: as ``add()``.
    """
    row = _prepare(
        body,
        routing_key=routing_key,
        exchange=exchange,
        message_id=message_id,
        ordering_key=ordering_key,
        headers=headers,
        content_type=content_type,
        content_encoding=content_encoding,
        correlation_id=correlation_id,
        message_type=message_type,
        user_id=user_id,
        max_body=max_body,
    )
    table = check_table_name(table)
    kind = _kind_of(connection)
    if kind in (_Kind.SA_ASYNC, _Kind.PSYCOPG_ASYNC, _Kind.ASYNCPG):
        raise UnsupportedConnection(
            f"add_sync() cannot use an async {type(connection).__name__}: use `await add()`"
        )
    _add_sync(kind, connection, table, row)
    return row.message_id


def _add_sync(kind: _Kind, connection: Any, table: str, row: _Row) -> None:
    if kind is _Kind.SQLITE3:
        if connection.isolation_level is None and not connection.in_transaction:
            raise NotInTransaction(
                "sqlite3 connection is in autocommit mode with no transaction open: "
                "execute BEGIN first"
            )
        connection.execute(_sqlite_sql(table, "qmark"), (*row.values(), time.time()))
    elif kind is _Kind.SA_SYNC:
        statement, params = _sqlalchemy_statement(connection, table, row)
        connection.execute(statement, params)
    elif kind is _Kind.PSYCOPG:
        _check_psycopg_transaction(connection)
        connection.execute(_postgres_sql(table, row, "psycopg"), _psycopg_params(row))
    else:  # pragma: no cover - every kind is handled above
        raise UnsupportedConnection(f"cannot write through {type(connection).__name__}")


# -- validation -------------------------------------------------------------------


def _text(name: str, value: object, *, limit: int = _MAX_NAME, empty: bool = True) -> str:
    if not isinstance(value, str):
        raise InvalidMessage(f"{name} must be a str, not {type(value).__name__}")
    if not empty and not value:
        raise InvalidMessage(f"{name} must not be empty")
    if "\x00" in value:
        raise InvalidMessage(f"{name} must not contain NUL characters")
    if len(value) > limit // 4 and len(value.encode()) > limit:
        raise InvalidMessage(f"{name} is longer than {limit} bytes")
    return value


def _prepare(
    body: Any,
    *,
    routing_key: Any,
    exchange: Any,
    message_id: Any,
    ordering_key: Any,
    headers: Any,
    content_type: Any,
    content_encoding: Any,
    correlation_id: Any,
    message_type: Any,
    user_id: Any,
    max_body: int,
) -> _Row:
    routing_key = _text("routing_key", routing_key)
    exchange = _text("exchange", exchange)
    if message_id is None:
        message_id = secrets.token_hex(16)
    message_id = _text("message_id", message_id, empty=False)
    if ordering_key is not None:
        ordering_key = _text("ordering_key", ordering_key, limit=1024, empty=False)
    payload, inferred = encode_body(body)
    if len(payload) > max_body:
        raise MessageTooLarge(
            f"body is {len(payload)} bytes, over the outbox's max_body={max_body}",
            message_id=message_id,
            attempts=0,
        )
    properties: dict[str, Any] = {"content_type": inferred}
    for name, value in (
        ("content_type", content_type),
        ("content_encoding", content_encoding),
        ("correlation_id", correlation_id),
        ("message_type", message_type),
        ("user_id", user_id),
    ):
        if value is not None:
            properties[name] = _text(name, value)
    fields = [json.dumps(name) + ":" + json.dumps(value) for name, value in properties.items()]
    if headers is not None:
        if not isinstance(headers, Mapping) or not all(isinstance(k, str) for k in headers):
            raise InvalidMessage("headers must be a mapping with str keys")
        encode_headers(headers)  # what AMQP cannot carry is refused here, not dead at publish
    # The caller's trace context (a W3C traceparent), so the relay and the
    # consumer link back to the request that wrote the row.
    headers = stamp_creation(
        _TRACING, headers, exchange=exchange, routing_key=routing_key, message_id=message_id
    )
    if headers is not None:
        fields.append('"headers":' + headers_json(headers))
    encoded = "{" + ",".join(fields) + "}"
    if "\\u0000" in encoded:
        raise InvalidMessage("headers must not contain NUL characters")
    return _Row(message_id, exchange, routing_key, ordering_key, payload, encoded)


# -- connection kinds ---------------------------------------------------------------


def _module_class(module: str, *names: str) -> tuple[type, ...]:
    """Classes of an optional driver, only if the application already imported it."""
    loaded = sys.modules.get(module)
    if loaded is None:
        return ()
    return tuple(cls for name in names if isinstance(cls := getattr(loaded, name, None), type))


def _kind_of(connection: Any) -> _Kind:
    if isinstance(connection, sqlite3.Connection):
        return _Kind.SQLITE3
    checks: tuple[tuple[_Kind, str, tuple[str, ...]], ...] = (
        (_Kind.SA_ASYNC, "sqlalchemy.ext.asyncio", ("AsyncSession", "AsyncConnection")),
        (_Kind.SA_SYNC, "sqlalchemy.orm", ("Session",)),
        (_Kind.SA_SYNC, "sqlalchemy.engine", ("Connection",)),
        (_Kind.PSYCOPG_ASYNC, "psycopg", ("AsyncConnection",)),
        (_Kind.PSYCOPG, "psycopg", ("Connection",)),
        (_Kind.ASYNCPG, "asyncpg.connection", ("Connection",)),
        (_Kind.ASYNCPG, "asyncpg.pool", ("PoolConnectionProxy",)),
    )
    for kind, module, names in checks:
        classes = _module_class(module, *names)
        if classes and isinstance(connection, classes):
            return kind
    raise UnsupportedConnection(
        f"outbox.add() cannot write through a {type(connection).__module__}."
        f"{type(connection).__qualname__}: pass a SQLAlchemy Session/AsyncSession/Connection, "
        "a psycopg 3 connection, an asyncpg connection or an sqlite3.Connection"
    )


def _check_psycopg_transaction(connection: Any) -> None:
    # pq.TransactionStatus.IDLE is 0: no transaction block is open.
    if connection.autocommit and int(connection.info.transaction_status) == 0:
        raise NotInTransaction(
            "psycopg connection is in autocommit mode with no transaction open: "
            "use `with conn.transaction():` (or turn autocommit off)"
        )


def _sqlalchemy_dialect(connection: Any) -> Dialect:
    bind = connection.get_bind() if hasattr(connection, "get_bind") else connection
    dialect = getattr(bind, "dialect", None)
    name = getattr(dialect, "name", None)
    if name == "postgresql":
        return Dialect.POSTGRES
    if name == "sqlite":
        return Dialect.SQLITE
    raise UnsupportedConnection(f"the outbox supports PostgreSQL and SQLite, not {name!r}")


def _sqlalchemy_statement(connection: Any, table: str, row: _Row) -> tuple[Any, dict[str, Any]]:
    # The caller passed a SQLAlchemy object, so it is installed; not imported before.
    from sqlalchemy import text  # noqa: PLC0415

    params = dict(zip(_COLUMNS, row.values(), strict=True))
    if _sqlalchemy_dialect(connection) is Dialect.SQLITE:
        params["created_at"] = time.time()
        return text(_sqlite_sql(table, "named")), params
    return text(_postgres_sql(table, row, "named")), params


# -- SQL ------------------------------------------------------------------------------


def _lock_seed(table: str) -> int:
    """A per-table seed for the advisory-lock hash, so tables do not share lock keys."""
    return zlib.crc32(table.encode())


def _postgres_sql(table: str, row: _Row, style: str) -> str:
    if style == "asyncpg":
        marks = [f"${n}" for n in range(1, len(_COLUMNS) + 1)]
    elif style == "psycopg":
        marks = [f"%({name})s" for name in _COLUMNS]
    else:
        marks = [f":{name}" for name in _COLUMNS]
    # Explicit types: in INSERT ... SELECT a parameter would otherwise be text.
    marks = [f"CAST({mark} AS {kind})" for mark, kind in zip(marks, _PG_TYPES, strict=True)]
    columns = ", ".join(_COLUMNS)
    values = ", ".join(marks)
    if row.ordering_key is None:
        return f"INSERT INTO {table} ({columns}) VALUES ({values})"
    key = marks[_COLUMNS.index("ordering_key")]
    return (
        f"INSERT INTO {table} ({columns}) SELECT {values} FROM "
        f"(SELECT pg_advisory_xact_lock(hashtextextended({key}, {_lock_seed(table)}))) "
        "AS ordering_lock"
    )


def _psycopg_params(row: _Row) -> dict[str, Any]:
    return dict(zip(_COLUMNS, row.values(), strict=True))


def _sqlite_sql(table: str, style: str) -> str:
    names = (*_COLUMNS, "created_at")
    marks = ", ".join("?" if style == "qmark" else f":{name}" for name in names)
    return f"INSERT INTO {table} ({', '.join(names)}) VALUES ({marks})"
