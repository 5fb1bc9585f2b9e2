"""The consumer's channel: prefetch, consume, settle, cancel, close.

Deliveries reach ``on_delivery`` (`reliable_mq._amqp.inbound.OnDelivery`)
synchronously and in tag order, on either path:

* fast: `reliable_mq._amqp.inbound.take_deliveries` replaces the channel's
  delivery handler (no ``DeliveredMessage``, no task per delivery);
* plain: aiormq's public ``basic_consume`` callback (aiormq starts a task per
  delivery, in order, which calls ``on_delivery`` at once).

Settles are aiormq's public ``basic_ack`` and ``basic_nack`` on both.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import aiormq
from aiormq.abc import DeliveredMessage
from pamqp.commands import Basic

from .faults import AMQP_ERRORS
from .inbound import OnDelivery, take_deliveries

__all__ = ("ConsumeChannel",)


class ConsumeChannel:
    """One consumer channel (see the module doc).

    Attributes:
        fast: deliveries take the fast path.
    """

    def __init__(self, channel: aiormq.Channel, *, fast: bool) -> None:
        self._channel = channel
        self.fast = fast
        self.number = int(channel.number)

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
