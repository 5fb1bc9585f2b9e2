"""``spark.read.format("rabbitmq")``: a stream read between two offsets, as a batch.

The driver resolves the starting and ending points to offsets
(`reliable_mq.streams.StreamReader.resolve`), checks retention (a start before
the stream's head is data loss), and cuts ``[start, end)`` into
``numPartitions`` ranges (`split_range`). Each task reads its range over a
connection of its own with a `StreamReader` (prefetch, multiple acks, stops at
the end offset) and yields one row per message, as `RowFormat` builds it
(the body binary, or JSON parsed into a struct: `reliable_mq.spark._rows`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from pydantic import SecretStr
from pyspark.sql.datasource import DataSourceReader, InputPartition
from pyspark.sql.types import StructType

from .._sync import run_sync
from ..errors import InvalidSettings, StreamDataLoss
from ..log import get_logger
from ..settings import ConnectionSettings
from ..streams import (
    OffsetRange,
    StartingOffset,
    StartingPoint,
    StreamReader,
    StreamRecord,
    parse_starting_offset,
    split_range,
)
from ._rows import BODY_OPTIONS, READ_SCHEMA, RowFormat

__all__ = ("READ_SCHEMA", "RabbitMQStreamRangeReader", "ReadSpec", "StreamPartition")
# READ_SCHEMA lives in _rows (shared with the streaming source); re-exported here.

_OPTIONS = (
    "url",
    "stream",
    "startingoffsets",
    "endingoffsets",
    "failondataloss",
    "numpartitions",
    "prefetch",
    *BODY_OPTIONS,
)
_BATCH = 2000
"""Records taken from the reader per step of a task's event loop."""


@dataclass(frozen=True)
class ReadSpec:
    """What a batch read reads; built on the driver from the options, pickled to tasks.

    Attributes:
        connection: `ConnectionSettings` fields (rebuilt on the executor).
        stream: the stream's name.
        starting: where the read starts (option ``startingOffsets``, default ``earliest``).
        ending: where it ends, excluded (option ``endingOffsets``, default ``latest``:
            the tail when the read is planned).
        fail_on_data_loss: option ``failOnDataLoss`` (default true).
        partitions: option ``numPartitions`` (default 1): ranges read in parallel.
        prefetch: option ``prefetch`` (default 1000): deliveries in flight per task.
        rows: the rows' format: the body binary or parsed JSON (options
            ``bodyFormat``, ``bodySchema``, ``mode``, ``columnNameOfCorruptRecord``:
            see `RowFormat`).
    """

    connection: dict[str, Any]
    stream: str
    starting: StartingOffset = StartingPoint.EARLIEST
    ending: StartingOffset = StartingPoint.LATEST
    fail_on_data_loss: bool = True
    partitions: int = 1
    prefetch: int = 1000
    rows: RowFormat = field(default_factory=RowFormat)

    @classmethod
    def from_options(cls, options: Mapping[str, str], schema: StructType | None = None) -> ReadSpec:
        """The spec from ``spark.read`` options (any case) and the read's schema.

        Raises:
            InvalidSettings: an unknown option, a missing ``url`` or ``stream``, a
                value that does not parse, or a ``schema`` other than the one the
                options read.
        """
        given = {str(k).lower(): str(v) for k, v in options.items()}
        problems = [(name, "unknown option") for name in given if name not in _OPTIONS]
        for name in ("url", "stream"):
            if not given.get(name):
                problems.append((name, "required"))
        if problems:
            raise InvalidSettings("rabbitmq read options", problems)
        try:
            numbers = {
                name: int(given.get(name, default))
                for name, default in (("numpartitions", "1"), ("prefetch", "1000"))
            }
        except ValueError as exc:
            raise InvalidSettings("rabbitmq read options", [("numPartitions", str(exc))]) from None
        if min(numbers.values()) < 1:
            raise InvalidSettings(
                "rabbitmq read options", [("numPartitions/prefetch", "must be >= 1")]
            )
        fail = given.get("failondataloss", "true").strip().lower()
        if fail not in ("true", "false"):
            raise InvalidSettings("rabbitmq read options", [("failOnDataLoss", "true or false")])
        connection = ConnectionSettings(url=SecretStr(given["url"]))
        return cls(
            connection=connection.model_dump(),
            stream=given["stream"],
            starting=parse_starting_offset(given.get("startingoffsets", "earliest")),
            ending=parse_starting_offset(given.get("endingoffsets", "latest")),
            fail_on_data_loss=fail == "true",
            partitions=numbers["numpartitions"],
            prefetch=numbers["prefetch"],
            rows=RowFormat.from_options(given, schema),
        )

    def settings(self) -> ConnectionSettings:
        return ConnectionSettings(**self.connection)

    def reader(self) -> StreamReader:
        return StreamReader(self.settings(), self.stream, prefetch=self.prefetch)


class StreamPartition(InputPartition):
    """One task's offsets."""

    def __init__(self, offsets: OffsetRange) -> None:
        super().__init__(offsets)
        self.offsets = offsets


async def plan_ranges(spec: ReadSpec) -> list[OffsetRange]:
    """``[start, end)`` resolved and cut into ranges (on the driver).

    Raises:
        StreamDataLoss: the start is before the stream's head (retention removed
            it) and ``fail_on_data_loss`` is set; else the start moves to the head.
        InvalidSettings: the start resolves past the end.
    """
    async with spec.reader() as reader:
        start, end = await reader.resolve(spec.starting), await reader.resolve(spec.ending)
        head = await reader.head()
    if start < head:
        if spec.fail_on_data_loss:
            raise StreamDataLoss(
                f"retention removed offsets {start}..{head - 1} of stream {spec.stream!r}: "
                "start at 'earliest', or set failOnDataLoss=false to skip them",
                stream=spec.stream,
                requested=start,
                available=head,
            )
        get_logger("reliable_mq.spark").warning(
            "stream_data_loss", stream=spec.stream, requested=start, available=head
        )
        start = head
    if start > end:
        raise InvalidSettings(
            "rabbitmq read options",
            [("startingOffsets", f"resolves to offset {start}, after endingOffsets' {end}")],
        )
    whole = OffsetRange(spec.stream, start, end)
    return split_range(whole, spec.partitions) or [whole]  # Spark wants one partition at least


async def _take(records: AsyncGenerator[StreamRecord, None], count: int) -> list[StreamRecord]:
    taken: list[StreamRecord] = []
    async for record in records:
        taken.append(record)
        if len(taken) >= count:
            break
    return taken


async def _close(reader: StreamReader, records: AsyncGenerator[StreamRecord, None]) -> None:
    try:
        await records.aclose()
    finally:
        await reader.__aexit__(None, None, None)


def read_range(spec: ReadSpec, offsets: OffsetRange) -> Iterator[tuple[Any, ...] | pa.RecordBatch]:
    """The rows of ``offsets`` (in a task), read on an event loop of the task's own.

    The loop runs while a batch of records is taken, then the rows go to Spark:
    memory stays bounded by the prefetch and the batch. Binary bodies go as
    one Arrow batch per batch of records (`RowFormat.batch`: Spark converts
    tuples value by value, which cost more than the read), JSON ones as tuples.
    """
    columnar = spec.rows.columnar
    reader = spec.reader()
    with asyncio.Runner() as runner:  # cancels what is left and closes the loop on exit
        runner.run(reader.__aenter__())
        records = reader.read(offsets, fail_on_data_loss=spec.fail_on_data_loss)
        try:
            while batch := runner.run(_take(records, _BATCH)):
                if columnar:
                    yield spec.rows.batch(batch)
                else:
                    yield from map(spec.rows.row, batch)
        finally:
            runner.run(_close(reader, records))


class RabbitMQStreamRangeReader(DataSourceReader):
    """Batch reads of a stream: ranges planned on the driver, one per task."""

    def __init__(self, spec: ReadSpec) -> None:
        self.spec = spec
        self.ranges = run_sync(lambda: plan_ranges(spec), thread_name="reliable_mq.spark.plan")

    def partitions(self) -> list[StreamPartition]:
        return [StreamPartition(offsets) for offsets in self.ranges]

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...] | pa.RecordBatch]:
        assert isinstance(partition, StreamPartition)
        return read_range(self.spec, partition.offsets)
