"""Delivery: one incoming message, as a handler sees it, settled exactly once.

A handler normally lets the consumer settle the delivery from its outcome
(return: ack, ``Retry``: retry, ``Reject``: dead-letter). It can also settle it
itself with `Delivery.ack()`, `Delivery.retry()`,
`Delivery.reject()` or `Delivery.nack()`. Only the first settle counts:
a second one is a no-op that logs a warning and returns False, never a channel
error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from .log import get_logger

__all__ = ("ATTEMPT_HEADER", "Delivery", "Settler")

ATTEMPT_HEADER = "x-reliable-mq-attempt"
"""The header carrying the attempt number (1-based) of a retried message."""

_log = get_logger(__name__)


class Settler(Protocol):
    """What a delivery calls to settle itself (implemented by the consumer)."""

    async def settle_ack(self, delivery: Delivery) -> None: ...

    async def settle_nack(self, delivery: Delivery, requeue: bool) -> None: ...

    async def settle_retry(
        self, delivery: Delivery, reason: str, delay: float | None, error: BaseException | None
    ) -> None: ...

    async def settle_dead_letter(
        self, delivery: Delivery, reason: str, error: BaseException | None
    ) -> None: ...


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
    """

    __slots__ = (
        "_dedup_owner",
        "_outcome",
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
        self._outcome: str | None = None
        self._dedup_owner: str | None = None  # set while this delivery holds a dedup claim

    def __repr__(self) -> str:
        return (
            f"Delivery(queue={self.queue!r}, message_id={self.message_id!r}, "
            f"attempt={self.attempt}, outcome={self._outcome!r})"
        )

    @property
    def settled(self) -> bool:
        """True once an outcome was chosen (by the handler or the consumer)."""
        return self._outcome is not None

    @property
    def outcome(self) -> str | None:
        """``"ack"``, ``"retry"``, ``"dead_letter"``, ``"nack"``, ``"requeue"``,
        ``"duplicate"`` (acked unhandled), ``"defer"`` (sent round a retry queue
        unhandled), ``"stale"`` or None."""
        return self._outcome

    def claim(self, outcome: str) -> bool:
        """Reserve the one settle of this delivery; False (and a warning) if taken.

        Used by the consumer; user code settles through the methods below.
        """
        if self._outcome is not None:
            _log.warning(
                "delivery_already_settled",
                queue=self.queue,
                message_id=self.message_id,
                first=self._outcome,
                second=outcome,
            )
            return False
        self._outcome = outcome
        return True

    def _require_settler(self) -> Settler:
        if self._settler is None:
            raise RuntimeError("this Delivery is not attached to a consumer")
        return self._settler

    async def ack(self) -> bool:
        """Acknowledge now (batched with others when batch acks are on).

        Returns:
            True if this call settled the delivery, False if it was settled before.
        """
        settler = self._require_settler()
        if not self.claim("ack"):
            return False
        await settler.settle_ack(self)
        return True

    async def retry(self, reason: str = "retry requested", *, delay: float | None = None) -> bool:
        """Republish to the retry queue for the next attempt (or the DLQ when out of attempts).

        Returns:
            True if this call settled the delivery, False if it was settled before.
        """
        settler = self._require_settler()
        if not self.claim("retry"):
            return False
        await settler.settle_retry(self, reason, delay, None)
        return True

    async def reject(self, reason: str = "rejected by handler") -> bool:
        """Dead-letter now: publish to the DLQ with ``reason`` in the headers, then ack.

        Returns:
            True if this call settled the delivery, False if it was settled before.
        """
        settler = self._require_settler()
        if not self.claim("dead_letter"):
            return False
        await settler.settle_dead_letter(self, reason, None)
        return True

    async def nack(self, *, requeue: bool = True) -> bool:
        """Send a plain ``basic.nack`` (requeue: back to the queue head, no delay).

        Prefer `retry()`; with ``requeue=False`` the broker drops the message
        unless the queue has a dead-letter exchange (the topology helper sets one).

        Returns:
            True if this call settled the delivery, False if it was settled before.
        """
        settler = self._require_settler()
        if not self.claim("nack"):
            return False
        await settler.settle_nack(self, requeue)
        return True
