"""The direct path (`reliable_mq._amqp.direct`): deliveries handed over by the frame reader.

A delivery is handed over only whole (method, header, one body frame) and only
while its channel's reader is idle; anything else is queued for the channel
exactly as aiormq's reader would have queued it, in order, the last frame read
going back to aiormq's loop. Unit tests drive `DirectChannel.take` with a real
``asyncio.Queue`` and a real waiting reader task; against the broker, the
consumer's channel is registered, deliveries of every body size arrive in tag
order with the publisher's frames interleaved on another connection, and
aiormq's last-frame time advances while only deliveries arrive.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from unittest import mock

import aio_pika
import pamqp.frame
import pytest
from pamqp.body import ContentBody
from pamqp.commands import Basic
from pamqp.header import ContentHeader
from prometheus_client import CollectorRegistry

from reliable_mq import ReliableConsumer
from reliable_mq._amqp.direct import (
    DirectChannel,
    DirectChannels,
    Received,
    buffered,
    whole_deliveries,
)
from reliable_mq._amqp.inbound import _plain_delivery, decode_frame
from reliable_mq.delivery import Delivery
from reliable_mq.topology import QueueTopology, delete_topology
from tests.support.waiting import wait_until

URL = os.environ.get("RELIABLE_MQ_TEST_URL", "amqp://guest:guest@127.0.0.1:5672/")


def _deliver(tag: int) -> Basic.Deliver:
    return Basic.Deliver(consumer_tag="ctag", delivery_tag=tag, routing_key="q")


def _header(size: int) -> ContentHeader:
    return ContentHeader(body_size=size, properties=Basic.Properties(message_id="m"))


def _reads(*frames: Received) -> Callable[[], Awaitable[Received]]:
    pending = list(frames)

    async def read() -> Received:
        return pending.pop(0)

    return read


def _nothing() -> None:
    return None


class _Channel:
    """A channel frame queue with a reader task waiting on it, as aiormq's is when idle."""

    def __init__(self) -> None:
        self.frames: asyncio.Queue[Any] = asyncio.Queue(maxsize=10)
        self.handed: list[tuple[Any, Any, bytes]] = []
        self.stamps = 0
        taker = DirectChannel.of(
            self.frames,
            lambda *args: self.handed.append(args),
            lambda *args: self.handed.append(args),  # (deliver, properties, body)
        )
        assert taker is not None
        self.taker = taker
        self.reader: asyncio.Task[Any] | None = None

    async def wait_idle(self) -> None:
        self.reader = asyncio.create_task(self.frames.get())
        await asyncio.sleep(0)  # the reader now waits in get()

    def stamp(self) -> None:
        self.stamps += 1

    async def take(self, *frames: Received) -> Received | None:
        return await self.taker.take(frames[0], _nothing, _reads(*frames[1:]), self.stamp)

    def queued(self) -> list[Any]:
        return [self.frames.get_nowait()[1] for _ in range(self.frames.qsize())]

    def stop(self) -> None:
        if self.reader is not None:
            self.reader.cancel()


@pytest.fixture(name="channel")
async def _channel() -> AsyncIterator[_Channel]:
    channel = _Channel()
    await channel.wait_idle()
    yield channel
    channel.stop()


@pytest.mark.unit
class TestTake:
    async def test_a_whole_delivery_is_handed_over(self, channel: _Channel) -> None:
        """Method, header and its one body frame: handed over, nothing queued, time noted."""
        deliver, header, body = _deliver(1), _header(3), ContentBody(b"abc")
        assert channel.taker.idle()
        assert await channel.take((20, 1, deliver), (30, 1, header), (11, 1, body)) is None
        assert channel.handed == [(deliver, header, b"abc")]
        assert channel.queued() == []
        assert channel.stamps == 1

    async def test_an_empty_body_takes_two_frames(self, channel: _Channel) -> None:
        """A header with body size 0 ends the delivery: no body frame is read."""
        deliver, header = _deliver(1), _header(0)
        assert await channel.take((20, 1, deliver), (30, 1, header)) is None
        assert channel.handed == [(deliver, header, b"")]

    async def test_a_body_of_several_frames_goes_to_the_channel(self, channel: _Channel) -> None:
        """The method and header are queued in order; the first body frame returns to aiormq."""
        deliver, header, part = _deliver(1), _header(5), ContentBody(b"abc")
        returned = await channel.take((20, 1, deliver), (30, 1, header), (11, 1, part))
        assert returned == (11, 1, part)
        assert channel.handed == []
        assert channel.queued() == [deliver, header]
        assert channel.stamps == 0

    async def test_another_channels_frame_in_between(self, channel: _Channel) -> None:
        """A frame of another channel after the method: the method is queued, that frame returned."""
        deliver, other = _deliver(1), _header(3)
        returned = await channel.take((20, 1, deliver), (30, 2, other))
        assert returned == (30, 2, other)
        assert channel.queued() == [deliver]

    async def test_a_frame_of_the_wrong_kind_goes_to_the_channel(self, channel: _Channel) -> None:
        """No header after the method: queued for the channel's reader, which raises as aiormq."""
        deliver, wrong = _deliver(1), ContentBody(b"x")
        returned = await channel.take((20, 1, deliver), (9, 1, wrong))
        assert returned == (9, 1, wrong)
        assert channel.queued() == [deliver]
        assert channel.handed == []

    async def test_a_channel_busy_meanwhile_gets_the_frames(self, channel: _Channel) -> None:
        """The reader stopped waiting while the frames were read: queued, not handed over."""

        async def read_and_stop() -> Received:
            channel.stop()
            await asyncio.sleep(0)
            return (30, 1, _header(0))

        deliver = _deliver(1)
        returned = await channel.taker.take(
            (20, 1, deliver), _nothing, read_and_stop, channel.stamp
        )
        assert returned is not None and isinstance(returned[2], ContentHeader)
        assert channel.handed == [] and channel.queued() == [deliver]


@pytest.mark.unit
class TestIdle:
    async def test_not_idle_without_a_waiting_reader(self) -> None:
        """A reader busy with a frame (not in get()) is not idle."""
        channel = _Channel()
        assert not channel.taker.idle()

    async def test_not_idle_with_frames_queued(self, channel: _Channel) -> None:
        """Frames queued before (the reader not yet woken) keep later ones behind them."""
        channel.frames.put_nowait((1, "x"))
        assert not channel.taker.idle()

    async def test_not_idle_mid_content(self, channel: _Channel) -> None:
        """The channel's own handler waits for a header or a body: not idle."""
        channel.taker.mid_content = True
        assert not channel.taker.idle()

    async def test_a_queue_without_the_private_deques_is_refused(self) -> None:
        """An asyncio.Queue of another shape: no direct path (deliveries go the usual way)."""

        class _Other:
            pass

        assert DirectChannel.of(_Other(), print, print) is None  # type: ignore[arg-type]


@pytest.mark.unit
class TestRegistry:
    async def test_a_closed_channel_is_unregistered(self, channel: _Channel) -> None:
        """Registered until its closing future is done; a later channel of that number stays."""

        class _Connection:
            _Connection__last_frame_time = 0.0

        connection = _Connection()
        direct = DirectChannels.of(connection)
        assert direct is not None and DirectChannels.registered(connection) is direct
        closing: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        direct.register(1, channel.taker, closing)
        assert direct.channels == {1: channel.taker}
        later = DirectChannel.of(asyncio.Queue(), print, print)
        assert later is not None
        direct.register(1, later, asyncio.get_running_loop().create_future())
        closing.set_result(None)
        await asyncio.sleep(0)
        assert direct.channels == {1: later}
        direct.stamp()
        assert connection._Connection__last_frame_time > 0

    async def test_a_connection_without_the_frame_time_is_refused(self) -> None:
        """An aiormq without ``__last_frame_time``: no direct path on that connection."""
        assert DirectChannels.of(object()) is None


@pytest.mark.unit
class TestBuffered:
    async def test_whole_frames_are_taken_from_the_buffer(self) -> None:
        """Two whole frames: decoded one by one, as readexactly would; then None."""
        reader = asyncio.StreamReader()
        deliver = pamqp.frame.marshal(_deliver(7), 1)
        body = pamqp.frame.marshal(ContentBody(b"abc"), 1)
        reader.feed_data(deliver + body)
        read_now = buffered(reader, decode_frame)
        first = read_now()
        assert first is not None and first[:2] == (len(deliver), 1)
        assert isinstance(first[2], Basic.Deliver) and first[2].delivery_tag == 7
        second = read_now()
        assert second is not None and second[2].value == b"abc"
        assert read_now() is None

    async def test_a_partial_frame_stays_in_the_buffer(self) -> None:
        """Not all there: None, and readexactly later reads the frame whole."""
        reader = asyncio.StreamReader()
        data = pamqp.frame.marshal(ContentBody(b"abcdef"), 3)
        reader.feed_data(data[:5])
        read_now = buffered(reader, decode_frame)
        assert read_now() is None
        reader.feed_data(data[5:12])
        assert read_now() is None
        reader.feed_data(data[12:])
        assert await reader.readexactly(len(data)) == data

    async def test_a_transport_paused_for_a_full_buffer_resumes(self) -> None:
        """Taking the frame out resumes reading, as readexactly does."""
        reader = asyncio.StreamReader(limit=4)
        transport = mock.Mock()
        reader.set_transport(transport)
        reader.feed_data(pamqp.frame.marshal(ContentBody(b"abcdef"), 3))
        transport.pause_reading.assert_called_once()
        assert buffered(reader, decode_frame)() is not None
        transport.resume_reading.assert_called_once()

    async def test_a_reader_of_another_shape_reads_nothing_now(self) -> None:
        """No asyncio buffer: always None (the caller awaits readexactly)."""
        assert buffered(object(), decode_frame)() is None  # type: ignore[arg-type]


def _wire(body: bytes, *, channel: int = 1, header_channel: int = 1, key: str = "q") -> bytes:
    """A delivery's frames as the broker sends them (the body in one frame)."""
    props = Basic.Properties(message_id="m1", headers={"n": 1}, content_type="text/plain")
    data = pamqp.frame.marshal(Basic.Deliver("ctag", 5, False, "ex", key), channel)
    data += pamqp.frame.marshal(ContentHeader(0, len(body), props), header_channel)
    if body:
        data += pamqp.frame.marshal(ContentBody(body), channel)
    return data


@pytest.mark.unit
class TestWholeDeliveries:
    async def _take(self, channel: _Channel, data: bytes) -> tuple[int, asyncio.StreamReader]:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        take_whole = whole_deliveries(reader, {1: channel.taker}, channel.stamp, _plain_delivery)
        return take_whole(), reader

    @pytest.mark.parametrize("body", [b"", b"abc", os.urandom(4096)])
    async def test_a_whole_delivery_is_handed_over_from_the_buffer(
        self, channel: _Channel, body: bytes
    ) -> None:
        """Its frames leave the buffer; the frames handed over are pamqp's, the body intact."""
        data = _wire(body)
        taken, reader = await self._take(channel, data + b"next")
        assert taken and channel.stamps == 1
        assert await reader.read() == b"next"
        ((deliver, properties, got),) = channel.handed
        assert got == body and type(got) is bytes
        assert (deliver.delivery_tag, deliver.exchange, deliver.routing_key) == (5, "ex", "q")
        assert properties.message_id == "m1"
        assert properties.headers == {"n": 1}
        assert properties.content_type == "text/plain"

    async def test_the_whole_deliveries_of_a_read_in_one_call(self, channel: _Channel) -> None:
        """Every whole delivery at the head of the buffer, in order, up to the first one
        that is not whole; one last-frame stamp for them all."""
        data = b"".join(_wire(b"%d" % n, key=f"q{n}") for n in range(5))
        taken, reader = await self._take(channel, data + _wire(b"abc")[:-1])
        assert taken == 5 and channel.stamps == 1
        assert [(d.routing_key, body) for d, _, body in channel.handed] == [
            (f"q{n}", b"%d" % n) for n in range(5)
        ]
        assert await reader.read() == _wire(b"abc")[:-1]

    @pytest.mark.parametrize("cut", [5, 11, 40, 60, -1])
    async def test_a_partial_delivery_stays_in_the_buffer(
        self, channel: _Channel, cut: int
    ) -> None:
        """Not all there: nothing handed over, nothing taken."""
        data = _wire(b"abc")
        taken, reader = await self._take(channel, data[:cut])
        assert not taken and channel.handed == []
        assert await reader.read(len(data)) == data[:cut]

    async def test_the_header_on_another_channel(self, channel: _Channel) -> None:
        """Frames interleaved with another channel's: frame by frame instead."""
        data = _wire(b"abc", header_channel=2)
        taken, reader = await self._take(channel, data)
        assert not taken and channel.handed == []
        assert await reader.read(len(data)) == data

    async def test_a_body_of_several_frames(self, channel: _Channel) -> None:
        """More than one body frame: frame by frame (the channel reads the rest)."""
        props = Basic.Properties(message_id="m1")
        data = pamqp.frame.marshal(Basic.Deliver("ctag", 5, False, "ex", "q"), 1)
        data += pamqp.frame.marshal(ContentHeader(0, 6, props), 1)
        data += pamqp.frame.marshal(ContentBody(b"abc"), 1)
        taken, _ = await self._take(channel, data)
        assert not taken and channel.handed == []

    async def test_a_routing_key_not_utf8_goes_frame_by_frame(self, channel: _Channel) -> None:
        """Not plain: left for decode_frame, which escapes and names it."""
        data = _wire(b"abc", key="qZZ").replace(b"qZZ", b"q\xff\xfe")
        taken, reader = await self._take(channel, data)
        assert not taken and channel.handed == []
        assert await reader.read(len(data)) == data

    async def test_not_while_the_channel_is_busy(self, channel: _Channel) -> None:
        """Frames queued for the channel: the delivery waits its turn."""
        channel.frames.put_nowait((1, "earlier"))
        taken, _ = await self._take(channel, _wire(b"abc"))
        assert not taken and channel.handed == []

    async def test_another_channel_is_not_taken(self, channel: _Channel) -> None:
        """A channel not registered: aiormq's."""
        taken, _ = await self._take(channel, _wire(b"abc", channel=3, header_channel=3))
        assert not taken


@pytest.mark.rabbitmq
class TestOnTheBroker:
    @pytest.fixture(name="queue")
    async def _queue(self) -> AsyncIterator[str]:
        queue = f"test-direct-{uuid.uuid4().hex[:10]}"
        yield queue
        connection = await aio_pika.connect(URL)
        try:
            await delete_topology(await connection.channel(), QueueTopology(queue))
        finally:
            await connection.close()

    async def test_deliveries_arrive_whole_and_in_order(self, queue: str) -> None:
        """Mixed body sizes (one frame, several, none): every one intact, in tag order,
        most of them handed over directly; aiormq's last-frame time advances."""
        sizes = [0, 1, 256, 300_000, 256, 0, 131_064, 131_065, *([64] * 200)]
        bodies = [os.urandom(size) for size in sizes]
        seen: list[tuple[int, bytes]] = []
        consumer = ReliableConsumer(URL, registry=CollectorRegistry(), dedup=None)

        @consumer.handler(queue)
        async def handle(body: bytes, delivery: Delivery) -> None:
            seen.append((delivery.delivery_tag or 0, body))

        async with consumer:
            link = consumer._supervisor.connection
            assert link is not None and link.fast
            direct = DirectChannels.registered(link._connection)
            assert direct is not None and len(direct.channels) == 1
            (taker,) = direct.channels.values()
            handed = 0
            real_hand = taker.hand

            def counting(*args: Any) -> None:
                nonlocal handed
                handed += 1
                real_hand(*args)

            taker.hand = counting
            before = link._connection._Connection__last_frame_time
            connection = await aio_pika.connect(URL)
            try:
                channel = await connection.channel(publisher_confirms=True)
                for index, body in enumerate(bodies):
                    await channel.default_exchange.publish(
                        aio_pika.Message(body, message_id=f"m{index}"), routing_key=queue
                    )
            finally:
                await connection.close()
            await wait_until(lambda: len(seen) == len(bodies), timeout=30, what="every body")
            assert link._connection._Connection__last_frame_time > before
        assert [body for _, body in seen] == bodies
        tags = [tag for tag, _ in seen]
        assert tags == sorted(tags)
        assert handed >= len(bodies) // 2, handed
        assert consumer.stats().acked == len(bodies)
