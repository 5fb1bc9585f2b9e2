"""Work done, ack lost: a channel that dies between a handler's return and the
broker taking its ack must not make the message run twice.

The broker requeues every delivery it holds unacked when a channel or a
connection dies, and delivers it again (``redelivered``). Acks still batched
are covered by the consumer's dedup store (the id was marked done before the
ack was batched). A plain ``def`` handler that finishes in its thread after
the channel died, and an ack (or a copy's ack) that finds the channel dead,
are recorded in memory (`reliable_mq._consume.acks.LostAcks`): the
redelivery is acked without running the handler again, with or without a
dedup store. Cut with a real TCP proxy in front of the shared broker. Before
this, the thread's message ran twice.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time

import pytest
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from reliable_mq import ConnectionSettings, ReliablePublisher
from reliable_mq._consume.acks import LostAcks
from reliable_mq.consumer import ReliableConsumer
from reliable_mq.delivery import Delivery
from reliable_mq.testing import TCPProxy
from tests.conftest import proxied_url
from tests.support.amqp import drain_queue
from tests.support.waiting import wait_until


def _consumer(proxy: TCPProxy, queue: str, **settings: object) -> ReliableConsumer:
    return ReliableConsumer(
        ConnectionSettings(
            url=SecretStr(proxied_url(proxy)), connection_name=queue, reconnect_initial_delay=0.1
        ),
        registry=CollectorRegistry(),
        retry_delays=(0.2,),
        **settings,  # type: ignore[arg-type]
    )


@pytest.mark.rabbitmq
class TestLostAcks:
    async def test_batched_acks_lost_with_the_connection(
        self, broker_url: str, queue: str, proxy: TCPProxy
    ) -> None:
        """20 handled, their acks still batched when the connection is cut: each of the
        20 redeliveries is acked without running (the dedup store knows them done);
        every message had one effect."""
        consumer = _consumer(proxy, queue, ack_batch_size=1000, ack_flush_interval=10.0)
        effects: collections.Counter[str] = collections.Counter()
        redelivered: list[str] = []

        @consumer.handler(queue)
        async def handler(delivery: Delivery) -> None:
            effects[delivery.message_id] += 1

        ids = [f"m{n}" for n in range(20)]
        async with consumer, ReliablePublisher(broker_url, registry=CollectorRegistry()) as pub:
            for message_id in ids:
                await pub.publish(b"x", routing_key=queue, message_id=message_id)
            await wait_until(
                lambda: len(effects) == len(ids), timeout=10, what="every message handled"
            )
            assert consumer.stats().ack_frames == 0  # all 20 acks still batched
            assert await proxy.cut() > 0
            await wait_until(
                lambda: consumer.stats().duplicates == len(ids), timeout=15, what="redeliveries"
            )
            redelivered = [m for m in ids if effects[m] != 1]
            stats = consumer.stats()
        assert redelivered == []
        assert dict(effects) == dict.fromkeys(ids, 1)
        assert (stats.delivered, stats.duplicates, stats.channel_reopens) == (40, 20, 1)
        assert await drain_queue(broker_url, queue) == []  # the redeliveries were acked

    @pytest.mark.parametrize("dedup", ["memory", None])
    async def test_a_thread_that_finishes_after_the_channel_died(
        self, broker_url: str, queue: str, proxy: TCPProxy, dedup: str | None
    ) -> None:
        """A plain def handler still running when the connection is cut finishes its
        work in its thread: its redelivery (deferred while the thread ran) is acked
        without running again."""
        consumer = _consumer(proxy, queue, prefetch=10, dedup=dedup)
        effects: collections.Counter[str] = collections.Counter()
        started = threading.Event()

        @consumer.handler(queue)
        def handler(delivery: Delivery) -> None:
            started.set()
            if delivery.message_id == "slow":
                time.sleep(1.5)
            effects[delivery.message_id] += 1

        async with consumer, ReliablePublisher(broker_url, registry=CollectorRegistry()) as pub:
            await pub.publish(b"x", routing_key=queue, message_id="slow")
            await wait_until(started.is_set, timeout=10, what="the handler started")
            assert await proxy.cut() > 0
            await wait_until(
                lambda: consumer.stats().duplicates == 1, timeout=20, what="the redelivery"
            )
            await wait_until(lambda: consumer.stats().in_progress == 0, timeout=10, what="settled")
            await asyncio.sleep(0.5)  # nothing else comes
            stats = consumer.stats()
        assert dict(effects) == {"slow": 1}
        assert stats.stale >= 1 and stats.channel_reopens == 1
        assert await drain_queue(broker_url, queue) == []


class TestLostAcksTable:
    """`LostAcks` alone: which redelivery it answers, and for how long."""

    @pytest.mark.parametrize(
        ("recorded", "arrives", "counts_returns", "skipped"),
        [
            (1, 1, False, True),  # the broker's return of the done delivery
            (1, 2, False, False),  # a retry copy (attempt + 1): new work
            (1, 2, True, True),  # a quorum queue counted the return itself
            (2, 1, False, False),  # an older attempt: not this one
            (2, 3, True, True),
            (2, 4, True, False),
        ],
    )
    def test_which_attempt(
        self, recorded: int, arrives: int, counts_returns: bool, skipped: bool
    ) -> None:
        lost = LostAcks()
        lost.add("m", recorded, now=0.0)
        assert lost.take("m", arrives, 1.0, counts_returns=counts_returns) is skipped
        assert len(lost) == (0 if skipped else 1)

    def test_taken_once(self) -> None:
        lost = LostAcks()
        lost.add("m", 1, now=0.0)
        assert lost.take("m", 1, 1.0, counts_returns=False)
        assert not lost.take("m", 1, 1.0, counts_returns=False)  # a second copy runs

    def test_forgotten_after_its_ttl(self) -> None:
        lost = LostAcks(ttl=10.0)
        lost.add("m", 1, now=0.0)
        assert not lost.take("m", 1, 10.0, counts_returns=False)
        assert len(lost) == 0

    def test_bounded_oldest_forgotten_first(self) -> None:
        lost = LostAcks(capacity=3)
        for n in range(5):
            lost.add(f"m{n}", 1, now=float(n))
        assert len(lost) == 3
        assert not lost.take("m0", 1, 5.0, counts_returns=False)
        assert not lost.take("m1", 1, 5.0, counts_returns=False)
        assert lost.take("m4", 1, 5.0, counts_returns=False)

    def test_unknown_id(self) -> None:
        assert not LostAcks().take("m", 1, 0.0, counts_returns=False)

    @pytest.mark.unit
    def test_recorded_again_is_newest(self) -> None:
        """An id recorded again (a later attempt done) moves to the newest end: it is
        forgotten last when capacity runs out, with its new attempt and ttl."""
        lost = LostAcks(capacity=2, ttl=10.0)
        lost.add("a", 1, now=0.0)
        lost.add("b", 1, now=1.0)
        lost.add("a", 2, now=2.0)
        lost.add("c", 1, now=3.0)  # over capacity: "b" is now the oldest
        assert not lost.take("b", 1, 4.0, counts_returns=False)
        assert lost.take("a", 2, 11.0, counts_returns=False)  # ttl from its second record
        assert lost.take("c", 1, 4.0, counts_returns=False)
