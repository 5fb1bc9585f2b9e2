"""Publish a small DataFrame to RabbitMQ with confirms, then read it back.

Runs as is against a local broker (amqp://guest:guest@127.0.0.1:5672/, or set
RELIABLE_MQ_URL) with the spark extra (from a clone: ``pip install '.[spark]'``)
and Java 17::

    python examples/spark_publish.py

It creates its own queue and DataFrame, publishes every row twice: with
``publish_dataframe`` (which returns a report) and with
``df.write.format("rabbitmq")``. Both send the same message ids (derived from
the whole row), so a de-duplicating consumer applies each row once. It prints
the report and a message, and deletes the queue.
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid

import aio_pika
from pyspark.sql import SparkSession

from reliable_mq.spark import PublishSpec, publish_dataframe, register_data_source

URL = os.environ.get("RELIABLE_MQ_URL", "amqp://guest:guest@127.0.0.1:5672/")


async def declare(queue: str) -> None:
    connection = await aio_pika.connect(URL)
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(queue, durable=True)


async def peek(queue: str) -> None:
    connection = await aio_pika.connect(URL)
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, durable=True)
        print(f"queue {queue} holds {declared.declaration_result.message_count} messages")
        message = await declared.get(no_ack=True, fail=False)
        if message is not None:
            print(f"first message: id={message.message_id} headers={dict(message.headers)}")
            print(f"               body={message.body.decode()}")


async def delete(queue: str) -> None:
    connection = await aio_pika.connect(URL)
    async with connection:
        channel = await connection.channel()
        await channel.queue_delete(queue)


def main() -> None:
    # Executors run Python too: make them use this interpreter (and its packages).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("reliable_mq-example")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    queue = f"example.orders.{uuid.uuid4().hex[:8]}"
    asyncio.run(declare(queue))
    try:
        orders = spark.createDataFrame(
            [(i, f"customer-{i % 5}", round(9.99 * i, 2)) for i in range(1, 1001)],
            "order_id INT, customer STRING, amount DOUBLE",
        ).repartition(4)
        spec = PublishSpec(
            url=URL,
            routing_key=queue,  # the default exchange routes by queue name
            key_columns=("order_id",),  # checked: never null
            id_namespace="example-orders-v1",  # with the row, it makes the message id
            header_columns=("customer",),
        )
        report = publish_dataframe(orders, spec)
        print(
            f"published {report.rows} rows from {report.partitions} partitions: "
            f"{report.confirmed} confirmed, {report.republished} republished, "
            f"{report.task_attempts} task attempts, {report.seconds:.2f} s"
        )
        asyncio.run(peek(queue))

        register_data_source(spark)  # makes format("rabbitmq") known to this session
        (
            orders.write.format("rabbitmq")
            .mode("append")
            .option("url", URL)
            .option("routing_key", queue)
            .option("key_columns", "order_id")
            .option("id_namespace", "example-orders-v1")
            .option("header_columns", "customer")
            .save()
        )
        print('df.write.format("rabbitmq") published the same rows again, under the same ids')
    finally:
        asyncio.run(delete(queue))
        spark.stop()


if __name__ == "__main__":
    main()
