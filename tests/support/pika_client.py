"""pika as the other client: an encoder and a decoder that are not ours nor pamqp's.

Blocking helpers (run them with ``asyncio.to_thread`` from async tests). pika
encodes every int header value as a 64-bit ``l``, a ``datetime`` as 64-bit
seconds, a ``Decimal`` normalised; it cannot encode a float; and pika 1.4.4
decodes every ``d`` and ``f`` value as an int (``long(...)`` in its
``data.decode_value``): a float we send arrives truncated, by pika's doing.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from decimal import Decimal
from typing import Any

import pika
from pika.spec import BasicProperties

__all__ = (
    "PROPERTIES",
    "Received",
    "get_all",
    "publish",
    "same",
    "seconds_of",
)

PROPERTIES = (
    "content_type",
    "content_encoding",
    "headers",
    "delivery_mode",
    "priority",
    "correlation_id",
    "reply_to",
    "expiration",
    "message_id",
    "timestamp",
    "message_type",
    "user_id",
    "app_id",
    "cluster_id",
)
"""Every basic property, by pamqp's names (pika calls ``message_type`` ``type``)."""


class Received:
    """One message as pika read it: its body and its properties by pamqp's names."""

    def __init__(self, body: bytes, properties: BasicProperties) -> None:
        self.body = body
        self.properties = {
            name: getattr(properties, "type" if name == "message_type" else name)
            for name in PROPERTIES
        }

    def __repr__(self) -> str:
        return f"Received({self.body!r}, {self.properties!r})"


def publish(url: str, queue: str, messages: Iterable[tuple[bytes, dict[str, Any]]]) -> None:
    """Publish ``(body, properties)`` pairs (pamqp's names) with confirms."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        for body, properties in messages:
            values = dict(properties)
            if "message_type" in values:
                values["type"] = values.pop("message_type")
            channel.basic_publish("", queue, body, BasicProperties(**values), mandatory=True)
    finally:
        connection.close()


def get_all(url: str, queue: str, *, requeue: bool = False) -> list[Received]:
    """Every message in ``queue`` by ``basic.get``; acked, or all put back (``requeue``)."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        got: list[Received] = []
        last = 0
        while True:
            method, properties, body = channel.basic_get(queue, auto_ack=False)
            if method is None:
                break
            last = method.delivery_tag
            got.append(Received(body, properties))
        if last:
            if requeue:
                channel.basic_nack(last, multiple=True, requeue=True)
            else:
                channel.basic_ack(last, multiple=True)
        return got
    finally:
        connection.close()


def seconds_of(value: Any) -> Any:
    """A timestamp as whole POSIX seconds (pika reads the property as an int, pamqp
    as a datetime); anything else as it is."""
    if isinstance(value, dt.datetime):
        aware = value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)
        return int(aware.timestamp())
    return value


def same(sent: Any, got: Any) -> bool:  # noqa: PLR0911 (one return per AMQP value kind)
    """Equal values of the same AMQP kind: a bool is not an int, a str is not bytes;
    bytes and bytearray alike; datetimes compared as instants (naive means UTC)."""
    if isinstance(sent, bool) or isinstance(got, bool):
        return type(sent) is type(got) and sent == got
    if isinstance(sent, dict):
        return (
            isinstance(got, dict)
            and sent.keys() == got.keys()
            and all(same(value, got[key]) for key, value in sent.items())
        )
    if isinstance(sent, (list, tuple)):
        return (
            isinstance(got, list)
            and len(sent) == len(got)
            and all(same(a, b) for a, b in zip(sent, got, strict=True))
        )
    if isinstance(sent, (bytes, bytearray)):
        return isinstance(got, (bytes, bytearray)) and bytes(sent) == bytes(got)
    if isinstance(sent, dt.datetime):
        return isinstance(got, dt.datetime) and seconds_of(sent) == seconds_of(got)
    if isinstance(sent, Decimal):
        return isinstance(got, Decimal) and sent == got
    if isinstance(sent, float):
        return isinstance(got, float) and sent == got
    if isinstance(sent, int):  # pika's 64-bit ints are its own int subclass, ``long``
        return isinstance(got, int) and not isinstance(got, bool) and sent == got
    if isinstance(sent, str):
        return isinstance(got, str) and sent == got
    return sent is None and got is None
