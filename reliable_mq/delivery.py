"""Delivery: one incoming message, as a handler sees it, settled exactly once.

A handler normally lets the consumer settle the delivery from its outcome
(return: ack, ``Retry``: retry, ``Reject``: dead-letter). It can also settle it
itself with `Delivery.ack`, `Delivery.retry`,
`Delivery.reject` or `Delivery.nack`. Only the first settle counts:
a second one is a no-op that logs a warning and returns False, never a channel
error. [`Delivery.outcome`][reliable_mq.delivery.Delivery.outcome] says how it
ended.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, Protocol

from .headers import ATTEMPT_HEADER

__all__ = ("ATTEMPT_HEADER", "Delivery", "Settle", "Settler")


class Settle(enum.StrEnum):
    """How a delivery was settled (what the broker was told)."""

    ACK = "ack"
    """Acked: handled (or, under ``ACK_FIRST``, taken)."""
    DUPLICATE = "duplicate"
    """Acked without running the handler: its message id was done already."""
    RETRY = "retry"
    """A copy went to a retry queue (attempt + 1), then the original was acked."""
    DEAD_LETTER = "dead_letter"
    """A copy went to the DLQ with reason headers, then the original was acked;
    or, when no copy could be published, the broker dead-lettered it (reject)."""
    DEFER = "defer"
    """A copy went round the first retry queue unhandled (id busy elsewhere, or
    the dedup store down), with the same attempt number."""
    REQUEUE = "requeue"
    """``basic.nack(requeue=true)``: back to the queue (shutdown, a handler's
    ``nack()``, a store that could not record the id, or a copy that could not
    be published anywhere)."""
    REJECT = "reject"
    """``basic.nack(requeue=false)`` asked by the handler: the broker dead-letters
    it if the queue has a dead-letter exchange, else drops it."""
    STALE = "stale"
    """Nothing sent: the delivery's channel had died (the broker requeued it)."""
    HOLD = "hold"
    """Not a settle: leave the delivery unsettled for now (the handler runs next)."""


class Settler(Protocol):
    """What a delivery calls to settle itself (implemented by the consumer).

    Each method returns True if it settled the delivery, False if it was
    settled before (nothing is sent then).
    """

    @property
    def outcome(self) -> Settle | None:
        """The settle chosen so far, or None."""
        ...

    async def settle_ack(self, delivery: Delivery) -> bool: ...

    async def settle_nack(self, delivery: Delivery, requeue: bool) -> bool: ...

    async def settle_retry(self, delivery: Delivery, reason: str, delay: float | None) -> bool: ...

    async def settle_dead_letter(self, delivery: Delivery, reason: str) -> bool: ...


class Delivery:
    """One delivered message.

    Attributes:
        body: the raw body.
        message_id: the AMQP message id ("" if the publisher set none); the key
            of de-duplication, and the id to pass to
            ``SQLiteDedupStore.run_once`` for an exactly-once effect.
        headers: the AMQP headers (read-only view; do not mutate).
        redelivered: the broker's redelivered flag (delivered before, not acked).
        attempt: 1 for a first delivery, +1 for each retry; on quorum queues it
            also counts the broker's ``x-delivery-count``.
        queue: the queue it was consumed from.
        exchange: the exchange it was published to ("" is the default one).
        routing_key: the routing key it was published with.
        content_type: the AMQP content type, if any.
        correlation_id: the AMQP correlation id, if any.
        reply_to: the AMQP reply-to, if any.
        delivery_tag: the tag on its channel (for logs; settle through the methods).
        properties: every basic property as it came (pamqp's ``Basic.Properties``:
            ``content_encoding``, ``priority``, ``timestamp`` as an aware UTC
            datetime, ``message_type``, ``user_id``, ``app_id``...; None on a
            Delivery made by hand). The consumer's copies keep them all.
    """

    __slots__ = (
        "_settler",
        "attempt",
        "body",
        "content_type",
        "correlation_id",
        "delivery_tag",
        "exchange",
        "headers",
        "message_id",
        "properties",
        "queue",
        "redelivered",
        "reply_to",
        "routing_key",
    )

    def __init__(
        self,
        *,
        body: bytes,
        message_id: str,
        headers: Mapping[str, Any],
        redelivered: bool,
        attempt: int,
        queue: str,
        exchange: str,
        routing_key: str,
        content_type: str | None,
        correlation_id: str | None = None,
        reply_to: str | None = None,
        delivery_tag: int = 0,
        properties: Any = None,
        settler: Settler | None = None,
    ) -> None:
        self.body = body
        self.message_id = message_id
        self.headers = headers
        self.redelivered = redelivered
        self.attempt = attempt
        self.queue = queue
        self.exchange = exchange
        self.routing_key = routing_key
        self.content_type = content_type
        self.correlation_id = correlation_id
        self.reply_to = reply_to
        self.delivery_tag = delivery_tag
        self.properties = properties
        self._settler = settler

    @classmethod
    def _received(
        cls,
        body: bytes,
        message_id: str,
        headers: Mapping[str, Any],
        redelivered: bool,
        attempt: int,
        queue: str,
        exchange: str,
        routing_key: str,
        content_type: str | None,
        correlation_id: str | None,
        reply_to: str | None,
        delivery_tag: int,
        properties: Any,
        settler: Settler | None,
        /,
    ) -> Delivery:
        """The consumer's constructor (`reliable_mq._consume.dispatch`): the fields of
        ``__init__`` in its order, all given, positional. A call with fourteen keyword
        arguments costs about three times as much per delivery."""
        self = cls.__new__(cls)
        self.body = body
        self.message_id = message_id
        self.headers = headers
        self.redelivered = redelivered
        self.attempt = attempt
        self.queue = queue
        self.exchange = exchange
        self.routing_key = routing_key
        self.content_type = content_type
        self.correlation_id = correlation_id
        self.reply_to = reply_to
        self.delivery_tag = delivery_tag
        self.properties = properties
        self._settler = settler
        return self

    def __repr__(self) -> str:
        outcome = self.outcome
        return (
            f"Delivery(queue={self.queue!r}, message_id={self.message_id!r}, "
            f"attempt={self.attempt}, outcome={outcome.value if outcome else None!r})"
        )

    @property
    def settled(self) -> bool:
        """True once an outcome was chosen (by the handler or the consumer)."""
        return self.outcome is not None

    @property
    def outcome(self) -> Settle | None:
        """How the delivery was settled, or None while it is not."""
        return self._settler.outcome if self._settler is not None else None

    def _require_settler(self) -> Settler:
        if self._settler is None:
            raise RuntimeError("this Delivery is not attached to a consumer")
        return self._settler

    async def ack(self) -> bool:
        """Acknowledge now (batched with others when batch acks are on).

        Returns:
            True if this call settled the delivery, False if it was settled before.
        """
        return await self._require_settler().settle_ack(self)

    async def retry(self, reason: str = "retry requested", *, delay: float | None = None) -> bool:
        """Republish to the retry queue for the next attempt (or the DLQ when out of attempts).

        Returns:
            True if this call settled the delivery, False if it was settled before.
        """
        return await self._require_settler().settle_retry(self, reason, delay)

    async def reject(self, reason: str = "rejected by handler") -> bool:
        """Dead-letter now: publish to the DLQ with ``reason`` in the headers, then ack.

        The copy's ``x-reliable-mq-reason`` is ``rejected`` and
        ``x-reliable-mq-error-message`` is ``reason``, as for a raised ``Reject``.

        Returns:
            True if this call settled the delivery, False if it was settled before.
        """
        return await self._require_settler().settle_dead_letter(self, reason)

    async def nack(self, *, requeue: bool = True) -> bool:
        """Send a plain ``basic.nack`` (requeue: back to the queue head, no delay).

        Prefer `retry`; with ``requeue=False`` the broker drops the message
        unless the queue has a dead-letter exchange (the topology helper sets one).

        Returns:
            True if this call settled the delivery, False if it was settled before.
        """
        return await self._require_settler().settle_nack(self, requeue)
