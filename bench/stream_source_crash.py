"""Proof: a streaming read whose driver is SIGKILLed mid-batch and restarted reads every message once.

The steps, all against the real broker on ``local[2]``:

1. publish ``--messages`` messages (ids ``m-0 ..``) with confirms into a fresh stream;
2. start a driver (a Python process of its own, with its JVM) running
   ``spark.readStream.format("rabbitmq")`` into a Parquet file sink with a
   checkpoint (``Trigger.AvailableNow``, ``maxRecordsPerTrigger``);
3. once ``--kill-after`` micro-batches are committed and the next one is
   planned (its offsets written, its files being written), SIGKILL the driver's
   whole process group (Python and JVM);
4. start the driver again on the same checkpoint: it replays the planned batch
   and reads on to the end (with ``--fail-offset N --master "local[2,3]"``, the
   first attempt of the task that reads offset N fails, and Spark retries it);
5. read the sink back (Spark's file sink lists only committed files): every
   id once, none missing. Then, for the same stream, the rows per second of a
   plain pika consumer draining it (``x-stream-offset: first``, prefetch 1000,
   multiple acks) beside the source's rate in the restarted run.

Run it from the repository's root::

    PYTHONPATH=$PWD .venv/bin/python bench/stream_source_crash.py --messages 100000

It prints one JSON object; exit status 1 if an id is missing or repeated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aio_pika
import pika
from prometheus_client import CollectorRegistry
from pyspark import TaskContext
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import LongType

from reliable_mq import Message, ReliablePublisher
from reliable_mq.spark import register_data_source
from reliable_mq.streams import declare_stream

URL = "amqp://guest:guest@127.0.0.1:5672/"
ROOT = Path(__file__).resolve().parents[1]


def _publish(url: str, stream: str, count: int) -> float:
    async def send() -> None:
        await declare_stream(url, stream)
        async with ReliablePublisher(url, registry=CollectorRegistry()) as publisher:
            for first in range(0, count, 10_000):
                await publisher.publish_many(
                    Message(
                        f"{n:012d}".ljust(100, "x").encode(),
                        routing_key=stream,
                        message_id=f"m-{n}",
                    )
                    for n in range(first, min(count, first + 10_000))
                )

    started = time.monotonic()
    asyncio.run(send())
    return time.monotonic() - started


def _delete(url: str, stream: str) -> None:
    async def delete() -> None:
        connection = await aio_pika.connect(url)
        async with connection:
            await (await connection.channel()).queue_delete(stream)

    asyncio.run(delete())


def _fail_once(offset: int, folder: Path) -> Any:
    """A UDF that fails the first attempt of the task that reads ``offset`` (a file
    ``injected-*`` in ``folder`` records each failure); Spark retries the task, which
    reads its range again (``local[N,M]``: M attempts)."""

    def check(value: int) -> int:
        context = TaskContext.get()
        if value == offset and context is not None and context.attemptNumber() == 0:
            marker = folder / f"injected-{context.stageId()}-{context.partitionId()}"
            marker.touch()
            raise RuntimeError(f"injected task failure at offset {offset}")
        return value

    return F.udf(check, LongType())


def driver(args: argparse.Namespace) -> None:
    """One driver run: the query until AvailableNow ends; with --verify, the sink's figures."""
    spark = (
        SparkSession.builder.master(args.master)
        .appName("stream-source-crash")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    register_data_source(spark)
    folder = Path(args.folder)
    started = time.monotonic()
    frame = (
        spark.readStream.format("rabbitmq")
        .option("url", args.url)
        .option("stream", args.stream)
        .option("maxRecordsPerTrigger", str(args.per_trigger))
        .option("numPartitions", "2")
        .load()
        .select("stream", "offset", "message_id")
    )
    if args.fail_offset is not None:
        frame = frame.withColumn("offset", _fail_once(args.fail_offset, folder)("offset"))
    query = (
        frame.writeStream.format("parquet")
        .option("path", str(folder / "out"))
        .option("checkpointLocation", str(folder / "cp"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    elapsed = time.monotonic() - started
    batches = [p for p in query.recentProgress if p["numInputRows"]]
    rows = sum(int(p["numInputRows"]) for p in batches)
    busy = sum(p["durationMs"]["triggerExecution"] for p in batches) / 1000
    result: dict[str, Any] = {
        "run_s": round(elapsed, 2),
        "rows_read": rows,
        "batches": len(batches),
        "batches_s": round(busy, 2),
    }
    if args.verify:
        sink = spark.read.parquet(str(folder / "out"))
        ids = sink.select(F.regexp_extract("message_id", r"^m-(\d+)$", 1).cast("long").alias("n"))
        figures = ids.agg(
            F.count("*").alias("rows"),
            F.countDistinct("n").alias("distinct"),
            F.min("n").alias("min"),
            F.max("n").alias("max"),
            F.count(F.when(F.col("n").isNull(), 1)).alias("foreign"),
        ).first()
        assert figures is not None
        result.update(figures.asDict())
    print(json.dumps(result), flush=True)
    spark.stop()


def _start_driver(args: argparse.Namespace, folder: Path, *, verify: bool) -> subprocess.Popen[str]:
    command = [
        sys.executable,
        __file__,
        "--driver",
        "--url",
        args.url,
        "--stream",
        args.stream,
        "--folder",
        str(folder),
        "--per-trigger",
        str(args.per_trigger),
        "--master",
        args.master,
    ]
    if verify:
        command.append("--verify")
    if args.fail_offset is not None:
        command += ["--fail-offset", str(args.fail_offset)]
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True
    )


def _batches(folder: Path, kind: str) -> int:
    directory = folder / "cp" / kind
    if not directory.is_dir():
        return 0
    return sum(1 for p in directory.iterdir() if p.name.isdigit())


def _kill_mid_batch(
    args: argparse.Namespace, folder: Path, timeout: float = 600.0
) -> dict[str, int]:
    """Run the first driver and SIGKILL its process group once batch N+1 is planned."""
    process = _start_driver(args, folder, verify=False)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            committed, planned = _batches(folder, "commits"), _batches(folder, "offsets")
            if committed >= args.kill_after and planned > committed:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                return {"committed_at_kill": committed, "planned_at_kill": planned}
            if process.poll() is not None:
                raise SystemExit(
                    f"the driver ended before it could be killed ({process.returncode})"
                )
            time.sleep(0.05)
        raise SystemExit("no batch was planned in time")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _pika_drain(url: str, stream: str, count: int) -> float:
    """Seconds a plain pika consumer takes to read ``count`` messages of ``stream``."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    channel.basic_qos(prefetch_count=1000)
    seen = 0
    started = time.monotonic()
    for method, _properties, _body in channel.consume(
        stream, arguments={"x-stream-offset": "first"}, inactivity_timeout=30
    ):
        if method is None:
            break
        seen += 1
        if seen % 500 == 0 or seen == count:
            channel.basic_ack(method.delivery_tag, multiple=True)
        if seen == count:
            break
    elapsed = time.monotonic() - started
    channel.cancel()
    connection.close()
    if seen != count:
        raise SystemExit(f"pika read {seen} of {count}")
    return elapsed


def prove(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """The whole proof; its figures (``ok``: every id once, none missing)."""
    args.stream = f"crash-proof-{uuid.uuid4().hex[:8]}"
    report: dict[str, Any] = {"messages": args.messages, "master": args.master}
    try:
        report["publish_s"] = round(_publish(args.url, args.stream, args.messages), 2)
        report.update(_kill_mid_batch(args, folder))
        restart = _start_driver(args, folder, verify=True)
        out, _ = restart.communicate(timeout=900)
        if restart.returncode != 0:
            raise SystemExit(f"the restarted driver failed ({restart.returncode})")
        figures = json.loads(out.strip().splitlines()[-1])
        report["task_failures_injected"] = len(list(folder.glob("injected-*")))
        report.update(figures)
        # the restarted run: from start() to its end (JVM warm-up of the query included),
        # and over its micro-batches only (the steady state)
        report["source_rows_per_s_run"] = round(figures["rows_read"] / figures["run_s"])
        report["source_rows_per_s_batches"] = round(figures["rows_read"] / figures["batches_s"])
        report["missing"] = args.messages - figures["distinct"]
        report["duplicates"] = figures["rows"] - figures["distinct"]
        report["ok"] = (
            report["missing"] == 0
            and report["duplicates"] == 0
            and figures["foreign"] == 0
            and (figures["min"], figures["max"]) == (0, args.messages - 1)
            and (args.fail_offset is None or report["task_failures_injected"] >= 1)
        )
        if args.pika:
            pika_s = _pika_drain(args.url, args.stream, args.messages)
            report["pika_rows_per_s"] = round(args.messages / pika_s)
    finally:
        _delete(args.url, args.stream)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=URL)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--per-trigger", type=int, default=10_000, help="maxRecordsPerTrigger")
    parser.add_argument("--kill-after", type=int, default=2, help="batches committed first")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--folder", help="sink and checkpoint (default: a temporary folder)")
    parser.add_argument(
        "--fail-offset",
        type=int,
        help="fail the first attempt of the task reading this offset (use local[N,M], M > 1)",
    )
    parser.add_argument("--no-pika", dest="pika", action="store_false")
    parser.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--verify", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stream", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.driver:
        driver(args)
        return
    with tempfile.TemporaryDirectory(prefix="stream-crash-") as temporary:
        report = prove(args, Path(args.folder or temporary))
    print(json.dumps(report))
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
