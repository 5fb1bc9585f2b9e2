"""Many queues on one consumer: throughput with K queues against one, in one run (issue 22).

One `ReliableConsumer` (its defaults: batched acks, in-memory de-duplication,
a no-op handler) serves K queues, one channel each. Once it has started, a
publisher in a child process publishes ``--messages`` persistent messages
spread round-robin over the K queues (pika, no confirms: see `publish`), so
messages are published and consumed at once. The rate is measured from the
first delivery to the last one handled. For each K (default 1, 50 and 200,
interleaved round after round) the table shows medians of:

* the rate, and its ratio to K = 1 of the same run (issue 22's target: K = 200
  at 0.8x or more);
* client CPU per delivery (this process) and broker CPU per delivery (the
  process listening on the broker's port, read from /proc);
* ack frames per delivery (the consumer's ``ack_frames`` over the deliveries);
* start-up: seconds for ``consumer.start()`` (connect, declare K topologies,
  open K channels, consume), and per queue;
* RSS per queue: the measuring process's resident memory after start-up less
  before the consumer was made, over K (each measurement runs in a fresh
  process; for K = 1 it includes what the first connection imports and
  allocates);
* idle CPU: this process's CPU over ``--idle`` seconds after the drain, with
  every queue empty, in percent of one core.

    .venv/bin/python bench/many_queues.py                          # 20,000 messages, 3 rounds
    .venv/bin/python bench/many_queues.py --rounds 1 --messages 5000   # a quick check
    .venv/bin/python bench/many_queues.py --queues 1 200 --json many.json

It prints which reliable_mq it imported (path and commit), like every bench
(see ``bench/_provenance.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import os
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, cast

import _provenance
import aio_pika
import pika
from consume import URL, broker_cpu_seconds
from prometheus_client import CollectorRegistry

import reliable_mq
from reliable_mq.consumer import ReliableConsumer
from reliable_mq.topology import QueueTopology, delete_topology


@dataclass
class Sample:
    rate: float
    client_us: float
    broker_us: float | None
    ack_frames_per_msg: float
    startup_s: float
    rss_kb_per_queue: float
    idle_cpu_pct: float


def rss_kb() -> int:
    """This process's resident set size in KiB (VmRSS)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def publish(queues: list[str], count: int, size: int) -> None:
    """The child process: ``count`` persistent messages round-robin over ``queues``.

    pika's ``BlockingConnection`` without confirms: the cheapest publisher in
    Python, so that the consumer, not the publisher, bounds the rate (an
    aiormq publisher with confirms makes about 3,000 msgs/s here). A message the
    broker did not take would show as a drain that never ends (``--timeout``).
    """
    connection = pika.BlockingConnection(pika.URLParameters(URL))
    try:
        channel = connection.channel()
        body = os.urandom(size // 2).hex().encode()[:size]
        for i in range(count):
            channel.basic_publish(
                "",
                queues[i % len(queues)],
                body,
                pika.BasicProperties(
                    delivery_mode=2,
                    content_type="application/octet-stream",
                    message_id=f"m{i}",
                ),
            )
    finally:
        connection.close()


class Clock:
    """First-to-last delivery timing, with this process's and the broker's CPU."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.count = 0
        self.first = self.last = 0.0
        self.cpu_first = self.cpu_last = 0.0
        self.broker_first: float | None = None
        self.broker_last: float | None = None
        self.done = asyncio.Event()

    def tick(self) -> None:
        if not self.count:
            self.first = time.perf_counter()
            self.cpu_first = time.process_time()
            self.broker_first = broker_cpu_seconds()
        self.count += 1
        if self.count == self.expected:
            self.last = time.perf_counter()
            self.cpu_last = time.process_time()
            self.broker_last = broker_cpu_seconds()
            self.done.set()


async def measure(k: int, args: argparse.Namespace) -> Sample:
    run = uuid.uuid4().hex[:8]
    queues = [f"bench-many-{run}-{i}" for i in range(k)]
    clock = Clock(args.messages)
    rss_before = rss_kb()
    consumer = ReliableConsumer(URL, prefetch=args.prefetch, registry=CollectorRegistry())

    async def handler(body: bytes) -> None:
        clock.tick()

    for queue in queues:
        consumer.add_handler(queue, handler)
    try:
        started = time.perf_counter()
        await consumer.start()
        startup = time.perf_counter() - started
        rss_after = rss_kb()
        profile = cProfile.Profile() if args.profile else None
        if profile is not None:
            profile.enable()
        publisher = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--publish",
            *("--messages", str(args.messages), "--size", str(args.size)),
            *queues,
        )
        try:
            async with asyncio.timeout(args.timeout):
                await clock.done.wait()
        finally:
            if profile is not None:
                profile.disable()
                profile.dump_stats(f"{args.profile}.K{k}")
            await publisher.wait()
        await asyncio.sleep(0.2)  # let the last batched acks go out before the idle window
        if profile is not None:
            profile = cProfile.Profile()
            profile.enable()
        idle_cpu = time.process_time()
        idle_wall = time.perf_counter()
        await asyncio.sleep(args.idle)
        if profile is not None:
            profile.disable()
            profile.dump_stats(f"{args.profile}.K{k}.idle")
        idle_pct = 100 * (time.process_time() - idle_cpu) / (time.perf_counter() - idle_wall)
        ack_frames = consumer.stats().ack_frames
    finally:
        await consumer.stop()
        await delete_queues(queues)
    deliveries = max(clock.count - 1, 1)
    broker = None
    if clock.broker_first is not None and clock.broker_last is not None:
        broker = 1e6 * (clock.broker_last - clock.broker_first) / deliveries
    return Sample(
        rate=deliveries / (clock.last - clock.first),
        client_us=1e6 * (clock.cpu_last - clock.cpu_first) / deliveries,
        broker_us=broker,
        ack_frames_per_msg=ack_frames / clock.count,
        startup_s=startup,
        rss_kb_per_queue=(rss_after - rss_before) / k,
        idle_cpu_pct=idle_pct,
    )


async def delete_queues(queues: list[str]) -> None:
    connection = await aio_pika.connect(URL)
    try:
        channel = await connection.channel()
        for queue in queues:
            await delete_topology(channel, QueueTopology(queue))
    finally:
        await connection.close()


async def measure_in_child(k: int, args: argparse.Namespace) -> Sample:
    """`measure` in a fresh process, so that its RSS starts clean (memory a
    previous measurement freed would be reused and hide the growth)."""
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        *("--child", str(k), "--messages", str(args.messages)),
        *("--prefetch", str(args.prefetch), "--size", str(args.size)),
        *("--idle", str(args.idle), "--timeout", str(args.timeout)),
        *(["--profile", args.profile] if args.profile else []),
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await child.communicate()
    if child.returncode:
        raise RuntimeError(f"the measurement of K={k} exited {child.returncode}")
    return Sample(**json.loads(out.decode().strip().splitlines()[-1]))


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


async def main(args: argparse.Namespace) -> None:
    origin = _provenance.origin(reliable_mq, args.label)
    print(_provenance.describe(origin), flush=True)
    samples: dict[int, list[Sample]] = {k: [] for k in args.queues}
    load_before = os.getloadavg()
    for round_no in range(args.rounds):
        for k in args.queues:
            sample = await measure_in_child(k, args)
            samples[k].append(sample)
            print(
                f"round {round_no + 1}: K={k:<4} {sample.rate:>9,.0f} msgs/s "
                f"{sample.client_us:>6.1f} us client CPU/msg, "
                f"{sample.ack_frames_per_msg:.3f} ack frames/msg, start {sample.startup_s:.2f} s",
                flush=True,
            )
    load_after = os.getloadavg()
    base = statistics.median(s.rate for s in samples[args.queues[0]])
    print()
    print(
        f"many queues: {args.messages:,} persistent {args.size}-byte messages spread over K "
        f"queues, published (child process) and consumed at once, prefetch {args.prefetch}, "
        f"{args.rounds} interleaved round(s), medians; load average {load_before[0]:.2f} "
        f"before, {load_after[0]:.2f} after ({os.cpu_count()} CPUs)\n"
        f"{_provenance.describe(origin)}"
    )
    header = (
        f"{'K':>5} {'msgs/s':>9} {f'vs K={args.queues[0]}':>8} {'client µs/msg':>14} "
        f"{'broker µs/msg':>14} {'acks/msg':>9} {'start s':>8} {'ms/queue':>9} "
        f"{'RSS KiB/queue':>14} {'idle CPU %':>11}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for k, found in samples.items():
        rate = statistics.median(s.rate for s in found)
        row: dict[str, Any] = {
            "queues": k,
            "rate": rate,
            "vs_first": rate / base,
            **{
                key: _median([getattr(s, key) for s in found])
                for key in Sample.__dataclass_fields__
                if key != "rate"
            },
            "rounds": [s.__dict__ for s in found],
        }
        rows.append(row)
        broker = row["broker_us"]
        broker_text = f"{broker:>14.1f}" if broker is not None else f"{'n/a':>14}"
        print(
            f"{k:>5} {rate:>9,.0f} {rate / base:>7.2f}x {row['client_us']:>14.1f} {broker_text} "
            f"{row['ack_frames_per_msg']:>9.3f} {row['startup_s']:>8.2f} "
            f"{1000 * row['startup_s'] / k:>9.1f} {row['rss_kb_per_queue']:>14.0f} "
            f"{row['idle_cpu_pct']:>11.1f}"
        )
    if args.json:
        with open(args.json, "w") as out:  # noqa: ASYNC230 - once, after the measurements
            json.dump(
                {
                    "bench": "many_queues",
                    "label": origin["label"],
                    "reliable_mq": origin,
                    "messages": args.messages,
                    "prefetch": args.prefetch,
                    "size": args.size,
                    "rounds": args.rounds,
                    "load": [load_before[0], load_after[0]],
                    "rows": rows,
                },
                out,
                indent=2,
            )


def cli() -> None:
    parser = argparse.ArgumentParser(description=cast(str, __doc__).splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--queues", type=int, nargs="+", default=[1, 50, 200], help="each K")
    parser.add_argument(
        "--prefetch", type=int, default=200, help="basic.qos per channel (reliable_mq's default)"
    )
    parser.add_argument("--size", type=int, default=256, help="body bytes")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians")
    parser.add_argument("--idle", type=float, default=2.0, help="seconds of idle CPU sampling")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per drain")
    parser.add_argument("--label", help="a name for this run in the JSON (default: the commit)")
    parser.add_argument("--json", help="also write the medians to this file")
    parser.add_argument(
        "--profile", help="cProfile each drain (start to last delivery) into PROFILE.K<k>"
    )
    parser.add_argument("--publish", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("names", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.publish:
        publish(args.names, args.messages, args.size)
    elif args.child:
        sample = asyncio.run(measure(args.child, args))
        print(json.dumps(sample.__dict__), flush=True)
    else:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(main(args))


if __name__ == "__main__":
    cli()
