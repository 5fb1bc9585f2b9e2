"""``spark.read.format("rabbitmq")``: a stream read between offsets, as a batch (issue 23)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest

pytest.importorskip("pyspark")

from pyspark.sql import SparkSession

from reliable_mq.errors import InvalidSettings, NotAStream
from reliable_mq.spark import READ_SCHEMA, register_data_source
from reliable_mq.streams import declare_stream
from tests.support.amqp import run_sync

pytestmark = [pytest.mark.spark, pytest.mark.rabbitmq, pytest.mark.timeout(300)]


@pytest.fixture(name="stream")
def _stream(broker_url: str) -> Iterator[str]:
    """A fresh stream, deleted after the test."""
    import aio_pika

    name = f"test-spark-stream-{uuid.uuid4().hex[:10]}"
    run_sync(lambda: declare_stream(broker_url, name))
    yield name

    async def delete() -> None:
        connection = await aio_pika.connect(broker_url)
        async with connection:
            await (await connection.channel()).queue_delete(name)

    run_sync(delete)


class TestBatchRead:
    def test_what_the_writer_published_reads_back_once_each(
        self, spark: SparkSession, broker_url: str, stream: str
    ) -> None:
        """The rabbitmq writer publishes into a stream with confirms; the batch source reads
        every message exactly once, split over 3 partitions, and a sub-range reads just it."""
        register_data_source(spark)
        rows = spark.range(0, 1000, 1, 4).selectExpr("id", "concat('v-', id) AS value")
        (
            rows.write.format("rabbitmq")
            .mode("append")
            .option("url", broker_url)
            .option("routing_key", stream)
            .option("id_namespace", f"t-{stream}")
            .save()
        )

        def read(**options: str) -> list[dict[str, object]]:
            reader = spark.read.format("rabbitmq").option("url", broker_url)
            for key, value in {"stream": stream, **options}.items():
                reader = reader.option(key, value)
            frame = reader.load()
            assert frame.schema == READ_SCHEMA
            return [row.asDict() for row in frame.collect()]

        got = read(numPartitions="3")
        assert len(got) == 1000
        assert sorted(r["offset"] for r in got) == list(range(1000))  # type: ignore[type-var]
        assert len({r["message_id"] for r in got}) == 1000
        ids = sorted(json.loads(bytes(r["body"]))["id"] for r in got)  # type: ignore[arg-type]
        assert ids == list(range(1000))
        sample = got[0]
        assert sample["stream"] == stream and sample["routing_key"] == stream
        assert sample["properties"]["content_type"] == "application/json"  # type: ignore[index]

        middle = read(startingOffsets="100", endingOffsets="200", numPartitions="2")
        assert sorted(r["offset"] for r in middle) == list(range(100, 200))  # type: ignore[type-var]
        assert read(startingOffsets="latest") == []

    def test_a_queue_or_bad_options_fail_on_the_driver(
        self, spark: SparkSession, broker_url: str, queue: str
    ) -> None:
        """A classic queue is refused (it cannot replay); an unknown option is named."""
        register_data_source(spark)
        reader = spark.read.format("rabbitmq").option("url", broker_url)
        with pytest.raises(Exception, match="cannot be read again") as caught:
            reader.option("stream", queue).load().collect()
        assert "NotAStream" in str(caught.value) or isinstance(caught.value, NotAStream)
        with pytest.raises(Exception, match="maxrecords") as unknown:
            reader.option("stream", queue).option("maxRecords", "5").load().collect()
        assert "InvalidSettings" in str(unknown.value) or isinstance(unknown.value, InvalidSettings)
