"""Publish a small DataFrame to RabbitMQ with confirms, then read it back.

Runs as is against a local broker (amqp://guest:guest@127.0.0.1:5672/, or set
RELIABLE_MQ_URL) with ``pip install 'reliable-mq[spark]'`` and Java 17::

    python examples/spark_publish.py

It creates its own queue and DataFrame, publishes every row (one message per
row, its id derived from ``order_id``), prints the report and a message, and
deletes the queue.
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid

import aio_pika
from pyspark.sql import SparkSession

from reliable_mq.spark import PublishSpec, publish_dataframe

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
            key_columns=("order_id",),  # the message id derives from these
            id_namespace="example-orders-v1",
            header_columns=("customer",),
        )
        report = publish_dataframe(orders, spec)
        print(
            f"published {report.rows} rows from {report.partitions} partitions: "
            f"{report.confirmed} confirmed, {report.republished} republished, "
            f"{report.task_attempts} task attempts, {report.seconds:.2f} s"
        )
        asyncio.run(peek(queue))
    finally:
        asyncio.run(delete(queue))
        spark.stop()


if __name__ == "__main__":
    main()
