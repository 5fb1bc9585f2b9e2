"""Rows per second read from one stream: pika, `StreamReader`, Spark batch and streaming reads.

All against the real broker, in one run, on one stream of ``--messages``
messages of 100 bytes (published once, with confirms). Each round measures,
in an order that rotates from round to round:

* ``pika``: a plain pika consumer draining the stream (prefetch 1000,
  multiple acks): the reference;
* ``reader``: `StreamReader.read` over the whole range, in this process;
* ``spark_batch``: ``spark.read.format("rabbitmq")`` (``numPartitions`` 2)
  written to the ``noop`` sink, planning included;
* ``spark_stream_1``: ``spark.readStream`` with ``Trigger.AvailableNow`` into
  the ``noop`` sink, a new checkpoint, one micro-batch; from ``start()`` to the
  query's end;
* ``spark_stream_n``: the same with ``maxRecordsPerTrigger`` cutting the read
  into ``--triggers`` micro-batches.

The figures are the medians over ``--rounds``, and each one's ratio to pika.
The streaming reads also give their rate over their triggers only (Spark's
``triggerExecution``, without the query's start) and the time per trigger
(Spark's ``durationMs``: ``latestOffset``, the source's planning on the
driver; ``addBatch``, the tasks), medians over their triggers. Spark's JVM is warmed up by one batch
read first, not counted. Run it from the repository's root::

    PYTHONPATH=$PWD .venv/bin/python bench/stream_read.py --messages 100000 --json out.json

The machine's load average is printed with the figures: the rates follow it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _provenance import origin
from pyspark.sql import SparkSession
from stream_source_crash import URL, _delete, _pika_drain, _publish

import reliable_mq
from reliable_mq.spark import register_data_source
from reliable_mq.streams import OffsetRange, StreamReader

_NOT_MS = ("triggers", "rows_per_s_over_triggers")


def _reader(url: str, stream: str, count: int) -> float:
    async def read() -> float:
        async with StreamReader(url, stream) as reader:
            started = time.monotonic()
            seen = 0
            async for _record in reader.read(OffsetRange(stream, 0, count)):
                seen += 1
            elapsed = time.monotonic() - started
        if seen != count:
            raise SystemExit(f"the reader read {seen} of {count}")
        return elapsed

    return asyncio.run(read())


def _spark_batch(spark: SparkSession, url: str, stream: str, count: int) -> float:
    started = time.monotonic()
    frame = (
        spark.read.format("rabbitmq")
        .option("url", url)
        .option("stream", stream)
        .option("numPartitions", "2")
        .load()
    )
    frame.write.format("noop").mode("overwrite").save()
    return time.monotonic() - started


def _spark_stream(
    spark: SparkSession, url: str, stream: str, count: int, triggers: int, sink: dict[str, Any]
) -> float:
    """Seconds from ``start()`` to the end of an AvailableNow query reading the stream."""
    with tempfile.TemporaryDirectory(prefix="stream-read-") as folder:
        reader = (
            spark.readStream.format("rabbitmq")
            .option("url", url)
            .option("stream", stream)
            .option("numPartitions", "2")
        )
        if triggers > 1:
            reader = reader.option("maxRecordsPerTrigger", str(-(-count // triggers)))
        started = time.monotonic()
        query = (
            reader.load()
            .writeStream.format("noop")
            .option("checkpointLocation", str(Path(folder) / "cp"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()
        elapsed = time.monotonic() - started
        batches = [p for p in query.recentProgress if p["numInputRows"]]
    rows = sum(int(p["numInputRows"]) for p in batches)
    if rows != count:
        raise SystemExit(f"the streaming query read {rows} of {count}")
    sink.setdefault("rows_per_s_over_triggers", []).append(
        rows * 1000 / sum(p["durationMs"]["triggerExecution"] for p in batches)
    )
    for phase in ("latestOffset", "queryPlanning", "addBatch", "triggerExecution"):
        sink.setdefault(phase, []).extend(p["durationMs"].get(phase, 0) for p in batches)
    sink.setdefault("triggers", []).append(len(batches))
    return elapsed


def _session(master: str) -> SparkSession:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (
        SparkSession.builder.master(master)
        .appName("stream-read")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    register_data_source(spark)
    return spark


def measure(args: argparse.Namespace) -> dict[str, Any]:
    stream = f"stream-read-{uuid.uuid4().hex[:8]}"
    count = args.messages
    spark = _session(args.master)
    phases: dict[str, dict[str, Any]] = {"spark_stream_1": {}, "spark_stream_n": {}}
    runs: dict[str, Callable[[], float]] = {
        "pika": lambda: _pika_drain(args.url, stream, count),
        "reader": lambda: _reader(args.url, stream, count),
        "spark_batch": lambda: _spark_batch(spark, args.url, stream, count),
        "spark_stream_1": lambda: _spark_stream(
            spark, args.url, stream, count, 1, phases["spark_stream_1"]
        ),
        "spark_stream_n": lambda: _spark_stream(
            spark, args.url, stream, count, args.triggers, phases["spark_stream_n"]
        ),
    }
    rates: dict[str, list[float]] = {name: [] for name in runs}
    loads: list[float] = []
    try:
        _publish(args.url, stream, count)
        _spark_batch(spark, args.url, stream, count)  # JVM warm-up
        names = list(runs)
        for round_ in range(args.rounds):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            for name in order:
                rates[name].append(count / runs[name]())
            loads.append(os.getloadavg()[0])
            print(
                f"round {round_ + 1}: "
                + ", ".join(f"{n} {rates[n][-1]:,.0f}" for n in names)
                + f" rows/s (load {loads[-1]:.1f})",
                file=sys.stderr,
            )
    finally:
        _delete(args.url, stream)
        spark.stop()
    medians = {name: round(statistics.median(values)) for name, values in rates.items()}
    return {
        "messages": count,
        "body_bytes": 100,
        "master": args.master,
        "rounds": args.rounds,
        "triggers_n": args.triggers,
        "load_average": [round(x, 1) for x in loads],
        "reliable_mq": origin(reliable_mq),
        "rows_per_s": medians,
        "ratio_to_pika": {
            name: round(
                statistics.median(r / p for r, p in zip(rates[name], rates["pika"], strict=True)), 2
            )
            for name in runs
        },
        "per_trigger_ms": {
            run: {k: statistics.median(v) for k, v in found.items() if k not in _NOT_MS}
            | {"triggers": found.get("triggers", [])[:1]}
            for run, found in phases.items()
        },
        "rows_per_s_over_triggers": {
            run: round(statistics.median(found["rows_per_s_over_triggers"]))
            for run, found in phases.items()
        },
        "all_rows_per_s": {name: [round(v) for v in values] for name, values in rates.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=URL)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--triggers", type=int, default=10)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    report = measure(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
