"""An outgoing message: validated, encoded once, and its delivery state."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Mapping
from datetime import datetime
from typing import Any, TypedDict

from pamqp.commands import Basic

from ._codec import encode_body
from .errors import InvalidMessage, MessageTooLarge
from .metrics import exchange_label
from .settings import PublisherSettings

__all__ = ("MessageOptions", "Outgoing", "encode_message")


class MessageOptions(TypedDict, total=False):
    """Optional message properties accepted by ``publish()`` and ``enqueue()``.

    Attributes:
        message_id: a stable id; generated when omitted, kept on every republish.
        headers: AMQP headers (values must be AMQP-encodable).
        persistent: delivery mode 2 (default ``settings.persistent``).
        mandatory: ask for ``basic.return`` when unroutable (default ``settings.mandatory``).
        content_type: overrides the type inferred from the body.
        correlation_id: AMQP correlation id.
        reply_to: AMQP reply-to.
        expiration: per-message TTL in seconds.
        priority: AMQP priority, 0 to 255.
        message_type: AMQP ``type`` property.
        app_id: AMQP ``app-id`` property.
        timestamp: AMQP ``timestamp`` property.
    """

    message_id: str | None
    headers: Mapping[str, Any] | None
    persistent: bool | None
    mandatory: bool | None
    content_type: str | None
    correlation_id: str | None
    reply_to: str | None
    expiration: float | None
    priority: int | None
    message_type: str | None
    app_id: str | None
    timestamp: datetime | None


def encode_message(
    settings: PublisherSettings,
    body: Any,
    *,
    routing_key: str,
    exchange: str,
    options: MessageOptions,
) -> tuple[str, bytes, Basic.Properties]:
    """Validate and encode once; republishes reuse the bytes and properties.

    Raises:
        InvalidBody, InvalidMessage, MessageTooLarge: nothing can be sent as given.
    """
    message_id = options.get("message_id")
    priority = options.get("priority")
    expiration = options.get("expiration")
    persistent = options.get("persistent")
    headers = options.get("headers")
    payload, inferred_type = encode_body(body)
    if message_id is None:
        message_id = secrets.token_hex(16)
    elif not message_id or len(message_id) > 255:
        raise InvalidMessage("message_id must be 1 to 255 characters")
    if len(payload) > settings.max_message_size:
        raise MessageTooLarge(
            f"body is {len(payload)} bytes, over max_message_size={settings.max_message_size}",
            message_id=message_id,
            attempts=0,
        )
    if len(routing_key) > 85 and len(routing_key.encode()) > 255:
        raise InvalidMessage("routing_key is longer than 255 bytes")
    if len(exchange) > 85 and len(exchange.encode()) > 255:
        raise InvalidMessage("exchange name is longer than 255 bytes")
    if priority is not None and not 0 <= priority <= 255:
        raise InvalidMessage("priority must be 0 to 255")
    if persistent is None:
        persistent = settings.persistent
    properties = Basic.Properties(
        content_type=options.get("content_type") or inferred_type,
        delivery_mode=2 if persistent else 1,
        message_id=message_id,
        timestamp=options.get("timestamp"),
        headers=dict(headers) if headers else None,
        correlation_id=options.get("correlation_id"),
        reply_to=options.get("reply_to"),
        expiration=str(int(expiration * 1000)) if expiration is not None else None,
        priority=priority,
        message_type=options.get("message_type"),
        app_id=options.get("app_id"),
    )
    return message_id, payload, properties


class Outgoing:
    """One message and its delivery state; lives until its outcome is final."""

    __slots__ = (
        "attempts",
        "body",
        "deadline",
        "exchange",
        "failures",
        "label",
        "mandatory",
        "message_id",
        "properties",
        "retry_reason",
        "returns",
        "routing_key",
        "sent",
        "seq",
        "started",
    )

    def __init__(
        self,
        *,
        seq: int,
        message_id: str,
        body: bytes,
        properties: Basic.Properties,
        exchange: str,
        routing_key: str,
        mandatory: bool,
        deadline: float,
        started: float,
    ) -> None:
        self.seq = seq
        self.message_id = message_id
        self.body = body
        self.properties = properties
        self.exchange = exchange
        self.label = exchange_label(exchange)
        self.routing_key = routing_key
        self.mandatory = mandatory
        self.deadline = deadline
        self.started = started
        self.attempts = 0
        self.failures = 0
        self.returns = 0
        self.retry_reason = ""
        self.sent: asyncio.Future[None] | None = None
