"""`RowFormat` without Spark running: the DDL parser and the checked JSON conversion."""

from __future__ import annotations

import datetime as dt
import decimal
from typing import Any

import pytest

pytest.importorskip("pyspark")

from pyspark.sql.types import (
    ArrayType,
    DecimalType,
    IntegerType,
    MapType,
    StringType,
    StructField,
    StructType,
)

from reliable_mq.errors import InvalidSettings
from reliable_mq.spark import BadRows, MalformedBody, RowFormat
from reliable_mq.spark._ddl import parse_schema
from reliable_mq.streams import StreamRecord


def record(body: bytes, offset: int = 7) -> StreamRecord:
    return StreamRecord("events", offset, body, "m-1", "events", "")


class TestDdl:
    def test_reads_nested_types_synonyms_quotes_and_clauses(self) -> None:
        """Spark's DDL, with nested types, synonyms, backquoted names, NOT NULL and COMMENT."""
        parsed = parse_schema(
            "a INTEGER, `odd ``name``` map<string, array<dec(5,2)>> NOT NULL COMMENT 'x, y', "
            "s STRUCT<x: STRING, y INT>"
        )
        assert parsed == StructType(
            [
                StructField("a", IntegerType()),
                StructField(
                    "odd `name`", MapType(StringType(), ArrayType(DecimalType(5, 2))), False
                ),
                StructField(
                    "s",
                    StructType([StructField("x", StringType()), StructField("y", IntegerType())]),
                ),
            ]
        )
        assert parse_schema(parsed.json()) == parsed

    @pytest.mark.parametrize(
        "text", ["", "a", "a INT,", "a INT b", "a MAP<INT", "a INT, a INT", "a DECIMAL(40,2)"]
    )
    def test_refuses_what_does_not_parse(self, text: str) -> None:
        with pytest.raises(ValueError):
            parse_schema(text)


class TestRows:
    def test_values_follow_from_json(self) -> None:
        """Missing fields null, extra ignored, strings take any JSON as its text, numbers
        checked by range, times with a zone, decimals at their scale."""
        rows = RowFormat.from_options(
            {
                "bodyformat": "json",
                "bodyschema": "i TINYINT, s STRING, d DECIMAL(4,2), t TIMESTAMP, m MAP<STRING,INT>",
            }
        )
        row = rows.row(record(b'{"i": 5, "s": {"k": [1]}, "d": 1.5, "t": "2026-01-02T03:04:05"}'))
        value: Any = row[2]
        assert value[:3] == (5, '{"k": [1]}', decimal.Decimal("1.50"))
        assert value[3] == dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
        assert value[4] is None and row[-1] is None
        for bad in (
            b'{"i": 128}',
            b'{"i": true}',
            b'{"d": 100.5}',
            b'{"m": {"a": "1"}}',
            b'{"t": "x"}',
        ):
            malformed = rows.row(record(bad))
            assert malformed[2] is None and malformed[-1] == bad.decode()

    def test_failfast_raises_with_stream_and_offset(self) -> None:
        rows = RowFormat.from_options(
            {"bodyformat": "json", "bodyschema": "i INT", "mode": "failfast"}
        )
        assert rows.mode is BadRows.FAILFAST
        with pytest.raises(MalformedBody, match="offset 42 of stream 'events'") as caught:
            rows.row(record(b'{"i": "x"}', offset=42))
        assert (caught.value.stream, caught.value.offset) == ("events", 42)
        assert "value.i: expected an integer, got a string" in caught.value.reason

    def test_binary_rows_keep_the_body(self) -> None:
        row = RowFormat().row(record(b"\xff raw"))
        assert row[2] == b"\xff raw" and len(row) == 9

    def test_a_value_column_that_is_not_a_struct_is_refused(self) -> None:
        given = StructType([StructField("value", StringType())])
        with pytest.raises(InvalidSettings, match="must be a struct"):
            RowFormat.from_options({"bodyformat": "json"}, given)

    def test_a_given_value_that_cannot_hold_null_is_refused(self) -> None:
        """A body may lack a field, so ``.schema(...)`` cannot make one non-nullable."""
        fields = [*RowFormat().schema().fields]
        strict = StructType([StructField("id", IntegerType(), False)])
        fields[2] = StructField("value", strict, True)
        fields.append(StructField("_corrupt_body", StringType(), True))
        with pytest.raises(InvalidSettings, match="must be nullable"):
            RowFormat.from_options({"bodyformat": "json"}, StructType(fields))


class TestArrowBatch:
    def test_a_batch_is_what_spark_makes_of_the_rows(self) -> None:
        """`RowFormat.batch` gives the Arrow batch Spark builds from `RowFormat.row`'s
        tuples (its own converter), value for value: headers of any type as text, a
        naive and an aware timestamp, unset properties left out."""
        from pyspark.sql.worker.plan_data_source_read import (
            records_to_arrow_batches,
        )

        stamp = dt.datetime(2026, 1, 2, 3, 4, 5)
        records = [
            StreamRecord("events", 0, b"\xff raw", None, "", "amq.topic"),
            StreamRecord(
                "events",
                3,
                b"{}",
                "m-3",
                "rk",
                "",
                {"n": 1, "b": b"\xc3\xa9", "t": stamp, "none": None, "d": decimal.Decimal("1.5")},
                {"content_type": "application/json", "priority": 5},
                stamp,
            ),
            StreamRecord("events", 4, b"", "m-4", "rk", "", {}, {}, stamp.replace(tzinfo=dt.UTC)),
        ]
        rows = RowFormat()
        ours = rows.batch(records)
        spark = next(
            iter(records_to_arrow_batches(iter(map(rows.row, records)), 100, rows.schema(), None))
        )
        assert ours.schema.equals(spark.schema)
        assert ours.to_pylist() == spark.to_pylist()
        assert ours.num_rows == 3 and ours.column("headers")[1].as_py()[0] == ("n", "1")
        assert (
            rows.columnar
            and not RowFormat.from_options({"bodyformat": "json", "bodyschema": "id INT"}).columnar
        )
