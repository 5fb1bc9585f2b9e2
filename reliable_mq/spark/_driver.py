"""The driver side: checks before any task runs, the job, and the report."""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from .._sync import run_sync
from ..connection import AMQP_ERRORS, Channel, ConnectionSupervisor, FaultKind, Link, classify
from ..log import get_logger
from ..metrics import Metrics
from ._encode import canonical_value
from ._errors import DestinationNotFound, DuplicateKeys, NullKey
from ._partition import PartitionStats, publish_partition
from ._plan import PublishPlan, plan_publish
from ._spec import IdScheme, PublishSpec

__all__ = (
    "PublishReport",
    "check_destination",
    "check_keys",
    "partition_publisher",
    "plan_for",
    "publish_dataframe",
    "raise_for_stats",
)

_log = get_logger("reliable_mq.spark")
_SESSION_TIME_ZONE = "spark.sql.session.timeZone"


@dataclass(frozen=True, slots=True)
class PublishReport:
    """The outcome of `publish_dataframe`, summed over partitions.

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
        rounds: in-task publishing rounds in all (empty partitions have none).
        seconds: wall time on the driver, checks included.
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


def plan_for(df: DataFrame, spec: PublishSpec) -> PublishPlan:
    """`plan_publish` for ``df``'s schema in its session's time zone."""
    zone = df.sparkSession.conf.get(_SESSION_TIME_ZONE) or "UTC"
    return plan_publish(spec, df.schema, time_zone=zone)


def check_keys(df: DataFrame, spec: PublishSpec) -> None:
    """Check the key columns on the driver, with Spark jobs, before anything is published.

    * Nullable key columns are searched for nulls (one job that stops at the
      first null; skipped for columns the schema declares non-nullable, and
      when ``allow_null_keys``).
    * With ``ids="key"``, one aggregation job looks for two rows with one key.

    Raises:
        NullKey: a key column holds null.
        DuplicateKeys: ``ids="key"`` and several rows share a key.
    """
    keys = list(spec.key_columns)
    nullable = [name for name in keys if df.schema[name].nullable]
    if nullable and not spec.allow_null_keys:
        condition = functools.reduce(
            lambda a, b: a | b, [_column(name).isNull() for name in nullable]
        )
        if df.where(condition).limit(1).count():
            raise NullKey(
                f"a key column ({', '.join(nullable)}) holds null: rows with null keys "
                "cannot be told apart by key. Filter them out, or set allow_null_keys=True"
            )
    if spec.ids == IdScheme.KEY:
        found = (
            df.groupBy(*[_column(name) for name in keys])
            .agg(F.count(F.lit(1)).alias("__rows"))
            .where(F.col("__rows") > 1)
            .limit(1)
            .collect()
        )
        if found:
            row = found[0]
            key = canonical_value({name: row[index] for index, name in enumerate(keys)})
            raise DuplicateKeys(key, int(row["__rows"]))


def _column(name: str) -> Column:
    return F.col("`" + name.replace("`", "``") + "`")


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
    run_sync(lambda: _check_destination(spec), thread_name="reliable_mq.spark")


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
                lambda channel: channel.declare_exchange(exchange, passive=True),
                f"exchange {exchange!r} does not exist on {connection.addresses[0]}; "
                "declare it before publishing",
            )
        elif spec.routing_key is not None:
            queue = spec.routing_key
            await _passive_declare(
                amqp,
                lambda channel: channel.declare_queue(queue, passive=True),
                f"queue {queue!r} does not exist on {connection.addresses[0]} "
                "(default exchange: the routing key names the queue); declare it first",
            )
    finally:
        await supervisor.close()


async def _passive_declare(
    amqp: Link,
    declare: Callable[[Channel], Awaitable[object]],
    missing: str,
) -> None:
    """Run a passive declare on a channel of its own; a 404 becomes DestinationNotFound."""
    channel = await amqp.channel()
    try:
        await declare(channel)
    except AMQP_ERRORS as exc:
        fault = classify(exc)
        if fault is not None and fault.kind is FaultKind.NOT_FOUND:
            raise DestinationNotFound(missing) from None
        raise
    finally:
        await channel.close()


def raise_for_stats(stats: Iterable[PartitionStats]) -> None:
    """Raise, on the driver, the deterministic failure a partition stopped at (if any).

    The error object travelled from the executor whole (errors pickle); a note
    says that the task ended without a Spark retry.
    """
    for item in sorted(stats, key=lambda s: s.partition):
        if item.error is not None:
            error = item.error
            error.add_note(
                f"reliable_mq.spark: partition {item.partition} stopped at this message "
                f"after {item.confirmed} confirmed; the failure is deterministic, so the "
                "task ended without a Spark retry"
            )
            raise error


def publish_dataframe(
    df: DataFrame, spec: PublishSpec, *, batch_id: int | None = None, check: bool = True
) -> PublishReport:
    """Publish every row of ``df``; return once all are confirmed.

    Before any task runs, the driver checks the schema (`plan_publish`), the
    key columns (`check_keys`) and, with ``check``, the destination
    (`check_destination`). Then ``df.rdd.mapPartitions`` publishes and returns
    one stats row per partition, which the driver collects (no accumulators).

    Args:
        df: the rows to publish.
        spec: where and how.
        batch_id: a micro-batch id, sent in the ``x-spark-batch-id`` header.
        check: run `check_destination` first.

    Raises:
        InvalidSettings: the spec names a column the DataFrame lacks.
        UnsupportedSchema: a column cannot be encoded, or names repeat.
        NullKey, DuplicateKeys: the key columns would merge distinct rows.
        DestinationNotFound: the pre-check failed.
        PublishUnroutable, PublishRefused, MessageTooLarge, InvalidMessage:
            a partition hit a deterministic failure; raised on the driver after
            the job, without Spark task retries.
        pyspark.errors.PySparkException (or Py4JJavaError): a task failed
            ``spark.task.maxFailures`` times (for example with
            `PartitionNotConfirmed`, `BrokerUnavailable` or the user
            serializer's error); its text names the error.
    """
    started = time.monotonic()
    plan = plan_for(df, spec)
    check_keys(df, spec)
    if check:
        check_destination(spec)
    collected: list[PartitionStats] = df.rdd.mapPartitions(
        _stats_partition(plan, batch_id)
    ).collect()
    stats = tuple(sorted(collected, key=lambda s: s.partition))
    seconds = time.monotonic() - started
    raise_for_stats(stats)
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


def _stats_partition(
    plan: PublishPlan, batch_id: int | None
) -> Callable[[Iterable[object]], Iterator[PartitionStats]]:
    def publish(rows: Iterable[object]) -> Iterator[PartitionStats]:
        yield publish_partition(plan, rows, batch_id=batch_id)

    return publish


def partition_publisher(
    spec: PublishSpec, df: DataFrame, *, batch_id: int | None = None, check: bool = True
) -> Callable[[Iterable[object]], None]:
    """Check ``df`` on the driver, then return a function for ``df.foreachPartition``.

    Usage: ``df.foreachPartition(partition_publisher(spec, df))``. The checks
    are those of `publish_dataframe`. The returned function publishes a
    partition and returns once every row is confirmed; any failure raises, so
    Spark retries the task (same ids), deterministic ones (unroutable...)
    included, each retry failing again at its first message.
    `publish_dataframe` avoids those retries and returns a report.

    Raises:
        ReliableMQError: the driver-side checks failed (as `publish_dataframe`).
    """
    plan = plan_for(df, spec)
    check_keys(df, spec)
    if check:
        check_destination(spec)

    def publish(rows: Iterable[object]) -> None:
        stats = publish_partition(plan, rows, batch_id=batch_id)
        raise_for_stats((stats,))

    return publish
