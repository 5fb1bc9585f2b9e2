"""What a caller hands over, made an `Outgoing`: checked, encoded, traced and counted.

The publisher checks its own state first; the `Intake` numbers each message,
encodes it (`Preparer`), starts its span when tracing is on (`.traced`) and counts
it as published for its exchange.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from .._amqp.wire import Encoded
from .._tracing import Tracing
from ..errors import InvalidMessage
from ..message import Message, MessageOptions
from .outgoing import Outgoing, Preparer
from .traced import BatchTrace, encode_copy_traced, encode_traced

if TYPE_CHECKING:
    from yarl import URL

    from ..metrics import ExchangeMetrics, PublisherMetrics

__all__ = ("Intake",)

_OPTION_NAMES = frozenset(MessageOptions.__annotations__)


class Intake:
    """Makes the `Outgoing` of each message of one publisher.

    Args:
        preparer: validates and encodes.
        counts: the publisher's metrics (``published`` per exchange).
        tracing: its tracer, or off.
        url: the broker in use now (``server.*`` of the spans).
    """

    __slots__ = ("_counts", "_labelled", "_seq", "_url", "preparer", "tracing")

    def __init__(
        self,
        preparer: Preparer,
        counts: PublisherMetrics,
        tracing: Tracing,
        url: Callable[[], URL | None],
    ) -> None:
        self.preparer = preparer
        self.tracing = tracing
        self._counts = counts
        self._url = url
        self._labelled: dict[str, ExchangeMetrics] = {}
        self._seq = 0

    def message(
        self,
        body: Any,
        routing_key: str,
        exchange: str,
        timeout: float | None,
        options: MessageOptions,
    ) -> Outgoing:
        """A message of ``publish()``, ``enqueue()`` or ``publish_with_callback()``.

        Raises:
            InvalidMessage, InvalidBody, MessageTooLarge: it cannot be sent as given.
        """
        if options and not _OPTION_NAMES.issuperset(options):
            unknown = ", ".join(sorted(set(options) - _OPTION_NAMES))
            raise InvalidMessage(f"unknown message option(s): {unknown}")
        deadline_in = self.preparer.deadline_in(timeout)
        self._seq += 1
        seq, span = self._seq, None
        tracer = self.tracing.tracer()
        if tracer is None:
            message_id, encoded, mandatory = self.preparer.encode(
                seq, body, routing_key, exchange, **options
            )
        else:
            span, (message_id, encoded, mandatory) = encode_traced(
                tracer, self._url(), self.preparer, seq, body, routing_key, exchange, options
            )
        out = self._outgoing(message_id, encoded, exchange, routing_key, mandatory, deadline_in)
        out.span = span
        return out

    def copy(
        self,
        body: bytes,
        routing_key: str,
        properties: Mapping[str, Any],
        headers: Mapping[str, Any],
        timeout: float | None,
    ) -> Outgoing:
        """A copy of a received message (see `Preparer.encode_copy`)."""
        deadline_in = self.preparer.deadline_in(timeout)
        self._seq += 1
        seq, span = self._seq, None
        tracer = self.tracing.tracer()
        if tracer is None:
            message_id, encoded = self.preparer.encode_copy(
                seq, body, routing_key, properties, headers
            )
        else:
            span, (message_id, encoded) = encode_copy_traced(
                tracer, self._url(), self.preparer, seq, body, routing_key, properties, headers
            )
        out = self._outgoing(message_id, encoded, "", routing_key, True, deadline_in)
        out.span = span
        return out

    def batch_trace(self, create_spans: bool) -> BatchTrace | None:
        """The spans of a ``publish_many()`` starting now; None with tracing off."""
        tracer = self.tracing.tracer()
        if tracer is None:
            return None
        return BatchTrace(tracer, self._url(), create_spans=create_spans)

    def batch_message(
        self, message: Message, timeout: float | None, trace: BatchTrace | None
    ) -> Outgoing:
        """A message of a ``publish_many()`` (``trace``: its spans, None when off)."""
        deadline_in = self.preparer.deadline_in(timeout)
        self._seq += 1
        if trace is None:
            encoded = self.preparer.encode_message(self._seq, message, message.headers)
        else:
            encoded = trace.encode(self.preparer, self._seq, message)
        message_id, frames, mandatory = encoded
        return self._outgoing(
            message_id, frames, message.exchange, message.routing_key, mandatory, deadline_in
        )

    def _outgoing(
        self,
        message_id: str,
        encoded: Encoded,
        exchange: str,
        routing_key: str,
        mandatory: bool,
        deadline_in: float,
    ) -> Outgoing:
        counts = self._labelled.get(exchange)
        if counts is None:
            counts = self._labelled[exchange] = self._counts.for_exchange(exchange)
        counts.published += 1
        return Outgoing(
            self._seq,
            message_id,
            encoded,
            exchange,
            routing_key,
            mandatory,
            asyncio.get_running_loop().time() + deadline_in,
            time.monotonic(),
            counts,
        )
