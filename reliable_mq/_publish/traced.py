"""The publisher's spans: a message's ``publish`` span and the spans of a ``publish_many()``.

Only built when tracing is on (`reliable_mq._tracing.Tracing.tracer` gave a tracer):
with it off, the publisher never calls into this module. The OpenTelemetry calls
themselves are in `reliable_mq._tracing` (the one package that imports it); this
module decides which span a message gets and when it ends.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from .._tracing import (
    batch_ended,
    batch_message,
    created,
    linked,
    publish_ended,
    start_batch,
    start_publish,
)
from ..errors import PublishBatchError

if TYPE_CHECKING:
    from yarl import URL

    from .._amqp.wire import Encoded
    from ..message import Message, MessageOptions
    from ..outcomes import BatchResult
    from .batch import Batch
    from .outgoing import Preparer

__all__ = ("MAX_LINKS", "BatchTrace", "encode_copy_traced", "encode_traced")

MAX_LINKS = 128
"""The batch span links to the creation contexts of this many messages at most (the
first ones read): the SDK's default link limit, and a bounded cost per batch."""

_T = TypeVar("_T")


def encode_traced(
    tracer: Any,
    url: URL | None,
    preparer: Preparer,
    seq: int,
    body: Any,
    routing_key: str,
    exchange: str,
    options: MessageOptions,
) -> tuple[Any, tuple[str, Encoded, bool]]:
    """`Preparer.encode` with a ``publish`` span: ``(span, encode's result)``."""

    def encode(headers: Any) -> tuple[str, Encoded, bool]:
        options["headers"] = headers
        return preparer.encode(seq, body, routing_key, exchange, **options)

    return _traced(
        tracer,
        url,
        exchange,
        routing_key,
        options.get("headers"),
        options.get("correlation_id"),
        encode,
    )


def encode_copy_traced(
    tracer: Any,
    url: URL | None,
    preparer: Preparer,
    seq: int,
    body: bytes,
    routing_key: str,
    properties: Mapping[str, Any],
    headers: Mapping[str, Any],
) -> tuple[Any, tuple[str, Encoded]]:
    """`Preparer.encode_copy` with a ``publish`` span: ``(span, encode_copy's result)``."""
    return _traced(
        tracer,
        url,
        "",
        routing_key,
        headers,
        properties.get("correlation_id"),
        lambda traced: preparer.encode_copy(seq, body, routing_key, properties, traced),
    )


def _traced(
    tracer: Any,
    url: URL | None,
    exchange: str,
    routing_key: str,
    headers: Any,
    correlation_id: Any,
    encode: Callable[[Any], _T],
) -> tuple[Any, _T]:
    """Start a message's ``publish`` span, then ``encode(headers)`` with its ``traceparent``.

    Returns ``(span, encode's result)``; the span (None if the tracer failed) is
    ended by the engine with the outcome. A message the encoder refuses ends it
    at once with that error, which is raised.
    """
    span, headers = start_publish(tracer, exchange, routing_key, headers, correlation_id, url)
    try:
        encoded = encode(headers)
    except BaseException as exc:
        if span is not None:  # None: the tracer failed (logged once)
            publish_ended(span, "", 0, exc)
        raise
    return span, encoded


class BatchTrace:
    """The spans of one ``publish_many()`` call.

    One span for the call (PRODUCER when its context is the messages' creation
    context, that is with ``create`` spans off; CLIENT otherwise, as the conventions ask), started in the caller's context and ended once
    every outcome is known (`run`). Each message read gets a creation context
    before it is encoded (see `reliable_mq._tracing.batch_message`): the
    ``traceparent`` it carries, else a ``create`` span of its own (``create_spans``),
    else the batch span's context. The batch span links to the first `MAX_LINKS`
    creation contexts that are not its own.
    """

    __slots__ = ("_create", "_links", "_mixed", "_route", "_span", "_tracer", "_url")

    def __init__(self, tracer: Any, url: URL | None, *, create_spans: bool) -> None:
        self._tracer = tracer
        self._url = url
        self._create = create_spans
        # None: the tracer failed (logged once)
        self._span = start_batch(tracer, url, creation_context=not create_spans)
        self._route: tuple[str, str] | None = None
        self._mixed = False
        self._links = 0

    def encode(self, preparer: Preparer, seq: int, message: Message) -> tuple[str, Encoded, bool]:
        """`Preparer.encode_message`, with the message's creation context in its headers."""
        route = (message.exchange, message.routing_key)
        if self._route is None:
            self._route = route
        elif route != self._route:
            self._mixed = True
        span = self._span
        if span is None:
            return preparer.encode_message(seq, message, message.headers)
        create, headers, context = batch_message(
            self._tracer if self._create else None,
            span,
            exchange=message.exchange,
            routing_key=message.routing_key,
            headers=message.headers,
            correlation_id=message.correlation_id,
            url=self._url,
        )
        try:
            encoded = preparer.encode_message(seq, message, headers)
        except BaseException as exc:
            if create is not None:
                created(create, "", exc)
            raise
        if create is not None:
            created(create, encoded[0], None)
        if context is not None and self._links < MAX_LINKS:
            self._links += 1
            linked(span, context, encoded[0])
        return encoded

    async def run(self, batch: Batch, running: Awaitable[BatchResult]) -> BatchResult:
        """Await the batch, then end its span with the counts and the first failure."""
        try:
            result = await running
        except BaseException as exc:
            self._end(batch, exc)
            raise
        self._end(batch, None)
        return result

    def _end(self, batch: Batch, raised: BaseException | None) -> None:
        """``error.type``: what the call raised, unless that is the `PublishBatchError`
        summing up the failures; then (and with ``raise_on_error`` off) the class of
        the first failed message's error, by index."""
        span = self._span
        if span is None:
            return
        failures = batch.failures
        error = raised
        if (raised is None or isinstance(raised, PublishBatchError)) and failures:
            error = min(failures, key=lambda failure: failure.index).error
        route = None if self._mixed else self._route
        batch_ended(span, route, batch.taken, len(failures), batch.republished, error)
