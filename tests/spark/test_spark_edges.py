"""Issue 19, item 10: the Spark helper's smaller edges, on a real local Spark and the shared broker.

* a DataFrame with rows but no columns is refused on the driver by both
  publishing paths (it used to publish ``{}`` per row through
  ``publish_dataframe`` and nothing at all through ``format("rabbitmq")``);
* the data source's ``check_destination`` option is parsed strictly;
* ``message_id_for`` gives the published id for every representation of a
  decimal (``collect()`` returns ``Decimal('9.00E-7')`` for a ``DECIMAL(20,7)``).
"""

from __future__ import annotations

import uuid
from decimal import Decimal
from typing import Any

import pytest

pytest.importorskip("pyspark")

from pyspark.sql import DataFrame, SparkSession

from reliable_mq.spark import (
    PublishSpec,
    UnsupportedSchema,
    message_id_for,
    publish_dataframe,
    register_data_source,
)
from tests.support.amqp import drain_queue_sync

pytestmark = [pytest.mark.spark, pytest.mark.rabbitmq]


def _spec(url: str, queue: str, **overrides: Any) -> PublishSpec:
    fields: dict[str, Any] = {"url": url, "routing_key": queue, "id_namespace": f"t-{queue}"}
    fields.update(overrides)
    return PublishSpec(**fields)


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


class TestNoColumns:
    def test_both_paths_refuse_rows_without_columns(
        self, spark: SparkSession, broker_url: str, spark_queue: str
    ) -> None:
        """3 rows, 0 columns: UnsupportedSchema on the driver for both paths; nothing published."""
        register_data_source(spark)
        df = spark.range(3).select()
        assert (df.columns, df.count()) == ([], 3)
        with pytest.raises(UnsupportedSchema, match="no columns"):
            publish_dataframe(df, _spec(broker_url, spark_queue))
        with pytest.raises(Exception, match=r"UnsupportedSchema.*no columns"):
            _writer(df, broker_url, spark_queue).save()
        assert drain_queue_sync(broker_url, spark_queue, idle_timeout=0.3) == []


class TestCheckDestinationOption:
    @pytest.mark.parametrize("value", ["off", "ture", "", "on"])
    def test_anything_but_a_boolean_is_an_error(
        self, spark: SparkSession, broker_url: str, spark_queue: str, value: str
    ) -> None:
        """Not read as true: an error naming the option, before any task."""
        register_data_source(spark)
        df = spark.range(2)
        with pytest.raises(Exception, match="check_destination: must be true or false"):
            _writer(df, broker_url, spark_queue, check_destination=value).save()
        assert drain_queue_sync(broker_url, spark_queue, idle_timeout=0.3) == []

    @pytest.mark.parametrize("value", ["no", "false", "0", "No"])
    def test_false_skips_the_check(
        self, spark: SparkSession, broker_url: str, spark_queue: str, value: str
    ) -> None:
        """No passive declare: a missing queue is found by the publish (unroutable), not the check."""
        register_data_source(spark)
        df = spark.range(2)
        missing = f"{spark_queue}-missing"
        with pytest.raises(Exception, match="DestinationNotFound"):
            _writer(df, broker_url, missing, check_destination="yes").save()
        with pytest.raises(Exception, match="PublishUnroutable") as caught:
            _writer(df, broker_url, missing, check_destination=value).save()
        assert "DestinationNotFound" not in str(caught.value)


class TestDecimalIds:
    def test_ids_agree_for_every_representation(
        self, spark: SparkSession, broker_url: str, spark_queue: str
    ) -> None:
        """Row and key ids from collect()'s Decimals, and from other spellings, are the published ones."""
        df = spark.sql(
            "SELECT * FROM VALUES"
            " (1, CAST('0.0000009' AS DECIMAL(20,7)), CAST('12.5' AS DECIMAL(38,18))),"
            " (2, CAST('1' AS DECIMAL(20,7)), CAST('-0.000000000000000001' AS DECIMAL(38,18))),"
            " (3, CAST('0' AS DECIMAL(20,7)), CAST('12345678901234567890.1' AS DECIMAL(38,18))),"
            " (4, CAST('0.00001' AS DECIMAL(20,7)), CAST('100' AS DECIMAL(38,18)))"
            " AS t(n, a, b)"
        )
        collected = [row.asDict() for row in df.collect()]
        assert Decimal("9.00E-7") in [row["a"] for row in collected]  # what collect() gives
        for ids in ("row", "key"):
            namespace = f"t-{ids}-{uuid.uuid4().hex[:6]}"
            spec = _spec(
                broker_url, spark_queue, ids=ids, key_columns=("a", "b"), id_namespace=namespace
            )
            publish_dataframe(df, spec)
            published = {
                m.message_id for m in drain_queue_sync(broker_url, spark_queue, settled=True)
            }
            assert published == {message_id_for(spec, row) for row in collected}, ids
            respelled = [
                {**row, "a": Decimal(format(row["a"], "f") + "000"), "b": row["b"].normalize()}
                for row in collected
            ]
            assert published == {message_id_for(spec, row) for row in respelled}, ids
        one = _spec(broker_url, spark_queue, ids="key", key_columns=("a",))
        spellings = ["9.00E-7", "9E-7", "0.0000009", "0.000000900000", "+9e-7"]
        assert len({message_id_for(one, {"a": Decimal(text)}) for text in spellings}) == 1
        zeros = ["0", "0E-7", "-0", "0.000", "-0E+3"]
        assert len({message_id_for(one, {"a": Decimal(text)}) for text in zeros}) == 1
        assert message_id_for(one, {"a": Decimal("1.5")}) != message_id_for(
            one, {"a": Decimal("15")}
        )
