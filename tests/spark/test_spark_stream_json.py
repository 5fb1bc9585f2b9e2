"""``spark.read.format("rabbitmq")`` with ``bodyFormat`` ``json``: bodies parsed into ``value``,
malformed ones to a column or failing the read (issue 23)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("pyspark")

from prometheus_client import CollectorRegistry
from pyspark.sql import DataFrameReader, SparkSession
from pyspark.sql.types import LongType, StringType, StructField, StructType

from reliable_mq import Message, ReliablePublisher
from reliable_mq.spark import READ_SCHEMA, register_data_source
from reliable_mq.spark._ddl import parse_schema
from reliable_mq.streams import declare_stream
from tests.support.amqp import run_sync

pytestmark = [pytest.mark.spark, pytest.mark.rabbitmq, pytest.mark.timeout(300)]

BODY_SCHEMA = "id BIGINT, name STRING, tags ARRAY<STRING>, at TIMESTAMP"
GOOD = [
    {"id": 1, "name": "one", "tags": ["a", "b"], "at": "2026-11-28T10:00:00+00:00"},
    {"id": 2, "name": "two", "extra": {"ignored": True}},  # missing fields null, extra ignored
]
BAD = [
    b"not json at all",
    b'{"id": "three"}',  # a string where the schema has BIGINT
    b"[1, 2, 3]",  # JSON, but not an object
    b"\xff\xfe\x00 not UTF-8",
    b'{"id": ' + b"9" * 5000 + b"}",  # over Python's digit limit for ints
    b"[" * 100_000,  # nested past the recursion limit
]
BIG = {"id": 99, "name": "x" * 2_000_000}  # a 2 MB body, parsed whole


@pytest.fixture(name="stream")
def _stream(broker_url: str) -> Iterator[str]:
    """A fresh stream holding GOOD, BAD, then BIG, in that order; deleted afterwards."""
    import aio_pika

    name = f"test-spark-json-{uuid.uuid4().hex[:10]}"
    bodies = [json.dumps(body).encode() for body in GOOD] + BAD + [json.dumps(BIG).encode()]

    async def fill() -> None:
        await declare_stream(broker_url, name)
        async with ReliablePublisher(broker_url, registry=CollectorRegistry()) as publisher:
            await publisher.publish_many(
                Message(body, routing_key=name, message_id=f"m-{index}")
                for index, body in enumerate(bodies)
            )

    run_sync(fill)
    yield name

    async def delete() -> None:
        connection = await aio_pika.connect(broker_url)
        async with connection:
            await (await connection.channel()).queue_delete(name)

    run_sync(delete)


def reader(spark: SparkSession, url: str, stream: str, **options: str) -> DataFrameReader:
    register_data_source(spark)
    found = spark.read.format("rabbitmq").option("url", url).option("stream", stream)
    for key, value in options.items():
        found = found.option(key, value)
    return found


def rows(frame: Any) -> list[dict[str, Any]]:
    return sorted(
        (row.asDict(recursive=True) for row in frame.collect()), key=lambda r: r["offset"]
    )


class TestJsonBodies:
    def test_good_bodies_parse_and_bad_ones_go_to_the_column(
        self, spark: SparkSession, broker_url: str, stream: str
    ) -> None:
        """PERMISSIVE (the default): good bodies become ``value``, every malformed one
        (not JSON, wrong type, not an object, not UTF-8, huge number, too deep) has a null
        ``value`` and its text in ``_corrupt_body``; the 2 MB body parses whole; the
        metadata columns are all there."""
        frame = reader(
            spark, broker_url, stream, bodyFormat="json", bodySchema=BODY_SCHEMA, numPartitions="2"
        ).load()
        names = frame.schema.fieldNames()
        assert names == [
            "stream",
            "offset",
            "value",
            "message_id",
            "routing_key",
            "exchange",
            "headers",
            "properties",
            "timestamp",
            "_corrupt_body",
        ]
        assert frame.schema["value"].dataType == parse_schema(BODY_SCHEMA)
        got = rows(frame)
        assert [r["message_id"] for r in got] == [f"m-{i}" for i in range(len(GOOD + BAD) + 1)]
        first, second = got[0], got[1]
        assert first["value"]["id"] == 1 and first["value"]["tags"] == ["a", "b"]
        assert first["value"]["at"].isoformat().startswith("2026-11-28T10:00:00")
        assert second["value"] == {"id": 2, "name": "two", "tags": None, "at": None}
        assert first["_corrupt_body"] is None and first["stream"] == stream
        bad = got[len(GOOD) : len(GOOD) + len(BAD)]
        assert all(r["value"] is None for r in bad)
        assert [r["_corrupt_body"] for r in bad[:3]] == [body.decode() for body in BAD[:3]]
        assert bad[3]["_corrupt_body"].endswith(" not UTF-8")  # undecodable bytes replaced
        assert len(bad[4]["_corrupt_body"]) == len(BAD[4]) and len(bad[5]["_corrupt_body"]) == len(
            BAD[5]
        )
        big = got[-1]
        assert big["_corrupt_body"] is None and big["value"]["name"] == BIG["name"]

    def test_failfast_fails_the_read_naming_stream_and_offset(
        self, spark: SparkSession, broker_url: str, stream: str
    ) -> None:
        """FAILFAST: the first malformed body fails the read with `MalformedBody`, naming the
        stream and its offset; a range of good bodies alone reads."""
        options = {"bodyFormat": "json", "bodySchema": BODY_SCHEMA, "mode": "FAILFAST"}
        frame = reader(spark, broker_url, stream, **options).load()
        assert "_corrupt_body" not in frame.schema.fieldNames()
        with pytest.raises(Exception, match="MalformedBody") as caught:
            frame.collect()
        assert f"the body at offset {len(GOOD)} of stream '{stream}'" in str(caught.value)
        good = reader(spark, broker_url, stream, endingOffsets=str(len(GOOD)), **options).load()
        assert [r["value"]["id"] for r in rows(good)] == [1, 2]

    def test_a_given_schema_names_the_body_struct(
        self, spark: SparkSession, broker_url: str, stream: str
    ) -> None:
        """``.schema(...)`` instead of ``bodySchema``: its ``value`` struct is the body's schema,
        and a custom corrupt column name is used."""
        body = StructType([StructField("id", LongType()), StructField("name", StringType())])
        fields = list(READ_SCHEMA.fields)
        fields[2] = StructField("value", body, True)
        given = StructType([*fields, StructField("bad", StringType(), True)])
        frame = (
            reader(
                spark,
                broker_url,
                stream,
                bodyFormat="json",
                columnNameOfCorruptRecord="bad",
                endingOffsets="3",
            )
            .schema(given)
            .load()
        )
        got = rows(frame)
        assert [(r["value"], r["bad"]) for r in got] == [
            ({"id": 1, "name": "one"}, None),
            ({"id": 2, "name": "two"}, None),
            (None, BAD[0].decode()),
        ]


class TestOptions:
    @pytest.mark.parametrize(
        ("options", "named"),
        [
            ({"bodyFormat": "xml"}, "bodyFormat"),
            ({"bodyFormat": "json"}, "bodySchema"),
            ({"bodyFormat": "json", "bodySchema": "id BIGINT,"}, "not a DDL schema"),
            ({"bodyFormat": "json", "bodySchema": "id INTERVAL"}, "no JSON reading"),
            ({"bodyFormat": "json", "bodySchema": "id INT", "mode": "DROPMALFORMED"}, "mode"),
            ({"bodySchema": "id INT"}, "only with bodyFormat json"),
            (
                {
                    "bodyFormat": "json",
                    "bodySchema": "id INT",
                    "columnNameOfCorruptRecord": "offset",
                },
                "names another column",
            ),
        ],
    )
    def test_wrong_values_give_invalid_settings(
        self, spark: SparkSession, broker_url: str, stream: str, options: dict[str, str], named: str
    ) -> None:
        """Each wrong body option fails on the driver with `InvalidSettings`, naming it."""
        with pytest.raises(Exception, match="InvalidSettings") as caught:
            reader(spark, broker_url, stream, **options).load().collect()
        assert named in str(caught.value)

    def test_a_given_schema_that_does_not_fit_is_refused(
        self, spark: SparkSession, broker_url: str, stream: str
    ) -> None:
        """A binary read with a schema of other columns is refused, showing the expected one."""
        given = StructType([StructField("body", StringType())])
        with pytest.raises(Exception, match="InvalidSettings") as caught:
            reader(spark, broker_url, stream).schema(given).load().collect()
        assert "expected struct<stream:string,offset:bigint,body:binary" in str(caught.value)
