"""The fault suite's building blocks: a publishing workload, an effect sink, the report.

A scenario wires them like this::

    run = Scenario("cut storm", oracle)
    sink = EffectSink(oracle)                      # the consumer's handler
    consumer = fault_consumer(conn, queue, sink)   # ReliableConsumer, dedup when it has it
    work = Workload(publisher, oracle, queue, timeout=60)
    await work.stream(min_messages=5000, until=faults_done)
    await work.settle()                            # every publish() resolved by its deadline
    await finish(url, consumer, sink, work, oracle) # effects, stop, drain every queue
    run.report(...)                                 # one line, and the oracle's verdict

The oracle (:class:`reliable_mq.testing.LossOracle`) gets attempted, confirmed
and failed from the publisher side, delivered from the handlers and from the
final drain of every queue of the topology, and applied effects from the sink.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import os
import random
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import aio_pika
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from reliable_mq import (
    ConnectionSettings,
    ConsumerSettings,
    PublishError,
    PublisherSettings,
    ReliableConsumer,
    ReliablePublisher,
    Retry,
)
from reliable_mq.dedup import ClaimResult, DedupStore, MemoryDedupStore
from reliable_mq.delivery import Delivery
from reliable_mq.testing import LossOracle, OracleReport, TCPProxy
from reliable_mq.topology import QueueTopology, QueueType, declare_topology, delete_topology
from tests.support.amqp import drain_queue

__all__ = (
    "LIBRARY_DEDUP",
    "REPORTED",
    "EffectSink",
    "Faults",
    "Scenario",
    "Workload",
    "StreamRun",
    "connection",
    "declare",
    "describe",
    "check",
    "run_stream",
    "fault_consumer",
    "finish",
    "new_queue",
)

LIBRARY_DEDUP = "dedup" in inspect.signature(ReliableConsumer.__init__).parameters
"""True once ``ReliableConsumer(dedup=store)`` exists: the consumer then dedupes,
and the sink only applies effects (so a duplicate effect is the library's bug)."""

REPORTED: list[str] = []
"""Every summary line of this run, for the terminal summary."""

_FIELDS = (
    "scenario",
    "messages",
    "faults",
    "republished",
    "broker_duplicates",
    "lost",
    "unexpected",
    "duplicate_effects",
    "max_in_flight",
    "max_unacked",
    "seconds",
)


def new_queue(prefix: str) -> str:
    slug = "".join(c if c.isalnum() else "-" for c in prefix.lower()).strip("-")
    return f"faults-{slug}-{uuid.uuid4().hex[:8]}"


def connection(url: str | Iterable[str], name: str, **overrides: Any) -> ConnectionSettings:
    """Settings that reconnect quickly (tests want many recoveries per second)."""
    urls = url if isinstance(url, str) else ",".join(url)
    values: dict[str, Any] = {
        "url": SecretStr(urls),
        "connection_name": f"{name}-{uuid.uuid4().hex[:6]}",
        "heartbeat": 5,
        "connect_timeout": 3.0,
        "reconnect_initial_delay": 0.05,
        "reconnect_max_delay": 0.5,
    }
    values.update(overrides)
    return ConnectionSettings(**values)


async def declare(url: str, topology: QueueTopology) -> None:
    """Declare the consumer's topology before anything is published (mandatory publishes)."""
    conn = await aio_pika.connect(url, timeout=10)
    async with conn:
        await declare_topology(await conn.channel(), topology)


async def delete(url: str, topology: QueueTopology) -> None:
    conn = await aio_pika.connect(url, timeout=10)
    async with conn:
        await delete_topology(await conn.channel(), topology)


class Workload:
    """Publishes a stream of ids; every outcome goes to the oracle.

    Each publish has a deadline (``timeout``); :meth:`settle` then checks that
    every one of them resolved by that deadline (plus a little slack): a task
    still running is a hang, and shows in the oracle as unresolved.
    """

    def __init__(
        self,
        publisher: ReliablePublisher,
        oracle: LossOracle,
        queue: str,
        *,
        timeout: float,
        prefix: str = "m",
        body: Callable[[int], bytes] | None = None,
        max_rate: float = 2000.0,
    ) -> None:
        self.publisher = publisher
        self.max_rate = max_rate
        self.oracle = oracle
        self.queue = queue
        self.timeout = timeout
        self.prefix = prefix
        self.body = body or (lambda index: b"%d" % index)
        self.count = 0
        self.confirmed: set[str] = set()
        self.errors: Counter[str] = Counter()
        self.tasks: list[asyncio.Task[None]] = []
        self.unresolved: list[str] = []

    def next_id(self) -> str:
        mid = f"{self.prefix}{self.count:07d}"
        self.count += 1
        return mid

    async def stream(
        self,
        *,
        min_messages: int,
        max_messages: int | None = None,
        until: asyncio.Event | None = None,
    ) -> None:
        """Publish at least ``min_messages``, and go on until ``until`` is set.

        The window is the backpressure: ``enqueue()`` waits for a slot, so the
        stream runs as fast as confirms come back, and stalls with them.
        """
        limit = max_messages if max_messages is not None else min_messages * 20
        loop = asyncio.get_running_loop()
        started = loop.time()
        while self.count < limit:
            if self.count >= min_messages and (until is None or until.is_set()):
                break
            await self.publish_one(self.next_id(), self.count - 1)
            if self.count % 100 == 0:
                # Paced: the scenarios test faults mid-stream, not throughput; an
                # unpaced stream outruns the consumer and the drain takes minutes.
                ahead = self.count / self.max_rate - (loop.time() - started)
                if ahead > 0:
                    await asyncio.sleep(ahead)

    async def publish_one(self, mid: str, index: int = 0, **options: Any) -> None:
        self.oracle.attempted(mid)
        try:
            pending = await self.publisher.enqueue(
                self.body(index),
                routing_key=self.queue,
                message_id=mid,
                timeout=self.timeout,
                **options,
            )
        except PublishError as exc:
            self._failed(mid, exc)
            return
        self.tasks.append(asyncio.ensure_future(self._outcome(mid, pending)))

    async def _outcome(self, mid: str, pending: Any) -> None:
        try:
            await pending
        except PublishError as exc:
            self._failed(mid, exc)
        except Exception as exc:  # not a documented outcome: stays unresolved in the oracle
            self.errors[f"undocumented {type(exc).__name__}: {exc}"[:200]] += 1
        else:
            self.confirmed.add(mid)
            self.oracle.confirmed(mid)

    def _failed(self, mid: str, exc: PublishError) -> None:
        self.errors[type(exc).__name__] += 1
        self.oracle.failed(mid)

    async def settle(self, slack: float = 10.0) -> None:
        """Wait for every publish; those still running past deadline + slack hung."""
        if not self.tasks:
            return
        _, pending = await asyncio.wait(self.tasks, timeout=self.timeout + slack)
        for task in pending:
            task.cancel()
        self.unresolved = [t.get_name() for t in pending]

    @property
    def failed(self) -> int:
        return sum(self.errors.values())


class EffectSink:
    """The consumer's handler: records deliveries and applies each effect once.

    Until ``ReliableConsumer(dedup=...)`` exists the sink dedupes itself with
    the same claim / complete protocol the consumer will use: claim the id,
    apply the effect, mark it done (a BUSY claim means another copy is in a
    handler right now: retry later). With :data:`LIBRARY_DEDUP` the consumer
    does that and the sink only applies.
    """

    def __init__(
        self,
        oracle: LossOracle,
        store: DedupStore | None = None,
        *,
        poison: Callable[[Delivery], bool] | None = None,
        delay: float = 0.0,
    ) -> None:
        self.oracle = oracle
        self.store: DedupStore = store if store is not None else MemoryDedupStore(1_000_000)
        self.poison = poison
        self.delay = delay
        self.applied: set[str] = set()
        self.deliveries = 0
        self.skipped = 0
        self.max_unacked = 0
        self.probe: Callable[[], int] | None = None
        self._owners = itertools.count()

    async def __call__(self, delivery: Delivery) -> None:
        mid = delivery.message_id
        self.deliveries += 1
        self.oracle.delivered(mid)
        if self.probe is not None:
            self.max_unacked = max(self.max_unacked, self.probe())
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.poison is not None and self.poison(delivery):
            raise ValueError(f"poison message {mid}")
        if LIBRARY_DEDUP:
            self._apply(mid)
            return
        owner = f"sink-{id(self)}-{next(self._owners)}"
        claim = await self.store.claim(mid, owner=owner, lease=60)
        if claim is ClaimResult.DONE:
            self.skipped += 1
            return
        if claim is ClaimResult.BUSY:
            raise Retry("another copy is in a handler", delay=0.2)
        try:
            self._apply(mid)
        except BaseException:
            await self.store.release(mid, owner=owner)
            raise
        await self.store.complete(mid, owner=owner)

    def _apply(self, mid: str) -> None:
        # The effect: nothing may sit between it and complete() (no await).
        self.applied.add(mid)
        self.oracle.applied(mid)


def unacked_probe(consumer: ReliableConsumer, queue: str) -> Callable[[], int]:
    """Deliveries the consumer holds unacked on its live channel (read at each delivery).

    Reads the consumer's ack tracker: outstanding tags, in a handler or waiting
    in an ack batch. Falls back to the handlers in progress if the internals move.
    """

    def probe() -> int:
        route = getattr(consumer, "_routes", {}).get(queue)
        session = getattr(route, "session", None)
        tracker = getattr(session, "tracker", None)
        states = getattr(tracker, "_states", None)
        if states is None:
            return consumer.stats().in_progress
        # In a handler or waiting for a batched ack; SETTLED tags (acked or nacked
        # by a frame of their own) only wait behind the head for bookkeeping.
        return sum(1 for state in states if state != 2)

    return probe


def fault_consumer(
    conn: ConnectionSettings,
    queue: str,
    sink: EffectSink,
    *,
    prefetch: int = 100,
    queue_type: QueueType = QueueType.CLASSIC,
    queue_arguments: dict[str, Any] | None = None,
    max_attempts: int = 50,
    retry_delays: tuple[float, ...] = (0.2,),
    **overrides: Any,
) -> ReliableConsumer:
    """A ReliableConsumer with ``sink`` as the handler of ``queue``."""
    settings = ConsumerSettings(
        prefetch=prefetch,
        max_attempts=max_attempts,
        retry_delays=retry_delays,
        shutdown_grace=5.0,
        **overrides,
    )
    extra: dict[str, Any] = {"dedup": sink.store} if LIBRARY_DEDUP else {}
    consumer = ReliableConsumer(
        conn,
        settings=settings,
        publisher_settings=PublisherSettings(publish_timeout=60, max_attempts=1000),
        registry=CollectorRegistry(),
        **extra,
    )

    async def handle(delivery: Delivery) -> None:
        await sink(delivery)

    consumer.add_handler(
        queue, handle, queue_type=queue_type, queue_arguments=queue_arguments or {}
    )
    sink.probe = unacked_probe(consumer, queue)
    return consumer


async def wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    """Poll ``predicate`` until true or ``timeout``; never fails (the oracle judges)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def drain_all(url: str, topology: QueueTopology, oracle: LossOracle) -> dict[str, list[Any]]:
    """Drain every queue of the topology completely; every id counts as delivered."""
    drained: dict[str, list[Any]] = {}
    for name in topology.all_queues:
        messages = await drain_queue(url, name, idle_timeout=1.0)
        oracle.delivered_many(m.message_id or "" for m in messages)
        drained[name] = messages
    return drained


async def finish(
    url: str,
    consumer: ReliableConsumer,
    sink: EffectSink,
    work: Workload,
    topology: QueueTopology,
    *,
    expect_effects: set[str] | None = None,
    timeout: float = 60.0,
) -> dict[str, list[Any]]:
    """Wait for the effects, stop the consumer, drain every queue, delete the topology."""
    wanted = work.confirmed if expect_effects is None else expect_effects
    await wait_for(lambda: wanted <= sink.applied, timeout)
    await consumer.stop(grace=5)
    drained = await drain_all(url, topology, work.oracle)
    await delete(url, topology)
    return drained


class Scenario:
    """Times one scenario and prints its summary line."""

    def __init__(self, name: str, oracle: LossOracle) -> None:
        self.name = name
        self.oracle = oracle
        self.faults = 0
        self.started = time.monotonic()

    def report(
        self,
        *,
        republished: int,
        max_in_flight: int,
        max_unacked: int,
        unresolved: Iterable[str] = (),
        messages: int | None = None,
        skipped_duplicates: int = 0,
        note: str = "",
    ) -> OracleReport:
        """Print (and append to ``$FAULTS_REPORT``) one line; return the oracle's verdict."""
        verdict = self.oracle.report()
        hung = list(unresolved)
        row: dict[str, Any] = {
            "scenario": self.name,
            "messages": verdict.attempted if messages is None else messages,
            "faults": self.faults,
            "republished": republished,
            # Copies the consumer's dedup acked unseen never reached the handler.
            "broker_duplicates": verdict.broker_duplicates + skipped_duplicates,
            "lost": len(verdict.lost),
            "unexpected": len(verdict.unexpected),
            "duplicate_effects": len(verdict.duplicate_effects),
            "max_in_flight": max_in_flight,
            "max_unacked": max_unacked,
            "seconds": f"{time.monotonic() - self.started:.1f}",
        }
        line = "FAULTS " + " ".join(f"{key}={value}" for key, value in row.items())
        if hung:
            line += f" hung={len(hung)}"
        if verdict.unresolved:
            line += f" unresolved={len(verdict.unresolved)}"
        if note:
            line += f" {note}"
        sys.stdout.write(line + "\n")
        REPORTED.append(line)
        _append_markdown(row)
        return verdict


def _append_markdown(row: dict[str, Any]) -> None:
    path = os.environ.get("FAULTS_REPORT")
    if not path:
        return
    target = Path(path)
    new = not target.exists() or target.stat().st_size == 0
    with target.open("a") as out:
        if new:
            out.write("| " + " | ".join(f.replace("_", " ") for f in _FIELDS) + " |\n")
            out.write("|" + "---|" * len(_FIELDS) + "\n")
        out.write("| " + " | ".join(str(row[f]) for f in _FIELDS) + " |\n")


def describe(verdict: OracleReport, work: Workload | None = None) -> str:
    """The failure message: the verdict and a few offending ids."""
    parts = [verdict.summary()]
    for label, ids in (
        ("lost", verdict.lost),
        ("unexpected", verdict.unexpected),
        ("duplicate effects", verdict.duplicate_effects),
        ("unresolved", verdict.unresolved),
    ):
        if ids:
            parts.append(f"{label}: {sorted(ids)[:10]}")
    if work is not None and work.errors:
        parts.append(f"publish errors: {dict(work.errors)}")
    return "; ".join(parts)


class Faults:
    """What a fault injector gets: the scenario to count in, and the two events."""

    def __init__(self, scenario: Scenario, publisher: ReliablePublisher, queue: str) -> None:
        self.scenario = scenario
        self.publisher = publisher
        self.queue = queue
        self.enough = asyncio.Event()
        """Set by the injector: the stream may end once it has its minimum."""
        self.stop = asyncio.Event()
        """Set by the stream when it is over: repeating faults stop."""

    async def repeat(
        self, *actions: Callable[[], Awaitable[Any]], low: float, high: float, min_times: int
    ) -> None:
        """Run each action every ``low``-``high`` s (independently) until :attr:`stop`.

        :attr:`enough` is set once every action has run ``min_times`` times.
        """
        counts = [0] * len(actions)

        async def one(index: int, action: Callable[[], Awaitable[Any]]) -> None:
            while not self.stop.is_set():
                await asyncio.sleep(random.uniform(low, high))
                if self.stop.is_set():
                    return
                await action()
                self.scenario.faults += 1
                counts[index] += 1
                if min(counts) >= min_times:
                    self.enough.set()

        await asyncio.gather(*(one(i, a) for i, a in enumerate(actions)))

    def then_publisher_reopens(
        self, action: Callable[[], Awaitable[Any]]
    ) -> Callable[[], Awaitable[None]]:
        """``action``, then wait until the publisher has opened a newer channel.

        A fault that strikes while the publisher is still reconnecting finds no
        channel of its own to break, so without this wait the number of channel
        generations a scenario may assert depends on timing (CI once saw four
        closes and four generations, not five). With it, each fault finds the
        publisher connected, and each of the first ``min_times`` (which all
        finish before :attr:`enough` is set) adds at least one generation.
        """

        async def run() -> None:
            since = self.publisher.stats().channel_generation
            await action()
            await wait_for(
                lambda: self.stop.is_set() or self.publisher.stats().channel_generation > since,
                30,
            )

        return run

    async def cut_with_unconfirmed(self, proxy: TCPProxy) -> int:
        """Cut the publisher's link through ``proxy`` while it holds messages no confirm can reach.

        A cut at a random moment catches a message unconfirmed only by luck: the
        stream is paced and a confirm takes well under a millisecond, so CI has
        seen a storm of cuts with nothing to republish. Here the link is stalled
        first (bytes held, not lost), the stream publishes on into it, and the
        cut lands once it has: a message written after the stall began cannot
        have been confirmed, so it must be republished on the next channel.
        Returns the number of connections cut.
        """
        proxy.set_stall(True)
        try:
            since = self.publisher.stats().published
            await wait_for(
                lambda: self.stop.is_set() or self.publisher.stats().published > since, 30
            )
            return await proxy.cut()
        finally:
            proxy.set_stall(False)


class StreamRun:
    """What :func:`run_stream` observed."""

    def __init__(self, scenario: Scenario, work: Workload, sink: EffectSink) -> None:
        self.scenario = scenario
        self.work = work
        self.sink = sink
        self.publisher_stats: Any = None
        self.consumer_stats: Any = None
        self.verdict: OracleReport | None = None
        self.drained: dict[str, list[Any]] = {}


async def run_stream(
    name: str,
    node_url: str,
    *,
    faults: Callable[[Faults], Awaitable[None]],
    publisher_url: str | None = None,
    consumer_url: str | Iterable[str] | None = None,
    min_messages: int = 5000,
    queue_type: QueueType = QueueType.CLASSIC,
    queue_arguments: dict[str, Any] | None = None,
    window: int = 1000,
    prefetch: int = 100,
    timeout: float = 60.0,
    heartbeat: int = 5,
    publisher_settings: dict[str, Any] | None = None,
    sink_delay: float = 0.0,
    publisher_urls: Iterable[str] | None = None,
    count_faults: Callable[[Any], int] | None = None,
) -> StreamRun:
    """One streaming scenario: consumer and publisher run while ``faults`` strike.

    ``faults(ctx)`` runs next to the stream and sets ``ctx.enough`` once it
    has injected what it wanted; the stream publishes at least
    ``min_messages`` and goes on until then, so every fault lands mid-stream.
    ``ctx.stop`` is set when the stream is over (repeating faults end there).
    ``count_faults(publisher_stats)``, if given, sets the fault count at the end
    (for faults the broker makes, like nacks).
    Then every publish must resolve by its deadline, every confirmed id must
    reach the handler, and every queue is drained.
    """
    oracle = LossOracle()
    scenario = Scenario(name, oracle)
    queue = new_queue(name)
    topology = QueueTopology(
        queue=queue, queue_type=queue_type, retry_delays=(0.2,), arguments=queue_arguments or {}
    )
    await declare(node_url, topology)
    if queue_type is QueueType.QUORUM:
        await asyncio.sleep(2)  # 3.10: a quorum queue killed within ~1 s may never get a leader
    sink = EffectSink(oracle, delay=sink_delay)
    consumer = fault_consumer(
        connection(consumer_url or node_url, f"{name}-consumer", heartbeat=heartbeat),
        queue,
        sink,
        prefetch=prefetch,
        queue_type=queue_type,
        queue_arguments=queue_arguments,
    )
    pub_settings = PublisherSettings(
        max_in_flight=window,
        publish_timeout=timeout,
        **{"max_attempts": 1000, **(publisher_settings or {})},
    )
    pub_target: str | Iterable[str] = publisher_urls or publisher_url or node_url
    publisher = ReliablePublisher(
        connection(pub_target, f"{name}-publisher", heartbeat=heartbeat),
        settings=pub_settings,
        registry=CollectorRegistry(),
    )
    await consumer.start()
    await publisher.start()
    work = Workload(publisher, oracle, queue, timeout=timeout)
    run = StreamRun(scenario, work, sink)
    ctx = Faults(scenario, publisher, queue)
    injector = asyncio.ensure_future(faults(ctx))
    progress = asyncio.ensure_future(_progress(scenario, work, sink, publisher, consumer))
    try:
        streaming = asyncio.ensure_future(work.stream(min_messages=min_messages, until=ctx.enough))
        await asyncio.wait((streaming, injector), return_when=asyncio.FIRST_COMPLETED)
        if injector.done() and injector.exception() is not None:
            streaming.cancel()  # the injector broke: stop, and let it raise below
        with contextlib.suppress(asyncio.CancelledError):
            await streaming
        ctx.stop.set()
        await injector
        await work.settle()
        run.publisher_stats = publisher.stats()
        await publisher.close(timeout=5)
        run.drained = await finish(node_url, consumer, sink, work, topology)
        run.consumer_stats = consumer.stats()
    finally:
        injector.cancel()
        progress.cancel()
        await publisher.close(timeout=1)
        await consumer.stop(grace=1)
    if count_faults is not None:
        scenario.faults = count_faults(run.publisher_stats)
    run.verdict = scenario.report(
        republished=run.publisher_stats.republished,
        max_in_flight=run.publisher_stats.max_in_flight_seen,
        max_unacked=max(sink.max_unacked, run.consumer_stats.max_in_progress),
        unresolved=work.unresolved,
        skipped_duplicates=skipped_by_consumer(run.consumer_stats),
    )
    return run


async def _progress(
    scenario: Scenario,
    work: Workload,
    sink: EffectSink,
    publisher: ReliablePublisher,
    consumer: ReliableConsumer,
) -> None:
    """With ``FAULTS_DEBUG=1``: a progress line every 2 s on stderr."""
    if not os.environ.get("FAULTS_DEBUG"):
        return
    while True:
        await asyncio.sleep(2)
        sys.stderr.write(
            f"[{scenario.name} {time.monotonic() - scenario.started:.0f}s] "
            f"sent={work.count} confirmed={len(work.confirmed)} failed={work.failed} "
            f"faults={scenario.faults} applied={len(sink.applied)} "
            f"deliveries={sink.deliveries} pub={tuple(publisher.stats())} "
            f"con={tuple(consumer.stats())}\n"
        )


def skipped_by_consumer(stats: Any) -> int:
    """Deliveries the consumer's own dedup acked without calling the handler."""
    return int(getattr(stats, "duplicates", 0))


def check(run: StreamRun, *, window: int = 1000, prefetch: int = 100) -> None:
    """The assertions every streaming scenario shares."""
    verdict = run.verdict
    assert verdict is not None
    work = run.work
    assert not work.unresolved, f"{len(work.unresolved)} publishes hung past their deadline"
    assert verdict.ok, describe(verdict, work)
    assert work.failed == 0, f"publishes failed: {dict(work.errors)}"
    assert len(work.confirmed) == work.count
    assert run.publisher_stats.max_in_flight_seen <= window
    assert run.sink.max_unacked <= prefetch
    assert run.consumer_stats.max_in_progress <= prefetch
