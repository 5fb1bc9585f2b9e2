"""``format("rabbitmq")`` for batch and streaming writes, and stopping streams (item 9)."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession

from reliable_mq.spark import (
    HEADER_BATCH_ID,
    NullKey,
    PublishReport,
    PublishSpec,
    UnsupportedSchema,
    foreach_batch_sink,
    publish_dataframe,
    register_data_source,
    stop_after_current_batch,
)
from reliable_mq.spark.datasource import _Spool
from tests.support.amqp import DrainedMessage, drain_queue_sync

pytestmark = [pytest.mark.spark, pytest.mark.rabbitmq]


def _rows(spark: SparkSession) -> DataFrame:
    return spark.sql(
        "SELECT id, concat('c-', id % 3) AS customer, CAST(id AS DECIMAL(10,2)) / 4 AS amount,"
        " timestamp_seconds(1729989000 + id * 1800) AS at FROM range(0, 40, 1, 3)"
    )


def _writer(df: DataFrame, url: str, queue: str, **options: str) -> Any:
    writer = (
        df.write.format("rabbitmq")
        .mode("append")
        .option("url", url)
        .option("routing_key", queue)
        .option("id_namespace", f"t-{queue}")
    )
    for name, value in options.items():
        writer = writer.option(name, value)
    return writer


def _messages(messages: list[DrainedMessage]) -> set[tuple[str | None, bytes]]:
    return {(m.message_id, m.body) for m in messages}


class TestBatchWrite:
    """df.write.format("rabbitmq") publishes exactly what publish_dataframe publishes."""

    def test_same_ids_and_bodies_as_publish_dataframe(
        self, spark: SparkSession, broker_url: str, spark_queue: str
    ) -> None:
        """Arrow rows (data source) and pickled rows (publish_dataframe) encode alike."""
        register_data_source(spark)
        previous = spark.conf.get("spark.sql.session.timeZone")
        spark.conf.set("spark.sql.session.timeZone", "Europe/Berlin")
        try:
            df = _rows(spark)
            _writer(df, broker_url, spark_queue, header_columns="customer,at").save()
            by_format = drain_queue_sync(broker_url, spark_queue, settled=True)
            spec = PublishSpec(
                url=broker_url,
                routing_key=spark_queue,
                id_namespace=f"t-{spark_queue}",
                header_columns=("customer", "at"),
            )
            publish_dataframe(df, spec)
            by_function = drain_queue_sync(broker_url, spark_queue, settled=True)
        finally:
            spark.conf.set("spark.sql.session.timeZone", previous or "UTC")
        assert len(by_format) == 40
        assert _messages(by_format) == _messages(by_function)
        assert {m.headers["at"] for m in by_format} == {m.headers["at"] for m in by_function}
        assert json.loads(by_format[0].body)["at"].endswith(("+01:00", "+02:00"))

    def test_options_are_checked_on_the_driver(
        self, spark: SparkSession, broker_url: str, spark_queue: str
    ) -> None:
        """Bad options, unsupported types, key ids and overwrite fail before any task."""
        register_data_source(spark)
        df = _rows(spark)
        with pytest.raises(Exception, match="routingkey: unknown option"):
            _writer(df, broker_url, spark_queue, routingkey="x").save()
        with pytest.raises(Exception, match="ids: 'key' needs a duplicate-key check"):
            _writer(df, broker_url, spark_queue, ids="key", key_columns="id").save()
        with pytest.raises(Exception, match="cannot be overwritten"):
            _writer(df, broker_url, spark_queue).mode("overwrite").save()
        with pytest.raises(Exception, match=UnsupportedSchema.__name__):
            _writer(spark.sql("SELECT INTERVAL '1' DAY AS v"), broker_url, spark_queue).save()
        with pytest.raises(Exception, match="DestinationNotFound"):
            _writer(df, broker_url, spark_queue + "-missing").save()
        assert drain_queue_sync(broker_url, spark_queue, idle_timeout=0.3) == []

    def test_unroutable_is_raised_by_commit_without_task_retries(
        self, spark: SparkSession, broker_url: str
    ) -> None:
        """A deterministic failure travels in the commit message and fails the job once."""
        register_data_source(spark)
        df = spark.range(0, 10, 1, 2)
        writer = _writer(df, broker_url, "no-such-binding", exchange="amq.direct")
        with pytest.raises(Exception, match="PublishUnroutable") as caught:
            writer.save()
        assert "NO_ROUTE" in str(caught.value)
        assert "without a Spark retry" in str(caught.value)


class TestNullKeys:
    """A data source cannot run the driver's null check; each task checks its partition first."""

    def test_a_null_key_stops_its_partition_before_anything_of_it_is_published(
        self, spark: SparkSession, broker_url: str, spark_queue: str
    ) -> None:
        """3 partitions of 10 rows in Arrow batches of 4; partition 2's last row has a null key.

        NullKey reaches the driver without Spark retries. The two clean partitions are
        published; of partition 2 nothing, though its null is in its third batch.
        """
        register_data_source(spark)
        df = spark.sql(
            "SELECT id, CASE WHEN id = 29 THEN NULL ELSE id END AS k FROM range(0, 30, 1, 3)"
        )
        previous = spark.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch")
        spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "4")
        try:
            with pytest.raises(Exception, match="NullKey") as caught:
                _writer(df, broker_url, spark_queue, key_columns="k").save()
        finally:
            spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", previous or "10000")
        text = str(caught.value)
        assert "key column 'k' is null in row 9 of partition 2" in text
        assert "Nothing of this partition was published" in text
        published = sorted(
            json.loads(m.body)["id"] for m in drain_queue_sync(broker_url, spark_queue)
        )
        assert published == list(range(20))
        _writer(df, broker_url, spark_queue, key_columns="k", allow_null_keys="true").save()
        assert len(drain_queue_sync(broker_url, spark_queue, settled=True)) == 30

    def test_the_spool_spills_to_disk_past_its_memory_and_replays_in_order(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Past its memory bound the spool writes every batch to a local file, read back in order."""
        monkeypatch.setenv("SPARK_LOCAL_DIRS", str(tmp_path))
        batches = [pa.record_batch({"k": list(range(n * 100, n * 100 + 100))}) for n in range(5)]
        with _Spool(memory=batches[0].nbytes * 2) as spool:
            assert spool.fill(iter(batches), [("k", 0)]) is None
            assert spool.path is not None and Path(spool.path).parent == tmp_path
            replayed = list(spool.batches())
        assert [b.column(0).to_pylist() for b in replayed] == [
            b.column(0).to_pylist() for b in batches
        ]
        assert list(tmp_path.iterdir()) == []  # the file is gone
        with _Spool(memory=batches[0].nbytes * 2) as spool:
            nulls = [*batches[:3], pa.record_batch({"k": [1, None]})]
            error = spool.fill(iter(nulls), [("k", 0)])
        assert isinstance(error, NullKey) and "null in row 301 of partition 0" in str(error)
        assert list(tmp_path.iterdir()) == []


def _wait(predicate: Any, timeout: float, what: str, query: Any) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not within {timeout}s"
        assert query.exception() is None, query.exception()
        time.sleep(0.1)


def _spark_batches(query: Any) -> Counter[int]:
    """batch id -> input rows, for each micro-batch with rows, as Spark's progress reports them."""
    return Counter(
        {p["batchId"]: p["numInputRows"] for p in query.recentProgress if p["numInputRows"]}
    )


class TestStreaming:
    """writeStream.format("rabbitmq"), and stopping after a batch's confirms (item 9)."""

    def test_stream_writer_puts_the_batch_id_in_headers(
        self, spark: SparkSession, broker_url: str, spark_queue: str, tmp_path: Path
    ) -> None:
        """Rate source into format("rabbitmq"): every row once, each with its batch id."""
        register_data_source(spark)
        stream = (
            spark.readStream.format("rate")
            .option("rowsPerSecond", 100)
            .option("numPartitions", 2)
            .load()
        )
        query = (
            stream.writeStream.format("rabbitmq")
            .option("url", broker_url)
            .option("routing_key", spark_queue)
            .option("id_namespace", f"t-{spark_queue}")
            .option("checkpointLocation", str(tmp_path / "checkpoint"))
            .trigger(processingTime="1 second")
            .start()
        )
        try:
            _wait(
                lambda: query.lastProgress and query.lastProgress["batchId"] >= 2,
                90,
                "3 batches",
                query,
            )
        finally:
            assert stop_after_current_batch(query, timeout=60)
        messages = drain_queue_sync(broker_url, spark_queue)
        ids = Counter(m.message_id for m in messages)
        assert messages and set(ids.values()) == {1}
        published = Counter(m.headers[HEADER_BATCH_ID] for m in messages)
        assert published == _spark_batches(query)  # Spark's own batch ids and row counts
        assert len(published) >= 2
        for message in messages:
            body = json.loads(message.body)
            assert set(body) == {"timestamp", "value"}

    def test_stop_after_current_batch_cuts_no_batch(
        self, spark: SparkSession, broker_url: str, spark_queue: str, tmp_path: Path
    ) -> None:
        """Called while a batch is being published, it returns after that batch: every batch
        in the queue is whole, and nothing is published after it returns.

        Each micro-batch has exactly ROWS rows (rate-micro-batch source); batches run every
        2 s and take part of that, so a batch is in progress when stop is called.
        """
        rows = 3000
        register_data_source(spark)
        stream = (
            spark.readStream.format("rate-micro-batch")
            .option("rowsPerBatch", rows)
            .option("numPartitions", 2)
            .load()
        )
        query = (
            stream.writeStream.format("rabbitmq")
            .option("url", broker_url)
            .option("routing_key", spark_queue)
            .option("id_namespace", f"t-{spark_queue}")
            .option("publisher.max_in_flight", "20")  # slower batches: easier to stop mid-way
            .option("checkpointLocation", str(tmp_path / "checkpoint"))
            .trigger(processingTime="2 seconds")
            .start()
        )
        done_before: list[int] = []

        def in_progress() -> bool:
            """A trigger is active, and stays so for 0.2 s with no new progress: a batch runs."""
            done = len(_spark_batches(query))
            if done < 2 or not query.status["isTriggerActive"]:
                return False
            time.sleep(0.2)
            if query.status["isTriggerActive"] and len(_spark_batches(query)) == done:
                done_before.append(done)
                return True
            return False

        try:
            _wait(in_progress, 90, "a batch in progress after 2 batches", query)
        finally:
            assert stop_after_current_batch(query, timeout=60)
        assert not query.isActive
        messages = drain_queue_sync(broker_url, spark_queue)
        time.sleep(1.0)
        assert drain_queue_sync(broker_url, spark_queue, idle_timeout=0.3) == []
        published = Counter(m.headers[HEADER_BATCH_ID] for m in messages)
        assert set(published.values()) == {rows}, published  # every batch whole
        assert published == _spark_batches(query)
        assert len(published) > done_before[0]  # the batch in progress finished first
        assert len({m.message_id for m in messages}) == len(messages)

    def test_sink_stop_waits_for_the_batch_in_progress(
        self, spark: SparkSession, broker_url: str, spark_queue: str, tmp_path: Path
    ) -> None:
        """sink.stop(query) returns after the running batch is confirmed; nothing is cut.

        Each batch takes about a second (a slow serializer), and a new one starts as
        soon as the last ends, so a batch is in progress when stop is called. A plain
        query.stop() would kill its tasks mid-partition.
        """

        def slow(row: Any) -> dict[str, Any]:
            time.sleep(0.002)
            return {"value": row.value}

        reports: list[PublishReport] = []
        spec = PublishSpec(
            url=broker_url,
            routing_key=spark_queue,
            id_namespace=f"t-{spark_queue}",
            serializer=slow,
        )
        sink = foreach_batch_sink(spec, on_report=reports.append)
        stream = (
            spark.readStream.format("rate")
            .option("rowsPerSecond", 400)
            .option("numPartitions", 2)
            .load()
        )
        query = (
            stream.writeStream.foreachBatch(sink)
            .option("checkpointLocation", str(tmp_path / "checkpoint"))
            .trigger(processingTime="0 seconds")
            .start()
        )
        try:
            _wait(lambda: sum(1 for r in reports if r.rows) >= 2, 90, "2 batches", query)
        finally:
            assert sink.stop(query, timeout=60)
        stopped_at = len(reports)
        assert not query.isActive
        messages = drain_queue_sync(broker_url, spark_queue)
        time.sleep(1.0)
        assert drain_queue_sync(broker_url, spark_queue, idle_timeout=0.3) == []
        assert len(reports) == stopped_at  # no batch published after stop() returned
        published = Counter(m.headers[HEADER_BATCH_ID] for m in messages)
        reported = {r.batch_id: r.rows for r in reports if r.rows}
        assert dict(published) == reported  # every batch whole: none cut mid-way
