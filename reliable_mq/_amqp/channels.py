"""A plain channel for topology and tooling: declares, deletes, ``basic.get``, settles.

Everything here is aiormq's public ``Channel`` API. `Channel` wraps one opened
by a `Link`, or (`user_channel`) the aiormq channel under an aio-pika channel
an application passes to `reliable_mq.topology.declare_topology`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import aio_pika.abc
import aiormq
from aiormq.abc import DeliveredMessage
from pamqp.commands import Basic
from typing_extensions import TypeIs

from .faults import AMQP_ERRORS

__all__ = (
    "Channel",
    "ChannelOpener",
    "Got",
    "QueueInfo",
    "UserChannel",
    "UserConnection",
    "is_user_channel",
    "user_channel",
    "user_connection",
)

UserChannel = aio_pika.abc.AbstractChannel
"""An aio-pika channel, as applications pass one to ``declare_topology``."""
UserConnection = aio_pika.abc.AbstractConnection
"""An aio-pika connection, as applications pass one to ``prepare_topology``."""


class ChannelOpener(Protocol):
    """Opens plain channels: a `reliable_mq._amqp.Link`, or `user_connection`'s adapter."""

    async def channel(self, *, timeout: float | None = None) -> Channel: ...


class _UserConnection:
    def __init__(self, connection: UserConnection) -> None:
        self._connection = connection

    async def channel(self, *, timeout: float | None = None) -> Channel:
        opened = await self._connection.channel(publisher_confirms=False)
        underlay = await opened.get_underlay_channel()
        assert isinstance(underlay, aiormq.Channel)
        return Channel(underlay)


def user_connection(value: UserConnection) -> ChannelOpener:
    """Opens channels (`Channel`) on an application's aio-pika connection."""
    return _UserConnection(value)


def is_user_channel(value: object) -> TypeIs[UserChannel]:
    """True if ``value`` is an aio-pika channel."""
    return isinstance(value, aio_pika.abc.AbstractChannel)


async def user_channel(value: UserChannel) -> Channel:
    """The `Channel` over an aio-pika channel (closing it stays the application's)."""
    underlay = await value.get_underlay_channel()
    assert isinstance(underlay, aiormq.Channel)
    return Channel(underlay, owned=False)


@dataclass(frozen=True)
class QueueInfo:
    """What a queue declaration answered: messages ready and consumers."""

    messages: int
    consumers: int


@dataclass(frozen=True)
class Got:
    """One message taken with ``basic.get``, held unacknowledged until settled.

    Its properties are exactly as they came (``properties``: every basic
    property, absent ones None), so a copy can keep them all.
    """

    delivery_tag: int
    exchange: str
    routing_key: str
    redelivered: bool
    properties: Basic.Properties
    body: bytes

    @property
    def message_id(self) -> str | None:
        return self.properties.message_id

    @property
    def headers(self) -> Mapping[str, Any]:
        return self.properties.headers or {}

    @property
    def content_type(self) -> str | None:
        return self.properties.content_type

    @property
    def correlation_id(self) -> str | None:
        return self.properties.correlation_id

    @property
    def reply_to(self) -> str | None:
        return self.properties.reply_to

    @property
    def type(self) -> str | None:
        return self.properties.message_type

    @property
    def app_id(self) -> str | None:
        return self.properties.app_id

    @property
    def timestamp(self) -> dt.datetime | None:
        return self.properties.timestamp


class Channel:
    """A channel for declarations, deletes and ``basic.get`` (no publisher confirms)."""

    def __init__(self, channel: aiormq.Channel, *, owned: bool = True) -> None:
        self._channel = channel
        self._owned = owned

    @property
    def is_closed(self) -> bool:
        return bool(self._channel.is_closed)

    async def declare_queue(
        self,
        name: str,
        *,
        durable: bool = True,
        auto_delete: bool = False,
        passive: bool = False,
        arguments: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> QueueInfo:
        """Declare ``name`` (or check it exists, ``passive``); a refusal closes the channel."""
        ok = await self._channel.queue_declare(
            name,
            durable=durable,
            auto_delete=auto_delete,
            passive=passive,
            arguments=dict(arguments) if arguments else None,
            timeout=timeout,
        )
        return QueueInfo(int(ok.message_count or 0), int(ok.consumer_count or 0))

    async def declare_exchange(
        self, name: str, *, passive: bool = True, timeout: float | None = None
    ) -> None:
        """Check that exchange ``name`` exists (a 404 closes the channel)."""
        await self._channel.exchange_declare(name, passive=passive, timeout=timeout)

    async def delete_queue(self, name: str) -> int:
        """Delete ``name`` with its messages; the number of messages it held."""
        ok = await self._channel.queue_delete(name)
        return int(ok.message_count or 0)

    async def get(self, queue: str, *, timeout: float = 30) -> Got | None:
        """Take the next message of ``queue`` unacknowledged; None when it is empty."""
        got = await self._channel.basic_get(queue, no_ack=False, timeout=timeout)
        delivery = got.delivery
        if not isinstance(delivery, Basic.GetOk):
            return None
        return Got(
            delivery_tag=int(delivery.delivery_tag or 0),
            exchange=delivery.exchange or "",
            routing_key=delivery.routing_key or "",
            redelivered=bool(delivery.redelivered),
            properties=got.header.properties,
            body=got.body,
        )

    async def consume_without_prefetch(self, queue: str, *, timeout: float | None = None) -> None:
        """``basic.consume`` on a channel without ``basic.qos``, cancelled at once: a probe.

        RabbitMQ refuses it on a stream (406 "consumer prefetch count is not
        set"; the channel closes), which needs a prefetch; any other queue
        accepts it. A message delivered before the cancel stays unacked on this
        channel: closing the channel returns it to the queue.
        """
        ok = await self._channel.basic_consume(queue, _ignored, no_ack=False, timeout=timeout)
        await self._channel.basic_cancel(str(ok.consumer_tag), timeout=timeout)

    async def ack(self, delivery_tag: int) -> None:
        await self._channel.basic_ack(delivery_tag, multiple=False)

    async def nack(self, delivery_tag: int, *, multiple: bool, requeue: bool) -> None:
        await self._channel.basic_nack(delivery_tag, multiple=multiple, requeue=requeue)

    async def close(self) -> None:
        """Close the channel (if this wrapper opened it), never raising."""
        if not self._owned or self._channel.is_closed:
            return
        with contextlib.suppress(*AMQP_ERRORS, RuntimeError):
            async with asyncio.timeout(5):
                await self._channel.close()


async def _ignored(message: DeliveredMessage) -> None:
    """The callback of `Channel.consume_without_prefetch`: its deliveries are left unacked."""
