"""``spark.readStream.format("rabbitmq")``: offsets in the checkpoint, exactly once (issue 23).

Every query writes into a Parquet file sink with a checkpoint and runs with
``Trigger.AvailableNow`` (it reads what is there, then stops), so a restart
is a second ``start()`` over the same two folders.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")

from prometheus_client import CollectorRegistry
from pyspark.sql import SparkSession
from pyspark.sql.streaming import StreamingQuery
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows
from structlog.testing import capture_logs

from reliable_mq import Message, ReliablePublisher
from reliable_mq.errors import InvalidSettings
from reliable_mq.spark import READ_SCHEMA, _stream_source, register_data_source
from reliable_mq.spark._stream_source import RabbitMQStreamSource, StreamSourceSpec, share
from reliable_mq.streams import OffsetRange, StreamReader, declare_stream
from tests.support.amqp import run_sync

pytestmark = [pytest.mark.spark, pytest.mark.rabbitmq, pytest.mark.timeout(300)]

MakeStream = Callable[..., str]


@pytest.fixture(name="make_stream")
def _make_stream(broker_url: str) -> Iterator[MakeStream]:
    """Declares fresh streams (``declare_stream`` keywords), deleted after the test."""
    import aio_pika

    names: list[str] = []

    def make(**retention: Any) -> str:
        name = f"test-spark-source-{uuid.uuid4().hex[:10]}"
        names.append(name)
        run_sync(lambda: declare_stream(broker_url, name, **retention))
        return name

    yield make

    async def delete() -> None:
        connection = await aio_pika.connect(broker_url)
        async with connection:
            channel = await connection.channel()
            for name in names:
                await channel.queue_delete(name)

    run_sync(delete)


def publish(url: str, stream: str, first: int, count: int, *, size: int = 8) -> None:
    """Publish messages ``first .. first + count - 1`` (id ``m-N``) with confirms."""

    async def send() -> None:
        async with ReliablePublisher(url, registry=CollectorRegistry()) as publisher:
            await publisher.publish_many(
                Message(
                    f"{n:0{size}d}".encode(),
                    routing_key=stream,
                    message_id=f"m-{n}",
                )
                for n in range(first, first + count)
            )

    run_sync(send)


def run_query(
    spark: SparkSession, url: str, streams: list[str], folder: Path, **options: str
) -> StreamingQuery:
    """One AvailableNow run of a query into ``folder/out`` (checkpoint ``folder/cp``)."""
    register_data_source(spark)
    reader = spark.readStream.format("rabbitmq").option("url", url)
    for name, value in {"stream": ",".join(streams), **options}.items():
        reader = reader.option(name, value)
    frame = reader.load()
    assert frame.schema == READ_SCHEMA
    query = (
        frame.writeStream.format("parquet")
        .option("path", str(folder / "out"))
        .option("checkpointLocation", str(folder / "cp"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(120)
    assert not query.isActive, "the AvailableNow run did not end in 120 s"
    return query


def output(spark: SparkSession, folder: Path) -> list[tuple[str, int, str]]:
    """(stream, offset, message_id) of every row the file sink committed."""
    rows = spark.read.parquet(str(folder / "out")).select("stream", "offset", "message_id")
    return [(r.stream, r.offset, r.message_id) for r in rows.collect()]


def exactly_once(rows: list[tuple[str, int, str]], stream: str, ids: Iterable[int]) -> None:
    """Every id of ``ids`` in ``stream``'s rows once, no other row, offsets unique."""
    mine = [row for row in rows if row[0] == stream]
    counts = Counter(row[2] for row in mine)
    duplicates = {k: v for k, v in counts.items() if v > 1}
    assert not duplicates, f"read more than once: {duplicates}"
    missing = {f"m-{n}" for n in ids} - set(counts)
    assert not missing, f"{len(missing)} never read"
    assert set(counts) == {f"m-{n}" for n in ids}
    assert len({row[1] for row in mine}) == len(mine)


def batch_sizes(query: StreamingQuery) -> list[int]:
    return [int(p["numInputRows"]) for p in query.recentProgress if p["numInputRows"]]


class TestCheckpoint:
    def test_restart_from_the_checkpoint_reads_each_offset_once(
        self, spark: SparkSession, broker_url: str, make_stream: MakeStream, tmp_path: Path
    ) -> None:
        """A run reads 300 messages in batches of at most 120 (maxRecordsPerTrigger), cut
        into ranges of at most 50 offsets; 200 more are published; the restarted query
        reads just those: 500 rows, every offset once, none missing."""
        stream = make_stream()
        publish(broker_url, stream, 0, 300)
        options = {"maxRecordsPerTrigger": "120", "maxRecordsPerPartition": "50"}
        first = run_query(spark, broker_url, [stream], tmp_path, **options)
        assert batch_sizes(first) == [120, 120, 60]
        exactly_once(output(spark, tmp_path), stream, range(300))

        publish(broker_url, stream, 300, 200)
        second = run_query(spark, broker_url, [stream], tmp_path, **options)
        assert batch_sizes(second) == [120, 80]
        rows = output(spark, tmp_path)
        exactly_once(rows, stream, range(500))
        assert sorted(row[1] for row in rows) == list(range(500))

    def test_two_streams_in_one_source(
        self, spark: SparkSession, broker_url: str, make_stream: MakeStream, tmp_path: Path
    ) -> None:
        """option("stream", "a,b"): one offset per stream in the checkpoint, each stream's
        messages once; the read limit is shared between them."""
        a, b = make_stream(), make_stream()
        publish(broker_url, a, 0, 90)
        publish(broker_url, b, 0, 30)
        query = run_query(
            spark, broker_url, [a, b], tmp_path, maxRecordsPerTrigger="60", numPartitions="2"
        )
        assert batch_sizes(query) == [60, 60]
        rows = output(spark, tmp_path)
        exactly_once(rows, a, range(90))
        exactly_once(rows, b, range(30))
        assert json.loads(query.lastProgress["sources"][0]["endOffset"]) == {a: 90, b: 30}


class TestStartingOffsets:
    def test_latest_reads_only_what_comes_after_the_start(
        self, spark: SparkSession, broker_url: str, make_stream: MakeStream, tmp_path: Path
    ) -> None:
        """startingOffsets=latest: the first run reads nothing; what is published after
        it is read by the next."""
        stream = make_stream()
        publish(broker_url, stream, 0, 40)
        run_query(spark, broker_url, [stream], tmp_path, startingOffsets="latest")
        assert output(spark, tmp_path) == []
        publish(broker_url, stream, 40, 25)
        run_query(spark, broker_url, [stream], tmp_path, startingOffsets="latest")
        exactly_once(output(spark, tmp_path), stream, range(40, 65))

    def test_a_time_starts_at_the_first_message_stored_from_then(
        self, spark: SparkSession, broker_url: str, make_stream: MakeStream, tmp_path: Path
    ) -> None:
        """startingOffsets=<ISO time>: messages stored before it are not read."""
        stream = make_stream()
        publish(broker_url, stream, 0, 40)
        run_sync(lambda: asyncio.sleep(1.5))  # the stream's chunks carry whole-second times
        since = dt.datetime.now(dt.UTC)
        run_sync(lambda: asyncio.sleep(1.0))
        publish(broker_url, stream, 40, 20)
        run_query(spark, broker_url, [stream], tmp_path, startingOffsets=since.isoformat())
        exactly_once(output(spark, tmp_path), stream, range(40, 60))


def stream_head(url: str, stream: str) -> int:
    async def head() -> int:
        async with StreamReader(url, stream) as reader:
            return await reader.head()

    return run_sync(head)


def overrun(url: str, stream: str, first: int, *, past: int, within: float = 60.0) -> int:
    """Publish 200-byte messages from id ``first`` on until retention removed offset
    ``past``; the next id. The broker applies retention after a segment rolls over, in a
    process of its own, and not always at once: so publish again every 3 s while it has
    not. (On a loaded broker a fresh stream's first reads can take seconds: a head of 0
    then only means "not yet".)"""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        publish(url, stream, first, 100, size=200)
        first += 100
        again = time.monotonic() + 3.0
        while time.monotonic() < min(again, deadline):
            if stream_head(url, stream) > past:
                return first
            time.sleep(0.3)
    raise AssertionError(f"retention removed nothing in {within:g} s")


class TestRetention:
    def test_truncation_while_stopped_is_data_loss_unless_skipped(
        self, spark: SparkSession, broker_url: str, make_stream: MakeStream, tmp_path: Path
    ) -> None:
        """Retention removes offsets the checkpoint still needs while the query is stopped:
        the restart fails with StreamDataLoss; with failOnDataLoss=false it logs the gap,
        skips it, and reads everything still held."""
        stream = make_stream(max_length_bytes=20_000, max_segment_size_bytes=5_000)
        publish(broker_url, stream, 0, 20)
        run_query(spark, broker_url, [stream], tmp_path)
        exactly_once(output(spark, tmp_path), stream, range(20))

        last = overrun(broker_url, stream, 20, past=20)
        head = stream_head(broker_url, stream)
        with pytest.raises(Exception, match="StreamDataLoss") as caught:
            run_query(spark, broker_url, [stream], tmp_path)
        assert "failOnDataLoss=false" in str(caught.value)
        assert len(output(spark, tmp_path)) == 20  # nothing committed by the failed run

        spec = StreamSourceSpec.from_options(
            {"url": broker_url, "stream": stream, "failOnDataLoss": "false"}
        )
        with capture_logs() as logs:  # the driver's side, called in-process
            end = RabbitMQStreamSource(spec).latestOffset({stream: 20}, ReadAllAvailable())
        lost = [e for e in logs if e["event"] == "stream_data_loss"]
        assert [e["requested"] for e in lost] == [20]
        assert lost[0]["available"] >= head
        assert end[stream] > lost[0]["available"]

        run_query(spark, broker_url, [stream], tmp_path, failOnDataLoss="false")
        rows = output(spark, tmp_path)
        later = sorted(n for n in (int(row[2][2:]) for row in rows) if n >= 20)
        assert later and later == list(range(later[0], last)), "a gap after the head"
        exactly_once(rows, stream, [*range(20), *range(later[0], last)])
        assert min(row[1] for row in rows if int(row[2][2:]) >= 20) >= head


DOCS = Path(__file__).resolve().parents[2] / "docs" / "spark.md"


def docs_snippet() -> str:
    """The first python block of docs/spark.md's "Streaming reads"."""
    section = DOCS.read_text().split("\n## Streaming reads\n", 1)[1]
    return section.split("```python\n", 1)[1].split("\n```", 1)[0]


class TestDocs:
    def test_the_streaming_reads_snippet_runs(
        self,
        spark: SparkSession,
        broker_url: str,
        make_stream: MakeStream,
        tmp_path: Path,
    ) -> None:
        """docs/spark.md's snippet, on a fresh stream and folder, reads every message once."""
        stream = make_stream()
        publish(broker_url, stream, 0, 30)
        source = docs_snippet()
        assert source.count('.option("stream", "events")') == 1
        source = source.replace('.option("stream", "events")', f'.option("stream", "{stream}")')
        source = source.replace("amqp://guest:guest@127.0.0.1:5672/", broker_url)
        source = source.replace('"out/', f'"{tmp_path}/out/')  # the JVM has its own cwd
        exec(compile(source, str(DOCS), "exec"), {})  # the docs' own code
        rows = spark.read.parquet(str(tmp_path / "out" / "events")).collect()
        exactly_once([(r.stream, r.offset, r.message_id) for r in rows], stream, range(30))


class TestOptions:
    def test_limits_are_shared_in_proportion(self) -> None:
        """share(): all when under budget; in proportion, rounding down, rest in order."""
        assert share({"a": 5, "b": 3}, None) == {"a": 5, "b": 3}
        assert share({"a": 5, "b": 3}, 10) == {"a": 5, "b": 3}
        assert share({"a": 90, "b": 30}, 60) == {"a": 45, "b": 15}
        assert share({"a": 1, "b": 1, "c": 1}, 2) == {"a": 1, "b": 1, "c": 0}
        assert share({"a": 0, "b": 7}, 3) == {"a": 0, "b": 3}

    def test_bad_options_are_refused_by_name(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """endingOffsets, a stream named twice, a bad number, an unknown option; and
        maxRecordsPerTrigger where PySpark has no read limits (4.1)."""
        url = "amqp://guest:guest@127.0.0.1:5672/"
        for options, named in [
            ({"stream": "a", "endingOffsets": "5"}, "endingOffsets"),
            ({"stream": "a, b,a"}, "named twice"),
            ({"stream": "a", "maxRecordsPerTrigger": "0"}, "maxRecordsPerTrigger"),
            ({"stream": "a", "maxRecordsPerPartition": "x"}, "maxRecordsPerPartition"),
            ({"stream": "a", "maxOffsets": "5"}, "maxoffsets"),
            ({"stream": " , "}, "stream: required"),
        ]:
            with pytest.raises(InvalidSettings, match=named):
                StreamSourceSpec.from_options({"url": url, **options})
        spec = StreamSourceSpec.from_options({"url": url, "stream": "a, b"})
        assert spec.streams == ("a", "b")
        monkeypatch.setattr(_stream_source, "READ_LIMITS", False)
        with pytest.raises(InvalidSettings, match=r"needs PySpark >= 4\.2"):
            StreamSourceSpec.from_options({"url": url, "stream": "a", "maxRecordsPerTrigger": "9"})

    def test_the_driver_side_in_process(self, broker_url: str, make_stream: MakeStream) -> None:
        """The default read limit comes from maxRecordsPerTrigger; an end never goes back
        before the start (a start past the tail the broker reports); a stream added to the
        option starts at startingOffsets; PySpark 4.1's latestOffset() gives the tails."""
        a, b = make_stream(), make_stream()
        publish(broker_url, a, 0, 10)
        publish(broker_url, b, 0, 3)
        options = {"url": broker_url, "maxRecordsPerTrigger": "4"}
        source = RabbitMQStreamSource(StreamSourceSpec.from_options({**options, "stream": a}))
        assert source.getDefaultReadLimit() == ReadMaxRows(4)
        assert source.initialOffset() == {a: 0}
        assert source.latestOffset({a: 0}, ReadMaxRows(4)) == {a: 4}
        assert source.latestOffset({a: 8}, ReadAllAvailable()) == {a: 10}
        assert source.latestOffset({a: 12}, ReadAllAvailable()) == {a: 12}
        assert source.latestOffset() == {a: 10}
        assert len(source.partitions({a: 0}, {a: 12})) == 1
        assert source.latestOffset() == {a: 12}  # never before an end Spark planned

        both = StreamSourceSpec.from_options({**options, "stream": f"{a},{b}"})
        added = RabbitMQStreamSource(both).latestOffset({a: 2}, ReadMaxRows(100))
        assert added == {a: 10, b: 0}
        ranges = RabbitMQStreamSource(both).partitions({a: 2}, added)
        assert [p.offsets for p in ranges] == [OffsetRange(a, 2, 10)]

    def test_a_limit_the_known_tail_fills_asks_no_broker(
        self, broker_url: str, make_stream: MakeStream
    ) -> None:
        """Under maxRecordsPerTrigger, a trigger the tail reported before can fill is
        planned without the broker (no connection, no wait for the tail): after the
        stream is deleted, the next batch is still planned; the one past the known
        tail asks, and fails."""
        import aio_pika

        from reliable_mq.errors import NotAStream

        a = make_stream()
        publish(broker_url, a, 0, 10)
        spec = StreamSourceSpec.from_options(
            {"url": broker_url, "stream": a, "maxRecordsPerTrigger": "4"}
        )
        source = RabbitMQStreamSource(spec)
        assert source.latestOffset({a: 0}, ReadMaxRows(4)) == {a: 4}

        async def delete() -> None:
            async with await aio_pika.connect(broker_url) as connection:
                await (await connection.channel()).queue_delete(a)

        run_sync(delete)
        assert source.latestOffset({a: 4}, ReadMaxRows(4)) == {a: 8}
        with pytest.raises(NotAStream):
            source.latestOffset({a: 8}, ReadMaxRows(4))
