"""Streams on the real broker: declared with retention, refused by the consumer, read by range."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import aio_pika
import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from reliable_mq import ConsumerError, Delivery, Message, ReliableConsumer, ReliablePublisher
from reliable_mq._amqp import Channel, Link
from reliable_mq.streams import (
    NotAStream,
    OffsetRange,
    StartingPoint,
    StreamDataLoss,
    StreamError,
    StreamNotSupported,
    StreamReader,
    StreamRecord,
    StreamSpec,
    declare_stream,
    split_range,
)
from reliable_mq.streams._declare import (
    _declared_as_stream,
    _Verdict,
    is_stream,
    stream_connection,
)
from reliable_mq.topology import declare_stream as declare_stream_from_topology

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(120)]

MakeStream = Callable[..., Awaitable[str]]


@pytest.fixture(name="make_stream")
async def _make_stream(
    broker_url: str, amqp: aio_pika.abc.AbstractChannel
) -> AsyncIterator[MakeStream]:
    """Declares fresh streams (``declare_stream`` keywords), deleted after the test."""
    names: list[str] = []

    async def make(**retention: object) -> str:
        name = f"test-stream-{uuid.uuid4().hex[:12]}"
        names.append(name)
        await declare_stream(broker_url, name, **retention)  # type: ignore[arg-type]
        return name

    yield make
    for name in names:
        await amqp.queue_delete(name)


async def publish(
    url: str, stream: str, count: int, *, size: int = 16, rounds: int = 1
) -> list[str]:
    """Publish ``count`` messages with confirms, in ``rounds`` calls each confirmed
    before the next; their ids, in order."""
    ids = [f"m-{index}" for index in range(count)]
    per_round = -(-count // rounds)
    async with ReliablePublisher(url, registry=CollectorRegistry()) as publisher:
        for start in range(0, count, per_round):
            await publisher.publish_many(
                Message(
                    f"{index:0{size}d}".encode(),
                    routing_key=stream,
                    message_id=ids[index],
                    headers={"n": index},
                    content_type="text/plain",
                )
                for index in range(start, min(start + per_round, count))
            )
    return ids


async def refusal(url: str, name: str, **declare: object) -> str:
    """The broker's refusal of a queue declaration, on a connection of its own."""
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await (await connection.channel()).get_underlay_channel()
        with pytest.raises(Exception) as caught:  # aiormq's ChannelClosed
            await channel.queue_declare(name, durable=True, **declare)  # type: ignore[arg-type]
    return str(caught.value)


async def read_all(reader: StreamReader, offsets: OffsetRange, **kw: bool) -> list[StreamRecord]:
    return [record async for record in reader.read(offsets, **kw)]


class TestDeclare:
    async def test_declares_a_stream_with_its_retention(
        self, broker_url: str, make_stream: MakeStream
    ) -> None:
        """A stream is declared with its retention; the same declaration again is a no-op,
        another retention is refused with the reason, and the queue really is a stream."""
        name = await make_stream(max_length_bytes=1_000_000, max_age="7D")
        again = await declare_stream_from_topology(
            broker_url, StreamSpec(name, max_length_bytes=1_000_000, max_age="7D")
        )
        assert again.name == name
        with pytest.raises(ConsumerError, match="x-max-length-bytes"):
            await declare_stream(broker_url, name, max_length_bytes=2_000_000, max_age="7D")
        classic = {"x-queue-type": "classic", "x-max-length-bytes": 1_000_000, "x-max-age": "7D"}
        assert "inequivalent arg 'x-queue-type'" in await refusal(
            broker_url, name, arguments=classic
        )

    async def test_declares_on_an_application_channel(
        self, broker_url: str, amqp: aio_pika.abc.AbstractChannel
    ) -> None:
        """An aio-pika channel is a target too, and it stays open."""
        name = f"test-stream-{uuid.uuid4().hex[:12]}"
        try:
            await declare_stream(amqp, name, max_segment_size_bytes=1_000_000)
            assert not amqp.is_closed
            async with StreamReader(broker_url, name) as reader:  # a stream: not refused
                assert await reader.tail() == 0
        finally:
            await amqp.queue_delete(name)


class TestConsumerRefusesStreams:
    async def test_start_refuses_a_stream_and_declares_nothing(
        self, broker_url: str, make_stream: MakeStream
    ) -> None:
        """A ReliableConsumer on a stream fails at start, naming the stream reader and the
        Spark source; no retry queue or DLQ is left behind."""
        name = await make_stream()
        consumer = ReliableConsumer(broker_url, registry=CollectorRegistry())

        @consumer.handler(name)
        async def handle(body: bytes, delivery: Delivery) -> None:
            raise AssertionError("no delivery expected")

        with pytest.raises(StreamNotSupported, match=r"format\('rabbitmq'\)") as caught:
            await consumer.start()
        assert isinstance(caught.value, ConsumerError)
        assert "StreamReader" in str(caught.value)
        await consumer.stop()
        assert "NOT_FOUND" in await refusal(broker_url, f"{name}.dlq", passive=True)


class TestRead:
    async def test_reads_ranges_with_every_field(
        self, broker_url: str, make_stream: MakeStream
    ) -> None:
        """All of a stream, then a range inside it: in offset order, each offset once,
        with body, id, routing key, headers (not the broker's) and properties."""
        name = await make_stream()
        ids = await publish(broker_url, name, 300)
        async with StreamReader(broker_url, name, prefetch=64) as reader:
            tail = await reader.tail()
            assert tail == 300  # a fresh stream: offsets 0, 1, 2, ...
            records = await read_all(reader, OffsetRange(name, 0, tail))
            assert [r.message_id for r in records] == ids
            assert [r.offset for r in records] == list(range(300))
            first = records[0]
            assert (first.stream, first.body, first.routing_key, first.exchange) == (
                name,
                b"0" * 16,
                name,
                "",
            )
            assert first.headers["n"] == 0 and "x-stream-offset" not in first.headers
            assert first.properties["content_type"] == "text/plain"
            middle = await read_all(reader, OffsetRange(name, 100, 200))
            assert [r.message_id for r in middle] == ids[100:200]
            assert await read_all(reader, OffsetRange(name, 300, 300)) == []

    async def test_split_ranges_read_every_message_once(
        self, broker_url: str, make_stream: MakeStream
    ) -> None:
        """Split into parts, the parts together read every message exactly once."""
        name = await make_stream()
        ids = await publish(broker_url, name, 1000)
        async with StreamReader(broker_url, name) as reader:
            whole = OffsetRange(name, await reader.head(), await reader.tail())
            seen: list[str | None] = []
            for part in split_range(whole, 7):
                seen.extend(r.message_id for r in await read_all(reader, part))
        assert seen == ids

    async def test_head_tail_and_starting_points(
        self, broker_url: str, make_stream: MakeStream
    ) -> None:
        """earliest is the head, latest the tail, an old time the head, a future time the
        tail; an empty stream's head and tail are 0."""
        name = await make_stream()
        async with StreamReader(broker_url, name, first_wait=0.5) as reader:
            assert (await reader.head(), await reader.tail()) == (0, 0)
            await publish(broker_url, name, 50)
            assert await reader.resolve(StartingPoint.EARLIEST) == 0
            assert await reader.resolve(StartingPoint.LATEST) == 50
            assert await reader.resolve(17) == 17
            past = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)
            future = dt.datetime.now(dt.UTC) + dt.timedelta(days=1)
            assert await reader.resolve(past) == 0
            assert await reader.resolve(future) == 50

    async def test_a_slow_first_delivery_is_not_taken_for_an_empty_stream(
        self, broker_url: str, make_stream: MakeStream
    ) -> None:
        """A broker slower than ``first_wait`` (here 1 ms, so the first delivery is
        always late) must not make the head the tail: a read from ``earliest`` would
        skip the stream. The head is the first offset held, or 0 when nothing answers,
        never past it. (A CI run under load saw the head answer the tail.)"""
        name = await make_stream()
        await publish(broker_url, name, 50)
        async with StreamReader(broker_url, name, first_wait=0.001) as reader:
            heads = {await reader.head() for _ in range(10)}
            starts = {await reader.resolve(StartingPoint.EARLIEST) for _ in range(5)}
        assert heads == {0} and starts == {0}

    async def test_a_range_past_the_tail_fails_instead_of_waiting_for_ever(
        self, broker_url: str, make_stream: MakeStream
    ) -> None:
        """Past the tail nothing comes: the read fails after idle_timeout, saying so."""
        name = await make_stream()
        await publish(broker_url, name, 5)
        async with StreamReader(broker_url, name, idle_timeout=0.5) as reader:
            got: list[int] = []
            with pytest.raises(StreamError, match="past the stream's tail"):
                async for record in reader.read(OffsetRange(name, 0, 10)):
                    got.append(record.offset)
        assert got == [0, 1, 2, 3, 4]


async def truncated_head(reader: StreamReader, within: float = 20.0) -> int:
    """The stream's head once retention has run. The broker applies retention in a
    process of its own after a segment rolls over, so right after the publish the
    head can still be 0 (a CI run saw it): wait for it, up to ``within`` seconds."""
    deadline = asyncio.get_running_loop().time() + within
    while (head := await reader.head()) == 0 and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.2)
    return head


class TestRetention:
    async def test_truncation_is_data_loss_unless_skipped(
        self, broker_url: str, make_stream: MakeStream
    ) -> None:
        """Retention (per segment) removed the start of the range: StreamDataLoss by default,
        naming the gap; told to skip, the read logs it and starts at the head."""
        name = await make_stream(max_length_bytes=20_000, max_segment_size_bytes=5_000)
        # In ten confirmed rounds: the broker rolls a segment, and applies retention,
        # only between chunks, and a loaded broker wrote all 500 as one chunk (one
        # segment, nothing to remove: a CI run saw the head stay 0 for 20 s).
        ids = await publish(broker_url, name, 500, size=200, rounds=10)
        async with StreamReader(broker_url, name) as reader:
            head = await truncated_head(reader)
            tail = await reader.tail()
            assert head > 0, "retention removed nothing in 20 s"
            with pytest.raises(StreamDataLoss) as caught:
                await read_all(reader, OffsetRange(name, 0, tail))
            assert (caught.value.stream, caught.value.requested, caught.value.available) == (
                name,
                0,
                head,
            )
            with capture_logs() as logs:
                kept = await read_all(reader, OffsetRange(name, 0, tail), fail_on_data_loss=False)
            # Each segment starts with an entry of the broker's: offsets have gaps here.
            assert kept[0].offset == head
            assert [r.message_id for r in kept] == ids[-len(kept) :]
            assert [r.offset for r in kept] == sorted({r.offset for r in kept})
            lost = [e for e in logs if e["event"] == "stream_data_loss"]
            assert [(e["requested"], e["available"]) for e in lost] == [(0, head)]
            # Reading from the head on is no loss, even across the gaps.
            assert len(await read_all(reader, OffsetRange(name, head, tail))) == len(kept)


class TestRefusesQueues:
    @pytest.mark.parametrize("held", [0, 2])
    async def test_a_classic_queue_is_not_a_stream(
        self, broker_url: str, queue: str, amqp: aio_pika.abc.AbstractChannel, held: int
    ) -> None:
        """A classic queue (empty or not) is refused with the reason and the way out, and
        keeps its messages."""
        for _ in range(held):
            await amqp.default_exchange.publish(aio_pika.Message(b"x"), routing_key=queue)
        with pytest.raises(NotAStream, match="cannot be read again from an offset") as caught:
            async with StreamReader(broker_url, queue):
                pass
        assert "shovel or bind" in str(caught.value)
        declared = await amqp.declare_queue(queue, passive=True)
        assert declared.declaration_result.message_count == held

    async def test_queues_with_arguments_and_messages_are_told_from_streams(
        self, broker_url: str, make_stream: MakeStream, amqp: aio_pika.abc.AbstractChannel
    ) -> None:
        """A stream with retention and messages is a stream; a classic queue with dead-letter
        arguments and a quorum queue, both holding messages, are not, and the check takes
        none of their messages (none comes back redelivered)."""
        stream = await make_stream(max_length_bytes=1_000_000, max_age="1D")
        await publish(broker_url, stream, 10)
        async with StreamReader(broker_url, stream) as reader:
            assert await reader.tail() == 10
        for arguments in (
            {
                "x-dead-letter-exchange": "",
                "x-dead-letter-routing-key": "x.dlq",
                "x-max-length": 50,
            },
            {"x-queue-type": "quorum", "x-max-length-bytes": 1_000_000},
        ):
            name = f"test-q-{uuid.uuid4().hex[:10]}"
            declared = await amqp.declare_queue(name, durable=True, arguments=arguments)
            try:
                for _ in range(3):
                    await amqp.default_exchange.publish(aio_pika.Message(b"x"), routing_key=name)
                with pytest.raises(NotAStream, match="is not a stream"):
                    async with StreamReader(broker_url, name):
                        pass
                got = await declared.get(no_ack=True)
                assert got is not None and not got.redelivered
                assert (got.headers or {}).get("x-delivery-count", 0) == 0
            finally:
                await declared.delete(if_unused=False, if_empty=False)

    async def test_a_missing_stream_is_named(self, broker_url: str) -> None:
        """A name that is nothing is refused too, with how to declare it."""
        with pytest.raises(NotAStream, match="does not exist"):
            async with StreamReader(broker_url, f"missing-{uuid.uuid4().hex[:8]}"):
                pass


class _DeletesAfterFirstChannel:
    """Opens channels on ``link``; before the second, deletes ``name`` (a deletion between
    the probe's steps, made deterministic)."""

    def __init__(self, link: Link, amqp: aio_pika.abc.AbstractChannel, name: str) -> None:
        self._link, self._amqp, self._name = link, amqp, name
        self.opened = 0

    async def channel(self, *, timeout: float | None = None) -> Channel:
        self.opened += 1
        if self.opened == 2:
            await self._amqp.queue_delete(self._name)
        return await self._link.channel(timeout=timeout)


class TestProbeCreatesNothing:
    @pytest.mark.parametrize("kind", ["stream", "classic"])
    async def test_a_queue_deleted_between_the_steps_is_missing_and_stays_gone(
        self, broker_url: str, amqp: aio_pika.abc.AbstractChannel, kind: str
    ) -> None:
        """The queue exists at the passive declare and is gone at the redeclare: the probe
        says it does not exist and creates no stray stream."""
        name = f"test-probe-{uuid.uuid4().hex[:10]}"
        if kind == "stream":
            await declare_stream(broker_url, name)
        else:
            await amqp.declare_queue(name, durable=True)
        try:
            async with stream_connection(broker_url) as link:
                opener = _DeletesAfterFirstChannel(link, amqp, name)
                assert await is_stream(opener, name) is None
                assert opener.opened == 2
            assert await exists(broker_url, name) is False
        finally:
            await amqp.queue_delete(name)

    async def test_the_redeclare_step_alone_creates_nothing(self, broker_url: str) -> None:
        """The redeclare on a name that is nothing is refused by the broker's creating path."""
        name = f"test-probe-{uuid.uuid4().hex[:10]}"
        async with stream_connection(broker_url) as link:
            assert await _declared_as_stream(link, name) is _Verdict.MISSING
        assert await exists(broker_url, name) is False

    async def test_queues_and_streams_with_flags_and_ttl_are_told_apart(
        self, broker_url: str, make_stream: MakeStream, amqp: aio_pika.abc.AbstractChannel
    ) -> None:
        """A classic queue with its own x-expires, a transient auto-delete one and a stream
        with retention all get their verdict from the redeclare (no fallback)."""
        stream = await make_stream(max_age="1D", max_segment_size_bytes=1_000_000)
        ttl = f"test-q-{uuid.uuid4().hex[:10]}"
        transient = f"test-q-{uuid.uuid4().hex[:10]}"
        await amqp.declare_queue(ttl, durable=True, arguments={"x-expires": 600_000})
        await amqp.declare_queue(transient, durable=False, auto_delete=True)
        try:
            async with stream_connection(broker_url) as link:
                assert await _declared_as_stream(link, stream) is _Verdict.STREAM
                assert await _declared_as_stream(link, ttl) is _Verdict.QUEUE
                assert await _declared_as_stream(link, transient) is _Verdict.QUEUE
        finally:
            await amqp.queue_delete(ttl)
            await amqp.queue_delete(transient)


async def exists(url: str, name: str) -> bool:
    """Whether queue ``name`` exists (a passive declare on a connection of its own)."""
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        try:
            await channel.declare_queue(name, passive=True)
        except aio_pika.exceptions.ChannelNotFoundEntity:
            return False
    return True
