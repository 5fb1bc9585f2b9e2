"""reliable_mq.spark: DataFrames published with confirms from a real local Spark session.

One SparkSession per test run (``spark`` fixture, master ``local[2,4]``: two
threads, and up to 4 attempts per task, because plain ``local[2]`` never
retries a task). Broker tests use the shared RabbitMQ and their own queues.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")

from pyspark import TaskContext
from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql.types import (
    BinaryType,
    DoubleType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from reliable_mq import (
    InvalidMessage,
    InvalidSettings,
    PublisherSettings,
    PublishUnroutable,
    __version__,
)
from reliable_mq._sync import run_sync as _run_sync
from reliable_mq.spark import (
    HEADER_BATCH_ID,
    HEADER_PARTITION,
    HEADER_TASK_ATTEMPT,
    DestinationNotFound,
    IdScheme,
    NonFinite,
    PartitionNotConfirmed,
    PublishReport,
    PublishSpec,
    TaskInfo,
    check_destination,
    foreach_batch_sink,
    message_id_for,
    partition_publisher,
    plan_publish,
    publish_dataframe,
    publish_partition,
)
from reliable_mq.spark._plan import RowEncoder
from tests.support.amqp import DrainedMessage, drain_queue, drain_queue_sync

ROWS_PER_PARTITION = 2_500
PARTITIONS = 4
TOTAL = ROWS_PER_PARTITION * PARTITIONS


def _orders(spark: SparkSession) -> DataFrame:
    """4 partitions x 2,500 rows; partition p holds ids [2500p, 2500(p+1))."""
    return spark.range(TOTAL, numPartitions=PARTITIONS).selectExpr(
        "id AS order_id", "concat('customer-', id % 7) AS customer", "id * 1.5 AS amount"
    )


def _spec(url: str, queue: str, **overrides: Any) -> PublishSpec:
    fields: dict[str, Any] = {
        "url": url,
        "routing_key": queue,
        "key_columns": ("order_id",),
        "id_namespace": f"tests-{queue}",
        "header_columns": ("customer",),
    }
    fields.update(overrides)
    return PublishSpec(**fields)


def _order_id(spec: PublishSpec, i: int) -> str:
    """The id of row ``i`` of `_orders` (ids from the whole row; ``amount`` is a DECIMAL)."""
    amount = Decimal(i) * Decimal("1.5")
    return message_id_for(spec, {"order_id": i, "customer": f"customer-{i % 7}", "amount": amount})


def _ids(messages: list[DrainedMessage]) -> Counter[str]:
    return Counter(m.message_id for m in messages if m.message_id is not None)


class TestPublishSpec:
    """The spec is validated on the driver and travels to executors by pickle."""

    def test_rejects_unusable_combinations(self) -> None:
        """Every problem is named by field in one InvalidSettings."""
        with pytest.raises(InvalidSettings) as caught:
            PublishSpec(
                url="http://nowhere", id_namespace="", body_column="b", columns=["a"], ids="key"
            )
        text = str(caught.value)
        for name in ("url", "routing_key", "id_namespace", "key_columns", "body_column"):
            assert f"{name}:" in text

    def test_enums_accept_their_values_and_name_the_choices(self) -> None:
        """ids and non_finite take enum values (or their strings); others are refused."""
        spec = PublishSpec(
            url="amqp://127.0.0.1/", routing_key="q", id_namespace="ns", ids="position"
        )
        assert spec.ids is IdScheme.POSITION
        with pytest.raises(InvalidSettings, match="ids: must be one of 'row', 'key', 'position'"):
            PublishSpec(url="amqp://127.0.0.1/", routing_key="q", id_namespace="ns", ids="rows")
        with pytest.raises(InvalidSettings, match="non_finite"):
            PublishSpec(url="amqp://127.0.0.1/", routing_key="q", id_namespace="n", non_finite="x")
        with pytest.raises(InvalidSettings, match="unknown time zone"):
            PublishSpec(url="amqp://127.0.0.1/", routing_key="q", id_namespace="n", time_zone="X/Y")

    def test_pickles_and_hides_the_password(self) -> None:
        """A spec pickles (to executors) and its repr never shows the password."""
        spec = _spec("amqp://guest:s3cret@127.0.0.1:5672/", "q", serializer=lambda row: b"x")
        assert "s3cret" not in repr(spec)
        from pyspark import cloudpickle  # what Spark uses for closures

        copy = pickle.loads(cloudpickle.dumps(spec))  # type: ignore[no-untyped-call]
        assert copy.connection.url.get_secret_value() == "amqp://guest:s3cret@127.0.0.1:5672/"
        assert copy.key_columns == ("order_id",)

    def test_key_id_is_uuid5_of_canonical_keys(self) -> None:
        """ids="key": uuid5(uuid5(URL, namespace), sorted compact JSON of the keys)."""
        spec = _spec(
            "amqp://127.0.0.1/", "q", key_columns=("b", "a"), id_namespace="orders-v1", ids="key"
        )
        namespace = uuid.uuid5(uuid.NAMESPACE_URL, "orders-v1")
        expected = str(uuid.uuid5(namespace, '{"a":"x","b":1}'))
        assert message_id_for(spec, {"b": 1, "a": "x", "other": 2}) == expected

    def test_options_build_the_same_spec(self) -> None:
        """The data source's string options carry every field but the serializer."""
        spec = PublishSpec.from_options(
            {
                "URL": "amqp://guest:guest@127.0.0.1:5672/",
                "routing_key": "q",
                "id_namespace": "ns",
                "key_columns": "a, b",
                "header_columns": '["c"]',
                "headers": '{"x-source": "spark"}',
                "ids": "row",
                "non_finite": "string",
                "allow_null_keys": "true",
                "time_zone": "+02:00",
                "max_task_attempts": "2",
                "publisher.max_in_flight": "50",
                "connection.heartbeat": "10",
                "connection.password": "pw",
            }
        )
        assert spec.key_columns == ("a", "b")
        assert spec.header_columns == ("c",)
        assert spec.headers == {"x-source": "spark"}
        assert (spec.non_finite, spec.allow_null_keys, spec.max_task_attempts) == (
            NonFinite.STRING,
            True,
            2,
        )
        assert spec.publisher.max_in_flight == 50
        assert spec.connection.heartbeat == 10
        assert "pw" in str(spec.connection.addresses[0].url)
        with pytest.raises(InvalidSettings, match="routingkey: unknown option"):
            PublishSpec.from_options({"url": "amqp://127.0.0.1/", "routingkey": "q"})

    def test_options_for_routing_bodies_names_and_ids(self) -> None:
        """exchange, routing_key_column, body_column, columns, connection_name, ids=position."""
        by_column = PublishSpec.from_options(
            {
                "url": "amqp://127.0.0.1/",
                "exchange": "amq.topic",
                "Routing_Key_Column": "region",
                "id_namespace": "ns",
                "body_column": "payload",
                "connection_name": "orders-export",
                "ids": "position",
            }
        )
        assert (by_column.exchange, by_column.routing_key, by_column.routing_key_column) == (
            "amq.topic",
            None,
            "region",
        )
        assert (by_column.body_column, by_column.columns) == ("payload", None)
        assert by_column.ids is IdScheme.POSITION
        assert by_column.connection_name == "orders-export"
        assert by_column.connection.connection_name == "orders-export"
        with_columns = PublishSpec.from_options(
            {
                "url": "amqp://127.0.0.1/",
                "routing_key": "q",
                "id_namespace": "ns",
                "columns": '["order_id", "amount"]',
                "connection_name": "orders-export",
                "connection.heartbeat": "5",  # dotted settings keep the connection name
            }
        )
        assert with_columns.columns == ("order_id", "amount")
        assert with_columns.body_column is None and with_columns.exchange == ""
        assert with_columns.connection.connection_name == "orders-export"
        assert with_columns.connection.heartbeat == 5
        with pytest.raises(InvalidSettings, match="give exactly one of routing_key"):
            PublishSpec.from_options(
                {
                    "url": "amqp://127.0.0.1/",
                    "id_namespace": "ns",
                    "routing_key_column": "r",
                    "routing_key": "q",
                }
            )
        with pytest.raises(InvalidSettings, match="ids: must be one of"):
            PublishSpec.from_options(
                {"url": "amqp://127.0.0.1/", "id_namespace": "ns", "routing_key": "q", "ids": "pos"}
            )


_ORDER_SCHEMA = StructType(
    [
        StructField("order_id", LongType()),
        StructField("customer", StringType()),
        StructField("amount", DoubleType()),
    ]
)


def _encoder(spec: PublishSpec, task: TaskInfo, schema: StructType = _ORDER_SCHEMA) -> RowEncoder:
    return RowEncoder(plan_publish(spec, schema), task)


class TestRowEncoder:
    """Rows become id, body, routing key and headers (no Spark session needed)."""

    def test_ids_ignore_the_task_attempt_and_batch(self) -> None:
        """A retried task or a replayed batch sends the same ids; attempt goes in headers."""
        spec = _spec("amqp://127.0.0.1/", "q")
        row = Row(order_id=7, customer="c", amount=1.5)
        first = _encoder(spec, TaskInfo(partition=1, attempt=0, batch_id=3))(row)
        retry = _encoder(spec, TaskInfo(partition=2, attempt=1, batch_id=4))(row)
        expected = message_id_for(spec, {"order_id": 7, "customer": "c", "amount": 1.5})
        assert first.message_id == retry.message_id == expected
        assert first.headers == {
            HEADER_PARTITION: 1,
            HEADER_TASK_ATTEMPT: 0,
            HEADER_BATCH_ID: 3,
            "customer": "c",
        }
        assert retry.headers[HEADER_TASK_ATTEMPT] == 1
        assert first.body == b'{"order_id":7,"customer":"c","amount":1.5}'

    def test_positional_ids_follow_partition_and_row_index(self) -> None:
        """Positional ids differ by row index and partition, not by attempt."""
        spec = PublishSpec(
            url="amqp://127.0.0.1/", routing_key="q", id_namespace="n", ids="position"
        )
        schema = StructType([StructField("v", LongType())])
        rows = [Row(v=1), Row(v=1)]

        def ids(task: TaskInfo) -> list[str]:
            encoder = _encoder(spec, task, schema)
            return [encoder(row).message_id for row in rows]

        a = ids(TaskInfo(0, 0, None))
        b = ids(TaskInfo(0, 1, None))
        c = ids(TaskInfo(1, 0, None))
        assert a == b
        assert len(set(a)) == 2
        assert not set(a) & set(c)

    def test_body_column_serializer_and_routing_key_column(self) -> None:
        """The body comes from a column or a serializer; the routing key from a column."""
        schema = StructType(
            [
                StructField("k", LongType()),
                StructField("payload", BinaryType()),
                StructField("rk", StringType()),
            ]
        )
        row = Row(k=1, payload=b"raw", rk="orders.eu")
        base: dict[str, Any] = {
            "url": "amqp://127.0.0.1/",
            "routing_key_column": "rk",
            "key_columns": ["k"],
            "id_namespace": "n",
        }
        task = TaskInfo(0, 0, None)
        by_column = _encoder(PublishSpec(**base, body_column="payload"), task, schema)(row)
        assert (by_column.body, by_column.routing_key) == (b"raw", "orders.eu")
        serialized = _encoder(PublishSpec(**base, serializer=lambda r: f"k={r.k}"), task, schema)(
            row
        )
        assert serialized.body == b"k=1"
        selected = _encoder(PublishSpec(**base, columns=["k"]), task, schema)(row)
        assert selected.body == b'{"k":1}'


class TestSyncBridge:
    """The executor-side bridge never depends on a caller's event loop."""

    async def test_runs_in_a_fresh_thread_under_a_running_loop(self) -> None:
        """Called where a loop already runs (a notebook), it uses its own thread and loop."""
        outer = threading.get_ident()

        async def where() -> int:
            return threading.get_ident()

        assert _run_sync(where) != outer

    def test_runs_on_this_thread_without_a_loop(self) -> None:
        """Without a running loop (an executor), asyncio.run on the calling thread."""

        async def where() -> int:
            return threading.get_ident()

        assert _run_sync(where) == threading.get_ident()

    def test_errors_are_not_chained_to_the_loop_probe(self) -> None:
        """Issue 15 item 8: no spurious "no running event loop" in front of the real error."""

        async def fail() -> None:
            raise InvalidMessage("the real error")

        with pytest.raises(InvalidMessage) as caught:
            _run_sync(fail)
        assert caught.value.__context__ is None
        assert caught.value.__cause__ is None

    def test_public_names_are_sorted_and_errors_rooted(self) -> None:
        """The module's __all__ is a sorted tuple; its errors derive from ReliableMQError."""
        import reliable_mq.spark as module
        from reliable_mq import ReliableMQError

        assert isinstance(module.__all__, tuple)
        assert list(module.__all__) == sorted(module.__all__)
        assert all(hasattr(module, name) for name in module.__all__)
        assert issubclass(module.DestinationNotFound, ReliableMQError)
        assert issubclass(module.PartitionNotConfirmed, ReliableMQError)

    @pytest.mark.parametrize("missing", ["pyspark", "pyarrow"])
    def test_import_without_the_extra_names_it(self, missing: str) -> None:
        """Importing the module without PySpark or PyArrow tells how to install the extra."""
        code = (
            f"import sys; sys.modules[{missing!r}] = None\n"
            "try:\n    import reliable_mq.spark\n"
            "except ImportError as e:\n    print(e)\n"
            "import reliable_mq; assert 'reliable_mq.spark' not in sys.modules\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
        assert "needs PySpark and PyArrow" in out
        assert "pip install '.[spark]'" in out
        assert f"pip install 'reliable_mq-{__version__}-py3-none-any.whl[spark]'" in out


@pytest.mark.spark
@pytest.mark.rabbitmq
class TestPublishDataFrame:
    """publish_dataframe and foreachPartition against the real broker."""

    async def test_every_row_confirmed_once_by_id(
        self, spark: SparkSession, broker_url: str, spark_queue: str
    ) -> None:
        """4 x 2,500 rows: all confirmed, each id present exactly once (called under a loop)."""
        spec = _spec(broker_url, spark_queue)
        report = publish_dataframe(_orders(spark), spec)

        assert isinstance(report, PublishReport)
        assert (report.rows, report.confirmed, report.partitions) == (TOTAL, TOTAL, PARTITIONS)
        assert report.task_attempts == PARTITIONS
        assert [s.rows for s in report.partition_stats] == [ROWS_PER_PARTITION] * PARTITIONS
        messages = await drain_queue(broker_url, spark_queue)
        ids = _ids(messages)
        assert len(messages) == TOTAL
        assert set(ids.values()) == {1}
        assert set(ids) == {_order_id(spec, i) for i in range(TOTAL)}
        sample = messages[0]
        assert sample.headers[HEADER_TASK_ATTEMPT] == 0
        assert sample.headers["customer"].startswith("customer-")

    def test_retried_task_duplicates_only_its_own_ids(
        self, spark: SparkSession, broker_url: str, spark_queue: str
    ) -> None:
        """Partition 1 fails after half its rows; Spark retries; dedup by id gives 10,000.

        Rows go to the publisher in chunks of 10 x max_in_flight (here 1,000): the
        first chunk of partition 1 was confirmed before the failure, the rows of the
        chunk being read when the serializer raised were never sent.
        """
        fail_at = ROWS_PER_PARTITION + ROWS_PER_PARTITION // 2  # the middle of partition 1
        chunk = 1_000

        def serialize(row: Any) -> dict[str, Any]:
            context = TaskContext.get()
            assert context is not None
            if row.order_id == fail_at and context.attemptNumber() == 0:
                raise RuntimeError("injected failure after half of partition 1")
            return {"order_id": row.order_id}

        spec = _spec(
            broker_url,
            spark_queue,
            serializer=serialize,
            publisher=PublisherSettings(max_in_flight=chunk // 10),
        )
        report = publish_dataframe(_orders(spark), spec)

        assert (report.rows, report.confirmed) == (TOTAL, TOTAL)
        assert report.task_attempts == PARTITIONS + 1
        assert [s.task_attempt for s in report.partition_stats] == [0, 1, 0, 0]
        messages = drain_queue_sync(broker_url, spark_queue)
        ids = _ids(messages)
        duplicated = {mid for mid, n in ids.items() if n > 1}
        half = range(ROWS_PER_PARTITION, ROWS_PER_PARTITION + chunk)
        assert duplicated == {_order_id(spec, i) for i in half}
        assert set(ids.values()) == {1, 2}
        assert {m.headers[HEADER_PARTITION] for m in messages if m.message_id in duplicated} == {1}
        applied = {m.message_id for m in messages}  # a de-duplicating consumer's effects
        assert len(applied) == TOTAL
        assert len(messages) == TOTAL + len(half)

    def test_unroutable_fails_fast_without_task_retries(
        self, spark: SparkSession, broker_url: str
    ) -> None:
        """No binding for the key: PublishUnroutable on the driver, each task ran once."""
        spec = _spec(broker_url, "no-such-binding", exchange="amq.direct")
        started = time.monotonic()
        with pytest.raises(PublishUnroutable) as caught:
            publish_dataframe(_orders(spark), spec)
        assert time.monotonic() - started < 30
        error = caught.value
        assert (error.exchange, error.routing_key, error.reply_code) == (
            "amq.direct",
            "no-such-binding",
            312,
        )
        assert any("without a Spark retry" in note for note in error.__notes__)

    def test_missing_queue_caught_before_the_job(
        self, spark: SparkSession, broker_url: str
    ) -> None:
        """A queue typo on the default exchange fails on the driver, no task started."""
        spec = _spec(broker_url, f"missing-{uuid.uuid4().hex[:8]}")
        with pytest.raises(DestinationNotFound, match="does not exist"):
            publish_dataframe(_orders(spark), spec)
        with pytest.raises(DestinationNotFound, match="exchange 'no-such-exchange"):
            check_destination(_spec(broker_url, "q", exchange="no-such-exchange"))

    def test_missing_column_caught_before_the_job(self, spark: SparkSession) -> None:
        """A spec naming a column the DataFrame lacks fails on the driver."""
        spec = _spec("amqp://127.0.0.1:1/", "q", key_columns=("order_id", "typo"))
        with pytest.raises(InvalidSettings, match="no column 'typo'"):
            publish_dataframe(_orders(spark), spec)

    def test_null_routing_key_stops_the_partition(
        self, spark: SparkSession, broker_url: str, spark_queue: str
    ) -> None:
        """A null routing-key column is a deterministic error raised on the driver."""
        spec = _spec(broker_url, spark_queue, routing_key=None, routing_key_column="rk")
        df = spark.createDataFrame(
            [(1, "c", spark_queue), (2, "c", None)], "order_id INT, customer STRING, rk STRING"
        ).coalesce(1)
        with pytest.raises(InvalidMessage, match="routing key column 'rk' is null"):
            publish_dataframe(df, spec)
        assert len(drain_queue_sync(broker_url, spark_queue)) == 1

    def test_foreach_partition_form(
        self, spark: SparkSession, broker_url: str, spark_queue: str
    ) -> None:
        """df.foreachPartition(partition_publisher(spec, df)) publishes every row once."""
        spec = _spec(broker_url, spark_queue, publisher=PublisherSettings(max_in_flight=200))
        df = spark.range(1_000, numPartitions=2).selectExpr("id AS order_id", "'c' AS customer")
        df.foreachPartition(partition_publisher(spec, df))
        ids = _ids(drain_queue_sync(broker_url, spark_queue))
        assert len(ids) == 1_000
        assert set(ids.values()) == {1}

    def test_foreach_partition_unroutable_raises_in_the_task(
        self, spark: SparkSession, broker_url: str
    ) -> None:
        """The plain form can only raise: the job fails naming PublishUnroutable.

        Spark retries such a task up to spark.task.maxFailures; each retry fails
        at its first message (publish_dataframe avoids those retries).
        """
        spec = _spec(broker_url, "no-such-binding", exchange="amq.direct")
        df = spark.range(100, numPartitions=1).selectExpr("id AS order_id", "'c' AS customer")
        with pytest.raises(Exception, match="PublishUnroutable") as caught:
            df.foreachPartition(partition_publisher(spec, df, check=False))
        assert "NO_ROUTE" in str(caught.value)


@pytest.mark.spark
@pytest.mark.rabbitmq
class TestForeachBatch:
    """Structured Streaming: each micro-batch published, batch id in the headers."""

    def test_rate_source_micro_batches(
        self, spark: SparkSession, broker_url: str, spark_queue: str, tmp_path: Path
    ) -> None:
        """A rate source for a few batches: every row once, headers name its batch."""
        reports: list[PublishReport] = []
        spec = _spec(broker_url, spark_queue, key_columns=("value",), header_columns=())
        sink = foreach_batch_sink(spec, on_report=reports.append)
        stream = (
            spark.readStream.format("rate")
            .option("rowsPerSecond", 200)
            .option("numPartitions", 2)
            .load()
        )
        query = (
            stream.writeStream.foreachBatch(sink)
            .option("checkpointLocation", str(tmp_path / "checkpoint"))
            .trigger(processingTime="1 second")
            .start()
        )
        try:
            deadline = time.monotonic() + 60
            while sum(1 for r in reports if r.rows) < 3:
                assert time.monotonic() < deadline, "fewer than 3 non-empty micro-batches in 60s"
                assert query.exception() is None, query.exception()
                time.sleep(0.2)
        finally:
            # Between batches: a plain query.stop() landing mid-batch (likely on a
            # loaded machine, where batches run back to back) kills its tasks, and
            # the messages they had published belong to no report.
            assert sink.stop(query, timeout=60)
        messages = drain_queue_sync(broker_url, spark_queue)
        ids = _ids(messages)
        assert len(messages) == sum(r.rows for r in reports) > 0
        assert set(ids.values()) == {1}
        batches = {r.batch_id for r in reports if r.rows}
        assert {m.headers[HEADER_BATCH_ID] for m in messages} == batches
        assert all(r.confirmed == r.rows for r in reports)


@pytest.mark.rabbitmq
class TestInTaskRounds:
    """Unconfirmed messages are republished in bounded rounds, then the task fails."""

    async def test_nacked_rows_fail_the_task_after_the_last_round(self, broker_url: str) -> None:
        """A full queue nacks the overflow every round; the task raises for Spark to retry."""
        import asyncio

        import aio_pika

        name = f"test-spark-full-{uuid.uuid4().hex[:12]}"
        connection = await aio_pika.connect(broker_url)
        async with connection:
            channel = await connection.channel()
            queue = await channel.declare_queue(
                name, arguments={"x-max-length": 50, "x-overflow": "reject-publish"}
            )
            try:
                spec = _spec(
                    broker_url,
                    name,
                    header_columns=(),
                    max_task_attempts=2,
                    publisher=PublisherSettings(
                        max_attempts=2, backoff_initial=0.01, backoff_max=0.02
                    ),
                )
                plan = plan_publish(spec, StructType([StructField("order_id", LongType())]))
                rows = [(i,) for i in range(80)]
                with pytest.raises(PartitionNotConfirmed, match="30 messages still unconfirmed"):
                    await asyncio.to_thread(publish_partition, plan, rows)
                messages = await drain_queue(broker_url, name)
                assert len(messages) == 50
            finally:
                await queue.delete(if_unused=False, if_empty=False)
