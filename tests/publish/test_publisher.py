"""ReliablePublisher against the real broker: confirms, nacks, returns, cuts, deadlines."""

from __future__ import annotations

import asyncio
import bisect
import json
import subprocess
import time
import uuid
from typing import Any

import aio_pika
import pytest
from pamqp.commands import Basic
from prometheus_client import CollectorRegistry
from pydantic import BaseModel

from reliable_mq import (
    ClosedError,
    ConnectionSettings,
    ExchangeNotFound,
    InvalidBody,
    InvalidMessage,
    MessageTooLarge,
    PublishAborted,
    PublisherSettings,
    PublishGaveUp,
    PublishTimeout,
    PublishUnroutable,
    ReliablePublisher,
)
from reliable_mq.testing import TCPProxy
from tests.conftest import proxied_url
from tests.support.amqp import drain_queue
from tests.support.waiting import wait_until

pytestmark = pytest.mark.rabbitmq


class Order(BaseModel):
    order_id: int
    item: str


def fast_settings(**overrides: Any) -> PublisherSettings:
    values: dict[str, Any] = {
        "max_in_flight": 500,
        "publish_timeout": 30,
        "backoff_initial": 0.01,
        "backoff_max": 0.2,
    }
    values.update(overrides)
    return PublisherSettings(**values)


def conn(url: str, **overrides: Any) -> ConnectionSettings:
    values: dict[str, Any] = {
        "url": url,
        "connection_name": f"test-{uuid.uuid4().hex[:8]}",
        "reconnect_initial_delay": 0.05,
        "reconnect_max_delay": 0.5,
        "connect_timeout": 5,
    }
    values.update(overrides)
    return ConnectionSettings(**values)


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


class TestPublishBasics:
    async def test_publish_returns_after_confirm_with_stable_id(
        self, broker_url: str, queue: str, registry: CollectorRegistry
    ) -> None:
        """A confirmed message carries its id, persistence and content type into the queue."""
        async with ReliablePublisher(conn(broker_url), registry=registry) as publisher:
            result = await publisher.publish(
                {"n": 1}, routing_key=queue, message_id="order-1", headers={"k": "v"}
            )
        assert result.message_id == "order-1"
        assert result.attempts == 1
        assert 0 < result.confirm_latency <= result.elapsed < 5
        drained = await drain_queue(broker_url, queue, settled=True)
        assert [m.message_id for m in drained] == ["order-1"]
        assert json.loads(drained[0].body) == {"n": 1}
        assert drained[0].headers == {"k": "v"}

    async def test_body_types_are_encoded_with_content_types(
        self, broker_url: str, queue: str, amqp: aio_pika.abc.AbstractChannel
    ) -> None:
        """bytes, str, pydantic models and dicts each get their encoding and content type."""
        async with ReliablePublisher(conn(broker_url), registry=CollectorRegistry()) as publisher:
            await publisher.publish(b"\x00raw", routing_key=queue, message_id="b")
            await publisher.publish("héllo", routing_key=queue, message_id="s")
            await publisher.publish(
                Order(order_id=7, item="tea"), routing_key=queue, message_id="m"
            )
            await publisher.publish([1, 2], routing_key=queue, message_id="l")
            with pytest.raises(InvalidBody):
                await publisher.publish(object(), routing_key=queue)
        got: dict[str, tuple[bytes, str | None, int | None]] = {}
        declared = await amqp.declare_queue(queue, passive=True)
        for _ in range(4):
            message = await declared.get(timeout=5)
            assert message is not None
            await message.ack()
            assert message.message_id is not None
            got[message.message_id] = (message.body, message.content_type, message.delivery_mode)
        assert got["b"] == (b"\x00raw", "application/octet-stream", 2)
        assert got["s"] == ("héllo".encode(), "text/plain; charset=utf-8", 2)
        assert json.loads(got["m"][0]) == {"order_id": 7, "item": "tea"}
        assert got["m"][1] == "application/json"
        assert got["l"][0] == b"[1,2]"

    async def test_message_ids_are_generated_unique(self, broker_url: str, queue: str) -> None:
        """Without a message_id each message gets its own."""
        async with ReliablePublisher(conn(broker_url), registry=CollectorRegistry()) as publisher:
            results = await asyncio.gather(
                *(publisher.publish(b"x", routing_key=queue) for _ in range(200))
            )
        assert len({r.message_id for r in results}) == 200

    async def test_invalid_messages_fail_before_sending(self, broker_url: str, queue: str) -> None:
        """Oversized bodies and overlong routing keys get typed errors; nothing is sent."""
        settings = fast_settings(max_message_size=1000)
        async with ReliablePublisher(
            conn(broker_url), settings=settings, registry=CollectorRegistry()
        ) as publisher:
            with pytest.raises(MessageTooLarge) as too_large:
                await publisher.publish(b"x" * 1001, routing_key=queue)
            assert too_large.value.attempts == 0
            with pytest.raises(InvalidMessage):
                await publisher.publish(b"x", routing_key="r" * 300)
            with pytest.raises(InvalidMessage):
                await publisher.publish(b"x", routing_key=queue, headers={"bad": object()})
            assert (await publisher.publish(b"ok", routing_key=queue)).attempts == 1
        assert [m.body for m in await drain_queue(broker_url, queue, settled=True)] == [b"ok"]

    async def test_closed_publisher_refuses_work(self, broker_url: str, queue: str) -> None:
        publisher = ReliablePublisher(conn(broker_url), registry=CollectorRegistry())
        with pytest.raises(ClosedError):
            await publisher.publish(b"x", routing_key=queue)
        async with publisher:
            pass
        with pytest.raises(ClosedError):
            await publisher.publish(b"x", routing_key=queue)


class TestStreaming:
    async def test_window_bounds_in_flight_and_everything_arrives(
        self, broker_url: str, queue: str, registry: CollectorRegistry
    ) -> None:
        """5,000 concurrent publishes never hold more than max_in_flight slots."""
        settings = fast_settings(max_in_flight=100)
        async with ReliablePublisher(conn(broker_url), settings=settings, registry=registry) as p:
            results = await asyncio.gather(
                *(p.publish(b"x", routing_key=queue, message_id=f"m{i}") for i in range(5000))
            )
            stats = p.stats()
        assert stats.max_in_flight_seen == 100
        assert stats.confirmed == 5000
        assert stats.in_flight == 0
        assert {r.message_id for r in results} == {f"m{i}" for i in range(5000)}
        drained = await drain_queue(broker_url, queue)
        assert sorted(m.message_id or "" for m in drained) == sorted(f"m{i}" for i in range(5000))
        assert (
            sample(registry, "reliable_mq_confirmed_messages_total", exchange="amq.default") == 5000
        )
        assert (
            sample(registry, "reliable_mq_confirm_latency_seconds_count", exchange="amq.default")
            == 5000
        )

    async def test_multiple_acks_resolve_every_message_up_to_the_tag(
        self, broker_url: str, queue: str
    ) -> None:
        """The broker coalesces acks (multiple=true); every covered message still resolves once."""
        frames: list[Basic.Ack | Basic.Nack] = []
        async with ReliablePublisher(conn(broker_url), registry=CollectorRegistry()) as publisher:
            generation = publisher._engine._stream.current
            assert generation is not None
            channel = generation.channel._channel  # aiormq's, under the seam's
            original = channel._on_confirm_frame

            async def spy(frame: Basic.Ack | Basic.Nack) -> None:
                frames.append(frame)
                await original(frame)

            channel._on_confirm_frame = spy  # type: ignore[method-assign]
            results = await asyncio.gather(
                *(publisher.publish(b"x" * 256, routing_key=queue) for _ in range(3000))
            )
        assert len(results) == 3000
        multiple = [f for f in frames if f.multiple]
        assert multiple, "the broker sent no multiple=true ack; cannot prove fan-out"
        assert len(frames) < 3000
        assert max(f.delivery_tag for f in frames) == 3000

    async def test_enqueue_returns_once_in_flight_and_flush_waits(
        self, broker_url: str, queue: str
    ) -> None:
        """enqueue() hands back a pending outcome; flush() waits for every confirm."""
        async with ReliablePublisher(conn(broker_url), registry=CollectorRegistry()) as publisher:
            pending = [await publisher.enqueue(b"x", routing_key=queue) for _ in range(1000)]
            await publisher.flush(timeout=30)
            assert all(p.done() for p in pending)
            assert publisher.in_flight == 0
            results = [await p for p in pending]
        assert [r.message_id for r in results] == [p.message_id for p in pending]

    async def test_backpressure_blocks_beyond_the_window(self, broker_url: str, queue: str) -> None:
        """With the link stalled, the call after max_in_flight waits instead of buffering."""
        async with TCPProxy("127.0.0.1", 5672) as proxy:
            settings = fast_settings(max_in_flight=10, confirm_timeout=60)
            async with ReliablePublisher(
                conn(proxied_url(proxy)), settings=settings, registry=CollectorRegistry()
            ) as publisher:
                proxy.set_stall(True)
                pending = [await publisher.enqueue(b"x", routing_key=queue) for _ in range(10)]
                eleventh = asyncio.ensure_future(publisher.enqueue(b"x", routing_key=queue))
                await asyncio.sleep(0.3)
                assert not eleventh.done()
                assert publisher.in_flight == 10
                proxy.set_stall(False)
                await asyncio.wait_for(eleventh, 10)
                await publisher.flush(timeout=10)
                assert [(await p).attempts for p in pending] == [1] * 10


class TestBrokerOutcomes:
    async def test_unroutable_is_returned_not_retried(
        self, broker_url: str, registry: CollectorRegistry
    ) -> None:
        """basic.return comes before the ack: the caller gets PublishUnroutable, attempts=1."""
        async with ReliablePublisher(conn(broker_url), registry=registry) as publisher:
            with pytest.raises(PublishUnroutable) as caught:
                await publisher.publish(b"x", routing_key=f"nowhere-{uuid.uuid4().hex}")
            assert caught.value.attempts == 1
            assert caught.value.reply_code == 312
            assert publisher.stats().returned == 1
        assert sample(registry, "reliable_mq_returned_messages_total", exchange="amq.default") == 1

    async def test_missing_exchange_fails_fast_and_publisher_recovers(
        self, broker_url: str, queue: str
    ) -> None:
        """A missing exchange is found by a passive declare on a probe channel, which takes
        the 404: the caller gets ExchangeNotFound, and the publish channel, never closed,
        carries the others once each."""
        async with ReliablePublisher(conn(broker_url), registry=CollectorRegistry()) as publisher:
            good = [publisher.publish(b"g", routing_key=queue) for _ in range(50)]
            bad = publisher.publish(b"b", routing_key="x", exchange=f"missing-{uuid.uuid4().hex}")
            outcomes = await asyncio.gather(*good, bad, return_exceptions=True)
            assert isinstance(outcomes[-1], ExchangeNotFound)
            assert all(not isinstance(o, BaseException) for o in outcomes[:-1])
            assert (await publisher.publish(b"after", routing_key=queue)).message_id
            assert publisher.stats().channel_generation == 1
            assert publisher.stats().republished == 0
        assert len(await drain_queue(broker_url, queue)) == 51

    async def test_broker_nack_is_republished_until_there_is_room(
        self, broker_url: str, amqp: aio_pika.abc.AbstractChannel, registry: CollectorRegistry
    ) -> None:
        """reject-publish overflow nacks; once a consumer drains, the republish is confirmed."""
        name = f"test-nack-{uuid.uuid4().hex[:8]}"
        declared = await amqp.declare_queue(
            name, durable=True, arguments={"x-max-length": 10, "x-overflow": "reject-publish"}
        )
        try:
            settings = fast_settings(max_attempts=1000, backoff_initial=0.02, backoff_max=0.05)
            async with ReliablePublisher(
                conn(broker_url), settings=settings, registry=registry
            ) as publisher:
                publishes = asyncio.gather(
                    *(
                        publisher.publish(b"x", routing_key=name, message_id=f"n{i}")
                        for i in range(30)
                    )
                )
                await wait_until(lambda: publisher.stats().nacked > 0, timeout=10)
                seen: list[str] = []

                async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
                    seen.append(message.message_id or "")
                    await message.ack()

                await declared.consume(on_message)
                results = await asyncio.wait_for(publishes, 30)
                stats = publisher.stats()
            await wait_until(lambda: len(set(seen)) == 30, timeout=10)
            assert stats.nacked > 0
            assert stats.republished >= stats.nacked
            assert max(r.attempts for r in results) > 1
            assert sample(registry, "reliable_mq_nacked_messages_total", exchange="amq.default") > 0
            assert (
                sample(
                    registry,
                    "reliable_mq_republished_messages_total",
                    exchange="amq.default",
                    reason="nack",
                )
                > 0
            )
        finally:
            await declared.delete(if_unused=False, if_empty=False)

    async def test_nacked_max_attempts_times_gives_up(
        self, broker_url: str, amqp: aio_pika.abc.AbstractChannel
    ) -> None:
        """A message nacked max_attempts times fails with PublishGaveUp naming the attempts."""
        name = f"test-nack-{uuid.uuid4().hex[:8]}"
        declared = await amqp.declare_queue(
            name, durable=True, arguments={"x-max-length": 0, "x-overflow": "reject-publish"}
        )
        try:
            settings = fast_settings(max_attempts=3)
            async with ReliablePublisher(
                conn(broker_url), settings=settings, registry=CollectorRegistry()
            ) as publisher:
                with pytest.raises(PublishGaveUp) as caught:
                    await publisher.publish(b"x", routing_key=name, message_id="doomed")
            assert caught.value.attempts == 3
            assert caught.value.message_id == "doomed"
        finally:
            await declared.delete(if_unused=False, if_empty=False)


def ascending_streams(order: list[int]) -> int:
    """The fewest ascending (non-decreasing) streams whose interleaving is ``order``:
    the length of its longest strictly descending subsequence (Dilworth)."""
    tails: list[int] = []  # patience sorting on the negated values
    for value in order:
        index = bisect.bisect_left(tails, -value)
        if index == len(tails):
            tails.append(-value)
        else:
            tails[index] = -value
    return len(tails)


async def _publish_through_cuts(
    publisher: ReliablePublisher, queue: str, count: int, cut: Any, cut_at: tuple[int, ...]
) -> list[Any]:
    tasks = [
        asyncio.ensure_future(
            publisher.publish(str(i).encode(), routing_key=queue, message_id=f"c{i}")
        )
        for i in range(count)
    ]
    for threshold in cut_at:
        await wait_until(lambda t=threshold: publisher.stats().confirmed >= t, timeout=30)
        await cut()
    return await asyncio.wait_for(asyncio.gather(*tasks), 60)


class TestConnectionLoss:
    async def test_cut_connection_republishes_everything_unconfirmed(
        self, broker_url: str, queue: str, registry: CollectorRegistry
    ) -> None:
        """Two cuts with thousands in flight: every publish confirms, every id arrives."""
        async with TCPProxy("127.0.0.1", 5672) as proxy:
            settings = fast_settings(max_in_flight=1000)
            async with ReliablePublisher(
                conn(proxied_url(proxy)), settings=settings, registry=registry
            ) as publisher:
                results = await _publish_through_cuts(
                    publisher, queue, 6000, proxy.cut, (1500, 3500)
                )
                stats = publisher.stats()
        assert len(results) == 6000
        assert stats.channel_generation >= 3
        assert stats.republished > 0
        drained = await drain_queue(broker_url, queue)
        ids = [m.message_id for m in drained]
        expected = {f"c{i}" for i in range(6000)}
        assert expected <= set(ids), "a confirmed message is missing"
        assert set(ids) <= expected, "the queue holds a message nobody published"
        assert sample(registry, "reliable_mq_connection_recoveries_total",
                      connection=f"{publisher._supervisor.name}") >= 2  # fmt: skip

    async def test_republish_keeps_the_original_order(self, broker_url: str, queue: str) -> None:
        """After a cut, the unconfirmed messages go out again in publish order.

        The queue holds two streams, each in publish order: what the dead
        connection delivered, and what the new one sent. They may interleave:
        the broker goes on reading frames the dead connection had already
        written into its socket while the new connection republishes (seen
        about 1 run in 4: 800, 1983, 801, 1984, ...). So the order is checked
        as "at most two ascending streams" (its longest strictly descending
        subsequence is at most 2 long), not as "at most one descent", which
        failed on that interleaving although each stream was in order.
        """
        async with TCPProxy("127.0.0.1", 5672) as proxy:
            settings = fast_settings(max_in_flight=3000)
            async with ReliablePublisher(
                conn(proxied_url(proxy)), settings=settings, registry=CollectorRegistry()
            ) as publisher:
                await _publish_through_cuts(publisher, queue, 3000, proxy.cut, (500,))
        order = [int(m.body) for m in await drain_queue(broker_url, queue)]
        assert ascending_streams(order) <= 2, "republished out of order"
        assert set(order) == set(range(3000))

    async def test_publish_while_disconnected_waits_for_reconnect(
        self, broker_url: str, queue: str
    ) -> None:
        """publish() during an outage waits, then confirms once the broker is reachable."""
        async with TCPProxy("127.0.0.1", 5672) as proxy:
            async with ReliablePublisher(
                conn(proxied_url(proxy)), settings=fast_settings(), registry=CollectorRegistry()
            ) as publisher:
                proxy.set_refuse(True)
                await proxy.cut()
                publish = asyncio.ensure_future(publisher.publish(b"late", routing_key=queue))
                await asyncio.sleep(1.0)
                assert not publish.done()
                proxy.set_refuse(False)
                result = await asyncio.wait_for(publish, 15)
        assert result.attempts >= 1
        assert [m.body for m in await drain_queue(broker_url, queue)] == [b"late"]

    async def test_deadline_bounds_the_wait_during_an_outage(
        self, broker_url: str, queue: str
    ) -> None:
        """With the broker unreachable, publish() raises PublishTimeout at its deadline."""
        async with TCPProxy("127.0.0.1", 5672) as proxy:
            async with ReliablePublisher(
                conn(proxied_url(proxy)), settings=fast_settings(), registry=CollectorRegistry()
            ) as publisher:
                proxy.set_refuse(True)
                await proxy.cut()
                started = time.monotonic()
                with pytest.raises(PublishTimeout):
                    await publisher.publish(b"x", routing_key=queue, timeout=1.0)
                assert 0.9 < time.monotonic() - started < 3
                proxy.set_refuse(False)
                await publisher.publish(b"y", routing_key=queue)

    async def test_stuck_channel_is_replaced_after_confirm_timeout(
        self, broker_url: str, queue: str
    ) -> None:
        """No confirm within confirm_timeout: a new channel carries the republish."""
        async with TCPProxy("127.0.0.1", 5672) as proxy:
            settings = fast_settings(confirm_timeout=0.5, max_attempts=10)
            async with ReliablePublisher(
                conn(proxied_url(proxy), heartbeat=0),
                settings=settings,
                registry=CollectorRegistry(),
            ) as publisher:
                proxy.set_stall(True)
                publish = asyncio.ensure_future(publisher.publish(b"s", routing_key=queue))
                await asyncio.sleep(1.2)
                proxy.set_stall(False)
                result = await asyncio.wait_for(publish, 20)
        assert result.attempts >= 2
        drained = await drain_queue(broker_url, queue)
        assert {m.message_id for m in drained} == {result.message_id}

    async def test_server_side_close_of_our_connection(self, broker_url: str, queue: str) -> None:
        """rabbitmqctl close_connection mid-stream: everything still confirms and arrives."""
        settings = conn(broker_url)
        async with ReliablePublisher(
            settings, settings=fast_settings(), registry=CollectorRegistry()
        ) as publisher:
            pending: list[Any] = []
            stop = asyncio.Event()

            async def produce() -> None:
                while not stop.is_set():
                    pending.append(await publisher.enqueue(b"x", routing_key=queue))
                    if len(pending) % 200 == 0:
                        await asyncio.sleep(0.01)  # keep the stream going, not the CPU pinned

            producer = asyncio.ensure_future(produce())
            await wait_until(lambda: publisher.stats().confirmed >= 500, timeout=30)
            await asyncio.to_thread(
                _close_connection_named, f"{settings.connection_name}.publisher"
            )
            await wait_until(lambda: publisher.stats().channel_generation >= 2, timeout=30)
            await asyncio.sleep(0.2)
            stop.set()
            await producer
            results = [await p for p in pending]
        ids = {m.message_id for m in await drain_queue(broker_url, queue)}
        assert {r.message_id for r in results} <= ids


def _close_connection_named(name: str) -> None:
    listing = subprocess.run(
        ["rabbitmqctl", "-q", "list_connections", "pid", "client_properties"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    pids = [line.split("\t", 1)[0] for line in listing.splitlines() if f'"{name}"' in line]
    assert pids, f"no connection named {name}"
    for pid in pids:
        subprocess.run(
            ["rabbitmqctl", "-q", "close_connection", pid, "closed by test"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip


class TestClose:
    async def test_close_waits_for_outstanding_confirms(self, broker_url: str, queue: str) -> None:
        """close() drains: messages enqueued before it are all confirmed."""
        publisher = ReliablePublisher(conn(broker_url), registry=CollectorRegistry())
        await publisher.start()
        pending = [await publisher.enqueue(b"x", routing_key=queue) for _ in range(2000)]
        await publisher.close()
        assert all(p.done() for p in pending)
        assert {(await p).attempts for p in pending} == {1}
        assert len(await drain_queue(broker_url, queue)) == 2000

    async def test_close_fails_what_it_cannot_confirm(self, broker_url: str, queue: str) -> None:
        """With the link stalled, close(timeout) aborts the rest with PublishAborted."""
        async with TCPProxy("127.0.0.1", 5672) as proxy:
            publisher = ReliablePublisher(
                conn(proxied_url(proxy), heartbeat=0),
                settings=fast_settings(confirm_timeout=60),
                registry=CollectorRegistry(),
            )
            await publisher.start()
            proxy.set_stall(True)
            pending = [await publisher.enqueue(b"x", routing_key=queue) for _ in range(20)]
            started = time.monotonic()
            await publisher.close(timeout=0.5)
            assert time.monotonic() - started < 15
            for p in pending:
                with pytest.raises(PublishAborted):
                    await p
            proxy.set_stall(False)


class TestAscendingStreams:
    """The order check of the republish test, on orders whose answer is known."""

    @pytest.mark.unit
    @pytest.mark.parametrize(
        ("order", "streams"),
        [
            ([], 0),
            ([0, 1, 2, 3], 1),
            ([0, 1, 2, 1, 2, 3], 2),  # a republish after a cut: one descent
            ([0, 1, 5, 2, 6, 3, 7], 2),  # two streams interleaved (the dead connection's tail)
            ([0, 5, 2, 6, 1, 7], 3),  # 5, 2, 1: a third stream
            ([3, 2, 1, 0], 4),  # republished in reverse
            ([1, 1, 1], 1),  # duplicates in a row are one stream
        ],
    )
    def test_streams(self, order: list[int], streams: int) -> None:
        assert ascending_streams(order) == streams
