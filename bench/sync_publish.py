"""Blocking publisher throughput: against the async stream, and against pika.

Two comparisons, in one run, each variant on its own fresh durable queue with
persistent 256-byte messages:

1. ``BlockingPublisher.publish_many`` from one thread vs the async
   ``ReliablePublisher.publish_many`` stream (target: >= 0.8x).
2. ``BlockingPublisher.publish()`` one message at a time from 8 threads vs
   pika's ``BlockingConnection`` with ``confirm_delivery()``, one message at a
   time (the usual sync choice; target: >= 5x). pika from 8 threads, one
   connection each (it is not thread-safe), is printed for reference, and so
   is the async ``publish()`` from 8 coroutines: the same round trips without
   threads, the ceiling for the blocking facade over it.

CPU is this process's (all threads) per message; the broker's is not counted.
Compare figures from one run only: rates drift by 25% or more between runs.

    python bench/sync_publish.py [--messages 20000] [--threads 8] [--rounds 1] [--tracing]
                                 [--json results.json]

``--tracing`` adds, for the two ``BlockingPublisher`` variants, three rows measured in
a fresh child process each, interleaved with the others round by round:
opentelemetry not importable, the API without an SDK (the default), and an SDK
sampling everything into a no-op exporter through a ``BatchSpanProcessor``
(see ``bench/_tracing_modes.py``). Without it the run is the same as before.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import NamedTuple

import _provenance
import _tracing_modes
import pika
from prometheus_client import CollectorRegistry

import reliable_mq
from reliable_mq import BlockingPublisher, Message, PublisherSettings, ReliablePublisher

URL = "amqp://guest:guest@127.0.0.1:5672/"
BODY = b"x" * 256

TRACER_PROVIDER: object | None = None
"""Set in a ``--child sdk`` process only: the SDK provider the BlockingPublisher gets."""


def _traced() -> dict[str, object]:
    return {"tracer_provider": TRACER_PROVIDER} if TRACER_PROVIDER is not None else {}


class Sample(NamedTuple):
    rate: float
    """Messages per second."""
    cpu_us: float
    """This process's CPU microseconds per message."""


class Clock:
    """Wall and process CPU time of the publishing part only (not connecting)."""

    def __init__(self) -> None:
        self.seconds = self.cpu = 0.0

    def __enter__(self) -> Clock:
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if TRACER_PROVIDER is not None:  # the spans still queued are part of the cost
            TRACER_PROVIDER.force_flush()  # type: ignore[attr-defined]
        self.seconds = time.perf_counter() - self._wall
        self.cpu = time.process_time() - self._cpu


def _messages(queue: str, count: int) -> Iterator[Message]:
    return (Message(BODY, routing_key=queue, persistent=True) for _ in range(count))


def async_stream(queue: str, count: int, threads: int, clock: Clock) -> None:
    """ReliablePublisher.publish_many over a generator, on asyncio."""

    async def run() -> None:
        async with ReliablePublisher(URL, registry=CollectorRegistry()) as publisher:
            with clock:
                await publisher.publish_many(_messages(queue, count))

    asyncio.run(run())


def blocking_stream(queue: str, count: int, threads: int, clock: Clock) -> None:
    """BlockingPublisher.publish_many over a generator, from this thread."""
    with BlockingPublisher(URL, registry=CollectorRegistry(), **_traced()) as publisher:
        with clock:
            publisher.publish_many(_messages(queue, count))


def async_coroutines(queue: str, count: int, threads: int, clock: Clock) -> None:
    """ReliablePublisher.publish(), one confirmed message at a time, from N coroutines.

    The ceiling for the threaded variant: the same round trips, without threads.
    """
    settings = PublisherSettings(persistent=True)

    async def run() -> None:
        async with ReliablePublisher(
            URL, settings=settings, registry=CollectorRegistry()
        ) as publisher:

            async def work(n: int) -> None:
                for _ in range(n):
                    await publisher.publish(BODY, routing_key=queue)

            with clock:
                await asyncio.gather(*(work(n) for n in _split(count, threads)))

    asyncio.run(run())


def _split(count: int, threads: int) -> list[int]:
    return [count // threads + (1 if i < count % threads else 0) for i in range(threads)]


def blocking_threads(queue: str, count: int, threads: int, clock: Clock) -> None:
    """BlockingPublisher.publish(), one confirmed message at a time, from N threads."""
    settings = PublisherSettings(persistent=True)
    with BlockingPublisher(
        URL, settings=settings, registry=CollectorRegistry(), **_traced()
    ) as publisher:

        def work(n: int) -> None:
            for _ in range(n):
                publisher.publish(BODY, routing_key=queue)

        with clock:
            _run_threads(work, _split(count, threads))


def pika_one(queue: str, count: int, threads: int, clock: Clock) -> None:
    """pika BlockingConnection + confirm_delivery, one message at a time, one thread."""
    channel = _pika_channel()
    with clock:
        _pika_publish(channel, queue, count)
    channel.connection.close()


def pika_threads(queue: str, count: int, threads: int, clock: Clock) -> None:
    """pika as above from N threads, one connection each (pika is not thread-safe)."""
    channels = [_pika_channel() for _ in range(threads)]
    shares = iter(zip(channels, _split(count, threads), strict=True))
    lock = threading.Lock()

    def work(_: int) -> None:
        with lock:
            channel, n = next(shares)
        _pika_publish(channel, queue, n)

    with clock:
        _run_threads(work, [0] * threads)
    for channel in channels:
        channel.connection.close()


def _pika_channel() -> pika.adapters.blocking_connection.BlockingChannel:
    channel = pika.BlockingConnection(pika.URLParameters(URL)).channel()
    channel.confirm_delivery()
    return channel


def _pika_publish(
    channel: pika.adapters.blocking_connection.BlockingChannel, queue: str, count: int
) -> None:
    properties = pika.BasicProperties(delivery_mode=2)
    for _ in range(count):
        channel.basic_publish("", queue, BODY, properties, mandatory=True)


def _run_threads(work: Callable[[int], None], shares: list[int]) -> None:
    errors: list[BaseException] = []

    def guarded(n: int) -> None:
        try:
            work(n)
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=guarded, args=(n,)) for n in shares]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]


Variant = Callable[[str, int, int, Clock], None]


def measure(run: Variant, count: int, threads: int) -> Sample:
    queue = f"bench-sync-{uuid.uuid4().hex[:8]}"
    admin = pika.BlockingConnection(pika.URLParameters(URL))
    try:
        channel = admin.channel()
        channel.queue_declare(queue, durable=True)
        clock = Clock()
        run(queue, count, threads, clock)
        depth = channel.queue_declare(queue, durable=True, passive=True).method.message_count
        if depth < count:
            raise SystemExit(f"{run.__name__}: only {depth} of {count} messages in the queue")
        channel.queue_delete(queue)
    finally:
        admin.close()
    return Sample(count / clock.seconds, clock.cpu / count * 1e6)


TRACED: dict[str, Variant] = {
    "blocking_stream": blocking_stream,
    "blocking_threads": blocking_threads,
}
"""The variants ``--tracing`` measures in each tracing set-up, by function name."""


def child(args: argparse.Namespace) -> None:
    """One measurement of ``args.variant`` in tracing mode ``args.child`` (see ``--tracing``)."""
    global TRACER_PROVIDER  # noqa: PLW0603 - this process measures one set-up
    _tracing_modes.check_mode(args.child)
    TRACER_PROVIDER = _tracing_modes.provider(args.child)
    sample = measure(TRACED[args.variant], args.messages, args.threads)
    _tracing_modes.emit(sample._asdict(), args.messages, TRACER_PROVIDER)


def _traced_round(
    args: argparse.Namespace,
    round_no: int,
    plan: list[tuple[str, Variant, int]],
    samples: dict[str, list[Sample]],
) -> None:
    """Each traced variant in each tracing set-up, in a child process; the set-ups' order
    turns round by round, so no set-up always runs first."""
    modes = _tracing_modes.MODES[round_no % 3 :] + _tracing_modes.MODES[: round_no % 3]
    argv = ["--messages", str(args.messages), "--threads", str(args.threads)]
    for name, run, _ in plan:
        if run.__name__ not in TRACED:
            continue
        for mode in modes:
            row = _tracing_modes.row_name(name, mode)
            found = _tracing_modes.run_child(__file__, mode, run.__name__, argv, row)
            spans = found.pop("spans_per_message")
            samples.setdefault(row, []).append(Sample(**found))
            print(
                f"round {round_no + 1}: {row:<80} {found['rate']:>9,.0f} msgs/s "
                f"{found['cpu_us']:>6.1f} us CPU/msg, {spans:.2f} spans/msg",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1, help="repeat and report the median")
    parser.add_argument(
        "--tracing",
        action="store_true",
        help="also the BlockingPublisher variants without opentelemetry, with the API only, "
        "and with an SDK sampling everything, each in a child process",
    )
    parser.add_argument("--json", help="also write the medians to this file")
    parser.add_argument("--child", choices=_tracing_modes.MODES, help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=list(TRACED), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    slow = max(args.messages // 10, 200)  # one-at-a-time variants: fewer messages, same rate
    plan: list[tuple[str, Variant, int]] = [
        ("async publish_many (stream)", async_stream, args.messages),
        ("BlockingPublisher.publish_many, 1 thread", blocking_stream, args.messages),
        (f"BlockingPublisher.publish(), {args.threads} threads", blocking_threads, args.messages),
        (f"async publish(), {args.threads} coroutines", async_coroutines, args.messages),
        ("pika confirm_delivery, 1 at a time", pika_one, slow),
        (f"pika confirm_delivery, {args.threads} threads x 1 conn", pika_threads, slow),
    ]
    samples: dict[str, list[Sample]] = {name: [] for name, _, _ in plan}
    for round_no in range(args.rounds):
        for name, run, count in plan:
            samples[name].append(measure(run, count, args.threads))
        if args.tracing:
            _traced_round(args, round_no, plan, samples)
    rate = {name: statistics.median(s.rate for s in values) for name, values in samples.items()}
    cpu = {name: statistics.median(s.cpu_us for s in values) for name, values in samples.items()}
    names = [name for name, _, _ in plan]
    width = max(46, *(len(name) for name in samples))
    print(
        f"sync publish: persistent 256-byte messages, durable queue, {args.rounds} round(s), "
        f"median; {args.messages} per stream/threaded variant, {slow} per pika variant"
    )
    print(f"{'variant':<{width}} {'msgs/s':>10} {'CPU us/msg':>11}")
    for name in samples:
        print(f"{name:<{width}} {rate[name]:>10,.0f} {cpu[name]:>11.1f}")
    stream = rate[names[1]] / rate[names[0]]
    versus_pika = rate[names[2]] / rate[names[4]]
    ceiling = rate[names[3]] / rate[names[4]]
    print(f"blocking publish_many / async stream:   {stream:.2f}x (target >= 0.8x)")
    print(
        f"publish() x{args.threads} threads / pika 1 at a time: {versus_pika:.2f}x (target >= 5x)"
    )
    print(
        f"async publish() x{args.threads} coroutines / pika 1 at a time: {ceiling:.2f}x (ceiling)"
    )

    if args.tracing:
        traced = [name for name, run, _ in plan if run.__name__ in TRACED]
        print("\n".join(_tracing_modes.summary(traced, cpu, "CPU", "µs/msg")))
        print("\n".join(_tracing_modes.summary(traced, rate, "rate", "msgs/s")))
        per_round = {row: [s.cpu_us for s in found] for row, found in samples.items()}
        print("\n".join(_tracing_modes.paired(traced, per_round, "CPU")))
    if args.json:
        _write_json(args, samples, rate, cpu)


def _write_json(
    args: argparse.Namespace,
    samples: dict[str, list[Sample]],
    rate: dict[str, float],
    cpu: dict[str, float],
) -> None:
    rows = [
        {
            "variant": name,
            "rate": rate[name],
            "client_us": cpu[name],
            "spans_per_message": _tracing_modes.spans_per_message(name),
            "rounds": [sample._asdict() for sample in found],
        }
        for name, found in samples.items()
    ]
    origin = _provenance.origin(reliable_mq)
    with open(args.json, "w") as out:
        json.dump(
            {
                "bench": "sync_publish",
                "label": origin["label"],
                "reliable_mq": origin,
                "messages": args.messages,
                "threads": args.threads,
                "rounds": args.rounds,
                "rows": rows,
            },
            out,
            indent=2,
        )


if __name__ == "__main__":
    main()
