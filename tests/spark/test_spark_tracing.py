"""Spans on the executors (issue 21): one ``publish_partition`` span per partition, only
where the Python workers have a tracer provider.

The workers get tracing the way an application would give it to them: a
``sitecustomize`` on their ``PYTHONPATH`` (``tests/spark/otel_worker``) sets a
global SDK provider that writes spans as JSON lines into a directory. The
shared session's ``SparkContext.environment`` carries the variables for one
job: Spark keeps a Python daemon per distinct environment, so that job's
workers start fresh with the hook, and the other tests' workers never see it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import LongType, StructField, StructType

from reliable_mq import PublisherSettings, PublishUnroutable
from reliable_mq._tracing import Tracing
from reliable_mq.spark import PublishSpec, plan_publish, publish_dataframe, publish_partition
from reliable_mq.spark import _partition as partition_module
from tests.support.amqp import drain_queue_sync
from tests.test_tracing import Spans

HOOK = Path(__file__).parent / "otel_worker"
PARTITIONS = 3
ROWS = 30  # per partition
CHUNK = 10  # publish_many chunk: 10 x max_in_flight


@contextmanager
def worker_hook(spark: SparkSession, directory: Path, *, tracing: bool) -> Iterator[None]:
    """Jobs started inside run their Python workers with the ``sitecustomize`` hook."""
    environment: dict[str, str] = spark.sparkContext.environment
    saved = dict(environment)
    environment.update(
        PYTHONPATH=str(HOOK),
        RELIABLE_MQ_TEST_SPANS=str(directory),
        RELIABLE_MQ_TEST_TRACING="on" if tracing else "off",
    )
    try:
        yield
    finally:
        environment.clear()
        environment.update(saved)


def read_spans(directory: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for path in sorted(directory.glob("spans-*.jsonl"))
        for line in path.read_text(encoding="utf-8").splitlines()
    ]


def frame(spark: SparkSession) -> DataFrame:
    return spark.range(PARTITIONS * ROWS, numPartitions=PARTITIONS).selectExpr("id AS n")


def spec(url: str, queue: str) -> PublishSpec:
    return PublishSpec(
        url=url,
        routing_key=queue,
        key_columns=("n",),
        id_namespace=f"tests-{queue}",
        publisher=PublisherSettings(max_in_flight=CHUNK // 10),
    )


@pytest.mark.spark
@pytest.mark.rabbitmq
class TestPartitionSpans:
    def test_one_span_per_partition_around_its_batch_spans(
        self, spark: SparkSession, broker_url: str, spark_queue: str, tmp_path: Path
    ) -> None:
        """A provider in the workers: ``publish_partition`` (INTERNAL, a root) per
        partition with its index, task attempt and counts; each ``publish_many`` chunk
        is a batch span, its child; every message carries a ``traceparent`` in its
        partition's trace. One job (a Spark job here costs seconds)."""
        with worker_hook(spark, tmp_path, tracing=True):
            report = publish_dataframe(frame(spark), spec(broker_url, spark_queue))
        assert report.confirmed == PARTITIONS * ROWS
        assert list(tmp_path.glob("started-*")), "the hook ran in the workers"
        spans = read_spans(tmp_path)
        partitions = [s for s in spans if s["name"] == "publish_partition"]
        assert len(partitions) == PARTITIONS
        indexes = sorted(s["attributes"]["reliable_mq.spark.partition"] for s in partitions)
        assert indexes == list(range(PARTITIONS))
        for span in partitions:
            assert span["kind"] == "SpanKind.INTERNAL"
            assert span["parent_id"] is None
            assert span["status"]["status_code"] == "UNSET"
            attributes = span["attributes"]
            assert attributes["reliable_mq.spark.task_attempt"] == 0
            assert attributes["reliable_mq.spark.rows"] == ROWS
            assert attributes["reliable_mq.spark.confirmed"] == ROWS
            assert attributes["reliable_mq.spark.republished"] == 0
            assert attributes["reliable_mq.spark.rounds"] == 1
        batches = [s for s in spans if "messaging.batch.message_count" in s["attributes"]]
        assert len(batches) == PARTITIONS * ROWS // CHUNK
        assert {b["name"] for b in batches} == {f"publish {spark_queue}"}
        assert {b["attributes"]["messaging.batch.message_count"] for b in batches} == {CHUNK}
        assert {b["parent_id"] for b in batches} == {p["context"]["span_id"] for p in partitions}
        traces = {p["context"]["trace_id"] for p in partitions}
        messages = drain_queue_sync(broker_url, spark_queue, settled=True)
        assert len(messages) == PARTITIONS * ROWS
        assert {"0x" + m.headers["traceparent"].split("-")[1] for m in messages} == traces

    def test_no_provider_in_the_workers_no_spans_no_headers(
        self, spark: SparkSession, broker_url: str, spark_queue: str, tmp_path: Path
    ) -> None:
        """Workers with the API only (nothing configured): no span is exported and no
        message gets a ``traceparent``."""
        with worker_hook(spark, tmp_path, tracing=False):
            report = publish_dataframe(frame(spark), spec(broker_url, spark_queue))
        assert report.confirmed == PARTITIONS * ROWS
        assert list(tmp_path.glob("started-*")), "the hook ran in the workers"
        assert not list(tmp_path.glob("spans-*"))
        messages = drain_queue_sync(broker_url, spark_queue, settled=True)
        assert len(messages) == PARTITIONS * ROWS
        assert not [m for m in messages if "traceparent" in m.headers]


@pytest.mark.rabbitmq
class TestPartitionSpanOutcome:
    def test_a_deterministic_failure_sets_error_type(
        self, broker_url: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """An unroutable row stops the partition: its span has ``error.type``, ERROR
        status and the counts so far (``publish_partition`` called outside Spark)."""
        spans = Spans()
        monkeypatch.setattr(partition_module, "_TRACING", Tracing(spans.provider))
        plan = plan_publish(
            spec(broker_url, f"no-such-queue-{id(spans)}"),
            StructType([StructField("n", LongType())]),
        )
        stats = publish_partition(plan, [(n,) for n in range(5)])
        assert isinstance(stats.error, PublishUnroutable)
        [span] = spans.named("publish_partition")
        attributes = dict(span.attributes or {})
        assert attributes["error.type"] == "PublishUnroutable"
        assert attributes["reliable_mq.spark.partition"] == 0
        assert attributes["reliable_mq.spark.rows"] == stats.rows
        assert attributes["reliable_mq.spark.confirmed"] == 0
        assert span.status.status_code.name == "ERROR"
