"""Profile the consumer's per-delivery path: client CPU, loop work and Tasks per delivery.

Pre-fills a fresh queue (reliable_mq's topology) with ``--messages``
persistent 256-byte messages, then drains it through a ``ReliableConsumer``
with a no-op handler, its defaults otherwise (batched acks, memory
de-duplication; ``--dedup off`` turns that off, ``--batch`` uses a no-op batch
handler instead). Each pass measures from the first delivery handled to the
last one:

1. ``--rounds`` *counting* passes, without a profiler: client CPU per delivery
   (``time.process_time``, the median of the rounds), event-loop iterations,
   ``call_soon`` calls, timers and asyncio Tasks per delivery (the loop wrapped
   as in ``bench/profile_publish.py``);
2. a *profile* pass under cProfile, enabled at the first delivery and disabled
   at the last: the share of busy time per package and the top functions by own
   time, in µs per delivery. cProfile inflates code with many small calls: read
   its figures as a comparison between trees, and the counting pass's CPU as
   the measurement.

To compare two trees in one run, give ``--tree`` more than once: each tree is
measured in a child process (``PYTHONPATH`` set to it), the trees alternating
round by round, and a table of the medians follows:

    .venv/bin/python bench/profile_consume.py --messages 20000
    .venv/bin/python bench/profile_consume.py --tree /work/main --tree . --rounds 3 --no-profile
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any

import _provenance
import aio_pika
from consume import URL, prefill
from profile_publish import GROUPS, Instruments, shares, top
from prometheus_client import CollectorRegistry

import reliable_mq
from reliable_mq.consumer import ReliableConsumer
from reliable_mq.topology import QueueTopology, declare_topology, delete_topology

PORT = int(URL.rsplit(":", 1)[-1].split("/", 1)[0] or 5672)


class Window:
    """Counts deliveries; runs ``start`` at the first and ``stop`` at the last."""

    def __init__(self, expected: int, start: Any, stop: Any) -> None:
        self.expected = expected
        self.count = 0
        self.start, self.stop = start, stop
        self.done = asyncio.Event()

    def tick(self) -> None:
        self.count += 1
        if self.count == 1:
            self.start()
        elif self.count == self.expected:
            self.stop()
            self.done.set()


async def one_pass(args: argparse.Namespace, start: Any, stop: Any) -> None:
    queue = f"bench-profile-consume-{uuid.uuid4().hex[:8]}"
    topology = QueueTopology(queue)
    connection = await aio_pika.connect(URL)
    await declare_topology(await connection.channel(), topology)
    await connection.close()
    await prefill(queue, args.messages, 256, dict(topology.work_queue_arguments()))
    window = Window(args.messages, start, stop)
    consumer = ReliableConsumer(
        URL,
        prefetch=args.prefetch,
        registry=CollectorRegistry(),
        dedup=None if args.dedup == "off" else "memory",
    )
    if args.batch:

        async def many(bodies: list[bytes]) -> None:
            for _ in bodies:
                window.tick()

        consumer.add_batch_handler(queue, many, max_size=min(100, args.prefetch))
    else:

        async def handler(body: bytes) -> None:
            window.tick()

        consumer.add_handler(queue, handler)
    try:
        async with consumer:
            await window.done.wait()
    finally:
        connection = await aio_pika.connect(URL)
        await delete_topology(await connection.channel(), topology)
        await connection.close()


async def counting_pass(args: argparse.Namespace) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    instruments = Instruments(loop, PORT)
    cpu: list[float] = []
    await one_pass(
        args,
        lambda: cpu.append(time.process_time()) or instruments.__enter__(),
        lambda: (cpu.append(time.process_time()), instruments.__exit__(None, None, None)),
    )
    counts, n = instruments.counts, args.messages - 1
    return {
        "cpu_us": (cpu[1] - cpu[0]) / n * 1e6,
        "loop_iterations": counts.loop_iterations / n,
        "call_soon": counts.call_soon / n,
        "timers": counts.timers / n,
        "tasks": counts.tasks / n,
        "socket_writes": counts.socket_writes / n,
    }


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    found = _provenance.origin(reliable_mq, args.label)
    GROUPS["reliable_mq"] = found["path"] + os.sep
    rounds = [await counting_pass(args) for _ in range(args.rounds)]
    result: dict[str, Any] = {
        "reliable_mq": found,
        "rounds": rounds,
        "per_delivery": {key: statistics.median(r[key] for r in rounds) for key in rounds[0]},
    }
    if not args.no_profile:
        profile = cProfile.Profile()
        await one_pass(args, profile.enable, profile.disable)
        stats = pstats.Stats(profile)
        share, busy, waiting = shares(stats)
        result["profile"] = {
            "busy_us_per_delivery": busy / args.messages * 1e6,
            "wait_seconds": waiting,
            "shares": share,
        }
        result["top"] = top(stats, args.top, args.messages)
    return result


def show(result: dict[str, Any], messages: int) -> None:
    print(_provenance.describe(result["reliable_mq"]))
    for key, value in result["per_delivery"].items():
        print(f"  {key:<18} {value:>10.3f} per delivery")
    if "profile" not in result:
        return
    prof = result["profile"]
    print(f"cProfile: {prof['busy_us_per_delivery']:.1f} µs busy per delivery; shares:")
    for name, value in sorted(prof["shares"].items(), key=lambda kv: -kv[1]):
        print(f"  {name:<18} {value:>6.1%}")
    print(f"{'calls':>10} {'tottime s':>10} {'µs/msg':>8} {'cumtime s':>10}  function")
    for row in result["top"]:
        print(
            f"{row['calls']:>10,} {row['tottime']:>10.3f} {row['us_per_message']:>8.2f} "
            f"{row['cumtime']:>10.3f}  {row['function']}"
        )


def compare(args: argparse.Namespace) -> None:
    """Each tree in a child process, alternating round by round; medians per tree."""
    trees = [os.path.abspath(tree) for tree in args.tree]
    cpu: dict[str, list[float]] = {tree: [] for tree in trees}
    for round_no in range(args.rounds):
        for tree in trees if round_no % 2 == 0 else trees[::-1]:
            argv = [sys.executable, os.path.abspath(__file__), "--child", "--rounds", "1"]
            argv += ["--messages", str(args.messages), "--prefetch", str(args.prefetch)]
            argv += ["--dedup", args.dedup, *(["--batch"] if args.batch else [])]
            argv += [] if args.profile_children else ["--no-profile"]
            env = {**os.environ, "PYTHONPATH": tree}
            out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
            result = json.loads(out.stdout.splitlines()[-1])
            cpu[tree].append(result["per_delivery"]["cpu_us"])
            print(f"round {round_no + 1}: {tree:<40} {cpu[tree][-1]:>7.1f} µs client CPU/delivery")
            if args.profile_children:
                show(result, args.messages)
    print(f"\n{'tree':<40} {'median µs/delivery':>19} rounds")
    for tree in trees:
        values = " ".join(f"{v:.1f}" for v in cpu[tree])
        print(f"{tree:<40} {statistics.median(cpu[tree]):>19.1f} {values}")


async def main(args: argparse.Namespace) -> None:
    result = await measure(args)
    if args.child:
        print(json.dumps(result))
        return
    mode = "batch handler" if args.batch else "single handler"
    print(
        f"profile_consume: {args.messages:,} persistent 256-byte messages, prefetch "
        f"{args.prefetch}, dedup {args.dedup}, {mode}, {args.rounds} counting round(s)"
    )
    show(result, args.messages)
    if args.json:
        with open(args.json, "w") as out:  # noqa: ASYNC230 - once, after the measurements
            json.dump(result, out, indent=2)


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--prefetch", type=int, default=200)
    parser.add_argument("--dedup", choices=("memory", "off"), default="memory")
    parser.add_argument("--batch", action="store_true", help="a no-op batch handler")
    parser.add_argument("--rounds", type=int, default=3, help="counting passes; median")
    parser.add_argument("--top", type=int, default=25, help="functions to list by own time")
    parser.add_argument("--no-profile", action="store_true", help="the counting passes only")
    parser.add_argument("--tree", action="append", help="compare trees (repeat), child per run")
    parser.add_argument("--profile-children", action="store_true", help="with --tree: profile")
    parser.add_argument("--label", help="a name for this run in the JSON (default: the commit)")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tree:
        compare(args)
    else:
        asyncio.run(main(args))


if __name__ == "__main__":
    cli()
