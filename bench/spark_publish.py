"""Benchmark: one plain ReliablePublisher process vs publish_dataframe on local Spark.

Both publish the same rows (an id and a ~200-byte payload, JSON bodies,
uuid5 ids, persistent messages, confirms) to a fresh durable queue on the
broker, which is purged between runs. The Spark session is started, and warmed
up by one tiny job, before the clock starts; that time is printed separately.

It measures whichever ``reliable_mq`` is importable and prints where it
came from (on the driver and in a Spark worker), so one session can compare two
versions of the code with one virtualenv. Run it from the root of the version
to measure, with that root on ``PYTHONPATH`` (Spark's workers put their working
directory first on ``sys.path``, the driver takes ``PYTHONPATH``)::

    cd /work/main && PYTHONPATH=$PWD .venv/bin/python bench/spark_publish.py --label after
    mkdir -p /tmp/rmq-before && git archive <old commit> | tar -x -C /tmp/rmq-before
    cd /tmp/rmq-before && PYTHONPATH=$PWD /work/main/.venv/bin/python \
        /work/main/bench/spark_publish.py --label before
    # options: --rows 200000 (default) --partitions 2 --repeat 3

The bench stops if the driver and the workers import different copies.

The workload and the ``PublishSpec`` it uses are the same in every version
since issue 5 (``key_columns=("id",)``), so the figures compare like with like.
Absolute rates on a shared 2-core machine drift by 25% or more between runs;
compare runs taken back to back on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections import deque
from pathlib import Path

import aio_pika
from prometheus_client import CollectorRegistry
from pyspark.sql import SparkSession

import reliable_mq
from reliable_mq import PendingPublish, PublisherSettings, ReliablePublisher
from reliable_mq.spark import PublishSpec, publish_dataframe

PAYLOAD_SIZE = 200


def _payload(i: int) -> str:
    return f"row-{i:010d}-".ljust(PAYLOAD_SIZE, "x")


async def _reset_queue(url: str, queue: str, *, delete: bool = False) -> None:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        if delete:
            await channel.queue_delete(queue)
            return
        declared = await channel.declare_queue(queue, durable=True)
        await declared.purge()


async def _plain(url: str, queue: str, rows: int, max_in_flight: int) -> float:
    """One process, one connection: the same per-row work as a Spark partition does."""
    namespace = uuid.uuid5(uuid.NAMESPACE_URL, "bench-spark")
    settings = PublisherSettings(max_in_flight=max_in_flight)
    started = time.perf_counter()
    async with ReliablePublisher(url, settings=settings, registry=CollectorRegistry()) as pub:
        in_flight: deque[PendingPublish] = deque()
        for i in range(rows):
            key = json.dumps({"id": i}, sort_keys=True, separators=(",", ":"))
            body = json.dumps({"id": i, "payload": _payload(i)}, separators=(",", ":")).encode()
            in_flight.append(
                await pub.enqueue(
                    body,
                    routing_key=queue,
                    message_id=str(uuid.uuid5(namespace, key)),
                    headers={"x-spark-partition": 0, "x-spark-task-attempt": 0},
                    content_type="application/json",
                )
            )
            while in_flight and in_flight[0].done():
                in_flight.popleft().result()
        for pending in in_flight:
            await pending
        assert pub.stats().confirmed == rows
    return time.perf_counter() - started


def _source() -> str:
    """Where the imported reliable_mq lives, and its git commit if it is a checkout."""
    root = Path(reliable_mq.__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "?"
    return f"{root} @ {commit}"


def _worker_source(_: object) -> str:
    # Runs in a Spark worker: the module global is that process's reliable_mq.
    return str(Path(reliable_mq.__file__).resolve().parent.parent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--max-in-flight", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=1, help="alternating rounds")
    parser.add_argument("--label", default="", help="a name for this code version")
    args = parser.parse_args()

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    queue = f"bench.spark.{uuid.uuid4().hex[:8]}"
    asyncio.run(_reset_queue(args.url, queue))
    spark = None
    try:
        print(
            f"[{args.label or 'unlabelled'}] reliable_mq from {_source()}\n"
            f"rows={args.rows} master={args.master} partitions={args.partitions} "
            f"repeat={args.repeat} queue={queue}"
        )
        t0 = time.perf_counter()
        spark = (
            SparkSession.builder.master(args.master)
            .appName("reliable_mq-bench")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        # The first job of a session pays 5-10 s of one-off start-up (JVM code
        # generation, Python workers forked and importing reliable_mq): a tiny
        # job takes it here, so the figures below are the steady-state cost.
        # (The lambda refers to PublishSpec, so unpickling it imports reliable_mq.spark.)
        spark.sparkContext.parallelize(range(2), 2).map(lambda _: PublishSpec.__name__).collect()
        print(f"(spark start + warm-up  : {time.perf_counter() - t0:7.2f} s, not counted)")
        workers = set(spark.sparkContext.parallelize(range(2), 2).map(_worker_source).collect())
        driver = str(Path(reliable_mq.__file__).resolve().parent.parent)
        print(f"workers import reliable_mq from {', '.join(sorted(workers))}")
        if workers != {driver}:
            sys.exit(
                f"the workers import another reliable_mq than the driver ({driver}): run from its root"
            )
        df = spark.range(args.rows, numPartitions=args.partitions).selectExpr(
            "id",
            f"rpad(concat('row-', lpad(cast(id AS string), 10, '0'), '-'), {PAYLOAD_SIZE}, 'x') AS payload",
        )
        spec = PublishSpec(
            url=args.url,
            routing_key=queue,
            key_columns=("id",),
            id_namespace="bench-spark",
            publisher=PublisherSettings(max_in_flight=args.max_in_flight),
        )
        ratios: list[float] = []
        spark_rates: list[float] = []
        for round_no in range(1, args.repeat + 1):
            # Spark and plain alternate, so drifting machine load hits both alike.
            plain_s = asyncio.run(_plain(args.url, queue, args.rows, args.max_in_flight))
            plain_rate = args.rows / plain_s
            print(
                f"[{round_no}] plain ReliablePublisher : {plain_s:7.2f} s  {plain_rate:9,.0f} rows/s"
            )
            asyncio.run(_reset_queue(args.url, queue))
            report = publish_dataframe(df, spec)
            assert report.confirmed == args.rows
            asyncio.run(_reset_queue(args.url, queue))
            spark_rate = report.rows / report.seconds
            print(
                f"[{round_no}] spark publish_dataframe : {report.seconds:7.2f} s  {spark_rate:9,.0f} rows/s"
            )
            for part in report.partition_stats:
                print(
                    f"      partition {part.partition}: {part.rows} rows in {part.seconds:.2f} s "
                    f"({part.rows / part.seconds:,.0f} rows/s), republished={part.republished}"
                )
            slowest = max(part.seconds for part in report.partition_stats)
            print(f"      job overhead (wall - slowest task): {report.seconds - slowest:.2f} s")
            ratios.append(spark_rate / plain_rate)
            print(f"[{round_no}] ratio spark/plain       : {ratios[-1]:.2f}x")
            spark_rates.append(spark_rate)
        label = args.label or "unlabelled"
        print(f"[{label}] median publish_dataframe: {statistics.median(spark_rates):,.0f} rows/s")
        if len(ratios) > 1:
            print(f"[{label}] median ratio spark/plain: {statistics.median(ratios):.2f}x")
    finally:
        if spark is not None:
            spark.stop()
        asyncio.run(_reset_queue(args.url, queue, delete=True))


if __name__ == "__main__":
    main()
