"""``spark.readStream.format("rabbitmq")``: streams read as they grow, offsets in the checkpoint.

A `DataSourceStreamReader` over one or more streams (option ``stream``,
names separated by commas). Its offset is a JSON object ``{stream: next
offset}``; Spark's checkpoint holds it, and it is the only record of what was
read: nothing is stored in the broker, and `commit` has nothing to do.

On the driver (Spark's Python planner process), each trigger asks every
stream for its tail (`StreamReader.tail`) and, when there is something to
read, its head (`StreamReader.head`): a checkpointed start before the head is
data loss (`StreamDataLoss`, or a ``stream_data_loss`` warning and a skip with
``failOnDataLoss=false``). The micro-batch ``[start, end)`` of each stream is
cut into ranges (`split_range`), and each task reads one with `read_range`,
the batch source's code: the rows are the batch source's rows.

Read limits (``maxRecordsPerTrigger``) need PySpark 4.2's
``latestOffset(start, limit)``; on 4.1 the option is refused
(`READ_LIMITS`), and every trigger reads all that is there.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition

from .._sync import run_sync
from ..errors import InvalidSettings, StreamDataLoss
from ..log import get_logger
from ..streams import OffsetRange, StreamReader, split_range
from ._source import ReadSpec, StreamPartition, read_range

try:
    from pyspark.sql.streaming.datasource import (
        ReadAllAvailable,
        ReadLimit,
        ReadMaxRows,
        SupportsTriggerAvailableNow,
    )

    READ_LIMITS = True
    """Whether this PySpark passes read limits to Python streaming sources (4.2+)."""
except ImportError:  # pragma: no cover - PySpark 4.1: no read limits, no AvailableNow mixin
    READ_LIMITS = False

    class ReadLimit:  # type: ignore[no-redef]
        """Stands in for PySpark 4.2's class."""

    @dataclass
    class ReadAllAvailable(ReadLimit):  # type: ignore[no-redef]
        """Stands in for PySpark 4.2's class."""

    @dataclass
    class ReadMaxRows(ReadLimit):  # type: ignore[no-redef]
        """Stands in for PySpark 4.2's class."""

        max_rows: int

    class SupportsTriggerAvailableNow:  # type: ignore[no-redef]
        """Stands in for PySpark 4.2's mixin (4.1 does not call it)."""


__all__ = ("READ_LIMITS", "RabbitMQStreamSource", "StreamSourceSpec")

_OWN_OPTIONS = ("maxrecordspertrigger", "maxrecordsperpartition")
_MODEL = "rabbitmq readStream options"

Offsets = dict[str, int]
"""A source offset: the next offset to read, by stream name."""


def _positive(given: Mapping[str, str], name: str, label: str) -> int | None:
    text = given.get(name)
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        raise InvalidSettings(_MODEL, [(label, f"{text!r} is not a whole number")]) from None
    if value < 1:
        raise InvalidSettings(_MODEL, [(label, "must be >= 1")])
    return value


@dataclass(frozen=True)
class StreamSourceSpec:
    """What a streaming read reads; built on the driver from the options.

    Options are the batch source's (`ReadSpec`: ``url``, ``startingOffsets``,
    ``failOnDataLoss``, ``numPartitions``, ``prefetch``), except
    ``endingOffsets`` (a streaming read has no end), plus:

    * ``stream``: one stream, or several separated by commas (``"a,b"``);
      ``startingOffsets`` applies to each;
    * ``maxRecordsPerTrigger``: offsets read per micro-batch at most, over all
      the streams (PySpark 4.2+; a range of ``n`` offsets holds at most ``n``
      messages);
    * ``maxRecordsPerPartition``: offsets per task at most: a stream's range is
      cut into ``max(numPartitions, ceil(n / maxRecordsPerPartition))`` ranges.

    Attributes:
        reads: one `ReadSpec` per stream, in the order given.
        max_records_per_trigger: option ``maxRecordsPerTrigger`` (None: all).
        max_records_per_partition: option ``maxRecordsPerPartition`` (None: no cap).
    """

    reads: tuple[ReadSpec, ...]
    max_records_per_trigger: int | None = None
    max_records_per_partition: int | None = None

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> StreamSourceSpec:
        """The spec from ``spark.readStream`` options (any case).

        Raises:
            InvalidSettings: an unknown option, ``endingOffsets``, a missing
                ``url`` or ``stream``, a name given twice, a value that does not
                parse, or ``maxRecordsPerTrigger`` on PySpark 4.1.
        """
        given = {str(k).lower(): str(v) for k, v in options.items()}
        if "endingoffsets" in given:
            raise InvalidSettings(
                _MODEL, [("endingOffsets", "a streaming read has no end: use spark.read")]
            )
        limit = _positive(given, "maxrecordspertrigger", "maxRecordsPerTrigger")
        per_task = _positive(given, "maxrecordsperpartition", "maxRecordsPerPartition")
        if limit is not None and not READ_LIMITS:
            raise InvalidSettings(
                _MODEL,
                [
                    (
                        "maxRecordsPerTrigger",
                        "needs PySpark >= 4.2 (read limits for Python streaming sources); "
                        "on 4.1 each micro-batch reads everything there is",
                    )
                ],
            )
        rest = {k: v for k, v in given.items() if k not in _OWN_OPTIONS}
        names = [name.strip() for name in rest.get("stream", "").split(",") if name.strip()]
        if len(set(names)) != len(names):
            raise InvalidSettings(_MODEL, [("stream", "a stream is named twice")])
        base = ReadSpec.from_options({**rest, "stream": names[0] if names else ""})
        reads = tuple(replace(base, stream=name) for name in names)
        return cls(reads, limit, per_task)

    @property
    def streams(self) -> tuple[str, ...]:
        return tuple(read.stream for read in self.reads)

    def read_spec(self, stream: str) -> ReadSpec:
        for read in self.reads:
            if read.stream == stream:
                return read
        raise KeyError(stream)

    def split(self, offsets: OffsetRange) -> list[OffsetRange]:
        """A stream's micro-batch range cut into the ranges of its tasks."""
        parts = self.reads[0].partitions
        if self.max_records_per_partition is not None:
            parts = max(parts, math.ceil(len(offsets) / self.max_records_per_partition))
        return split_range(offsets, parts)


@dataclass(frozen=True, slots=True)
class _Position:
    head: int | None
    """The first offset held; only asked for when there is something to read."""
    tail: int


async def _position(spec: StreamSourceSpec, stream: str, start: int | None) -> _Position:
    """A stream's tail and, when ``start`` is given, its head: asked at once (the
    tail waits for its last chunk to pause); the head is kept only when ``start``
    is before the tail."""
    async with StreamReader(spec.reads[0].settings(), stream) as reader:
        if start is None:
            return _Position(None, await reader.tail())
        tail, head = await asyncio.gather(reader.tail(), reader.head())
    return _Position(head if start < tail else None, tail)


async def _positions(spec: StreamSourceSpec, start: Offsets) -> dict[str, _Position]:
    """Head and tail of every stream, read concurrently, a connection each."""
    found = await asyncio.gather(*(_position(spec, s, start.get(s)) for s in spec.streams))
    return dict(zip(spec.streams, found, strict=True))


async def _starting(spec: StreamSourceSpec, streams: tuple[str, ...]) -> Offsets:
    async def one(read: ReadSpec) -> int:
        async with read.reader() as reader:
            return await reader.resolve(read.starting)

    reads = [spec.read_spec(stream) for stream in streams]
    return dict(zip(streams, await asyncio.gather(*(one(r) for r in reads)), strict=True))


def share(available: Mapping[str, int], budget: int | None) -> Offsets:
    """How many offsets each stream may read under ``budget`` (None: all there are).

    In proportion to what each has, rounded down; what rounding leaves goes to
    the streams in order, so the budget is used in full when there is enough.
    """
    total = sum(available.values())
    if budget is None or total <= budget:
        return dict(available)
    taken = {name: budget * count // total for name, count in available.items()}
    left = budget - sum(taken.values())
    for name, count in available.items():
        extra = min(left, count - taken[name])
        taken[name] += extra
        left -= extra
    return taken


class RabbitMQStreamSource(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches of one or more streams; see the module docstring.

    Raises (from the driver's calls):
        StreamDataLoss: retention removed offsets the checkpoint still needs
            (``failOnDataLoss`` true, the default).
        NotAStream: a name is a classic or quorum queue, or nothing.
    """

    def __init__(self, spec: StreamSourceSpec) -> None:
        self.spec = spec
        self._target: Offsets | None = None
        """The tails when ``Trigger.AvailableNow`` began: never read past them."""
        self._known: Offsets = {}
        """The highest end handed to Spark (PySpark 4.1 passes no start)."""
        self._seen: Offsets = {}
        """The highest tail the broker reported: offsets below it exist."""
        self._heads: dict[str, int | None] = {}
        """The heads `prepareForTriggerAvailableNow` found, for the first trigger's check."""

    def initialOffset(self) -> Offsets:
        """Each stream's ``startingOffsets`` as an offset (a new query only)."""
        return run_sync(lambda: _starting(self.spec, self.spec.streams))

    def getDefaultReadLimit(self) -> ReadLimit:
        """``ReadMaxRows(maxRecordsPerTrigger)``, or all available."""
        limit = self.spec.max_records_per_trigger
        return ReadMaxRows(limit) if limit is not None else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        """``Trigger.AvailableNow``: take the tails now; later messages wait for the next run.

        The heads come too: the first trigger checks its start against them
        (data loss) and plans without asking again (`_from_seen`).
        """
        every = dict.fromkeys(self.spec.streams, 0)
        positions = run_sync(lambda: _positions(self.spec, every))
        self._target = {name: position.tail for name, position in positions.items()}
        self._seen = dict(self._target)
        self._heads = {name: position.head for name, position in positions.items()}

    def latestOffset(self, start: Offsets | None = None, limit: ReadLimit | None = None) -> Offsets:
        """The end of the next micro-batch: the tails, within ``limit``.

        ``start`` is the previous end (from the checkpoint after a restart). A
        stream missing from it (added to the option) starts at
        ``startingOffsets``: its end is that point, so the batch after reads it.
        PySpark 4.1 passes neither argument: then the ends are the tails.

        Raises:
            StreamDataLoss: ``start`` is before a stream's head and
                ``failOnDataLoss`` is true. With it false, the gap is logged
                (``stream_data_loss``) and the batch goes on from the head.
        """
        if start is None:
            return self._tails()
        begin = dict(start)
        budget = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        known = self._from_seen(begin, budget)
        if known is not None:
            return known
        missing = tuple(s for s in self.spec.streams if s not in begin)
        if missing:  # a stream added to the option: it starts at startingOffsets
            begin.update(run_sync(lambda: _starting(self.spec, missing)))
        positions = run_sync(lambda: _positions(self.spec, begin))
        for name, position in positions.items():
            self._seen[name] = max(self._seen.get(name, 0), position.tail)
        firsts = {name: self._first(name, begin[name], positions[name]) for name in positions}
        available: dict[str, int] = {}
        for name, position in positions.items():
            if name in missing:  # Spark plans it from its end: nothing to read this time
                firsts[name], available[name] = begin[name], 0
                continue
            until = position.tail
            if self._target is not None:
                until = min(until, self._target.get(name, until))
            available[name] = max(0, until - firsts[name])
        taken = share(available, budget)
        return {name: max(begin[name], firsts[name] + taken[name]) for name in positions}

    def _from_seen(self, begin: Offsets, budget: int | None) -> Offsets | None:
        """The next end without asking the broker, when the tails it reported
        before are enough: a read limit they fill, or ``Trigger.AvailableNow``'s
        target reached. None: ask (a first trigger asks, unless
        `prepareForTriggerAvailableNow` just did, heads included).

        Spark then plans from offsets known to exist; retention since the last
        answer is found by the tasks, which raise `StreamDataLoss` (or log the
        gap) as the planner would (`StreamReader.read`). This saves the planner
        a connection, the tail's pause and the head per stream per trigger.
        """
        if not self._seen or any(s not in begin or s not in self._seen for s in self.spec.streams):
            return None
        until = dict(self._seen)
        if self._target is not None:
            until = {s: min(tail, self._target.get(s, tail)) for s, tail in until.items()}
        reached = self._target is not None and all(
            self._seen[s] >= self._target.get(s, 0) for s in until
        )
        if budget is None and not reached:
            return None  # all there is: only the broker knows
        heads, self._heads = self._heads, {}
        firsts = {
            s: self._first(s, begin[s], _Position(heads.get(s), self._seen[s]))
            for s in self.spec.streams
        }
        available = {s: max(0, until[s] - firsts[s]) for s in self.spec.streams}
        if budget is not None and sum(available.values()) < budget:
            return None  # the limit may take more than is known
        taken = share(available, budget)
        return {s: max(begin[s], firsts[s] + taken[s]) for s in self.spec.streams}

    def _tails(self) -> Offsets:
        """PySpark 4.1's ``latestOffset()``: the tails, never before an end handed out.

        Retention is then only checked by the tasks (`StreamReader.read`).
        """
        positions = run_sync(lambda: _positions(self.spec, {}))
        end = {name: max(p.tail, self._known.get(name, 0)) for name, p in positions.items()}
        self._known.update(end)
        return end

    def _first(self, stream: str, start: int, position: _Position) -> int:
        """Where the batch reads from: ``start``, or the head after data loss."""
        head = position.head
        if head is None or start >= head:
            return start
        if self.spec.read_spec(stream).fail_on_data_loss:
            raise StreamDataLoss(
                f"retention removed offsets {start}..{head - 1} of stream {stream!r} that "
                "the query's checkpoint still needs (they were never read). Restart from "
                "a new checkpoint, or set failOnDataLoss=false to skip them",
                stream=stream,
                requested=start,
                available=head,
            )
        get_logger("reliable_mq.spark").warning(
            "stream_data_loss", stream=stream, requested=start, available=head, lost=head - start
        )
        return head

    def partitions(self, start: Offsets, end: Offsets) -> list[StreamPartition]:
        """Each stream's ``[start, end)`` cut into ranges; none when nothing is new.

        A stream with no start (added to the option) starts at its end.
        """
        ranges: list[OffsetRange] = []
        for name, stop in end.items():
            self._known[name] = max(self._known.get(name, 0), stop)
            ranges.extend(self.spec.split(OffsetRange(name, start.get(name, stop), stop)))
        return [StreamPartition(offsets) for offsets in ranges]

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...] | pa.RecordBatch]:
        """The rows of one range (in a task), as the batch source reads them."""
        assert isinstance(partition, StreamPartition)
        offsets = partition.offsets
        return read_range(self.spec.read_spec(offsets.stream), offsets)

    def commit(self, end: Offsets) -> None:
        """Nothing to do: the checkpoint is the only record of what was read."""
