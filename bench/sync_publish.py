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

    python bench/sync_publish.py [--messages 20000] [--threads 8] [--rounds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import NamedTuple

import pika
from prometheus_client import CollectorRegistry

from reliable_mq import BlockingPublisher, Message, PublisherSettings, ReliablePublisher

URL = "amqp://guest:guest@127.0.0.1:5672/"
BODY = b"x" * 256


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
    with BlockingPublisher(URL, registry=CollectorRegistry()) as publisher:
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
    with BlockingPublisher(URL, settings=settings, registry=CollectorRegistry()) as publisher:

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1, help="repeat and report the median")
    args = parser.parse_args()
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
    for _ in range(args.rounds):
        for name, run, count in plan:
            samples[name].append(measure(run, count, args.threads))
    rate = {name: statistics.median(s.rate for s in values) for name, values in samples.items()}
    cpu = {name: statistics.median(s.cpu_us for s in values) for name, values in samples.items()}
    names = [name for name, _, _ in plan]
    print(
        f"sync publish: persistent 256-byte messages, durable queue, {args.rounds} round(s), "
        f"median; {args.messages} per stream/threaded variant, {slow} per pika variant"
    )
    print(f"{'variant':<46} {'msgs/s':>10} {'CPU us/msg':>11}")
    for name in names:
        print(f"{name:<46} {rate[name]:>10,.0f} {cpu[name]:>11.0f}")
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


if __name__ == "__main__":
    main()
