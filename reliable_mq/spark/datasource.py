"""The ``rabbitmq`` format: writes (``df.write``, ``writeStream``), stream reads (``spark.read``).

A Python Data Source. Reading: a stream between two offsets, as a batch
(`reliable_mq.spark._source`), or streams as they grow, offsets in Spark's
checkpoint (`reliable_mq.spark._stream_source`).

Built on PySpark 4's ``pyspark.sql.datasource`` API and on nothing but the
public functions of `reliable_mq.spark`:

* on the driver, `RabbitMQDataSource.writer` builds a `PublishSpec` from the
  options (`PublishSpec.from_options`), checks it against the schema
  (`plan_publish`) and checks the destination (`check_destination`), so a bad
  schema or a missing queue fails before any task runs;
* each task gets Arrow batches and runs `publish_partition` on them
  (`arrow_rows`): the same publishing path as `publish_dataframe`. When key
  columns may hold null, the task first reads its whole partition and checks
  them (the driver's `check_keys` job is not available to a data source), so a
  null key stops the partition before anything of it is published; see
  `_Spool`;
* each task's `PartitionStats` comes back as its commit message; ``commit``
  raises a deterministic failure (unroutable...) on the driver with
  `raise_for_stats`, so no Spark task retries are spent on it.

Register it in each thread that writes:

```python
from reliable_mq.spark import register_data_source

register_data_source(spark)
df.write.format("rabbitmq").mode("append").option("url", url)  # ...options... .save()
```
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import tempfile
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import SparkSession
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

from ..errors import InvalidSettings
from ._driver import check_destination, raise_for_stats
from ._errors import NullKey
from ._partition import PartitionStats, current_task, publish_partition
from ._plan import PublishPlan, arrow_rows, plan_publish
from ._rows import RowFormat
from ._source import RabbitMQStreamRangeReader, ReadSpec
from ._spec import IdScheme, PublishSpec, check_destination_option
from ._stream_source import RabbitMQStreamSource, StreamSourceSpec

__all__ = (
    "RabbitMQDataSource",
    "RabbitMQStreamWriter",
    "RabbitMQWriter",
    "StatsMessage",
    "register_data_source",
)


def register_data_source(spark: SparkSession) -> None:
    """Make ``format("rabbitmq")`` available in ``spark``, for the calling thread.

    Spark (4.3 seen) looks a Python data source up through the JVM thread's
    *active* session, which a thread other than the one that built the session
    does not have: ``save()`` there fails with ``DATA_SOURCE_NOT_FOUND``. So
    this also makes ``spark`` the active session of the calling thread (classic
    sessions). Call it in every thread that writes with ``format("rabbitmq")``.
    """
    spark.dataSource.register(RabbitMQDataSource)
    jvm, jsession = getattr(spark, "_jvm", None), getattr(spark, "_jsparkSession", None)
    if jvm is not None and jsession is not None:  # not under Spark Connect
        jvm.SparkSession.setActiveSession(jsession)


class RabbitMQDataSource(DataSource):
    """The ``rabbitmq`` format: writes and reads, batch and streaming.

    Options are `PublishSpec`'s fields (see `PublishSpec.from_options`), plus
    ``check_destination`` (default ``true``: passive declare on the driver).
    Only ``mode("append")`` is supported: a queue cannot be overwritten.
    ``ids="key"`` is refused: its duplicate check needs a Spark job that a
    data source cannot run (use `publish_dataframe` for it).
    """

    @classmethod
    def name(cls) -> str:
        return "rabbitmq"

    def schema(self) -> StructType:
        """The rows of a stream read (``spark.read``) when no ``.schema(...)`` is given:
        `READ_SCHEMA`, or with ``bodyFormat`` ``json`` the body as a struct (`RowFormat`).

        Raises:
            InvalidSettings: a body option that does not parse.
        """
        given = {str(k).lower(): str(v) for k, v in self.options.items()}
        return RowFormat.from_options(given).schema()

    def reader(self, schema: StructType) -> RabbitMQStreamRangeReader:
        """``spark.read.format("rabbitmq")``: a stream between two offsets (`ReadSpec` options).

        Raises:
            InvalidSettings: bad options, or a start past the end.
            NotAStream: the name is a classic or quorum queue, or nothing.
            StreamDataLoss: retention removed the start (``failOnDataLoss`` true).
        """
        return RabbitMQStreamRangeReader(ReadSpec.from_options(dict(self.options), schema))

    def streamReader(self, schema: StructType) -> RabbitMQStreamSource:
        """``spark.readStream.format("rabbitmq")``: streams as they grow (`StreamSourceSpec`).

        Raises:
            InvalidSettings: bad options (checked here, before the query starts).
        """
        return RabbitMQStreamSource(StreamSourceSpec.from_options(dict(self.options)))

    def writer(self, schema: StructType, overwrite: bool) -> RabbitMQWriter:
        return RabbitMQWriter(self._plan(schema, overwrite))

    def streamWriter(self, schema: StructType, overwrite: bool) -> RabbitMQStreamWriter:
        return RabbitMQStreamWriter(self._plan(schema, overwrite))

    def _plan(self, schema: StructType, overwrite: bool) -> PublishPlan:
        options: dict[str, str] = {str(k).lower(): str(v) for k, v in self.options.items()}
        if overwrite:
            raise InvalidSettings(
                "rabbitmq options", [("mode", "a queue cannot be overwritten: use mode('append')")]
            )
        spec = PublishSpec.from_options(options)
        check = check_destination_option(options)
        if spec.ids == IdScheme.KEY:
            raise InvalidSettings(
                "rabbitmq options",
                [
                    (
                        "ids",
                        "'key' needs a duplicate-key check job that a data source cannot "
                        "run; use ids='row', or publish_dataframe() for key ids",
                    )
                ],
            )
        plan = plan_publish(spec, schema)
        if check:
            check_destination(spec)
        return plan


class StatsMessage(WriterCommitMessage):
    """A task's commit message: its `PartitionStats`."""

    def __init__(self, stats: PartitionStats) -> None:
        self.stats = stats


def _publish_batches(plan: PublishPlan, batches: Iterator[pa.RecordBatch]) -> StatsMessage:
    first = next(batches, None)
    if first is None:
        return StatsMessage(publish_partition(plan, ()))  # no connection opened
    if plan.spec.time_zone is None:
        zone = _session_zone(first.schema)
        if zone is not None:  # Arrow carries spark.sql.session.timeZone
            plan = dataclasses.replace(plan, time_zone=zone)
    chained = itertools.chain((first,), batches)
    checked = _null_checked_keys(plan)
    if not checked:
        return StatsMessage(publish_partition(plan, arrow_rows(chained)))
    with _Spool() as spool:
        null_key = spool.fill(chained, checked)
        if null_key is not None:
            task = current_task()
            return StatsMessage(
                PartitionStats(
                    task.partition, task.attempt, task.batch_id, 0, 0, 0, 0, 0.0, null_key
                )
            )
        return StatsMessage(publish_partition(plan, arrow_rows(spool.batches())))


def _null_checked_keys(plan: PublishPlan) -> list[tuple[str, int]]:
    """(name, position) of the key columns that must be checked for nulls.

    None when nulls are allowed, nor for columns the schema declares non-nullable
    (as the driver's `check_keys` skips them).
    """
    spec, schema = plan.spec, plan.schema
    if spec.allow_null_keys:
        return []
    positions = {name: i for i, name in enumerate(schema.fieldNames())}
    return [(name, positions[name]) for name in spec.key_columns if schema[name].nullable]


SPOOL_MEMORY = 64 * 1024 * 1024
"""Bytes of Arrow batches a task holds in memory while it reads its partition
to check the key columns; past that, the batches go to a file on the executor's
local disk (``SPARK_LOCAL_DIRS``)."""


class _Spool:
    """A partition's Arrow batches, held while all of them are checked, then replayed.

    Holds up to ``memory`` bytes of batches in memory. Past that, every batch
    (those held first, in order) goes to an Arrow IPC stream file on the
    executor's local disk, read back one batch at a time: memory stays bounded
    whatever the partition's size. The file is removed on exit.

    Args:
        memory: bytes of batches kept in memory at most.
    """

    def __init__(self, memory: int = SPOOL_MEMORY) -> None:
        self._memory = memory
        self._held: deque[pa.RecordBatch] = deque()
        self._bytes = 0
        self.path: str | None = None
        """The spill file, once batches went to disk."""
        self._sink: Any = None
        self._writer: Any = None

    def __enter__(self) -> _Spool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._seal()
        self._held.clear()
        if self.path is not None:
            with contextlib.suppress(OSError):
                os.remove(self.path)

    def fill(
        self, batches: Iterable[pa.RecordBatch], checked: list[tuple[str, int]]
    ) -> NullKey | None:
        """Take every batch; the first null in a ``checked`` column stops it, as a `NullKey`."""
        rows = 0
        for batch in batches:
            for name, position in checked:
                column = batch.column(position)
                if column.null_count:
                    index = rows + pc.index(column.is_null(), True).as_py()
                    return NullKey(
                        f"key column {name!r} is null in row {index} of partition "
                        f"{current_task().partition}; rows with null keys would share message "
                        "ids (set allow_null_keys=True to publish them anyway). Nothing of "
                        "this partition was published"
                    )
            rows += batch.num_rows
            self._add(batch)
        self._seal()
        return None

    def _add(self, batch: pa.RecordBatch) -> None:
        if self._writer is None and self._bytes + batch.nbytes <= self._memory:
            self._held.append(batch)
            self._bytes += batch.nbytes
            return
        if self._writer is None:
            fd, self.path = tempfile.mkstemp(
                prefix="reliable_mq-spool-", suffix=".arrows", dir=_local_dir()
            )
            os.close(fd)
            self._sink = pa.OSFile(self.path, "wb")
            self._writer = pa.ipc.new_stream(self._sink, batch.schema)
            while self._held:
                self._writer.write_batch(self._held.popleft())
            self._bytes = 0
        self._writer.write_batch(batch)

    def _seal(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._sink.close()
            self._writer = self._sink = None

    def batches(self) -> Iterator[pa.RecordBatch]:
        """The batches in the order taken, each released once consumed."""
        while self._held:
            yield self._held.popleft()
        if self.path is not None:
            with pa.OSFile(self.path, "rb") as source:
                yield from pa.ipc.open_stream(source)


def _local_dir() -> str | None:
    """The executor's first local directory (``SPARK_LOCAL_DIRS``), else the temp directory."""
    for path in os.environ.get("SPARK_LOCAL_DIRS", "").split(","):
        if path and os.path.isdir(path):
            return path
    return None


def _session_zone(schema: pa.Schema) -> str | None:
    pending: list[Any] = [field.type for field in schema]
    while pending:
        data_type = pending.pop()
        if pa.types.is_timestamp(data_type) and data_type.tz:
            return str(data_type.tz)
        if pa.types.is_struct(data_type):
            pending.extend(data_type.field(i).type for i in range(data_type.num_fields))
        elif pa.types.is_map(data_type):
            pending.extend((data_type.key_type, data_type.item_type))
        elif pa.types.is_list(data_type) or pa.types.is_large_list(data_type):
            pending.append(data_type.value_type)
    return None


def _stats_of(messages: list[Any]) -> list[PartitionStats]:
    return [m.stats for m in messages if isinstance(m, StatsMessage)]


class RabbitMQWriter(DataSourceArrowWriter):
    """Batch writes: each task publishes its partition; ``commit`` raises deterministic failures."""

    def __init__(self, plan: PublishPlan) -> None:
        self.plan = plan

    def write(self, iterator: Iterator[pa.RecordBatch]) -> StatsMessage:
        return _publish_batches(self.plan, iterator)

    def commit(self, messages: list[Any]) -> None:
        raise_for_stats(_stats_of(messages))

    def abort(self, messages: list[Any]) -> None:
        """Nothing to undo: confirmed messages stay; a re-run sends the same ids."""


class RabbitMQStreamWriter(DataSourceStreamArrowWriter):
    """Micro-batch writes: the batch id goes in the ``x-spark-batch-id`` header."""

    def __init__(self, plan: PublishPlan) -> None:
        self.plan = plan

    def write(self, iterator: Iterator[pa.RecordBatch]) -> StatsMessage:
        return _publish_batches(self.plan, iterator)

    def commit(self, messages: list[Any], batchId: int) -> None:
        raise_for_stats(_stats_of(messages))

    def abort(self, messages: list[Any], batchId: int) -> None:
        """Nothing to undo: the batch is replayed on restart with the same ids."""
