"""A pipeline end to end, exactly once: stream -> Spark -> queue -> consumer with the inbox.

Runs as is against a local broker (amqp://guest:guest@127.0.0.1:5672/, or set
RELIABLE_MQ_URL) with the spark extra (``pip install '.[spark]'``) and Java 17::

    python examples/stream_pipeline.py

1. **Publish.** Order events go into a stream with confirms
   (`ReliablePublisher`); two of them are malformed.
2. **Transform.** A Spark job reads the stream in micro-batches with the
   ``rabbitmq`` source (``bodyFormat`` ``json``), from the offset its
   checkpoint holds to the stream's tail, turns each order into a total in
   cents, and writes the results with ``format("rabbitmq")`` into a queue,
   with confirms and deterministic message ids (from the whole output row,
   which holds the event's stream offset). Only then does it commit the end
   offset to its checkpoint. Malformed events land in ``_corrupt_body`` and are
   counted, not forwarded.
3. **Replay.** The first micro-batch "crashes" after its write and before its
   checkpoint commit; the next run starts from the checkpoint, reads the same
   offsets again and publishes the same ids again: duplicates, never a loss.
4. **Apply.** A `ReliableConsumer` applies each total with the inbox
   (`SQLiteDedupStore.run_once`: the effect and the *done* mark in one
   transaction), so the duplicates are acked and skipped.

At the end the ledger holds each good order once. The micro-batch loop uses
the batch source (``spark.read``) and keeps its own checkpoint file, as a
``spark.readStream`` source keeps its offsets in Spark's checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import sys
import tempfile
import uuid
from pathlib import Path

import aio_pika
from prometheus_client import CollectorRegistry
from pydantic import BaseModel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from reliable_mq import Message, ReliableConsumer, ReliablePublisher
from reliable_mq.dedup import SQLiteDedupStore
from reliable_mq.delivery import Delivery
from reliable_mq.settings import ConsumerSettings
from reliable_mq.spark import register_data_source
from reliable_mq.streams import StreamReader, declare_stream
from reliable_mq.topology import QueueTopology, declare_topology, delete_topology

URL = os.environ.get("RELIABLE_MQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
FIRST, LATER = 150, 50  # good events published before the first run, then later
MALFORMED = [b"not json", b'{"order_id": "seven", "amount": 1.5}']
BODY_SCHEMA = "order_id BIGINT, customer STRING, amount DECIMAL(10,2)"


class Total(BaseModel):
    """What the Spark job writes: one order's total, and where it came from."""

    stream: str
    offset: int
    order_id: int
    customer: str
    cents: int


async def publish_events(stream: str, first: int, count: int) -> None:
    """Events ``first .. first+count-1`` into the stream, each confirmed by the broker."""
    async with ReliablePublisher(URL, registry=CollectorRegistry()) as publisher:
        await publisher.publish_many(
            Message(
                {"order_id": n, "customer": f"c-{n % 7}", "amount": f"{n}.25"},
                routing_key=stream,  # a stream is published to as a queue is
                message_id=f"order-{n}",
            )
            for n in range(first, first + count)
        )


async def publish_raw(stream: str, bodies: list[bytes]) -> None:
    async with ReliablePublisher(URL, registry=CollectorRegistry()) as publisher:
        await publisher.publish_many(
            Message(body, routing_key=stream, message_id=f"raw-{index}")
            for index, body in enumerate(bodies)
        )


async def tail(stream: str) -> int:
    async with StreamReader(URL, stream) as reader:
        return await reader.tail()


def transform(events: DataFrame) -> DataFrame:
    """Orders to totals in cents; deterministic, so a replay writes the same rows."""
    return events.where("value IS NOT NULL").select(
        "stream",
        "offset",
        F.col("value.order_id").alias("order_id"),
        F.col("value.customer").alias("customer"),
        (F.col("value.amount") * 100).cast("long").alias("cents"),
    )


def micro_batch(
    spark: SparkSession, stream: str, queue: str, checkpoint: Path, *, crash: bool
) -> int:
    """One micro-batch: checkpoint offset -> tail, transformed, written, then committed."""
    # No checkpoint yet: from the stream's first offset ("earliest").
    start = json.loads(checkpoint.read_text())["next"] if checkpoint.exists() else "earliest"
    end = asyncio.run(tail(stream))  # what a streaming source's latestOffset gives
    if start == end:
        return 0
    events = (
        spark.read.format("rabbitmq")
        .option("url", URL)
        .option("stream", stream)
        .option("startingOffsets", str(start))
        .option("endingOffsets", str(end))
        .option("bodyFormat", "json")
        .option("bodySchema", BODY_SCHEMA)
        .load()
        .cache()  # read once: the counts below and the write use the same rows
    )
    counts = events.selectExpr("count(value) AS good", "count(_corrupt_body) AS bad").first()
    assert counts is not None
    totals = transform(events)
    (
        totals.write.format("rabbitmq")
        .mode("append")
        .option("url", URL)
        .option("routing_key", queue)
        .option("id_namespace", f"order-totals-v1-{stream}")  # id = f(namespace, row)
        .save()
    )  # every row confirmed when save() returns
    events.unpersist()
    written, malformed = int(counts["good"]), int(counts["bad"])
    print(f"micro-batch [{start}, {end}): {written} totals written, {malformed} malformed")
    if crash:
        print("  ...and the driver dies before committing its checkpoint")
        return written
    checkpoint.write_text(json.dumps({"next": end}))  # commit: the next run starts here
    return written


async def apply_totals(queue: str, ledger: Path, written: int) -> int:
    """Consume the ``written`` totals with the inbox; how many copies were skipped."""
    store = SQLiteDedupStore(ledger, retention=24 * 3600)
    # The inbox also covers two copies handled at once (the second is deferred
    # and skipped later); a prefetch below the replay's distance keeps this
    # demo's copies apart, so each duplicate is skipped on arrival.
    consumer = ReliableConsumer(
        URL, dedup=store, registry=CollectorRegistry(), settings=ConsumerSettings(prefetch=50)
    )

    @consumer.handler(queue)
    async def on_total(total: Total, delivery: Delivery) -> None:
        def book(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT INTO ledger (order_id, cents) VALUES (?, ?)", (total.order_id, total.cents)
            )

        await store.run_once(delivery.message_id, book)  # effect + done mark, one commit

    try:
        async with consumer:
            async with asyncio.timeout(30):
                # every copy settled: applied (acked) or skipped as a duplicate
                while (stats := consumer.stats()).acked + stats.duplicates < written:
                    await asyncio.sleep(0.05)
            skipped = consumer.stats().duplicates
    finally:
        await store.close()
    return skipped


async def setup(stream: str, queue: str) -> None:
    await declare_stream(URL, stream, max_age="1D")
    await declare_topology(URL, queue)  # the work queue, its retry and dead-letter queues
    await publish_events(stream, 0, FIRST)
    await publish_raw(stream, MALFORMED)


async def cleanup(stream: str, queue: str) -> None:
    connection = await aio_pika.connect(URL)
    async with connection:
        channel = await connection.channel()
        await channel.queue_delete(stream)
        await delete_topology(channel, QueueTopology(queue))


def main() -> None:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # executors run this Python
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("reliable_mq-stream-pipeline")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    register_data_source(spark)
    suffix = uuid.uuid4().hex[:8]
    stream, queue = f"example.orders.stream.{suffix}", f"example.order-totals.{suffix}"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint, ledger = Path(tmp) / "checkpoint.json", Path(tmp) / "ledger.db"
            with sqlite3.connect(ledger) as conn:
                conn.execute("CREATE TABLE ledger (order_id INTEGER, cents INTEGER)")
            asyncio.run(setup(stream, queue))
            written = micro_batch(spark, stream, queue, checkpoint, crash=True)
            written += micro_batch(spark, stream, queue, checkpoint, crash=False)  # replay
            asyncio.run(publish_events(stream, FIRST, LATER))
            written += micro_batch(spark, stream, queue, checkpoint, crash=False)
            written += micro_batch(spark, stream, queue, checkpoint, crash=False)  # nothing new
            skipped = asyncio.run(apply_totals(queue, ledger, written))
            with sqlite3.connect(ledger) as conn:
                rows, distinct, cents = conn.execute(
                    "SELECT COUNT(*), COUNT(DISTINCT order_id), SUM(cents) FROM ledger"
                ).fetchone()
    finally:
        asyncio.run(cleanup(stream, queue))
        spark.stop()
    expected_cents = sum(n * 100 + 25 for n in range(FIRST + LATER))
    print(f"written by Spark: {written} (with the replay); skipped by the inbox: {skipped}")
    print(f"ledger: {rows} rows, {distinct} orders, {cents} cents (expected {expected_cents})")
    assert written == FIRST * 2 + LATER, "the replay writes the first micro-batch again"
    assert rows == distinct == FIRST + LATER and cents == expected_cents, "each order once"


if __name__ == "__main__":
    main()
