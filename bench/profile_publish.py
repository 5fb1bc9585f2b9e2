"""Profile the confirmed publish path: loop iterations, callbacks, writes and Tasks per message.

Publishes ``--messages`` persistent 256-byte messages to a fresh durable queue
on the local broker, through ``publish_many()`` or ``enqueue()`` + ``flush()``,
twice:

1. a *counting* pass, without a profiler: event-loop iterations (the loop's
   ``_run_once`` wrapped), ``call_soon`` calls (the loop's method wrapped; the
   C Task and Future call it through the attribute too), timers
   (``call_at``/``call_later``), ``transport.write`` calls to the broker (the
   socket sends), asyncio Tasks created (a loop task factory), and process CPU;
2. a *profile* pass under cProfile: the share of busy time (profiled time
   minus the selector's wait) spent in pamqp, reliable_mq, aiormq, aio-pika and
   asyncio, and the top functions by own time. cProfile inflates code with many
   small calls, so read the shares as a comparison between runs, not as a
   measurement.

Only the publishing is measured: the publisher is started and warmed up (a
few hundred messages, so the channel is open and the route probed) before,
and closed after. The figures of the path before issue 12 (``enqueue()`` +
``flush()``, 20,000 messages) are printed alongside. It also runs against an
older reliable_mq (``PYTHONPATH=/tmp/rmq-before``, see docs/performance.md),
which has ``enqueue()`` but no ``publish_many()``:

    .venv/bin/python bench/profile_publish.py --api publish_many --messages 20000
    PYTHONPATH=/tmp/rmq-before .venv/bin/python bench/profile_publish.py --api enqueue
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import os
import pstats
import re
import time
import uuid
from asyncio import selector_events
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import _provenance
import aio_pika
from prometheus_client import CollectorRegistry

import reliable_mq
from reliable_mq import PublisherSettings, ReliablePublisher

URL = os.environ.get("BENCH_URL", "amqp://guest:guest@127.0.0.1:5672/")
BODY = b"x" * 256
WARM_UP = 300

OLD_PATH = {  # issue 12, "Where we are": enqueue() + flush() of 20,000 messages before the rewrite
    "loop_iterations": 60_000 / 20_000,
    "call_soon": 234_000 / 20_000,
    "socket_writes": 1.0,
    "tasks": 1.0,
    "pamqp_share": 0.17,
}

GROUPS = {  # share of busy time: (label, path fragment), first match wins
    "pamqp": f"{os.sep}pamqp{os.sep}",
    "reliable_mq": None,  # the imported package's directory, filled in at start
    "aiormq": f"{os.sep}aiormq{os.sep}",
    "aio_pika": f"{os.sep}aio_pika{os.sep}",
    "asyncio": f"{os.sep}asyncio{os.sep}",
    "prometheus_client": f"{os.sep}prometheus_client{os.sep}",
    "builtins (C)": "~",
}


@dataclass
class Counts:
    loop_iterations: int = 0
    call_soon: int = 0
    timers: int = 0
    socket_writes: int = 0
    bytes_written: int = 0
    tasks: int = 0
    task_names: dict[str, int] = field(default_factory=dict)
    cpu_seconds: float = 0.0
    wall_seconds: float = 0.0


class Instruments:
    """Counters wrapped around one event loop and the selector socket transport."""

    def __init__(self, loop: asyncio.AbstractEventLoop, broker_port: int) -> None:
        self.loop = loop
        self.port = broker_port
        self.counts = Counts()
        self._undo: list[Callable[[], None]] = []

    def __enter__(self) -> Counts:
        loop: Any = self.loop
        counts = self.counts
        if not hasattr(loop, "_run_once"):
            raise SystemExit("profile_publish.py needs asyncio's own event loop (not uvloop)")
        run_once, call_soon, call_at = loop._run_once, loop.call_soon, loop.call_at

        def counted_run_once() -> None:
            counts.loop_iterations += 1
            run_once()

        def counted_call_soon(*args: Any, **kwargs: Any) -> Any:
            counts.call_soon += 1
            return call_soon(*args, **kwargs)

        def counted_call_at(*args: Any, **kwargs: Any) -> Any:
            counts.timers += 1  # call_later goes through call_at
            return call_at(*args, **kwargs)

        def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
            counts.tasks += 1
            name = getattr(coro, "__qualname__", type(coro).__name__)
            counts.task_names[name] = counts.task_names.get(name, 0) + 1
            return asyncio.Task(coro, loop=loop, **kwargs)

        transport_class = selector_events._SelectorSocketTransport
        write = transport_class.write
        port = self.port

        def counted_write(transport: Any, data: Any) -> None:
            peer = transport.get_extra_info("peername")
            if peer is not None and peer[1] == port:
                counts.socket_writes += 1
                counts.bytes_written += len(data)
            write(transport, data)

        previous_factory = loop.get_task_factory()
        loop._run_once = counted_run_once
        loop.call_soon = counted_call_soon
        loop.call_at = counted_call_at
        loop.set_task_factory(factory)
        transport_class.write = counted_write  # type: ignore[method-assign]

        def undo() -> None:
            for name in ("_run_once", "call_soon", "call_at"):
                vars(loop).pop(name, None)
            loop.set_task_factory(previous_factory)
            transport_class.write = write  # type: ignore[method-assign]

        self._undo.append(undo)
        counts.cpu_seconds = time.process_time()
        counts.wall_seconds = time.perf_counter()
        return counts

    def __exit__(self, *exc_info: object) -> None:
        self.counts.cpu_seconds = time.process_time() - self.counts.cpu_seconds
        self.counts.wall_seconds = time.perf_counter() - self.counts.wall_seconds
        while self._undo:
            self._undo.pop()()


def _messages(queue: str, count: int) -> Iterator[Any]:
    message = reliable_mq.Message
    for _ in range(count):
        yield message(BODY, routing_key=queue)


async def _publish(publisher: ReliablePublisher, api: str, queue: str, count: int) -> None:
    if api == "publish_many":
        result = await publisher.publish_many(_messages(queue, count))
        if result.confirmed != count:
            raise SystemExit(f"only {result.confirmed} of {count} confirmed")
        return
    for _ in range(count):
        await publisher.enqueue(BODY, routing_key=queue)
    await publisher.flush()


async def one_pass(
    api: str, count: int, window: int, *, profile: cProfile.Profile | None
) -> Counts | None:
    """Publish ``count`` messages once; count (no profile) or profile them."""
    queue = f"bench-profile-{uuid.uuid4().hex[:8]}"
    loop = asyncio.get_running_loop()
    connection = await aio_pika.connect(URL)
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, durable=True)
        try:
            async with ReliablePublisher(
                URL,
                settings=PublisherSettings(max_in_flight=window),
                registry=CollectorRegistry(),
            ) as publisher:
                await _publish(publisher, "enqueue", queue, WARM_UP)
                if profile is not None:
                    profile.enable()
                    try:
                        await _publish(publisher, api, queue, count)
                    finally:
                        profile.disable()
                    return None
                port = int(URL.rsplit(":", 1)[-1].split("/", 1)[0] or 5672)
                with Instruments(loop, port) as counts:
                    await _publish(publisher, api, queue, count)
                return counts
        finally:
            await declared.delete(if_unused=False, if_empty=False)


def _group(filename: str) -> str:
    for name, fragment in GROUPS.items():
        if fragment == "~" and filename == "~":
            return name
        if fragment is not None and fragment != "~" and fragment in filename:
            return name
    return "other"


def shares(stats: pstats.Stats) -> tuple[dict[str, float], float, float]:
    """Busy-time share per group, busy seconds, and the selector's wait seconds."""
    table: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    total = 0.0
    waiting = 0.0
    by_group: dict[str, float] = {}
    for (filename, _, name), (_, _, tottime, _, _) in table.items():
        total += tottime
        if filename == "~" and "poll" in name and "select" in name:
            waiting += tottime
            continue
        group = _group(filename)
        by_group[group] = by_group.get(group, 0.0) + tottime
    busy = max(total - waiting, 1e-9)
    return {name: value / busy for name, value in by_group.items()}, busy, waiting


def top(stats: pstats.Stats, count: int, messages: int) -> list[dict[str, Any]]:
    table: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    rows = sorted(table.items(), key=lambda item: item[1][2], reverse=True)[:count]
    found = []
    for (filename, line, name), (_, calls, tottime, cumtime, _) in rows:
        where = name if filename == "~" else f"{_short(filename)}:{line}({name})"
        found.append(
            {
                "function": where,
                "calls": calls,
                "tottime": tottime,
                "cumtime": cumtime,
                "us_per_message": tottime / messages * 1e6,
            }
        )
    return found


def _short(filename: str) -> str:
    """A path short enough to read: from the package on (site-packages, stdlib, this repo)."""
    if "site-packages" + os.sep in filename:
        return filename.split("site-packages" + os.sep, 1)[1]
    stdlib = re.search(r"python3\.\d+" + re.escape(os.sep), filename)
    if stdlib is not None:
        return filename[stdlib.end() :]
    with contextlib.suppress(ValueError):
        return os.path.relpath(filename, GROUPS["reliable_mq"] + os.pardir)
    return filename


async def main(args: argparse.Namespace) -> None:
    found = _provenance.origin(reliable_mq, args.label)
    GROUPS["reliable_mq"] = found["path"] + os.sep
    print(_provenance.describe(found))
    if args.api == "publish_many" and not hasattr(ReliablePublisher, "publish_many"):
        raise SystemExit(
            "this reliable_mq has no publish_many(); use --api enqueue (the path before issue 12)"
        )
    n = args.messages
    print(
        f"profile: {args.api}, {n:,} persistent {len(BODY)}-byte messages, window {args.window}, "
        f"durable queue, after {WARM_UP} warm-up messages; loop: asyncio"
    )
    counts = await one_pass(args.api, n, args.window, profile=None)
    assert counts is not None
    per = {
        "loop_iterations": counts.loop_iterations / n,
        "call_soon": counts.call_soon / n,
        "timers": counts.timers / n,
        "socket_writes": counts.socket_writes / n,
        "tasks": counts.tasks / n,
        "cpu_us": counts.cpu_seconds / n * 1e6,
    }
    print()
    header = f"{'per message':<28} {'this run':>12} {'total':>12} {'before (issue 12)':>18}"
    print(header)
    print("-" * len(header))
    lines = [
        ("event-loop iterations", "loop_iterations", counts.loop_iterations),
        ("call_soon calls", "call_soon", counts.call_soon),
        ("timers (call_at/later)", "timers", counts.timers),
        ("socket writes", "socket_writes", counts.socket_writes),
        ("asyncio Tasks created", "tasks", counts.tasks),
    ]
    for title, key, total in lines:
        old = OLD_PATH.get(key)
        old_text = f"{old:>18.2f}" if old is not None else f"{'-':>18}"
        print(f"{title:<28} {per[key]:>12.3f} {total:>12,} {old_text}")
    print(f"{'client CPU (µs)':<28} {per['cpu_us']:>12.1f} {counts.cpu_seconds:>11.2f}s {'-':>18}")
    print(
        f"{'messages per socket write':<28} {n / max(counts.socket_writes, 1):>12.1f} "
        f"{counts.bytes_written:>11,}B {'1.00':>18}"
    )
    if counts.task_names:
        named = ", ".join(f"{k} x{v}" for k, v in sorted(counts.task_names.items()))
        print(f"Tasks: {named}")
    result: dict[str, Any] = {
        "bench": "profile_publish",
        "label": found["label"],
        "api": args.api,
        "messages": n,
        "window": args.window,
        "reliable_mq": found,
        "counts": asdict(counts),
        "per_message": per,
        "before_issue_12": OLD_PATH,
    }
    if not args.no_profile:
        profile = cProfile.Profile()
        await one_pass(args.api, n, args.window, profile=profile)
        stats = pstats.Stats(profile)
        share, busy, waiting = shares(stats)
        print()
        print(
            f"cProfile pass: {busy:.2f} s busy, {waiting:.2f} s waiting in the selector; "
            "share of busy time:"
        )
        for name in (*GROUPS, "other"):
            old = " (before: ~17%)" if name == "pamqp" else ""
            print(f"  {name:<18} {share.get(name, 0.0):>6.1%}{old}")
        print()
        print(f"top {args.top} functions by own time (the selector's poll is its wait):")
        print(f"{'calls':>10} {'tottime s':>10} {'µs/msg':>8} {'cumtime s':>10}  function")
        rows = top(stats, args.top, n)
        for row in rows:
            print(
                f"{row['calls']:>10,} {row['tottime']:>10.3f} {row['us_per_message']:>8.2f} "
                f"{row['cumtime']:>10.3f}  {row['function']}"
            )
        result["profile"] = {"busy_seconds": busy, "wait_seconds": waiting, "shares": share}
        result["top"] = rows
    if args.json:
        with open(args.json, "w") as out:  # noqa: ASYNC230 - once, after the measurements
            json.dump(result, out, indent=2)


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--api", choices=("publish_many", "enqueue"), default="publish_many")
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--window", type=int, default=1000)
    parser.add_argument("--top", type=int, default=15, help="functions to list by own time")
    parser.add_argument("--no-profile", action="store_true", help="the counting pass only")
    parser.add_argument("--label", help="a name for this run in the JSON (default: the commit)")
    parser.add_argument("--json", help="also write the figures to this file")
    asyncio.run(main(parser.parse_args()))


if __name__ == "__main__":
    cli()
