"""Publish throughput and CPU per message: reliable_mq vs raw aio-pika and pika, in one run.

Every variant publishes the same persistent 256-byte messages to its own fresh
durable queue on the same broker, one after another, round after round
(interleaved, so drift hits every variant alike), and the clock stops when the
broker holds every message (confirmed variants: when the last confirm is in;
unconfirmed ones: when the queue depth reaches the count). Reported: the
median rate, the ratio against aio-pika *unconfirmed* and against pika
*unconfirmed*, and the client's and the broker's CPU per message (process CPU
time of this process and of the broker's ``beam.smp``, divided by messages).

    python bench/publish.py [--messages 20000] [--window 1000] [--rounds 3] [--uvloop]
                            [--label after] [--json results.json] [--tracing]

``--tracing`` adds, for each reliable_mq variant, three rows measured in a fresh
child process each, interleaved with the others round by round: opentelemetry
not importable, the API without an SDK (the default), and an SDK sampling
everything into a no-op exporter (see ``bench/_tracing_modes.py``). Without it
the run is the same as before.

``--json`` writes the medians for ``bench/plot.py`` and ``bench/report.py`` (the
chart and the tables in docs/performance.md), with the reliable_mq it imported
(path, commit) and ``--label``. With ``PYTHONPATH`` pointing at an older
reliable_mq it measures that one (see docs/performance.md, "Reproduce").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import _provenance
import _tracing_modes
import aio_pika
import pika
from prometheus_client import CollectorRegistry

import reliable_mq
from reliable_mq import PublisherSettings, ReliablePublisher

URL = os.environ.get("BENCH_URL", "amqp://guest:guest@127.0.0.1:5672/")
BODY = b"x" * 256
AIO_UNCONFIRMED = "aio-pika, no confirms"
PIKA_UNCONFIRMED = "pika BlockingConnection, no confirms"


async def aio_unconfirmed(queue: str, count: int, window: int) -> None:
    """aio-pika without confirms: the fire-and-forget ceiling (not loss-proof)."""
    connection = await aio_pika.connect(URL)
    async with connection:
        channel = await connection.channel(publisher_confirms=False)
        exchange = channel.default_exchange
        for index in range(count):
            message = aio_pika.Message(
                BODY, delivery_mode=aio_pika.DeliveryMode.PERSISTENT, message_id=str(index)
            )
            await exchange.publish(message, routing_key=queue)


async def aio_confirmed_gather(queue: str, count: int, window: int) -> None:
    """aio-pika with confirms, publishes gathered in chunks of ``window``."""
    connection = await aio_pika.connect(URL)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = channel.default_exchange

        def one(index: int) -> Awaitable[object]:
            message = aio_pika.Message(
                BODY, delivery_mode=aio_pika.DeliveryMode.PERSISTENT, message_id=str(index)
            )
            return exchange.publish(message, routing_key=queue)

        for start in range(0, count, window):
            await asyncio.gather(*(one(i) for i in range(start, min(start + window, count))))


async def pika_unconfirmed(queue: str, count: int, window: int) -> None:
    """pika's BlockingConnection without confirms, in a thread."""

    def run() -> None:
        connection = pika.BlockingConnection(pika.URLParameters(URL))
        channel = connection.channel()
        properties = pika.BasicProperties(delivery_mode=2)
        for index in range(count):
            properties.message_id = str(index)
            channel.basic_publish("", queue, BODY, properties)
        connection.close()

    await asyncio.to_thread(run)


TRACER_PROVIDER: object | None = None
"""Set in a ``--child sdk`` process only: the SDK provider every reliable_mq variant gets."""


def _settings(window: int) -> PublisherSettings:
    return PublisherSettings(max_in_flight=window)


def _publisher(window: int) -> ReliablePublisher:
    traced = {"tracer_provider": TRACER_PROVIDER} if TRACER_PROVIDER is not None else {}
    return ReliablePublisher(
        URL, settings=_settings(window), registry=CollectorRegistry(), **traced
    )


async def rmq_publish_many(queue: str, count: int, window: int) -> None:
    """reliable_mq ``publish_many()``: the stream API."""
    async with _publisher(window) as publisher:
        message = reliable_mq.Message
        await publisher.publish_many(message(BODY, routing_key=queue) for _ in range(count))


async def rmq_gather(queue: str, count: int, window: int) -> None:
    """reliable_mq ``publish()`` calls gathered in chunks of ``window``."""
    async with _publisher(window) as publisher:
        for start in range(0, count, window):
            await asyncio.gather(
                *(
                    publisher.publish(BODY, routing_key=queue)
                    for _ in range(min(window, count - start))
                )
            )


async def rmq_enqueue(queue: str, count: int, window: int) -> None:
    """reliable_mq ``enqueue()`` in a loop, then one ``flush()``."""
    async with _publisher(window) as publisher:
        for _ in range(count):
            await publisher.enqueue(BODY, routing_key=queue)
        await publisher.flush()


Variant = Callable[[str, int, int], Awaitable[None]]
VARIANTS: dict[str, tuple[Variant, bool]] = {
    AIO_UNCONFIRMED: (aio_unconfirmed, False),
    PIKA_UNCONFIRMED: (pika_unconfirmed, False),
    "aio-pika, confirms, gather window": (aio_confirmed_gather, True),
    "reliable_mq publish_many()": (rmq_publish_many, True),
    "reliable_mq publish() gathered": (rmq_gather, True),
    "reliable_mq enqueue() + flush()": (rmq_enqueue, True),
}


if not hasattr(ReliablePublisher, "publish_many"):  # an older reliable_mq, for a before/after run
    del VARIANTS["reliable_mq publish_many()"]


def broker_pid() -> int | None:
    """The pid of the process listening on the broker's AMQP port (ss needs no root for it)."""
    port = URL.rsplit(":", 1)[-1].split("/", 1)[0] or "5672"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        listing = subprocess.run(
            ["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True, check=False
        ).stdout
        for part in listing.split("pid=")[1:]:
            return int(part.split(",", 1)[0])
    return None


BROKER_PID = broker_pid()


def broker_cpu_seconds() -> float | None:
    """CPU seconds used so far by the broker process (None if it cannot be read)."""
    if BROKER_PID is None:
        return None
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open(f"/proc/{BROKER_PID}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return None


@dataclass
class Sample:
    rate: float
    client_us: float
    broker_us: float | None


async def wait_for_depth(channel: aio_pika.abc.AbstractChannel, queue: str, count: int) -> None:
    deadline = time.monotonic() + 60
    depth = -1
    while time.monotonic() < deadline:
        declared = await channel.declare_queue(queue, durable=True, passive=True)
        depth = declared.declaration_result.message_count or 0
        if depth >= count:
            return
        await asyncio.sleep(0.002)
    raise SystemExit(f"{queue}: holds {depth}, expected {count}")


async def measure(run: Variant, count: int, window: int) -> Sample:
    queue = f"bench-publish-{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect(URL)
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, durable=True)
        broker_before = broker_cpu_seconds()
        cpu_before = time.process_time()
        started = time.perf_counter()
        await run(queue, count, window)
        await wait_for_depth(channel, queue, count)
        if TRACER_PROVIDER is not None:  # the spans still queued are part of the cost
            TRACER_PROVIDER.force_flush()  # type: ignore[attr-defined]
        seconds = time.perf_counter() - started
        cpu = time.process_time() - cpu_before
        broker_after = broker_cpu_seconds()
        await declared.delete(if_unused=False, if_empty=False)
    broker_us = None
    if broker_before is not None and broker_after is not None:
        broker_us = (broker_after - broker_before) / count * 1e6
    return Sample(count / seconds, cpu / count * 1e6, broker_us)


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


async def child(args: argparse.Namespace) -> None:
    """One measurement of ``args.variant`` in tracing mode ``args.child`` (see ``--tracing``)."""
    global TRACER_PROVIDER  # noqa: PLW0603 - this process measures one set-up
    _tracing_modes.check_mode(args.child)
    TRACER_PROVIDER = _tracing_modes.provider(args.child)
    sample = await measure(VARIANTS[args.variant][0], args.messages, args.window)
    _tracing_modes.emit(sample.__dict__, args.messages, TRACER_PROVIDER)


def _child_argv(args: argparse.Namespace) -> list[str]:
    return [
        "--messages",
        str(args.messages),
        "--window",
        str(args.window),
        *(["--uvloop"] if args.uvloop else []),
    ]


TRACED = [name for name in VARIANTS if name.startswith("reliable_mq")]
"""The variants ``--tracing`` measures in each mode."""


async def main(args: argparse.Namespace) -> None:
    if args.child:
        await child(args)
        return
    origin = _provenance.origin(reliable_mq, args.label)
    print(_provenance.describe(origin), flush=True)
    confirms = {name: confirmed for name, (_, confirmed) in VARIANTS.items()}
    samples: dict[str, list[Sample]] = {name: [] for name in VARIANTS}
    if args.tracing:
        for name in TRACED:
            for mode in _tracing_modes.MODES:
                samples[_tracing_modes.row_name(name, mode)] = []
                confirms[_tracing_modes.row_name(name, mode)] = True
    for round_no in range(args.rounds):
        for name, (run, _) in VARIANTS.items():
            samples[name].append(await measure(run, args.messages, args.window))
        if args.tracing:  # the modes' order turns round by round: no mode always runs first
            modes = _tracing_modes.MODES[round_no % 3 :] + _tracing_modes.MODES[: round_no % 3]
            for name in TRACED:
                for mode in modes:
                    found = await asyncio.to_thread(
                        _tracing_modes.run_child, __file__, mode, name, _child_argv(args)
                    )
                    spans = found.pop("spans_per_message")
                    samples[_tracing_modes.row_name(name, mode)].append(Sample(**found))
                    print(
                        f"round {round_no + 1}: {_tracing_modes.row_name(name, mode):<72} "
                        f"{found['rate']:>8,.0f} msgs/s {found['client_us']:>6.1f} µs client "
                        f"CPU/msg, {spans:.2f} spans/msg",
                        flush=True,
                    )
    rates = {name: statistics.median(s.rate for s in found) for name, found in samples.items()}
    aio = rates[AIO_UNCONFIRMED]
    pik = rates[PIKA_UNCONFIRMED]
    loop_name = type(asyncio.get_running_loop()).__module__.split(".")[0]
    print(
        f"publish: {args.messages} persistent {len(BODY)}-byte messages per run, durable queue, "
        f"window {args.window}, {args.rounds} interleaved round(s), medians; loop: {loop_name}; "
        f"threads: {threading.active_count()}\n{_provenance.describe(origin)}"
    )
    width = max(40, *(len(name) for name in samples))
    header = (
        f"{'variant':<{width}} {'confirms':>8} {'msgs/s':>9} {'vs aio-pika':>12} "
        f"{'vs pika':>8} {'client µs/msg':>14} {'broker µs/msg':>14}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for name, found_samples in samples.items():
        client = _median([s.client_us for s in found_samples])
        broker = _median([s.broker_us for s in found_samples])
        confirmed = "yes" if confirms[name] else "no"
        broker_text = f"{broker:>14.1f}" if broker is not None else f"{'n/a':>14}"
        print(
            f"{name:<{width}} {confirmed:>8} {rates[name]:>9,.0f} {rates[name] / aio:>11.2f}x "
            f"{rates[name] / pik:>7.2f}x {client or 0:>14.1f} {broker_text}"
        )
        rows.append(
            {
                "variant": name,
                "confirms": confirms[name],
                "rate": rates[name],
                "vs_aio_pika": rates[name] / aio,
                "vs_pika": rates[name] / pik,
                "client_us": client,
                "broker_us": broker,
                "rounds": [s.__dict__ for s in found_samples],
                "spans_per_message": _tracing_modes.spans_per_message(name),
            }
        )
    if args.tracing:
        client_us = {row["variant"]: row["client_us"] for row in rows}
        print("\n".join(_tracing_modes.summary(TRACED, client_us, "client CPU", "µs/msg")))
        print("\n".join(_tracing_modes.summary(TRACED, rates, "rate", "msgs/s")))
        per_round = {row: [s.client_us for s in found] for row, found in samples.items()}
        print("\n".join(_tracing_modes.paired(TRACED, per_round, "client CPU")))
    if args.json:
        with open(args.json, "w") as out:  # noqa: ASYNC230 - once, after the measurements
            json.dump(
                {
                    "bench": "publish",
                    "label": origin["label"],
                    "reliable_mq": origin,
                    "messages": args.messages,
                    "window": args.window,
                    "rounds": args.rounds,
                    "loop": loop_name,
                    "rows": rows,
                },
                out,
                indent=2,
            )


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--window", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians")
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop (if installed)")
    parser.add_argument("--label", help="a name for this run in the JSON (default: the commit)")
    parser.add_argument("--json", help="also write the medians to this file")
    parser.add_argument(
        "--tracing",
        action="store_true",
        help="also each reliable_mq variant without opentelemetry, with the API only, and "
        "with an SDK sampling everything, each in a child process",
    )
    parser.add_argument("--child", choices=_tracing_modes.MODES, help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.uvloop:
        import uvloop  # noqa: PLC0415 - optional

        uvloop.run(main(args))
    else:
        asyncio.run(main(args))


if __name__ == "__main__":
    cli()
