"""The consumer's channel: prefetch, consume, settle, cancel, close.

Deliveries reach ``on_delivery`` (`reliable_mq._amqp.inbound.OnDelivery`)
synchronously and in tag order, on either path:

* fast: `reliable_mq._amqp.inbound.take_deliveries` replaces the channel's
  delivery handler (no ``DeliveredMessage``, no task per delivery);
* plain: aiormq's public ``basic_consume`` callback (aiormq starts a task per
  delivery, in order, which calls ``on_delivery`` at once).

Settles are aiormq's public ``basic_ack`` and ``basic_nack`` on both. Batched
acks may also go out without a task or an await: `ConsumeChannel.ack_frame`
encodes a ``basic.ack`` frame, and `ConsumeChannel.write_now` puts the ack
frames of any channels of one connection on the connection's write queue
(aiormq's public ``Channel.write_queue``) as *one* item, so the writer sends
them in one socket write. `ConsumeChannel.has_room` says whether that item fits
now (the queue is bounded); the caller checks it and writes before its next
``await``, so nothing is queued between its decision and its frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import Callable, Mapping
from typing import Any

import aiormq
from aiormq.abc import ChannelFrame, DeliveredMessage
from pamqp.commands import Basic

from .faults import AMQP_ERRORS
from .inbound import OnDelivery, take_deliveries

__all__ = ("ConsumeChannel",)

_ACK_FRAME = struct.Struct(">BHLHHQBB")
"""A ``basic.ack`` method frame: type 1, channel, payload size 13, class 60,
method 80, delivery tag, the ``multiple`` bit, frame end 0xCE."""


class ConsumeChannel:
    """One consumer channel (see the module doc).

    Attributes:
        fast: deliveries take the fast path.
    """

    def __init__(self, channel: aiormq.Channel, *, fast: bool) -> None:
        self._channel = channel
        self.fast = fast
        self.number = int(channel.number)
        self._writes: asyncio.Queue[Any] = channel.write_queue

    @property
    def link_key(self) -> int:
        """The same for every channel of one connection: their frames may share one write."""
        return id(self._writes)

    def ack_frame(self, tag: int, *, multiple: bool) -> bytes:
        """The encoded ``basic.ack(tag, multiple)`` frame of this channel."""
        return _ACK_FRAME.pack(1, self.number, 13, 60, 80, tag, multiple, 0xCE)

    def has_room(self) -> bool:
        """True if `write_now` can queue an item now."""
        return not self._writes.full()

    def write_now(self, frames: bytes) -> None:
        """Queue encoded frames (of any channels of this connection) as one write.

        Check `has_room` first, with no ``await`` between the two.

        Raises:
            asyncio.QueueFull: no room (`has_room` was not checked).
        """
        self._writes.put_nowait(ChannelFrame(payload=frames, should_close=False))

    @property
    def is_closed(self) -> bool:
        return bool(self._channel.is_closed)

    @property
    def closing(self) -> asyncio.Future[Any]:
        """A future done when the channel closes (its exception says why; cancelled: aborted)."""
        return self._channel.closing

    def on_closed(self, callback: Callable[[BaseException | None], None]) -> None:
        """Call ``callback(why)`` once when the channel closes."""

        def closed(closing: asyncio.Future[Any]) -> None:
            callback(None if closing.cancelled() else closing.exception())

        self._channel.closing.add_done_callback(closed)

    async def qos(self, prefetch: int) -> None:
        await self._channel.basic_qos(prefetch_count=prefetch)

    async def consume(
        self, queue: str, on_delivery: OnDelivery, *, arguments: Mapping[str, Any] | None = None
    ) -> str:
        """Start consuming ``queue``; deliveries go to ``on_delivery``. The consumer tag."""
        if self.fast:
            take_deliveries(self._channel, on_delivery)
            callback: Callable[[DeliveredMessage], Any] = _not_called
        else:

            async def callback(message: DeliveredMessage) -> None:
                delivery = message.delivery
                assert isinstance(delivery, Basic.Deliver)
                on_delivery(delivery, message.header.properties, message.body, None)

        ok = await self._channel.basic_consume(
            queue, callback, no_ack=False, arguments=dict(arguments) if arguments else None
        )
        return str(ok.consumer_tag)

    def has_consumer(self, consumer_tag: str) -> bool:
        """False once the broker cancelled ``consumer_tag`` (a ``basic.cancel`` of its own)."""
        return consumer_tag in self._channel.consumers

    async def basic_cancel(self, consumer_tag: str) -> None:
        """Stop the deliveries of ``consumer_tag`` (those already sent still arrive)."""
        await self._channel.basic_cancel(consumer_tag)

    async def basic_ack(self, tag: int, *, multiple: bool = False, wait: bool = False) -> None:
        await self._channel.basic_ack(tag, multiple=multiple, wait=wait)

    async def basic_nack(
        self, tag: int, *, multiple: bool = False, requeue: bool, wait: bool = False
    ) -> None:
        await self._channel.basic_nack(tag, multiple=multiple, requeue=requeue, wait=wait)

    async def close(self, timeout: float = 5) -> None:
        """Close the channel: the broker requeues what it delivered and nobody settled."""
        with contextlib.suppress(*AMQP_ERRORS):
            async with asyncio.timeout(timeout):
                await self._channel.close()


async def _not_called(message: DeliveredMessage) -> None:
    """The callback aiormq registers for our consumer tag; `take_deliveries` bypasses it."""
    raise RuntimeError("deliveries of a reliable_mq consumer channel go to its dispatcher")
