"""Issue 15 items 2-5 and 7: faithful bodies and ids that never merge distinct rows.

Every test publishes through a real local Spark session to the shared broker
and reads the messages back. The session's Python workers run in
Europe/Berlin (see ``tests/support/spark.py``); tests that need a session
time zone set it and put it back.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import pytest

pytest.importorskip("pyspark")

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import TimestampType

from reliable_mq import InvalidBody
from reliable_mq.spark import (
    DuplicateKeys,
    NonFinite,
    NullKey,
    PublishSpec,
    UnsupportedSchema,
    message_id_for,
    publish_dataframe,
    register_data_source,
)
from reliable_mq.spark._encode import body_encoder
from reliable_mq.spark._zones import zone_named
from tests.support.amqp import DrainedMessage, drain_queue_sync

pytestmark = [pytest.mark.spark, pytest.mark.rabbitmq]

DOCS = Path(__file__).resolve().parents[2] / "docs" / "spark.md"


class Case(NamedTuple):
    """One row of the type matrix in docs/spark.md."""

    spark_type: str
    """The Spark type, as the docs name it."""
    sql: str
    """The value, as a SQL expression."""
    body: str
    """Its JSON text in our body."""
    to_json: str | None
    """Its JSON text in Spark's own ``to_json`` (None: ``to_json`` omits the field)."""
    header: Any
    """Its AMQP header value, as read back."""

    def docs_row(self) -> str:
        to_json = "omitted" if self.to_json is None else f"`{self.to_json}`"
        return f"| `{self.spark_type}` | `{self.sql}` | `{self.body}` | {to_json} | `{self.header!r}` |"


# The session time zone is Europe/Berlin; 2024-10-27 is the DST fall-back day there.
MATRIX: list[Case] = [
    Case("BOOLEAN", "true", "true", "true", True),
    Case("TINYINT", "CAST(-7 AS TINYINT)", "-7", "-7", -7),
    Case("SMALLINT", "CAST(300 AS SMALLINT)", "300", "300", 300),
    Case("INT", "2147483647", "2147483647", "2147483647", 2147483647),
    Case("BIGINT", "9007199254740993", "9007199254740993", "9007199254740993", 9007199254740993),
    Case("FLOAT", "CAST(1.1 AS FLOAT)", "1.1", "1.1", 1.100000023841858),
    Case("FLOAT", "CAST(1e10 AS FLOAT)", "1.0e10", "1.0E10", 1e10),
    Case("DOUBLE", "0.1D", "0.1", "0.1", 0.1),
    Case("DOUBLE", "1e7D", "10000000.0", "1.0E7", 1e7),
    Case("DOUBLE", "1e16D", "1e+16", "1.0E16", 1e16),
    Case("DOUBLE", "1e-5D", "1e-05", "1.0E-5", 1e-5),
    Case("DECIMAL(20,7)", "CAST('0.0000001' AS DECIMAL(20,7))", "0.0000001", "1E-7", "0.0000001"),
    Case(
        "DECIMAL(38,18)",
        "CAST('12345678901234567890.123456789012345678' AS DECIMAL(38,18))",
        "12345678901234567890.123456789012345678",
        "12345678901234567890.123456789012345678",
        "12345678901234567890.123456789012345678",
    ),
    Case("DECIMAL(5,2)", "CAST(1.5 AS DECIMAL(5,2))", "1.50", "1.50", "1.50"),
    Case("STRING", "concat('\"é', char(10), '<')", '"\\"é\\n<"', '"\\"é\\n<"', '"é\n<'),
    Case("BINARY", "X'00FF'", '"AP8="', '"AP8="', b"\x00\xff"),
    Case("DATE", "DATE'2024-02-29'", '"2024-02-29"', '"2024-02-29"', "2024-02-29"),
    Case(
        "TIMESTAMP",
        "TIMESTAMP'2024-10-27 00:30:00.123456 UTC'",
        '"2024-10-27T02:30:00.123456+02:00"',
        '"2024-10-27T02:30:00.123+02:00"',
        "2024-10-27T02:30:00.123456+02:00",
    ),
    Case(
        "TIMESTAMP",
        "TIMESTAMP'2024-10-27 01:30:00 UTC'",
        '"2024-10-27T02:30:00.000000+01:00"',
        '"2024-10-27T02:30:00.000+01:00"',
        "2024-10-27T02:30:00.000000+01:00",
    ),
    Case(
        "TIMESTAMP_NTZ",
        "TIMESTAMP_NTZ'2024-10-27 02:30:00.5'",
        '"2024-10-27T02:30:00.500000"',
        '"2024-10-27T02:30:00.500"',
        "2024-10-27T02:30:00.500000",
    ),
    Case("ARRAY<INT>", "array(1, NULL, 3)", "[1,null,3]", "[1,null,3]", "[1,null,3]"),
    Case(
        "MAP<STRING,INT>", "map('b', 1, 'a', 2)", '{"a":2,"b":1}', '{"b":1,"a":2}', '{"a":2,"b":1}'
    ),
    Case("MAP<INT,STRING>", "map(2, 'x')", '{"2":"x"}', '{"2":"x"}', '{"2":"x"}'),
    Case(
        "STRUCT<x:INT,y:STRING>",
        "named_struct('x', 1, 'y', CAST(NULL AS STRING))",
        '{"x":1,"y":null}',
        '{"x":1}',
        '{"x":1,"y":null}',
    ),
    Case("STRING (null)", "CAST(NULL AS STRING)", "null", None, None),
    Case("VOID", "NULL", "null", None, None),
]

MATRIX_HEADER = (
    "| Spark type | value (SQL) | in the JSON body | Spark's `to_json` "
    "| AMQP header value (Python, as read back) |"
)

UNSUPPORTED = [
    "INTERVAL '1' DAY",
    "INTERVAL '1' YEAR",
    "make_interval(0, 0, 0, 1)",
    "parse_json('{\"a\": 1}')",
    "map(DATE'2024-01-01', 1)",
    "map(X'01', 1)",
]


@contextmanager
def session_time_zone(spark: SparkSession, zone: str) -> Iterator[None]:
    previous = spark.conf.get("spark.sql.session.timeZone")
    spark.conf.set("spark.sql.session.timeZone", zone)
    try:
        yield
    finally:
        spark.conf.set("spark.sql.session.timeZone", previous)


@contextmanager
def job_group(spark: SparkSession) -> Iterator[list[int]]:
    """Collect the ids of the Spark jobs run inside the block."""
    group = f"test-{uuid.uuid4().hex[:8]}"
    context = spark.sparkContext
    context.setJobGroup(group, "reliable_mq test")
    jobs: list[int] = []
    try:
        yield jobs
    finally:
        jobs.extend(context.statusTracker().getJobIdsForGroup(group))
        context.setLocalProperty("spark.jobGroup.id", None)  # type: ignore[arg-type]


def _spec(url: str, queue: str, **overrides: Any) -> PublishSpec:
    fields: dict[str, Any] = {"url": url, "routing_key": queue, "id_namespace": f"t-{queue}"}
    fields.update(overrides)
    return PublishSpec(**fields)


def _strict(body: bytes) -> Any:
    def refuse(constant: str) -> Any:
        raise ValueError(f"invalid JSON constant {constant}")

    return json.loads(body, parse_constant=refuse)


def _matrix_df(spark: SparkSession) -> DataFrame:
    columns = ", ".join(f"{case.sql} AS c{i:02d}" for i, case in enumerate(MATRIX))
    return spark.sql(f"SELECT {columns}")


def _docs_matrix() -> list[str]:
    """The rows of the type matrix table in docs/spark.md."""
    lines = DOCS.read_text().splitlines()
    assert lines.count(MATRIX_HEADER) == 1, "the type matrix header changed"
    rows = []
    for line in lines[lines.index(MATRIX_HEADER) + 2 :]:  # past the |---| line
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


class TestTypeMatrix:
    """Each Spark type, published and read back (the table in docs/spark.md)."""

    def test_bodies_and_headers_of_every_type(
        self, spark: SparkSession, broker_url: str, spark_queue: str
    ) -> None:
        """Through publish_dataframe (pickled rows) and format("rabbitmq") (Arrow batches):
        the body is strict JSON, each value has the documented text and header value,
        and both paths give the row one message id."""
        register_data_source(spark)
        with session_time_zone(spark, "Europe/Berlin"):
            df = _matrix_df(spark)
            spec = _spec(broker_url, spark_queue, header_columns=df.columns)
            publish_dataframe(df, spec)
            (
                df.write.format("rabbitmq")
                .mode("append")
                .option("url", broker_url)
                .option("routing_key", spark_queue)
                .option("id_namespace", spec.id_namespace)
                .option("header_columns", ",".join(df.columns))
                .save()
            )
        by_function, by_format = drain_queue_sync(broker_url, spark_queue)
        expected = ",".join(f'"c{i:02d}":{case.body}' for i, case in enumerate(MATRIX))
        headers = {f"c{i:02d}": case.header for i, case in enumerate(MATRIX)}
        for message in (by_function, by_format):
            assert message.body.decode() == "{" + expected + "}"
            _strict(message.body)
            assert {name: message.headers[name] for name in headers} == headers
        assert by_function.message_id == by_format.message_id

    def test_spark_to_json_is_as_documented(self, spark: SparkSession) -> None:
        """The docs' to_json column is what Spark's own to_json writes (this Spark, local)."""
        with session_time_zone(spark, "Europe/Berlin"):
            columns = ", ".join(
                f"to_json(named_struct('v', {case.sql})) AS j{i:02d}"
                for i, case in enumerate(MATRIX)
            )
            [row] = spark.sql(f"SELECT {columns}").collect()
        written = [None if text == "{}" else text[len('{"v":') : -1] for text in row]
        assert written == [case.to_json for case in MATRIX]

    def test_a_zero_offset_is_plus_zero_where_spark_writes_z(self, spark: SparkSession) -> None:
        """As docs/spark.md says: at offset zero the body has +00:00, to_json has Z."""
        instant = "TIMESTAMP'2024-01-01 00:00:00 UTC'"
        with session_time_zone(spark, "UTC"):
            [row] = spark.sql(
                f"SELECT {instant} AS t, to_json(named_struct('t', {instant})) AS j"
            ).collect()
        assert row.j == '{"t":"2024-01-01T00:00:00.000Z"}'
        encode = body_encoder(TimestampType(), "t", zone_named("UTC"), NonFinite.ERROR)
        assert encode(row.t) == '"2024-01-01T00:00:00.000000+00:00"'

    def test_the_docs_show_the_tested_matrix(self) -> None:
        """docs/spark.md's table has exactly these rows, in this order: none missing, none stale."""
        assert _docs_matrix() == [case.docs_row() for case in MATRIX]

    def test_unsupported_types_fail_on_the_driver_before_any_job(
        self, spark: SparkSession, broker_url: str, spark_queue: str
    ) -> None:
        """Issue 15 item 3: interval, variant, maps keyed by date or binary: typed error, no job."""
        for sql in UNSUPPORTED:
            df = spark.sql(f"SELECT 1 AS id, {sql} AS v")
            with job_group(spark) as jobs, pytest.raises(UnsupportedSchema) as caught:
                publish_dataframe(df, _spec(broker_url, spark_queue))
            assert caught.value.problems[0][0] == "v", sql
            assert jobs == [], sql
        assert drain_queue_sync(broker_url, spark_queue, idle_timeout=0.3) == []

    def test_duplicate_column_names_fail_on_the_driver(
        self, spark: SparkSession, broker_url: str, spark_queue: str
    ) -> None:
        """Issue 15 item 5: a join that repeats a column name is an error, nothing published."""
        left = spark.sql("SELECT 1 AS k, 'left' AS v")
        right = spark.sql("SELECT 1 AS k, 'right' AS v")
        joined = left.join(right, "k")
        assert joined.columns == ["k", "v", "v"]
        with job_group(spark) as jobs, pytest.raises(UnsupportedSchema, match="v: duplicate"):
            publish_dataframe(joined, _spec(broker_url, spark_queue))
        assert jobs == []
        nested = spark.sql("SELECT named_struct('a', 1, 'a', 2) AS s")
        with pytest.raises(UnsupportedSchema, match=r"s\.a: duplicate"):
            publish_dataframe(nested, _spec(broker_url, spark_queue))
        assert drain_queue_sync(broker_url, spark_queue, idle_timeout=0.3) == []


class TestNonFinite:
    """Issue 15 item 4: NaN and Infinity never reach a body as invalid JSON."""

    def test_an_error_by_default_and_strings_or_null_on_request(
        self, spark: SparkSession, broker_url: str, spark_queue: str
    ) -> None:
        """Default: InvalidBody naming the column; 'string' and 'null' encode them."""
        df = spark.sql(
            "SELECT * FROM VALUES (1, 1.5D), (2, double('NaN')), (3, double('Infinity')),"
            " (4, double('-Infinity')) AS t(id, x)"
        ).coalesce(1)
        with pytest.raises(InvalidBody, match=r"column x holds NaN.*non_finite='string'"):
            publish_dataframe(df, _spec(broker_url, spark_queue, header_columns=("x",)))
        for message in drain_queue_sync(broker_url, spark_queue):
            _strict(message.body)  # what was published before the error is valid JSON
        as_strings = _spec(broker_url, spark_queue, non_finite="string", id_namespace="s")
        publish_dataframe(df, as_strings)
        as_null = _spec(broker_url, spark_queue, non_finite="null", id_namespace="n")
        publish_dataframe(df, as_null)
        bodies = sorted(
            m.body.decode() for m in drain_queue_sync(broker_url, spark_queue, settled=True)
        )
        assert bodies == sorted(
            [
                '{"id":1,"x":1.5}',
                '{"id":2,"x":"NaN"}',
                '{"id":3,"x":"Infinity"}',
                '{"id":4,"x":"-Infinity"}',
                '{"id":1,"x":1.5}',
                '{"id":2,"x":null}',
                '{"id":3,"x":null}',
                '{"id":4,"x":null}',
            ]
        )


def _ids(messages: list[DrainedMessage]) -> list[str]:
    return [m.message_id for m in messages if m.message_id is not None]


class TestIdsNeverMerge:
    """Issue 15 item 2: distinct rows never silently share a message id."""

    def test_null_keys_fail_before_anything_is_published(
        self, spark: SparkSession, broker_url: str, spark_queue: str
    ) -> None:
        """3 rows with a null key: NullKey on the driver, empty queue; opt-in publishes 3 ids."""
        df = spark.sql("SELECT * FROM VALUES (NULL, 'a'), (NULL, 'b'), (NULL, 'c') AS t(k, v)")
        spec = _spec(broker_url, spark_queue, key_columns=("k",))
        with pytest.raises(NullKey, match="key column \\(k\\) holds null"):
            publish_dataframe(df, spec)
        assert drain_queue_sync(broker_url, spark_queue, idle_timeout=0.3) == []
        publish_dataframe(
            df, _spec(broker_url, spark_queue, key_columns=("k",), allow_null_keys=True)
        )
        assert len(set(_ids(drain_queue_sync(broker_url, spark_queue, settled=True)))) == 3
        by_key = _spec(broker_url, spark_queue, key_columns=("k",), allow_null_keys=True, ids="key")
        with pytest.raises(DuplicateKeys, match="3 rows share the key"):
            publish_dataframe(df, by_key)

    def test_equal_keys_on_distinct_rows(
        self, spark: SparkSession, broker_url: str, spark_queue: str
    ) -> None:
        """Row ids keep both rows apart; key ids are refused before anything is published."""
        df = spark.sql("SELECT * FROM VALUES (1, 'a'), (1, 'b'), (2, 'a') AS t(k, v)")
        row_spec = _spec(broker_url, spark_queue, key_columns=("k",))
        publish_dataframe(df, row_spec)
        ids = _ids(drain_queue_sync(broker_url, spark_queue, settled=True))
        assert sorted(ids) == sorted(
            message_id_for(row_spec, {"k": k, "v": v}) for k, v in [(1, "a"), (1, "b"), (2, "a")]
        )
        key_spec = _spec(broker_url, spark_queue, key_columns=("k",), ids="key")
        with pytest.raises(DuplicateKeys, match=re.escape('2 rows share the key {"k":1}')):
            publish_dataframe(df, key_spec)
        assert drain_queue_sync(broker_url, spark_queue, idle_timeout=0.3) == []

    def test_dst_fold_instants_keep_their_ids_and_offsets(
        self, spark: SparkSession, broker_url: str, spark_queue: str
    ) -> None:
        """Items 2 and 7: two instants one hour apart in the fall-back hour stay apart.

        The docs' old advice followed (session and workers in Europe/Berlin):
        ids, bodies and headers differ, each with its own offset and microseconds.
        """
        with session_time_zone(spark, "Europe/Berlin"):
            df = spark.sql(
                "SELECT * FROM VALUES (TIMESTAMP'2024-10-27 00:30:00.250 UTC'),"
                " (TIMESTAMP'2024-10-27 01:30:00.250 UTC') AS t(ts)"
            )
            spec = _spec(
                broker_url, spark_queue, key_columns=("ts",), ids="key", header_columns=("ts",)
            )
            publish_dataframe(df, spec)
        messages = drain_queue_sync(broker_url, spark_queue, settled=True)
        assert sorted(m.body.decode() for m in messages) == [
            '{"ts":"2024-10-27T02:30:00.250000+01:00"}',
            '{"ts":"2024-10-27T02:30:00.250000+02:00"}',
        ]
        assert sorted(m.headers["ts"] for m in messages) == [
            "2024-10-27T02:30:00.250000+01:00",
            "2024-10-27T02:30:00.250000+02:00",
        ]
        assert len(set(_ids(messages))) == 2

    def test_session_time_zone_sets_the_offset_and_leaves_ids_alone(
        self, spark: SparkSession, broker_url: str, spark_queue: str
    ) -> None:
        """Item 7: bodies follow spark.sql.session.timeZone; ids are UTC instants."""
        sql = "SELECT 1 AS k, TIMESTAMP'2024-07-01 12:00:00.000001 UTC' AS ts"
        ids = []
        for zone, text in (
            ("America/New_York", "08:00:00.000001-04:00"),
            ("+05:30", "17:30:00.000001+05:30"),
        ):
            with session_time_zone(spark, zone):
                publish_dataframe(spark.sql(sql), _spec(broker_url, spark_queue))
            [message] = drain_queue_sync(broker_url, spark_queue, settled=True)
            assert message.body.decode() == '{"k":1,"ts":"2024-07-01T' + text + '"}'
            ids.append(message.message_id)
        assert ids[0] == ids[1]
