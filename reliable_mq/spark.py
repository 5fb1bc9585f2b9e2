"""Publish a Spark DataFrame to RabbitMQ so that a job's success means every row was confirmed.

An optional extra: ``pip install 'reliable-mq[spark]'``. Nothing in
``reliable_mq/__init__.py`` imports this module.

```python
from reliable_mq.spark import PublishSpec, publish_dataframe

spec = PublishSpec(
    url="amqp://guest:guest@rabbit:5672/",
    routing_key="orders",
    key_columns=("order_id",),
    id_namespace="orders-export-v1",
)
report = publish_dataframe(df, spec)                          # a PublishReport
df.foreachPartition(partition_publisher(spec))                # the plain form
stream_df.writeStream.foreachBatch(foreach_batch_sink(spec)).start()
```

How it works:

* Each partition runs in the executor's Python worker: it starts its own event
  loop (``asyncio.run``; in a fresh thread if the calling thread already runs a
  loop, as in a notebook), opens its own connection with a
  [`ReliablePublisher`][reliable_mq.ReliablePublisher], streams the rows through the
  confirm window with ``enqueue()``, waits for every confirm, and closes the
  connection in every case. Nothing is opened on the driver and pickled.
* Message ids are deterministic: ``uuid5(uuid5(NAMESPACE_URL, id_namespace),
  canonical JSON of the key columns)``, so task retries, speculative tasks and
  job re-runs send the same ids and a de-duplicating consumer applies each row
  once. Task attempt, partition and micro-batch id go in diagnostic headers
  (``x-spark-partition``, ``x-spark-task-attempt``, ``x-spark-batch-id``), never in
  the id. Without key columns, ``allow_positional_ids=True`` opts in to ids made
  of (batch id, partition index, row index), which are only stable while the
  input and its partitioning are deterministic.
* A nack, a confirm timeout or a lost connection is first handled inside the
  publisher (republished on the same id); messages that still end unconfirmed are
  republished in up to ``max_task_attempts`` rounds inside the task, each on a
  fresh connection; then `PartitionNotConfirmed` is raised and Spark
  retries the task.
* Deterministic failures (``basic.return`` unroutable, missing exchange, a message
  too large or not encodable) stop the partition at once. Under
  `publish_dataframe()` the task then *succeeds* with an error in its stats
  row and the driver raises the error: Spark spends no task retries on it. Under
  `partition_publisher()` (``foreachPartition``) the only way out is to raise,
  so Spark retries the task up to ``spark.task.maxFailures`` times, each retry
  failing at its first message again.
* `check_destination()` runs on the driver before the job (passive declare
  of the exchange, or of the queue on the default exchange), so a typo fails in
  milliseconds instead of burning every task retry.

Metrics: executors do not push Prometheus metrics. Each partition's publisher
uses a private ``CollectorRegistry`` (an executor has nobody scraping it) and
returns one `PartitionStats` row; `publish_dataframe()` collects the
rows into a `PublishReport` on the driver. Rows come only from task
attempts that succeeded: when a task fails and Spark retries it, the failed
attempt's counts are lost with it (its confirmed messages are still on the
broker, as duplicates of the retry's). No accumulators are used.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import itertools
import json
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, TypeVar

try:
    from pyspark import TaskContext
    from pyspark.sql import DataFrame, Row
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError("reliable_mq.spark needs PySpark: pip install 'reliable-mq[spark]'") from exc

import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from ._sync import run_sync
from .connection import ConnectionSupervisor
from .errors import (
    BrokerUnavailable,
    ExchangeNotFound,
    InvalidBody,
    InvalidMessage,
    InvalidSettings,
    MessageTooLarge,
    PublishError,
    PublishUnroutable,
    ReliableMQError,
)
from .headers import SPARK_BATCH_ID_HEADER as HEADER_BATCH_ID
from .headers import SPARK_PARTITION_HEADER as HEADER_PARTITION
from .headers import SPARK_TASK_ATTEMPT_HEADER as HEADER_TASK_ATTEMPT
from .log import get_logger
from .metrics import Metrics
from .publisher import PendingPublish, ReliablePublisher
from .settings import ConnectionSettings, PublisherSettings

__all__ = (
    "DestinationNotFound",
    "HEADER_BATCH_ID",
    "HEADER_PARTITION",
    "HEADER_TASK_ATTEMPT",
    "PartitionNotConfirmed",
    "PartitionStats",
    "PublishReport",
    "PublishSpec",
    "check_destination",
    "foreach_batch_sink",
    "message_id_for",
    "partition_publisher",
    "publish_dataframe",
)


_JSON = "application/json"
_T = TypeVar("_T")
_log = get_logger(__name__)


class DestinationNotFound(ReliableMQError, LookupError):
    """The pre-check found no such exchange or queue (passive declare answered 404)."""


class PartitionNotConfirmed(ReliableMQError):
    """Messages of a partition stayed unconfirmed after every in-task round.

    Raised inside the task so that Spark retries it; the retry sends the same ids.
    """


# -- the spec ---------------------------------------------------------------------


@dataclass(frozen=True)
class PublishSpec:
    """What to publish and where; picklable, built on the driver, used on executors.

    Args:
        url: an AMQP URL (several comma separated fail over) or
            [`ConnectionSettings`][reliable_mq.ConnectionSettings]. Stored as a ``SecretStr``,
            so ``repr`` never shows the password.
        routing_key: a fixed routing key (the queue name on the default exchange).
        exchange: the exchange; ``""`` is the default exchange.
        routing_key_column: take the routing key from this column instead.
        key_columns: the columns that identify a row; the message id derives from
            their values and ``id_namespace``.
        id_namespace: names the dataset/export ("orders-export-v1"); change it to
            publish the same rows again under new ids.
        body_column: send this column's value as the body (bytes as is, str as
            text, anything else as JSON).
        columns: for the default JSON body, only these columns (default: all).
        serializer: ``row -> body`` (bytes, str, dict...); replaces the default.
            Must be picklable (cloudpickle: lambdas and local functions are fine).
        header_columns: copy these columns into AMQP headers.
        headers: fixed headers added to every message.
        publisher: window, deadlines and retry policy of each partition's publisher.
        max_task_attempts: rounds inside one task: messages still unconfirmed
            after a round are republished on a fresh connection, at most this
            many rounds in all, then the task fails for Spark to retry.
        allow_positional_ids: without ``key_columns``, derive ids from (batch id,
            partition, row index). Weaker: only stable if the input and its
            partitioning are deterministic (see ``docs/spark.md``).
        connection_name: shown in the broker's connection list (the partition
            number is appended).

    Raises:
        InvalidSettings: the combination of fields is not usable.
    """

    url: SecretStr | str | ConnectionSettings = field(repr=False)
    routing_key: str | None = None
    exchange: str = ""
    routing_key_column: str | None = None
    key_columns: Sequence[str] = ()
    id_namespace: str = ""
    body_column: str | None = None
    columns: Sequence[str] | None = None
    serializer: Callable[[Any], Any] | None = None
    header_columns: Sequence[str] = ()
    headers: Mapping[str, Any] = field(default_factory=dict)
    publisher: PublisherSettings = field(default_factory=PublisherSettings)
    max_task_attempts: int = 3
    allow_positional_ids: bool = False
    connection_name: str = "reliable_mq.spark"

    def __post_init__(self) -> None:
        problems: list[tuple[str, str]] = []
        connection: ConnectionSettings | None
        if isinstance(self.url, ConnectionSettings):
            connection = self.url
        else:
            secret = self.url if isinstance(self.url, SecretStr) else SecretStr(self.url)
            object.__setattr__(self, "url", secret)
            try:
                connection = ConnectionSettings(url=secret, connection_name=self.connection_name)
            except InvalidSettings as exc:
                problems.extend(("url", msg) for _, msg in exc.problems)
                connection = None
        object.__setattr__(self, "_connection", connection)
        for name in ("key_columns", "header_columns"):
            value = getattr(self, name)
            if isinstance(value, str):
                problems.append((name, "must be a sequence of column names, not a str"))
            else:
                object.__setattr__(self, name, tuple(value))
        if self.columns is not None:
            if isinstance(self.columns, str):
                problems.append(("columns", "must be a sequence of column names, not a str"))
            else:
                object.__setattr__(self, "columns", tuple(self.columns))
        object.__setattr__(self, "headers", dict(self.headers))
        if (self.routing_key is None) == (self.routing_key_column is None):
            problems.append(("routing_key", "give exactly one of routing_key, routing_key_column"))
        if sum(x is not None for x in (self.body_column, self.serializer, self.columns)) > 1:
            problems.append(("body_column", "give at most one of body_column, serializer, columns"))
        if not self.id_namespace:
            problems.append(("id_namespace", "required: it names the id space of this dataset"))
        if not self.key_columns and not self.allow_positional_ids:
            problems.append(
                (
                    "key_columns",
                    "required for stable message ids; or set allow_positional_ids=True "
                    "to accept ids that change when a partition is recomputed differently",
                )
            )
        if self.max_task_attempts < 1:
            problems.append(("max_task_attempts", "must be >= 1"))
        if problems:
            raise InvalidSettings("PublishSpec", problems)

    def __getstate__(self) -> dict[str, Any]:
        # Settings travel as plain field values and are rebuilt (and validated)
        # on the executor: no pickled pydantic internals, and nothing read from
        # the executor's environment overrides what the driver configured.
        state = dict(self.__dict__)
        state["_connection"] = self.connection.model_dump()
        state["publisher"] = self.publisher.model_dump()
        if isinstance(self.url, ConnectionSettings):
            state["url"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        connection = ConnectionSettings(**state["_connection"])
        state["_connection"] = connection
        state["publisher"] = PublisherSettings(**state["publisher"])
        if state["url"] is None:
            state["url"] = connection
        self.__dict__.update(state)

    @property
    def connection(self) -> ConnectionSettings:
        """The connection settings (URL validated, password hidden)."""
        return self.__dict__["_connection"]  # type: ignore[no-any-return]

    @property
    def namespace(self) -> uuid.UUID:
        """``uuid5(NAMESPACE_URL, id_namespace)``, the namespace of every message id."""
        return uuid.uuid5(uuid.NAMESPACE_URL, self.id_namespace)


def message_id_for(spec: PublishSpec, keys: Mapping[str, Any]) -> str:
    """The message id of a row whose key columns hold ``keys`` (for consumers and tests).

    The id is ``uuid5(spec.namespace, canonical JSON of {column: value})`` with keys
    sorted, so column order does not matter; the value types do (1 and 1.0 differ).
    """
    return str(uuid.uuid5(spec.namespace, _canonical(keys)))


def _canonical(value: Any) -> str:
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_json_default
    )


def _json_default(value: Any) -> Any:
    if isinstance(value, Row):
        return value.asDict(recursive=True)
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(bytes(value)).decode()
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


_HEADER_TYPES = (str, int, float, bool, bytes, Decimal, dt.datetime, type(None))


def _header_value(value: Any) -> Any:
    if isinstance(value, _HEADER_TYPES):
        return value
    if isinstance(value, (dt.date, dt.time)):
        return value.isoformat()
    return _canonical(value)


# -- per-partition statistics and the report -----------------------------------------


@dataclass(frozen=True, slots=True)
class PartitionStats:
    """What one task attempt of one partition did (one row per partition).

    Attributes:
        partition: the partition index.
        task_attempt: Spark's attempt number of the task that produced this row
            (0 unless Spark retried the task).
        batch_id: the Structured Streaming micro-batch id, if any.
        rows: rows read from the partition.
        confirmed: messages confirmed by the broker.
        republished: resends: inside the publisher (nack, timeout, lost channel)
            plus whole in-task rounds.
        rounds: in-task publishing rounds (1 unless some messages needed another).
        seconds: wall time in the task.
        error_type: set when a deterministic failure (unroutable...) stopped the
            partition; `publish_dataframe()` raises it on the driver.
        error: that error's text.
        error_details: the fields needed to raise the error again on the driver.
    """

    partition: int
    task_attempt: int
    batch_id: int | None
    rows: int
    confirmed: int
    republished: int
    rounds: int
    seconds: float
    error_type: str | None = None
    error: str | None = None
    error_details: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class PublishReport:
    """The outcome of `publish_dataframe()`, summed over partitions.

    Counts come from the task attempts that succeeded only. A task attempt that
    failed (and was retried by Spark) left its confirmed messages on the broker,
    but its counts are not here: ``rows == confirmed`` always holds, and
    ``task_attempts > partitions`` tells that Spark retried some tasks, so the
    queue holds duplicates (same ids) of those partitions.

    Attributes:
        rows: rows published (each confirmed).
        confirmed: messages confirmed by the broker (equals ``rows``).
        republished: resends needed by the succeeding attempts.
        partitions: partitions in the DataFrame.
        task_attempts: sum over partitions of (Spark attempt number + 1) of the
            attempt that succeeded; equals ``partitions`` when no task was retried.
        rounds: in-task publishing rounds in all.
        seconds: wall time on the driver, pre-check included.
        batch_id: the micro-batch id, if any.
        partition_stats: the per-partition rows.
    """

    rows: int
    confirmed: int
    republished: int
    partitions: int
    task_attempts: int
    rounds: int
    seconds: float
    batch_id: int | None
    partition_stats: tuple[PartitionStats, ...]

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0


# -- the executor side ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Task:
    partition: int
    attempt: int
    batch_id: int | None


@dataclass(slots=True)
class _Prepared:
    message_id: str
    body: Any
    content_type: str | None
    routing_key: str
    headers: dict[str, Any]


class _RowEncoder:
    """Turns a Row into what ``enqueue()`` needs: id, body, routing key, headers."""

    def __init__(self, spec: PublishSpec, task: _Task) -> None:
        self._spec = spec
        self._namespace = spec.namespace
        self._task = task
        base = dict(spec.headers)
        base[HEADER_PARTITION] = task.partition
        base[HEADER_TASK_ATTEMPT] = task.attempt
        if task.batch_id is not None:
            base[HEADER_BATCH_ID] = task.batch_id
        self._base_headers = base
        self._index = -1

    def __call__(self, row: Any) -> _Prepared:
        spec = self._spec
        self._index += 1
        data: dict[str, Any] = row.asDict(recursive=True)
        if spec.key_columns:
            keys = {name: data[name] for name in spec.key_columns}
        else:
            keys = {"batch": self._task.batch_id, "partition": self._task.partition}
            keys["index"] = self._index
        message_id = str(uuid.uuid5(self._namespace, _canonical(keys)))
        content_type: str | None = None
        if spec.serializer is not None:
            body = spec.serializer(row)
        elif spec.body_column is not None:
            body = data[spec.body_column]
            if not isinstance(body, (bytes, bytearray, str)):
                body, content_type = _canonical(body).encode(), _JSON
        else:
            selected = data if spec.columns is None else {c: data[c] for c in spec.columns}
            body, content_type = _canonical(selected).encode(), _JSON
        if spec.routing_key is not None:
            routing_key = spec.routing_key
        else:
            assert spec.routing_key_column is not None
            value = data[spec.routing_key_column]
            if value is None:
                raise InvalidMessage(
                    f"row {message_id}: routing key column {spec.routing_key_column!r} is null"
                )
            routing_key = str(value)
        headers = self._base_headers
        if spec.header_columns:
            headers = dict(headers)
            for name in spec.header_columns:
                headers[name] = _header_value(data[name])
        return _Prepared(message_id, body, content_type, routing_key, headers)


_FATAL: dict[str, type[ReliableMQError]] = {
    cls.__name__: cls
    for cls in (PublishUnroutable, ExchangeNotFound, MessageTooLarge, InvalidBody, InvalidMessage)
}


class _Fatal(Exception):
    """Internal: a deterministic failure stopped the partition."""

    def __init__(self, error: ReliableMQError) -> None:
        self.error = error
        super().__init__(str(error))


class _Counters:
    __slots__ = ("confirmed", "republished", "rows")

    def __init__(self) -> None:
        self.rows = 0
        self.confirmed = 0
        self.republished = 0


async def _stream_round(
    publisher: ReliablePublisher,
    spec: PublishSpec,
    source: Iterator[_Prepared],
    failed: list[_Prepared],
    counters: _Counters,
) -> None:
    """Enqueue everything from ``source`` under the window; sort outcomes as they land."""
    in_flight: deque[tuple[PendingPublish, _Prepared]] = deque()
    fatal: ReliableMQError | None = None

    def settle(pending: PendingPublish, prepared: _Prepared) -> None:
        nonlocal fatal
        try:
            pending.result()
        except ReliableMQError as exc:
            if type(exc).__name__ in _FATAL:
                fatal = fatal or exc
            else:  # nack, timeout, abort: republish in the next round
                failed.append(prepared)
        else:
            counters.confirmed += 1

    try:
        while True:
            try:
                prepared = next(source)
            except StopIteration:
                break
            except ReliableMQError as exc:  # our encoder: null routing key, bad body...
                if type(exc).__name__ not in _FATAL:
                    raise
                fatal = exc
                break
            try:
                pending = await publisher.enqueue(
                    prepared.body,
                    routing_key=prepared.routing_key,
                    exchange=spec.exchange,
                    message_id=prepared.message_id,
                    headers=prepared.headers,
                    content_type=prepared.content_type,
                )
            except ReliableMQError as exc:  # raised before the message was in flight
                if type(exc).__name__ in _FATAL:
                    fatal = exc
                    break
                failed.append(prepared)
                continue
            in_flight.append((pending, prepared))
            while in_flight and in_flight[0][0].done():
                settle(*in_flight.popleft())
            if fatal is not None:
                break
    finally:
        # Every message in flight gets its outcome before the round ends, also
        # when a user serializer raised: what was sent is confirmed first.
        while in_flight:
            pending, prepared = in_flight.popleft()
            with contextlib.suppress(Exception):  # settle() reads the outcome
                await pending
            settle(pending, prepared)
    if fatal is not None:
        raise _Fatal(fatal)


async def _publish_partition(spec: PublishSpec, rows: Iterable[Any], task: _Task) -> PartitionStats:
    started = time.monotonic()
    encoder = _RowEncoder(spec, task)
    counters = _Counters()

    def counted(items: Iterable[Any]) -> Iterator[_Prepared]:
        for row in items:
            counters.rows += 1
            yield encoder(row)

    fresh = counted(rows)
    retry: list[_Prepared] = []
    connection = spec.connection.model_copy(
        update={"connection_name": f"{spec.connection.connection_name}.p{task.partition}"}
    )
    rounds = 0
    log = _log.bind(partition=task.partition, task_attempt=task.attempt, batch_id=task.batch_id)
    while True:
        rounds += 1
        failed: list[_Prepared] = []
        try:
            async with ReliablePublisher(
                connection, settings=spec.publisher, registry=CollectorRegistry()
            ) as publisher:
                try:
                    source = itertools.chain(retry, fresh)
                    await _stream_round(publisher, spec, source, failed, counters)
                finally:
                    counters.republished += publisher.stats().republished
        except BrokerUnavailable as exc:
            # Raised by start(): nothing of this round was read or sent.
            if rounds >= spec.max_task_attempts:
                exc.add_note(
                    f"partition {task.partition}: no connection in {rounds} rounds; "
                    "Spark retries the task"
                )
                raise
            log.warning("spark_round_no_connection", round=rounds, error=str(exc))
            await asyncio.sleep(spec.publisher.backoff(rounds))
            continue
        except _Fatal as fatal:
            return _stats(task, counters, rounds, started, fatal.error)
        if not failed:
            return _stats(task, counters, rounds, started)
        if rounds >= spec.max_task_attempts:
            raise PartitionNotConfirmed(
                f"partition {task.partition} (task attempt {task.attempt}): "
                f"{len(failed)} messages still unconfirmed after {rounds} rounds, "
                f"first message_id={failed[0].message_id}; Spark retries the task "
                "with the same message ids"
            )
        log.warning("spark_round_incomplete", round=rounds, unconfirmed=len(failed))
        counters.republished += len(failed)
        retry = failed
        await asyncio.sleep(spec.publisher.backoff(rounds))


def _stats(
    task: _Task,
    counters: _Counters,
    rounds: int,
    started: float,
    error: ReliableMQError | None = None,
) -> PartitionStats:
    details: tuple[tuple[str, Any], ...] = ()
    if isinstance(error, PublishError):
        base = str(error).rsplit(" (message_id=", 1)[0]
        details = (("text", base), ("message_id", error.message_id), ("attempts", error.attempts))
        if isinstance(error, PublishUnroutable):
            details += (
                ("exchange", error.exchange),
                ("routing_key", error.routing_key),
                ("reply_code", error.reply_code),
                ("reply_text", error.reply_text),
            )
    return PartitionStats(
        partition=task.partition,
        task_attempt=task.attempt,
        batch_id=task.batch_id,
        rows=counters.rows,
        confirmed=counters.confirmed,
        republished=counters.republished,
        rounds=rounds,
        seconds=time.monotonic() - started,
        error_type=None if error is None else type(error).__name__,
        error=None if error is None else str(error),
        error_details=details,
    )


def _current_task(batch_id: int | None) -> _Task:
    context = TaskContext.get()
    if context is None:  # called outside a Spark task (tests, local use)
        return _Task(partition=0, attempt=0, batch_id=batch_id)
    return _Task(
        partition=int(context.partitionId()),
        attempt=int(context.attemptNumber()),
        batch_id=batch_id,
    )


def _run_sync(factory: Callable[[], Awaitable[_T]]) -> _T:
    return run_sync(factory, thread_name="reliable_mq.spark")


def _error_from(stats: PartitionStats) -> ReliableMQError:
    assert stats.error_type is not None
    cls = _FATAL.get(stats.error_type, ReliableMQError)
    details = dict(stats.error_details)
    error: ReliableMQError
    if cls is PublishUnroutable:
        error = PublishUnroutable(
            message_id=details["message_id"],
            attempts=details["attempts"],
            exchange=details["exchange"],
            routing_key=details["routing_key"],
            reply_code=details["reply_code"],
            reply_text=details["reply_text"],
        )
    elif issubclass(cls, PublishError) and details:
        error = cls(details["text"], message_id=details["message_id"], attempts=details["attempts"])
    else:
        error = cls(stats.error or stats.error_type)
    error.add_note(
        f"reliable_mq.spark: partition {stats.partition} stopped at this message after "
        f"{stats.confirmed} confirmed; the failure is deterministic, so the task ended "
        "without a Spark retry"
    )
    return error


def partition_publisher(
    spec: PublishSpec, *, batch_id: int | None = None
) -> Callable[[Iterable[Any]], None]:
    """A function for ``df.foreachPartition`` that publishes the partition's rows.

    It returns once every row is confirmed. Any failure raises, so Spark retries
    the task (same ids); deterministic failures such as unroutable are retried
    too, up to ``spark.task.maxFailures``, each retry failing at its first
    message. `publish_dataframe()` avoids those retries and returns a report.
    """

    def publish_partition(rows: Iterable[Any]) -> None:
        task = _current_task(batch_id)
        stats = _run_sync(lambda: _publish_partition(spec, rows, task))
        if stats.error_type is not None:
            raise _error_from(stats)

    return publish_partition


def _stats_partition(
    spec: PublishSpec, batch_id: int | None
) -> Callable[[Iterable[Any]], Iterator[PartitionStats]]:
    def publish_partition(rows: Iterable[Any]) -> Iterator[PartitionStats]:
        task = _current_task(batch_id)
        yield _run_sync(lambda: _publish_partition(spec, rows, task))

    return publish_partition


# -- the driver side -------------------------------------------------------------------


def check_destination(spec: PublishSpec) -> None:
    """Check on the driver that the destination exists (passive declare).

    Checks the exchange when ``spec.exchange`` is set, and the queue when
    publishing to the default exchange with a fixed routing key. Bindings
    cannot be checked passively: an exchange whose bindings miss a routing key
    is caught by the first ``basic.return`` instead.

    Raises:
        DestinationNotFound: the exchange or queue does not exist.
        BrokerUnavailable: no broker accepted a connection.
    """
    _run_sync(lambda: _check_destination(spec))


async def _check_destination(spec: PublishSpec) -> None:
    connection = spec.connection.model_copy(
        update={"connection_name": f"{spec.connection.connection_name}.check"}
    )
    supervisor = ConnectionSupervisor(
        connection, role="check", metrics=Metrics.on(CollectorRegistry())
    )
    await supervisor.start()
    try:
        amqp = await supervisor.wait_connected()
        if spec.exchange:
            exchange = spec.exchange
            await _passive_declare(
                amqp,
                lambda channel: channel.get_exchange(exchange, ensure=True),
                f"exchange {exchange!r} does not exist on {connection.addresses[0]}; "
                "declare it before publishing",
            )
        elif spec.routing_key is not None:
            queue = spec.routing_key
            await _passive_declare(
                amqp,
                lambda channel: channel.get_queue(queue, ensure=True),
                f"queue {queue!r} does not exist on {connection.addresses[0]} "
                "(default exchange: the routing key names the queue); declare it first",
            )
    finally:
        await supervisor.close()


async def _passive_declare(
    amqp: AbstractConnection,
    declare: Callable[[AbstractChannel], Awaitable[object]],
    missing: str,
) -> None:
    """Run a passive declare on a channel of its own; a 404 becomes DestinationNotFound."""
    channel = await amqp.channel(publisher_confirms=False)
    try:
        await declare(channel)
    except aiormq.exceptions.ChannelNotFoundEntity:
        raise DestinationNotFound(missing) from None
    if not channel.is_closed:
        await channel.close()


def _check_columns(spec: PublishSpec, available: Sequence[str]) -> None:
    """Fail on the driver, before any task, when the spec names a missing column."""
    wanted: dict[str, Sequence[str]] = {
        "key_columns": spec.key_columns,
        "header_columns": spec.header_columns,
        "columns": spec.columns or (),
        "body_column": (spec.body_column,) if spec.body_column else (),
        "routing_key_column": (spec.routing_key_column,) if spec.routing_key_column else (),
    }
    present = set(available)
    problems = [
        (name, f"no column {column!r} in the DataFrame (columns: {', '.join(available)})")
        for name, columns in wanted.items()
        for column in columns
        if column not in present
    ]
    if problems:
        raise InvalidSettings("PublishSpec", problems)


def publish_dataframe(
    df: DataFrame, spec: PublishSpec, *, batch_id: int | None = None, check: bool = True
) -> PublishReport:
    """Publish every row of ``df``; return once all are confirmed.

    Runs ``df.rdd.mapPartitions`` with one stats row per partition and collects
    those rows (no accumulators). Counts come only from task attempts that
    succeeded: a failed attempt's counts are dropped with it, though what it
    confirmed stays on the broker (duplicates with the same ids as the retry's).

    Args:
        df: the rows to publish.
        spec: where and how.
        batch_id: a micro-batch id, sent in the ``x-spark-batch-id`` header.
        check: run `check_destination()` first.

    Raises:
        InvalidSettings: the spec names a column the DataFrame lacks (no task started).
        DestinationNotFound: the pre-check failed (no task started).
        PublishUnroutable, ExchangeNotFound, MessageTooLarge, InvalidMessage:
            a partition hit a deterministic failure; raised on the driver after
            the job, without Spark task retries.
        pyspark.errors.PySparkException (or Py4JJavaError): a task failed
            ``spark.task.maxFailures`` times (for example
            `PartitionNotConfirmed` or the user serializer's error).
    """
    started = time.monotonic()
    _check_columns(spec, df.columns)
    if check:
        check_destination(spec)
    collected: list[PartitionStats] = df.rdd.mapPartitions(
        _stats_partition(spec, batch_id)
    ).collect()
    stats = tuple(sorted(collected, key=lambda s: s.partition))
    seconds = time.monotonic() - started
    for item in stats:
        if item.error_type is not None:
            raise _error_from(item)
    report = PublishReport(
        rows=sum(s.rows for s in stats),
        confirmed=sum(s.confirmed for s in stats),
        republished=sum(s.republished for s in stats),
        partitions=len(stats),
        task_attempts=sum(s.task_attempt + 1 for s in stats),
        rounds=sum(s.rounds for s in stats),
        seconds=seconds,
        batch_id=batch_id,
        partition_stats=stats,
    )
    _log.info(
        "spark_publish_done",
        rows=report.rows,
        partitions=report.partitions,
        task_attempts=report.task_attempts,
        republished=report.republished,
        seconds=round(seconds, 3),
    )
    return report


def foreach_batch_sink(
    spec: PublishSpec,
    *,
    on_report: Callable[[PublishReport], None] | None = None,
    check: bool = True,
) -> Callable[[DataFrame, int], None]:
    """A function for ``writeStream.foreachBatch``: publishes each micro-batch.

    The batch id goes in the ``x-spark-batch-id`` header. Spark replays a batch
    with the same id after a failure; with key columns the replay sends the same
    message ids. The destination is checked before the first batch only.

    Args:
        spec: where and how.
        on_report: called on the driver with each batch's `PublishReport`.
        check: run `check_destination()` before the first batch.
    """
    checked = not check

    def sink(batch_df: DataFrame, batch_id: int) -> None:
        nonlocal checked
        if not checked:
            check_destination(spec)
            checked = True
        report = publish_dataframe(batch_df, spec, batch_id=int(batch_id), check=False)
        if on_report is not None:
            on_report(report)

    return sink
