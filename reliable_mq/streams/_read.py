"""Read a stream over AMQP 0-9-1: offset ranges, its head and tail, starting points.

How RabbitMQ (3.9+) serves a stream to an AMQP 0-9-1 consumer, as probed on
3.10.8, and what this module does with it:

* ``basic.consume`` with the argument ``x-stream-offset`` (an offset, ``first``,
  ``last``, ``next`` or a timestamp) delivers from there, each delivery with an
  ``x-stream-offset`` header; a prefetch (``basic.qos``) is required, and acks
  only make room in it. Delivery starts at the beginning of the *chunk* that
  holds the offset asked for, so offsets before it may come first: they are
  acked and skipped.
* ``basic.get``, ``basic.nack`` and ``basic.reject`` close the connection
  (540), and so does an invalid ``x-stream-offset`` (541): none is ever sent,
  and offsets are checked before they are.
* Nothing tells a consumer that it has reached the end. A range read stops at
  its end offset; the tail (the offset the next message will get) is found by
  consuming from ``last`` (the last chunk) until deliveries pause.
* Offsets count the stream's entries, not only its messages: each segment
  starts with an entry of the broker's own (its tracking snapshot), which takes
  an offset and is never delivered. So offsets have gaps, a range of ``n``
  offsets holds at most ``n`` messages, and a read that asks for the offset of
  such an entry gets the next message.
* Retention removes whole segments from the head: a read that asks for an
  offset retention removed gets the first one still held. When the first
  offset delivered is past the one asked for and the stream's head (its first
  message) is too, that is data loss, raised as `StreamDataLoss` unless the
  read is told to skip it. (One case reads as a loss though no message was
  lost: retention removed every segment before the one asked for, and the
  offset asked for is that segment's own first entry.)
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from .._amqp import AMQP_ERRORS, Basic, ConsumeChannel, Link, Undecodable
from ..errors import StreamDataLoss, StreamError
from ..log import get_logger
from ..settings import ConnectionSettings
from ._declare import check_stream, stream_connection
from ._offsets import OffsetRange, StartingOffset, StartingPoint

__all__ = ("StreamReader", "StreamRecord")

OFFSET_HEADER = "x-stream-offset"
_PROPERTIES = (
    "content_type",
    "content_encoding",
    "delivery_mode",
    "priority",
    "correlation_id",
    "reply_to",
    "expiration",
    "message_type",
    "user_id",
    "app_id",
)


@dataclass(frozen=True, slots=True)
class StreamRecord:
    """One message read from a stream.

    Attributes:
        stream: the stream's name.
        offset: its offset in the stream.
        body: the body, as published.
        message_id: the ``message_id`` property (None if unset).
        routing_key: the routing key it was published with.
        exchange: the exchange it was published to (``""``: the default exchange).
        headers: its headers, without the broker's ``x-stream-offset``.
        properties: the other basic properties that were set (``content_type``,
            ``correlation_id``, ``message_type``, ...), by pamqp's names.
        timestamp: the ``timestamp`` property (None if unset).
    """

    stream: str
    offset: int
    body: bytes
    message_id: str | None
    routing_key: str
    exchange: str
    headers: dict[str, Any] = field(default_factory=dict)
    properties: dict[str, Any] = field(default_factory=dict)
    timestamp: dt.datetime | None = None


@dataclass(frozen=True, slots=True)
class _Delivery:
    tag: int
    offset: int
    deliver: Basic.Deliver
    properties: Basic.Properties
    body: bytes


def _record(stream: str, delivery: _Delivery) -> StreamRecord:
    props = delivery.properties
    headers = dict(props.headers or ())
    headers.pop(OFFSET_HEADER, None)
    properties = {}
    for name in _PROPERTIES:
        value = getattr(props, name)
        if value is not None:
            properties[name] = value
    return StreamRecord(
        stream,
        delivery.offset,
        delivery.body,
        props.message_id,
        delivery.deliver.routing_key or "",
        delivery.deliver.exchange or "",
        headers,
        properties,
        props.timestamp,
    )


class _Subscription:
    """One consumer on a stream, on a channel of its own; deliveries queued in order."""

    def __init__(self, link: Link, stream: str, *, prefetch: int) -> None:
        self._link = link
        self._stream = stream
        self._prefetch = prefetch
        self._ack_every = max(1, prefetch // 2)
        self._unacked = 0
        self._last_tag = 0
        self._queue: asyncio.Queue[_Delivery | BaseException] = asyncio.Queue()
        self._channel: ConsumeChannel | None = None

    async def start(self, offset: int | str | dt.datetime) -> None:
        self._channel = channel = await self._link.consume_channel()
        channel.on_closed(self._closed)
        await channel.qos(self._prefetch)
        await channel.consume(self._stream, self._on_delivery, arguments={OFFSET_HEADER: offset})

    def _on_delivery(
        self,
        deliver: Basic.Deliver,
        properties: Basic.Properties,
        body: bytes,
        undecodable: Undecodable | None,
    ) -> None:
        offset = (properties.headers or {}).get(OFFSET_HEADER)
        if not isinstance(offset, int):
            self._queue.put_nowait(
                StreamError(f"a delivery from {self._stream!r} has no {OFFSET_HEADER} header")
            )
            return
        tag = int(deliver.delivery_tag or 0)
        self._queue.put_nowait(_Delivery(tag, offset, deliver, properties, body))

    def _closed(self, why: BaseException | None) -> None:
        self._queue.put_nowait(
            StreamError(f"the channel reading {self._stream!r} closed: {why or 'closed'}")
        )

    async def next(self, timeout: float) -> _Delivery | None:
        """The next delivery; None if none came within ``timeout`` seconds."""
        if self._queue.empty():
            try:
                async with asyncio.timeout(timeout):
                    item = await self._queue.get()
            except TimeoutError:
                return None
        else:  # already queued: no timer to arm (the hot path of a range read)
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            raise item
        return item

    async def ack(self, tag: int, *, flush: bool = False) -> None:
        """Ack up to ``tag`` (multiple), every half prefetch or when ``flush``."""
        self._last_tag = tag
        self._unacked += 1
        if (flush or self._unacked >= self._ack_every) and self._channel is not None:
            self._unacked = 0
            await self._channel.basic_ack(tag, multiple=True)

    async def close(self) -> None:
        channel = self._channel
        if channel is None:
            return
        if self._unacked and not channel.is_closed:
            with contextlib.suppress(*AMQP_ERRORS):
                await channel.basic_ack(self._last_tag, multiple=True)
        await channel.close()


class StreamReader:
    """Reads one stream over one connection of its own.

    ```python
    async with StreamReader(url, "events") as reader:
        end = await reader.tail()
        async for record in reader.read(OffsetRange("events", 0, end)):
            ...
    ```

    Args:
        target: where to connect: an AMQP URL or `ConnectionSettings`.
        stream: the stream's name.
        prefetch: deliveries in flight at most (``basic.qos``); acked every half.
        quiet: seconds without a delivery after which the last chunk is taken
            as complete (`tail`).
        first_wait: seconds to wait for the first delivery from ``first``,
            ``last`` or a time before a stream is taken as empty there.
        idle_timeout: seconds a range read waits for its next delivery before
            it fails (the range's end is past the stream's tail).

    Raises:
        NotAStream: on entry, ``stream`` is a classic or quorum queue, or missing.
        BrokerUnavailable: on entry, no broker accepted a connection.
    """

    def __init__(
        self,
        target: str | ConnectionSettings,
        stream: str,
        *,
        prefetch: int = 1000,
        quiet: float = 0.25,
        first_wait: float = 2.0,
        idle_timeout: float = 30.0,
    ) -> None:
        if prefetch < 1:
            raise ValueError("prefetch must be >= 1 (a stream consumer needs one)")
        self.stream = stream
        self._target = target
        self._prefetch = prefetch
        self._quiet = quiet
        self._first_wait = first_wait
        self._idle_timeout = idle_timeout
        self._stack = contextlib.AsyncExitStack()
        self._link: Link | None = None

    async def __aenter__(self) -> StreamReader:
        try:
            self._link = await self._stack.enter_async_context(
                stream_connection(self._target, role="stream-reader")
            )
            await check_stream(self._link, self.stream)
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._link = None
        await self._stack.aclose()

    @contextlib.asynccontextmanager
    async def _subscribe(self, offset: int | str | dt.datetime) -> AsyncIterator[_Subscription]:
        if self._link is None:
            raise StreamError("the reader is not open: use `async with StreamReader(...)`")
        subscription = _Subscription(self._link, self.stream, prefetch=self._prefetch)
        try:
            await subscription.start(offset)
            yield subscription
        finally:
            await subscription.close()

    async def tail(self, *, max_wait: float = 5.0) -> int:
        """The offset the next message will get (0 for an empty stream).

        Reads the last chunk until deliveries pause for ``quiet`` seconds (or
        ``max_wait`` passed, under a steady flow of new messages): every
        offset below the result exists, or existed before retention.

        Raises:
            StreamError: the stream holds messages (``first`` delivers) but
                ``last`` delivered none within ``idle_timeout``.
        """
        highest = -1
        loop = asyncio.get_running_loop()
        async with self._subscribe("last") as subscription:
            delivery = await self._first(subscription, "last")
            deadline = loop.time() + max_wait
            while delivery is not None:
                highest = max(highest, delivery.offset)
                await subscription.ack(delivery.tag)
                if loop.time() >= deadline:
                    break
                delivery = await subscription.next(self._quiet)
        return highest + 1

    async def head(self) -> int:
        """The first offset the stream still holds (0 when it is empty).

        Raises:
            StreamError: the stream holds messages but ``first`` delivered
                none within ``idle_timeout``.
        """
        async with self._subscribe("first") as subscription:
            delivery = await self._first(subscription, "first")
        return 0 if delivery is None else delivery.offset

    async def _first(self, subscription: _Subscription, where: str) -> _Delivery | None:
        """The first delivery of a subscription at ``first`` or ``last``; None only
        when the stream is empty.

        No delivery within ``first_wait`` means an empty stream, or a broker slow
        to answer (a loaded one takes seconds). A second subscription, at the
        other end, tells them apart: if it delivers, the stream holds messages
        and this one waits on, up to ``idle_timeout``. (Taking slowness for
        emptiness made `head` answer the tail: a read from ``earliest`` would
        have skipped the whole stream.)
        """
        delivery = await subscription.next(self._first_wait)
        if delivery is not None:
            return delivery
        other = "first" if where == "last" else "last"
        async with self._subscribe(other) as probe:
            if await probe.next(self._first_wait) is None:
                return None  # neither end delivers: empty
        delivery = await subscription.next(self._idle_timeout)
        if delivery is None:
            raise StreamError(
                f"stream {self.stream!r} holds messages, but a consumer at {where!r} got "
                f"none in {self._first_wait + self._idle_timeout:g} s"
            )
        return delivery

    async def resolve(self, start: StartingOffset) -> int:
        """A starting point as an offset.

        ``earliest``: `head`; ``latest``: `tail`; an offset: itself; a time:
        the first offset the stream delivers from that time (the tail when
        nothing is that recent). Times are as precise as the stream's chunks.
        """
        if start is StartingPoint.EARLIEST:
            return await self.head()
        if start is StartingPoint.LATEST:
            return await self.tail()
        if isinstance(start, int):
            if start < 0:
                raise ValueError(f"an offset is >= 0, not {start}")
            return start
        async with self._subscribe(start) as subscription:
            delivery = await subscription.next(self._first_wait)
            if delivery is None:
                # Nothing that recent, or a slow broker: once it has answered for
                # the tail, it answers this subscription too (a second chance).
                tail = await self.tail()
                delivery = await subscription.next(self._first_wait) if tail else None
                if delivery is None:
                    return tail
        return delivery.offset

    async def read(
        self, offsets: OffsetRange, *, fail_on_data_loss: bool = True
    ) -> AsyncGenerator[StreamRecord, None]:
        """Yield the records of ``offsets`` (``[start, end)``) in offset order, acking as it goes.

        Raises:
            StreamDataLoss: retention removed offsets of the range (unless
                ``fail_on_data_loss`` is False: then the gap is logged, as
                ``stream_data_loss``, and the read goes on from the first
                offset still held).
            StreamError: no delivery came for ``idle_timeout`` seconds before
                the end (the end is past the tail), or the channel closed.
        """
        if offsets.stream != self.stream:
            raise ValueError(f"a range of {offsets.stream!r}, not of {self.stream!r}")
        if not len(offsets):
            return
        first = True
        async with self._subscribe(offsets.start) as subscription:
            while True:
                delivery = await subscription.next(self._idle_timeout)
                if delivery is None:
                    raise StreamError(
                        f"no delivery from {self.stream!r} for {self._idle_timeout:g} s before "
                        f"offset {offsets.end}: is the range's end past the stream's tail?"
                    )
                if delivery.offset < offsets.start:  # the chunk began before the range
                    await subscription.ack(delivery.tag)
                    continue
                if first:
                    first = False
                    if delivery.offset > offsets.start:  # retention, or entries of no message
                        head = await self.head()
                        if head > offsets.start:
                            self._lost(offsets, head, fail_on_data_loss)
                if delivery.offset >= offsets.end:
                    return
                await subscription.ack(delivery.tag, flush=delivery.offset == offsets.end - 1)
                yield _record(self.stream, delivery)
                if delivery.offset == offsets.end - 1:
                    return

    def _lost(self, offsets: OffsetRange, available: int, fail: bool) -> None:
        gone = min(available, offsets.end) - offsets.start
        if fail:
            raise StreamDataLoss(
                f"retention removed offsets {offsets.start}..{available - 1} of stream "
                f"{self.stream!r} ({gone} in the range asked for) before they were read: "
                "they are lost. Read from the first offset still held, or allow the gap "
                "(failOnDataLoss=false / fail_on_data_loss=False)",
                stream=self.stream,
                requested=offsets.start,
                available=available,
            )
        get_logger("reliable_mq.streams").warning(
            "stream_data_loss",
            stream=self.stream,
            requested=offsets.start,
            available=available,
            lost=gone,
        )
