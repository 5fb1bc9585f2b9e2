"""A handler slower than the broker's ``consumer_timeout``, on a private node that has a small one.

The node runs with ``consumer_timeout = 4000`` (ms) and a ``channel_tick_interval``
of 1 s, so the broker closes a channel whose oldest delivery stays unacked past
4 s within about a second (406 ``PRECONDITION_FAILED - delivery acknowledgement
on channel N timed out``), and requeues every delivery unacked on it.

One handler always takes 7 s; fast messages stream in around it. The slow
one's every run is one failed attempt, although the broker redelivers the
original unchanged; it never runs twice at once; after ``max_attempts`` (3) it
is in the DLQ with an error naming ``consumer_timeout``. Every fast message
has its effect exactly once. (Before, the slow message ran again every 4-5 s,
forever, logged only as ``consumer_channel_lost``.)

With ``ConsumerSettings.consumer_timeout`` set to the broker's value, the
consumer keeps its handlers below it: the broker never closes the channel.
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import aio_pika
import aiormq
import pytest
import structlog
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from reliable_mq import ConnectionSettings, ReliablePublisher
from reliable_mq._amqp.faults import FaultKind, classify
from reliable_mq._consume.frames import broker_cut
from reliable_mq._consume.route import HELD_MESSAGES
from reliable_mq.consumer import ReliableConsumer
from reliable_mq.delivery import Delivery
from reliable_mq.headers import ATTEMPTS_HEADER, ERROR_MESSAGE_HEADER, REASON_HEADER
from reliable_mq.topology import delete_topology
from tests.amqp.test_amqp_faults import CONSUMER_TIMEOUT_TEXT
from tests.consume.test_settle import _Channel, _route, _ticket
from tests.support.private_node import PrivateBroker, running_private_node

pytestmark = pytest.mark.rabbitmq

BROKER_TIMEOUT = 4.0
SLOW = 7.0
MAX_ATTEMPTS = 3


@pytest.fixture(scope="module")
def node() -> Iterator[PrivateBroker]:
    with running_private_node(
        "rct",
        extra_config=f"consumer_timeout = {int(BROKER_TIMEOUT * 1000)}",
        advanced_config="[{rabbit, [{channel_tick_interval, 1000}]}].\n",
    ) as broker:
        yield broker


@dataclass
class Report:
    """What one scenario did: the figures the issue asks for."""

    slow_runs: list[tuple[int, bool]] = field(default_factory=list)
    """(attempt, redelivered) of each run of the slow handler."""
    slow_overlaps: int = 0
    """Runs of the slow message that started while another one still ran."""
    fast_effects: collections.Counter[str] = field(default_factory=collections.Counter)
    published: list[str] = field(default_factory=list)
    dead: dict[str, dict[str, Any]] = field(default_factory=dict)
    left: dict[str, int] = field(default_factory=dict)
    reopens: int = 0
    logs: list[dict[str, Any]] = field(default_factory=list)


async def _drain(url: str, queue: str) -> list[aio_pika.abc.AbstractIncomingMessage]:
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        declared = await channel.get_queue(queue, ensure=True)
        out = []
        while (message := await declared.get(no_ack=False, fail=False)) is not None:
            await message.ack()
            out.append(message)
        return out
    finally:
        await connection.close()


@pytest.fixture(name="queue")
async def _queue(node: PrivateBroker) -> AsyncIterator[str]:
    name = f"test-ctimeout-{uuid.uuid4().hex[:10]}"
    yield name
    probe = ReliableConsumer(node.url, registry=CollectorRegistry(), retry_delays=(0.2,))

    @probe.handler(name)
    async def unused(delivery: Delivery) -> None: ...

    connection = await aio_pika.connect(node.url)
    try:
        await delete_topology(await connection.channel(), probe.topology(name))
    finally:
        await connection.close()


async def _scenario(url: str, queue: str, *, sync: bool, **settings: Any) -> Report:
    report = Report()
    consumer = ReliableConsumer(
        ConnectionSettings(url=SecretStr(url), connection_name=queue, reconnect_initial_delay=0.1),
        registry=CollectorRegistry(),
        prefetch=50,
        concurrency=8,
        max_attempts=MAX_ATTEMPTS,
        retry_delays=(0.2,),
        handler_timeout=30.0,
        **settings,
    )
    slow_running = 0

    def slow_started(delivery: Delivery) -> None:
        nonlocal slow_running
        report.slow_runs.append((delivery.attempt, delivery.redelivered))
        if slow_running:
            report.slow_overlaps += 1
        slow_running += 1

    def slow_ended() -> None:
        nonlocal slow_running
        slow_running -= 1

    if sync:

        @consumer.handler(queue)
        def sync_handler(delivery: Delivery) -> None:
            if delivery.message_id == "slow":
                slow_started(delivery)
                try:
                    time.sleep(SLOW)
                finally:
                    slow_ended()
                return
            time.sleep(0.02)
            report.fast_effects[delivery.message_id] += 1

    else:

        @consumer.handler(queue)
        async def async_handler(delivery: Delivery) -> None:
            if delivery.message_id == "slow":
                slow_started(delivery)
                try:
                    await asyncio.sleep(SLOW)
                finally:
                    slow_ended()
                return
            await asyncio.sleep(0.02)
            report.fast_effects[delivery.message_id] += 1

    dlq = consumer.topology(queue).dead_letter_queue
    with structlog.testing.capture_logs() as logs:
        async with consumer, ReliablePublisher(url, registry=CollectorRegistry()) as publisher:
            await publisher.publish(b"slow", routing_key=queue, message_id="slow")
            deadline = time.monotonic() + 60
            n = 0
            while consumer.stats().dead_lettered < 1:
                assert time.monotonic() < deadline, f"not dead-lettered: {report.slow_runs}"
                ids = [f"fast-{n + i}" for i in range(5)]
                n += len(ids)
                for message_id in ids:
                    await publisher.publish(b"fast", routing_key=queue, message_id=message_id)
                report.published += ids
                await asyncio.sleep(0.2)
            deadline = time.monotonic() + 30
            while set(report.fast_effects) != set(report.published) or slow_running:
                assert time.monotonic() < deadline, "fast messages not all handled"
                await asyncio.sleep(0.05)
            report.reopens = consumer.stats().channel_reopens
    report.logs = list(logs)
    for message in await _drain(url, dlq):
        report.dead[str(message.message_id)] = dict(message.headers)
    for name in consumer.topology(queue).all_queues:
        if name != dlq:
            report.left[name] = len(await _drain(url, name))
    return report


def _check(report: Report, *, configured: bool) -> None:
    attempts = [attempt for attempt, _ in report.slow_runs]
    assert attempts == list(range(1, MAX_ATTEMPTS + 1)), report.slow_runs  # one run each
    assert report.slow_overlaps == 0  # never twice at once
    assert list(report.dead) == ["slow"]
    headers = report.dead["slow"]
    assert headers[REASON_HEADER] == "max_attempts"
    assert headers[ATTEMPTS_HEADER] == MAX_ATTEMPTS
    assert "consumer_timeout" in headers[ERROR_MESSAGE_HEADER]
    assert set(report.fast_effects) == set(report.published)
    assert set(report.fast_effects.values()) == {1}  # one effect each, none lost
    assert set(report.left.values()) == {0}
    events = collections.Counter(e["event"] for e in report.logs)
    if configured:  # every run cut by the consumer, before the broker's timeout
        assert report.reopens == 0
        assert (events["consumer_timeout"], events["consumer_timeout_learned"]) == (0, 0)
        assert events["handler_cut_for_consumer_timeout"] == MAX_ATTEMPTS
        return
    # The broker cut the first run (and named its timeout); the consumer cut the others.
    assert report.reopens == 1
    assert events["consumer_timeout_learned"] == 1
    assert events["handler_cut_for_consumer_timeout"] == MAX_ATTEMPTS - 1
    (timeout,) = [e for e in report.logs if e["event"] == "consumer_timeout"]
    assert timeout["log_level"] == "error"
    assert (timeout["message_id"], timeout["consumer_timeout"]) == ("slow", BROKER_TIMEOUT)
    assert timeout["queue"].startswith("test-ctimeout-") and timeout["counted"] is True
    assert BROKER_TIMEOUT - 0.5 <= timeout["handler_ran"] < SLOW


class TestConsumerTimeout:
    @pytest.mark.parametrize(
        ("sync", "configured"),
        [(False, False), (True, False), (False, True)],
        ids=["async_def", "plain_def", "async_def_configured"],
    )
    async def test_slow_handler_counts_attempts_and_ends_in_the_dlq(
        self, node: PrivateBroker, queue: str, sync: bool, configured: bool
    ) -> None:
        """Each slow run is one attempt (the first cut by the broker, which closes the
        channel; the next ones by the consumer, which learned the broker's timeout, or
        knew it from its settings), the message ends in the DLQ after max_attempts, it
        never runs twice at once, and every fast message has exactly one effect."""
        settings = {"consumer_timeout": BROKER_TIMEOUT} if configured else {}
        report = await _scenario(node.url, queue, sync=sync, **settings)
        print(  # noqa: T201 - the figures of the issue's proof (pytest -s)
            f"\nconsumer_timeout, {'plain def' if sync else 'async def'}"
            f"{', configured' if configured else ''}: slow runs {report.slow_runs}, in the "
            f"DLQ: {sorted(report.dead)} ({report.dead['slow'].get(ERROR_MESSAGE_HEADER)!r}), "
            f"fast effects {dict(collections.Counter(report.fast_effects.values()))} over "
            f"{len(report.published)} messages, channel reopens {report.reopens}"
        )
        _check(report, configured=configured)


class TestWaitingForASlot:
    async def test_a_delivery_that_waited_half_its_time_is_deferred_not_counted(
        self, node: PrivateBroker, queue: str
    ) -> None:
        """concurrency 1, 1 s handlers, 6 queued: the later ones would wait in the
        prefetch buffer past the broker's timeout. Those that used half the time before
        the cut waiting go round the retry queue instead, not counted: every message runs
        once at attempt 1 and the broker never closes the channel."""
        consumer = ReliableConsumer(
            ConnectionSettings(url=SecretStr(node.url), connection_name=queue),
            registry=CollectorRegistry(),
            prefetch=10,
            concurrency=1,
            retry_delays=(0.2,),
            consumer_timeout=BROKER_TIMEOUT,
        )
        runs: list[tuple[str, int]] = []

        @consumer.handler(queue)
        async def handler(delivery: Delivery) -> None:
            runs.append((delivery.message_id, delivery.attempt))
            await asyncio.sleep(1.0)

        ids = [f"m{n}" for n in range(6)]
        async with consumer, ReliablePublisher(node.url, registry=CollectorRegistry()) as pub:
            for message_id in ids:
                await pub.publish(b"x", routing_key=queue, message_id=message_id)
            deadline = time.monotonic() + 40
            while consumer.stats().acked < len(ids) or consumer.stats().in_progress:
                assert time.monotonic() < deadline, runs
                await asyncio.sleep(0.05)
            stats = consumer.stats()
        assert sorted(runs) == [(m, 1) for m in ids]  # each once, no attempt counted
        assert stats.deferred >= 3 and stats.retried == 0
        assert stats.channel_reopens == 0


# -- the pieces, without a broker ---------------------------------------------------


def _timeout_fault(text: str = CONSUMER_TIMEOUT_TEXT) -> Any:
    fault = classify(aiormq.exceptions.ChannelPreconditionFailed(text))
    assert fault is not None and fault.kind is FaultKind.CONSUMER_TIMEOUT
    return fault


def _timed_session(**settings: Any) -> Any:
    from reliable_mq._consume.session import Session, Shared
    from reliable_mq.settings import ConsumerSettings

    route = _route(**settings)
    return Session(Shared(ConsumerSettings(**settings)), route, _Channel())  # type: ignore[arg-type]


def _running(session: Any, tag: int, ran: float | None, **delivery: Any) -> Any:
    ticket = _ticket(session, tag)
    for name, value in delivery.items():
        setattr(ticket.delivery, name, value)
    if ran is not None:
        ticket.started = time.perf_counter() - ran
    return ticket


class TestConsumerTimedOut:
    def test_the_oldest_and_those_over_the_named_timeout_are_counted(self) -> None:
        """Only handlers that ran past the broker's timeout (and the oldest unacked
        delivery, which the broker checks) are recorded; the value is learned."""
        session = _timed_session()
        for tag, ran in [(1, 4.2), (2, 4.1), (3, 1.0), (4, None), (5, 4.5)]:
            _running(session, tag, ran)
        session.tracker.finish(5)  # finished, its ack batched: not the handler's fault
        with structlog.testing.capture_logs() as logs:
            session.consumer_timed_out(_timeout_fault())
        route = session.route
        assert [e["message_id"] for e in logs if e["event"] == "consumer_timeout"] == ["m1", "m2"]
        assert route.take_overran(_redelivered("m1")) is not None
        assert route.take_overran(_redelivered("m2")) is not None
        assert route.take_overran(_redelivered("m3")) is None
        assert route.take_overran(_redelivered("m4")) is None
        assert route.take_overran(_redelivered("m5")) is None
        assert session.shared.consumer_timeout == BROKER_TIMEOUT
        assert session.shared.broker_cut == pytest.approx(3.4)

    def test_an_older_broker_names_no_value_only_the_oldest_counts(self) -> None:
        """Without the value in the text (RabbitMQ < 3.9), only the oldest is known."""
        session = _timed_session()
        _running(session, 1, 9.0)
        _running(session, 2, 9.0)
        session.consumer_timed_out(
            _timeout_fault("PRECONDITION_FAILED - delivery acknowledgement on channel 1 timed out")
        )
        assert session.route.take_overran(_redelivered("m1")) is not None
        assert session.route.take_overran(_redelivered("m2")) is None
        assert session.shared.broker_cut is None  # nothing learned

    def test_the_oldest_waiting_for_a_slot_is_named_not_counted(self) -> None:
        """The oldest unacked delivery never reached a handler: logged, no attempt."""
        session = _timed_session()
        _running(session, 1, None)
        with structlog.testing.capture_logs() as logs:
            session.consumer_timed_out(_timeout_fault())
        (event,) = [e for e in logs if e["event"] == "consumer_timeout"]
        assert event["counted"] is False and "handler slot" in event["waiting"]
        assert session.route.take_overran(_redelivered("m1")) is None


def _redelivered(message_id: str, attempt: int = 1, **fields: Any) -> Delivery:
    return Delivery(
        body=b"x",
        message_id=message_id,
        headers={},
        redelivered=fields.pop("redelivered", True),
        attempt=attempt,
        queue="q",
        exchange="",
        routing_key="q",
        content_type=None,
    )


class TestOverran:
    def test_only_the_brokers_redelivery_of_that_attempt_matches_once(self) -> None:
        route = _route()
        route.overran(_redelivered("a", 2), 4.2, 4.0)
        assert route.take_overran(_redelivered("a", 2, redelivered=False)) is None  # consumed
        route.overran(_redelivered("a", 2), 4.2, 4.0)
        assert route.take_overran(_redelivered("a", 3)) is None  # another attempt
        route.overran(_redelivered("a", 2), 4.2, 4.0)
        assert route.take_overran(_redelivered("a", 2)) == (2, 4.2, 4.0)
        assert route.take_overran(_redelivered("a", 2)) is None  # once

    def test_a_quorum_queue_counted_it_already(self) -> None:
        """x-delivery-count raised the attempt: it is brought back, counted once."""
        route = _route()
        route.quorum = True
        route.overran(_redelivered("a", 1), 4.2, 4.0)
        delivery = _redelivered("a", 2)
        assert route.take_overran(delivery) is not None
        assert delivery.attempt == 1

    def test_memory_is_bounded(self) -> None:
        route = _route()
        for n in range(HELD_MESSAGES + 10):
            route.overran(_redelivered(f"m{n}"), 5.0, 4.0)
        assert route.take_overran(_redelivered("m0")) is None
        assert route.take_overran(_redelivered(f"m{HELD_MESSAGES + 9}")) is not None


class TestBrokerCut:
    @pytest.mark.parametrize(("limit", "cut"), [(4.0, 3.4), (60.0, 51.0), (1800.0, 1770.0)])
    def test_cut(self, limit: float, cut: float) -> None:
        """85 % of the broker's timeout, at most 30 s before it."""
        assert broker_cut(limit) == pytest.approx(cut)

    def test_configured_timeout_cuts_before_handler_timeout(self) -> None:
        from reliable_mq._consume.dispatch import _deadline

        session = _timed_session(consumer_timeout=4.0, handler_timeout=30.0)
        cut = session.shared.broker_cut
        ticket = _running(session, 1, 0.0)
        deadline = _deadline(ticket, ticket.started, 30.0, cut)
        assert deadline == pytest.approx(ticket.admitted + 3.4) and ticket.for_broker
        quick = _running(session, 2, 0.0)
        assert _deadline(quick, quick.started, 1.0, cut) == quick.started + 1.0
        assert not quick.for_broker
