"""The publishing side's spans: ``publish`` (one message), the ``publish_many()``
batch and its ``create`` spans, the outbox row's creation context and the Spark
partition span."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .core import (
    TRACEPARENT,
    Tracing,
    _attributes,
    _extracted,
    _failed,
    _guarded,
    _no_span,
    _nothing,
    _propagate,
    publish_destination,
    trace,
)

if TYPE_CHECKING:
    from yarl import URL

__all__ = (
    "batch_ended",
    "batch_message",
    "created",
    "linked",
    "partition_ended",
    "publish_ended",
    "republished",
    "stamp_creation",
    "start_batch",
    "start_partition",
    "start_publish",
)

# -- publish ----------------------------------------------------------------------------


def _producer_span(
    tracer: Any,
    operation: str,
    exchange: str,
    routing_key: str,
    *,
    correlation_id: Any = None,
    message_id: str = "",
    url: URL | None = None,
) -> Any:
    """Start a PRODUCER span ``{operation} {destination}`` (``publish``: a send;
    ``create``: a message's creation context) with the conventions' attributes."""
    destination = publish_destination(exchange, routing_key)
    attributes = _attributes(
        "send" if operation == "publish" else operation,
        operation,
        destination,
        url,
        routing_key=routing_key,
        message_id=message_id,
        correlation_id=correlation_id,
    )
    return tracer.start_span(
        f"{operation} {destination}", kind=trace.SpanKind.PRODUCER, attributes=attributes
    )


@_guarded(_no_span)
def start_publish(
    tracer: Any,
    exchange: str,
    routing_key: str,
    headers: Any,
    correlation_id: Any,
    url: URL | None,
) -> tuple[Any, Any]:
    """Start a PRODUCER span ``publish {destination}`` in the current context.

    Returns:
        ``(span, headers)``: the headers with the span's ``traceparent`` added,
        unless they carry one already (or are not a mapping: the encoder refuses them).
    """
    span = _producer_span(
        tracer, "publish", exchange, routing_key, correlation_id=correlation_id, url=url
    )
    if headers is None or (isinstance(headers, Mapping) and TRACEPARENT not in headers):
        carrier: dict[str, Any] = dict(headers) if headers else {}
        _propagate().inject(carrier, context=trace.set_span_in_context(span))
        headers = carrier
    return span, headers


@_guarded(_nothing)
def republished(span: Any, reason: str, attempt: int) -> None:
    """The engine sends the message again (a ``republish`` event on its one span)."""
    span.add_event("republish", {"reason": reason, "attempt": attempt})


@_guarded(_nothing)
def publish_ended(span: Any, message_id: str, attempts: int, error: BaseException | None) -> None:
    """The outcome is known: confirmed (``error`` None) or a typed error."""
    if message_id:
        span.set_attribute("messaging.message.id", message_id)
    span.set_attribute("reliable_mq.publish.attempts", attempts)
    if error is not None:
        _failed(span, error)
    span.end()


# -- publish_many ---------------------------------------------------------------------


def _batch_fallback(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
    return None, kwargs["headers"], None


@_guarded(_nothing)
def start_batch(tracer: Any, url: URL | None, *, creation_context: bool) -> Any:
    """Start the span of one ``publish_many()`` call in the current context.

    Its kind follows the messaging conventions: PRODUCER when its context is
    injected as the messages' creation context (``creation_context``: no
    ``create`` spans), CLIENT when each message has a creation context of its own.
    Named ``publish`` until `batch_ended` knows whether every message went to one
    destination (then ``publish {destination}``).
    """
    attributes = _attributes("send", "publish", None, url)
    kind = trace.SpanKind.PRODUCER if creation_context else trace.SpanKind.CLIENT
    return tracer.start_span("publish", kind=kind, attributes=attributes)


@_guarded(_batch_fallback)
def batch_message(
    tracer: Any | None,
    batch: Any,
    *,
    exchange: str,
    routing_key: str,
    headers: Any,
    correlation_id: Any,
    url: URL | None,
) -> tuple[Any, Any, Any]:
    """Give one message of a batch its creation context, before it is encoded.

    * It carries a ``traceparent``: kept as it is; its context is to be linked.
    * Else, with a ``tracer`` (create spans on): a PRODUCER span ``create
      {destination}`` is started in the current context (the caller's), and
      its context goes into the headers and is to be linked.
    * Else (create spans off): the ``batch`` span's context goes into the headers.

    Returns:
        ``(create span or None, headers, span context to link or None)``.
    """
    if isinstance(headers, Mapping) and TRACEPARENT in headers:
        return None, headers, _extracted(headers)
    if headers is not None and not isinstance(headers, Mapping):
        return None, headers, None  # the encoder refuses them
    carrier: dict[str, Any] = dict(headers) if headers else {}
    if tracer is None:
        _propagate().inject(carrier, context=trace.set_span_in_context(batch))
        return None, carrier, None
    span = _producer_span(
        tracer, "create", exchange, routing_key, correlation_id=correlation_id, url=url
    )
    _propagate().inject(carrier, context=trace.set_span_in_context(span))
    return span, carrier, span.get_span_context()


@_guarded(_nothing)
def created(span: Any, message_id: str, error: BaseException | None) -> None:
    """End a ``create`` span: the message is encoded (or refused with ``error``)."""
    if message_id:
        span.set_attribute("messaging.message.id", message_id)
    if error is not None:
        _failed(span, error)
    span.end()


@_guarded(_nothing)
def linked(batch: Any, context: Any, message_id: str) -> None:
    """Link the batch span to one message's creation context."""
    batch.add_link(context, {"messaging.message.id": message_id} if message_id else None)


@_guarded(_nothing)
def batch_ended(
    span: Any,
    route: tuple[str, str] | None,
    count: int,
    failed: int,
    republished: int,
    error: BaseException | None,
) -> None:
    """Every outcome of the batch is known: name it, count it, end it.

    ``route`` is the ``(exchange, routing key)`` of every message read, None when
    they differed (or none was read); ``error`` what ``error.type`` names.
    """
    if route is not None:
        destination = publish_destination(*route)
        span.update_name(f"publish {destination}")
        span.set_attribute("messaging.destination.name", destination)
        if route[1]:
            span.set_attribute("messaging.rabbitmq.destination.routing_key", route[1])
    span.set_attribute("messaging.batch.message_count", count)
    span.set_attribute("reliable_mq.batch.failed", failed)
    span.set_attribute("reliable_mq.batch.republished", republished)
    if error is not None:
        _failed(span, error)
    span.end()


# -- outbox and Spark -------------------------------------------------------------------


def _headers_unchanged(tracing: Tracing, headers: Any, *args: Any, **kwargs: Any) -> Any:
    return headers


@_guarded(_headers_unchanged)
def stamp_creation(
    tracing: Tracing,
    headers: Mapping[str, Any] | None,
    *,
    exchange: str,
    routing_key: str,
    message_id: str,
) -> Mapping[str, Any] | None:
    """The caller's context, written into an outbox row's headers (``outbox.add()``).

    With a tracer from ``tracing``: a PRODUCER ``create {destination}`` span, a
    child of the current span, ended at once; its context goes into the headers
    (the message's own creation context, as the conventions ask of a message
    sent later in a batch). Without one, but with a valid current span (from
    any provider): that span's context. Through the global propagator, and
    only if ``headers`` carry no ``traceparent`` yet.

    Returns:
        New headers with ``traceparent`` (and ``tracestate``...), or ``headers``
        themselves when there is nothing to add.
    """
    if trace is None or (headers is not None and TRACEPARENT in headers):
        return headers
    tracer = tracing.tracer()
    if tracer is None:
        if not trace.get_current_span().get_span_context().is_valid:
            return headers
        carrier: dict[str, Any] = dict(headers) if headers else {}
        _propagate().inject(carrier)
        return carrier
    span = _producer_span(tracer, "create", exchange, routing_key, message_id=message_id)
    span.end()
    carrier = dict(headers) if headers else {}
    _propagate().inject(carrier, context=trace.set_span_in_context(span))
    return carrier


@_guarded(_nothing)
def start_partition(tracer: Any, partition: int, task_attempt: int, batch_id: int | None) -> Any:
    """Start an INTERNAL span ``publish_partition`` for one Spark partition on an
    executor; the publisher's batch spans of its chunks are its children."""
    attributes: dict[str, Any] = {
        "messaging.system": "rabbitmq",
        "reliable_mq.spark.partition": partition,
        "reliable_mq.spark.task_attempt": task_attempt,
    }
    if batch_id is not None:
        attributes["reliable_mq.spark.batch_id"] = batch_id
    return tracer.start_span(
        "publish_partition", kind=trace.SpanKind.INTERNAL, attributes=attributes
    )


@_guarded(_nothing)
def partition_ended(span: Any, counts: Mapping[str, int], error: BaseException | None) -> None:
    """What the partition did (``reliable_mq.spark.rows``, ``.confirmed``...), and
    the error that stopped it; the span itself ends with ``use_span``."""
    for name, value in counts.items():
        span.set_attribute(f"reliable_mq.spark.{name}", value)
    if error is not None:
        _failed(span, error)
