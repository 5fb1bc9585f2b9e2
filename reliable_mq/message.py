"""Outgoing messages: the options of ``publish()`` and the `Message` of ``publish_many()``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypedDict

__all__ = ("Message", "MessageOptions")


class MessageOptions(TypedDict, total=False):
    """Optional message properties accepted by ``publish()`` and ``enqueue()``.

    Every value is checked before anything is sent; a bad one raises
    [InvalidMessage][reliable_mq.errors.InvalidMessage] naming the field.
    Together they cover every basic property of AMQP 0-9-1 but the reserved
    ``cluster-id`` (which copies of received messages keep). None (or
    leaving an option out) sends no property, or the default named; an empty
    string is sent as an empty string.

    Attributes:
        message_id: a stable id (1 to 255 bytes); generated when omitted, kept
            on every republish.
        headers: AMQP headers: str names up to 128 bytes; values None, bool,
            int (64-bit), finite float, Decimal, str, bytes, datetime, lists and
            nested mappings of those.
        persistent: delivery mode 2 (default ``settings.persistent``).
        mandatory: ask for ``basic.return`` when unroutable (default ``settings.mandatory``).
        content_type: overrides the type inferred from the body (None infers it;
            ``""`` sends an empty content type).
        content_encoding: AMQP ``content-encoding`` (``"gzip"``...): the body
            is sent as given, this only names its encoding.
        correlation_id: AMQP correlation id.
        reply_to: AMQP reply-to.
        expiration: per-message TTL in seconds (finite, 0 to 2**32 - 1 ms),
            rounded to the nearest millisecond.
        priority: AMQP priority, 0 to 255.
        message_type: AMQP ``type`` property.
        user_id: AMQP ``user-id``: RabbitMQ refuses a message whose user id is
            not the user the connection logged in as ([PublishRefused][reliable_mq.errors.PublishRefused],
            406 ``PRECONDITION_FAILED``).
        app_id: AMQP ``app-id`` property.
        timestamp: AMQP ``timestamp`` property, whole seconds (naive means UTC;
            1970 or later; 64-bit, so any year up to 9999).
    """

    message_id: str | None
    headers: Mapping[str, Any] | None
    persistent: bool | None
    mandatory: bool | None
    content_type: str | None
    content_encoding: str | None
    correlation_id: str | None
    reply_to: str | None
    expiration: float | None
    priority: int | None
    message_type: str | None
    user_id: str | None
    app_id: str | None
    timestamp: datetime | None


@dataclass(frozen=True, slots=True)
class Message:
    """One message for [publish_many][reliable_mq.publisher.ReliablePublisher.publish_many].

    The fields mean what the keyword arguments of ``publish()`` mean (see
    [MessageOptions][reliable_mq.message.MessageOptions]).
    """

    body: Any
    routing_key: str
    exchange: str = ""
    message_id: str | None = None
    headers: Mapping[str, Any] | None = None
    persistent: bool | None = None
    mandatory: bool | None = None
    content_type: str | None = None
    correlation_id: str | None = None
    reply_to: str | None = None
    expiration: float | None = None
    priority: int | None = None
    message_type: str | None = None
    app_id: str | None = None
    timestamp: datetime | None = None
    content_encoding: str | None = None  # last: fields given by position keep their place
    user_id: str | None = None
