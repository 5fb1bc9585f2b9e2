"""Issue 15 items 1, 6 and 8: a dead broker fails fast, empty partitions stay offline,
and a failed task's error is not hidden behind an event-loop RuntimeError.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

import pytest

pytest.importorskip("pyspark")

import aio_pika
from pyspark.sql import SparkSession

from reliable_mq import PublisherSettings
from reliable_mq.spark import PublishSpec, publish_dataframe, register_data_source
from reliable_mq.testing import TCPProxy
from tests.conftest import proxied_url
from tests.support.private_node import PrivateBroker

pytestmark = [pytest.mark.spark, pytest.mark.rabbitmq]


def _spec(url: str, queue: str, **overrides: Any) -> PublishSpec:
    fields: dict[str, Any] = {"url": url, "routing_key": queue, "id_namespace": f"t-{queue}"}
    fields.update(overrides)
    return PublishSpec(**fields)


class TestEmptyPartitions:
    """Item 6: a partition with no rows opens no connection (counted at a TCP proxy)."""

    async def test_200_empty_partitions_open_no_connection(
        self, spark: SparkSession, proxy: TCPProxy, spark_queue: str
    ) -> None:
        """publish_dataframe: only the driver's destination check connects."""
        df = spark.range(0, 10, 1, 200).where("id > 100")
        spec = _spec(proxied_url(proxy), spark_queue)
        report = await asyncio.to_thread(publish_dataframe, df, spec)
        assert (report.partitions, report.rows, report.rounds) == (200, 0, 0)
        assert proxy.connections_total == 1  # the check on the driver

    async def test_only_partitions_with_rows_connect(
        self, spark: SparkSession, proxy: TCPProxy, spark_queue: str
    ) -> None:
        """4 partitions, 2 of them empty: 2 connections plus the check, with the data source too."""
        df = spark.range(0, 40, 1, 4).where("id < 20")  # rows only in partitions 0 and 1
        spec = _spec(proxied_url(proxy), spark_queue)
        report = await asyncio.to_thread(publish_dataframe, df, spec)
        assert report.rows == 20
        assert proxy.connections_total == 1 + 2

        def write() -> None:
            register_data_source(spark)  # in the writing thread: see docs/spark.md
            (
                df.write.format("rabbitmq")
                .mode("append")
                .option("url", proxied_url(proxy))
                .option("routing_key", spark_queue)
                .option("id_namespace", "t")
                .save()
            )

        await asyncio.to_thread(write)
        assert proxy.connections_total == 3 + 1 + 2


class TestErrorChain:
    """Item 8: the job's error names the real failure, with no event-loop RuntimeError."""

    def test_a_serializer_error_is_not_chained_to_the_loop_probe(
        self, spark: SparkSession, broker_url: str, spark_queue: str
    ) -> None:
        """Every task attempt fails with the user's error; the text has no loop probe."""

        def serialize(row: Any) -> bytes:
            raise LookupError(f"no such product {row.id}")

        df = spark.range(0, 3, 1, 1)
        with pytest.raises(Exception, match="no such product") as caught:
            publish_dataframe(df, _spec(broker_url, spark_queue, serializer=serialize))
        text = str(caught.value)
        assert "LookupError" in text
        assert "no running event loop" not in text
        assert "During handling of the above exception" not in text


def _wait_for_messages(url: str, queue: str, count: int, timeout: float) -> None:
    async def depth() -> int:
        connection = await aio_pika.connect(url)
        async with connection:
            channel = await connection.channel()
            declared = await channel.declare_queue(queue, passive=True)
            return int(declared.declaration_result.message_count or 0)

    deadline = time.monotonic() + timeout
    while asyncio.run(depth()) < count:
        assert time.monotonic() < deadline, f"fewer than {count} messages in {timeout}s"
        time.sleep(0.05)


@pytest.mark.private_broker
class TestDeadBroker:
    """Item 1: a broker killed mid-job fails the job in bounded time, not rows x timeout."""

    def test_a_killed_broker_fails_the_job_quickly(
        self, spark: SparkSession, private_broker: PrivateBroker
    ) -> None:
        """20,000 slow rows; the node is SIGKILLed after 300 confirms; the job fails fast.

        With the publisher's ``unavailable_timeout`` (3 s here) every waiting message
        fails with PublishUnavailable; without it (older publisher) the first message
        past its 5 s deadline ends the round and the next round finds no broker.
        Before issue 15, each remaining row waited out its own deadline behind the
        window: about 19,700 / 100 x 5 s, over 15 minutes.
        """
        queue = f"test-spark-dead-{uuid.uuid4().hex[:8]}"
        url = private_broker.url

        async def declare() -> None:
            connection = await aio_pika.connect(url)
            async with connection:
                channel = await connection.channel()
                await channel.declare_queue(queue, durable=True)

        asyncio.run(declare())
        settings: dict[str, Any] = {"max_in_flight": 100, "publish_timeout": 5.0}
        if "unavailable_timeout" in PublisherSettings.model_fields:
            settings["unavailable_timeout"] = 3.0

        def slow(row: Any) -> bytes:
            time.sleep(0.001)  # keeps the job running long after the kill
            return str(row.id).encode()

        spec = _spec(url, queue, serializer=slow, publisher=PublisherSettings(**settings))
        df = spark.range(0, 20_000, 1, 2)
        failure: list[BaseException] = []
        finished = threading.Event()
        failed_at: list[float] = []

        def job() -> None:
            try:
                publish_dataframe(df, spec)
            except BaseException as exc:
                failure.append(exc)
            finally:
                failed_at.append(time.monotonic())
                finished.set()

        runner = threading.Thread(target=job, name="spark-dead-broker-job", daemon=True)
        runner.start()
        _wait_for_messages(url, queue, 300, timeout=120)
        assert not finished.is_set(), "the job ended before the kill"
        # Left down: the private_broker fixture starts it again for the next test that
        # needs it (none may: a start here cost 8-10 s).
        private_broker.kill()
        killed_at = time.monotonic()
        assert finished.wait(180), "the job still runs 180 s after the broker died"
        seconds = failed_at[0] - killed_at
        print(f"time to failure after the kill: {seconds:.1f} s")  # noqa: T201
        assert failure, "the job succeeded although the broker died"
        text = str(failure[0])
        assert "BrokerUnavailable" in text or "PublishUnavailable" in text, text[-2000:]
        assert "no running event loop" not in text
        assert seconds < 60, f"time to failure {seconds:.1f} s"
