"""A pipeline end to end, exactly once: stream -> Structured Streaming -> queue -> inbox.

Runs as is against a local broker (amqp://guest:guest@127.0.0.1:5672/, or set
RELIABLE_MQ_URL) with the spark extra (``pip install '.[spark]'``) and Java 17::

    python examples/stream_pipeline.py

1. **Publish.** Order events go into a stream with confirms
   (`ReliablePublisher`); two of them are malformed.
2. **Transform.** A Structured Streaming query reads the stream
   (``spark.readStream.format("rabbitmq")``, ``bodyFormat`` ``json``), turns
   each order into a total in cents, one output message per event, and writes
   them with ``writeStream.format("rabbitmq")`` into a queue, with confirms and
   deterministic message ids (from the whole output row, which holds the
   event's stream and offset). Malformed events land in ``_corrupt_body``; the
   query forwards each one, with its stream, offset and text, to a queue of
   malformed events instead (the routing key is a column). The query runs with
   ``trigger(availableNow=True)``: it reads what is there, then stops.
3. **Replay.** After the first run, the checkpoint's last ``commits/N`` file
   is deleted: what a driver that died after the sink's write and before the
   commit leaves behind. The second run replays that micro-batch (the same
   offsets, from ``offsets/N``) and publishes the same ids again: duplicates,
   never a loss. Then it reads the events published since.
4. **Apply.** A `ReliableConsumer` applies each total with the inbox
   (`SQLiteDedupStore.run_once`: the effect and the *done* mark in one
   transaction), so the duplicates are acked and skipped.

At the end the ledger holds each good order once.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import sys
import tempfile
import uuid
from dataclasses import dataclass
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
from reliable_mq.streams import declare_stream
from reliable_mq.topology import QueueTopology, declare_topology, delete_topology

URL = os.environ.get("RELIABLE_MQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
FIRST, LATER = 150, 50  # good events published before the first run, then later
MALFORMED = [b"not json", b'{"order_id": "seven", "amount": 1.5}']
BODY_SCHEMA = "order_id BIGINT, customer STRING, amount DECIMAL(10,2)"
BODY_COLUMNS = "stream,offset,order_id,customer,cents,malformed"


@dataclass(frozen=True)
class Names:
    """The stream the events go into and the two queues the query writes to."""

    stream: str
    totals: str  # one total per good event; a ReliableConsumer applies them
    malformed: str  # one message per malformed event, for a person to look at


@dataclass(frozen=True)
class Batch:
    """One micro-batch of a run, from the query's progress."""

    batch_id: int
    start: int | None  # the stream's offsets [start, end); None: the query's first batch
    end: int
    good: int
    malformed: int


class Total(BaseModel):
    """What the query writes for a good event (the ``malformed`` field is null)."""

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


def transform(events: DataFrame, names: Names) -> DataFrame:
    """Orders to totals in cents, one row per event; deterministic, so a replay
    writes the same rows. A malformed event keeps its text, for its own queue."""
    good = F.col("value").isNotNull()
    return events.select(
        F.when(good, F.lit(names.totals)).otherwise(F.lit(names.malformed)).alias("route"),
        "stream",
        "offset",
        F.col("value.order_id").alias("order_id"),
        F.col("value.customer").alias("customer"),
        (F.col("value.amount") * 100).cast("long").alias("cents"),
        F.col("_corrupt_body").alias("malformed"),
    )


def run_query(spark: SparkSession, names: Names, checkpoint: Path) -> list[Batch]:
    """One run of the streaming query, until it has read what the stream holds."""
    events = (
        spark.readStream.format("rabbitmq")
        .option("url", URL)
        .option("stream", names.stream)
        .option("startingOffsets", "earliest")  # a new checkpoint; a restart goes on from it
        .option("bodyFormat", "json")
        .option("bodySchema", BODY_SCHEMA)
        .load()
        # counted per micro-batch, reported in the query's progress
        .observe("events", F.count("value").alias("good"), F.count("_corrupt_body").alias("bad"))
    )
    query = (
        transform(events, names)
        .writeStream.format("rabbitmq")
        .option("url", URL)
        .option("routing_key_column", "route")  # totals or malformed, per row
        .option("columns", BODY_COLUMNS)  # the JSON body: all but the route
        .option("id_namespace", "order-totals-v1")  # id = f(namespace, whole row)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)  # what is there now, then stop
        .start()
    )
    query.awaitTermination()  # each batch's rows confirmed before its commit
    batches = []
    for progress in query.recentProgress:
        counts = progress.observedMetrics.get("events")
        if counts is None:  # no batch ran in this trigger
            continue
        source = progress.sources[0]  # its offsets: JSON, {stream: next offset}
        start = json.loads(source.startOffset or "null")  # null before the first batch
        batch = Batch(
            progress.batchId,
            None if start is None else start[names.stream],
            json.loads(source.endOffset)[names.stream],
            int(counts["good"]),
            int(counts["bad"]),
        )
        batches.append(batch)
        begin = "earliest" if batch.start is None else batch.start
        print(
            f"  micro-batch {batch.batch_id}, offsets [{begin}, {batch.end}): "
            f"{batch.good} totals, {batch.malformed} malformed forwarded"
        )
    return batches


def lose_last_commit(checkpoint: Path) -> int:
    """What a driver that dies after the sink's write, before the commit, leaves:
    the batch's ``offsets/N`` without its ``commits/N``. Spark replays batch N."""
    commits = checkpoint / "commits"
    last = max(int(path.name) for path in commits.iterdir() if path.name.isdigit())
    (commits / str(last)).unlink()
    (commits / f".{last}.crc").unlink(missing_ok=True)  # Hadoop's checksum file
    return last


async def apply_totals(queue: str, ledger: Path, written: int) -> tuple[int, int]:
    """Consume the ``written`` totals with the inbox: (applied, skipped as copies)."""
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
            stats = consumer.stats()
    finally:
        await store.close()
    return stats.acked, stats.duplicates


async def queued(queue: str) -> int:
    """Messages ready in ``queue`` (a passive declare)."""
    connection = await aio_pika.connect(URL)
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, passive=True)
        return declared.declaration_result.message_count or 0


async def drain_ids(queue: str) -> list[str]:
    """The message ids of what ``queue`` holds, taking the messages."""
    connection = await aio_pika.connect(URL)
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, passive=True)
        ids = []
        while (message := await declared.get(no_ack=True, fail=False)) is not None:
            ids.append(str(message.message_id))
        return ids


async def setup(names: Names) -> None:
    await declare_stream(URL, names.stream, max_age="1D")
    await declare_topology(URL, names.totals)  # the work queue, its retry and dead-letter queues
    connection = await aio_pika.connect(URL)
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(names.malformed, durable=True)
    await publish_events(names.stream, 0, FIRST)
    await publish_raw(names.stream, MALFORMED)


async def cleanup(names: Names) -> None:
    connection = await aio_pika.connect(URL)
    async with connection:
        channel = await connection.channel()
        await channel.queue_delete(names.stream)
        await channel.queue_delete(names.malformed)
        await delete_topology(channel, QueueTopology(names.totals))


def spark_session() -> SparkSession:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # executors run this Python
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("reliable_mq-stream-pipeline")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    register_data_source(spark)
    return spark


def main() -> None:
    spark = spark_session()
    suffix = uuid.uuid4().hex[:8]
    names = Names(
        f"example.orders.stream.{suffix}",
        f"example.order-totals.{suffix}",
        f"example.orders.malformed.{suffix}",
    )
    try:
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint, ledger = Path(tmp) / "checkpoint", Path(tmp) / "ledger.db"
            with sqlite3.connect(ledger) as conn:
                conn.execute("CREATE TABLE ledger (order_id INTEGER, cents INTEGER)")
            asyncio.run(setup(names))
            print("run 1:")
            first = run_query(spark, names, checkpoint)
            lost = lose_last_commit(checkpoint)
            print(f"  ...and the driver dies before committing batch {lost} (commits/{lost} gone)")
            asyncio.run(publish_events(names.stream, FIRST, LATER))
            print("run 2, from the checkpoint:")
            second = run_query(spark, names, checkpoint)
            runs = first + second
            written = sum(batch.good for batch in runs)
            forwarded = sum(batch.malformed for batch in runs)
            in_queue = asyncio.run(queued(names.totals))
            malformed_ids = asyncio.run(drain_ids(names.malformed))
            applied, skipped = asyncio.run(apply_totals(names.totals, ledger, written))
            with sqlite3.connect(ledger) as conn:
                rows, distinct, cents = conn.execute(
                    "SELECT COUNT(*), COUNT(DISTINCT order_id), SUM(cents) FROM ledger"
                ).fetchone()
    finally:
        asyncio.run(cleanup(names))
        spark.stop()
    expected_cents = sum(n * 100 + 25 for n in range(FIRST + LATER))
    print(f"totals written by Spark: {written} (with the replay), {in_queue} in the queue")
    print(f"malformed events forwarded: {forwarded}, {len(set(malformed_ids))} distinct ids")
    print(f"inbox: {applied} applied, {skipped} skipped as copies")
    print(f"ledger: {rows} rows, {distinct} orders, {cents} cents (expected {expected_cents})")
    assert [b.batch_id for b in first] == [lost] == [0], "run 1 is one micro-batch"
    assert [b.batch_id for b in second] == [0, 1], "run 2 replays batch 0, then reads on"
    assert second[0] == first[0], "the replay reads the same offsets, so the same rows"
    assert written == in_queue == FIRST * 2 + LATER, "the replayed batch is written again"
    assert len(malformed_ids) == forwarded == 2 * len(MALFORMED), "malformed: forwarded twice"
    assert len(set(malformed_ids)) == len(MALFORMED), "...under the same ids"
    assert applied == FIRST + LATER and skipped == FIRST, "each copy skipped by the inbox"
    assert rows == distinct == FIRST + LATER and cents == expected_cents, "each order once"


if __name__ == "__main__":
    main()
