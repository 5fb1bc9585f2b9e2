"""The consuming side's spans: ``process`` (one delivery) and the settle spans
(``ack``/``nack``, a batched ack as one span)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from .core import (
    _GETTER,
    TRACEPARENT,
    _attributes,
    _failed,
    _guarded,
    _nothing,
    _propagate,
    consume_destination,
    otel_context,
    trace,
)

if TYPE_CHECKING:
    from yarl import URL

__all__ = (
    "CHANNEL_CLOSED",
    "batch_process_ended",
    "MAX_SETTLE_LINKS",
    "SettleTrace",
    "settle_frame",
    "settle_trace",
    "settled",
    "start_batch_process",
    "start_process",
    "use_span",
)

# -- process ----------------------------------------------------------------------------


@_guarded(_nothing)
def start_process(
    tracer: Any,
    *,
    queue: str,
    exchange: str,
    routing_key: str,
    headers: Mapping[str, Any],
    message_id: str,
    correlation_id: Any,
    delivery_tag: int,
    attempt: int,
    url: URL | None,
    parent_from_message: bool = False,
) -> Any:
    """Start a CONSUMER span ``process {destination}``, a root linked to the producer's
    context found in ``headers`` (a link, not a parent: the message may be processed
    long after, in another trace; the context current here is only the consumer's
    start-up, which is no delivery's parent).

    ``parent_from_message``: the producer's context is the parent instead (still
    linked, as the conventions ask; a span current here is linked too).
    """
    destination = consume_destination(exchange, routing_key, queue)
    attributes = _attributes(
        "process",
        "process",
        destination,
        url,
        routing_key=routing_key,
        message_id=message_id,
        correlation_id=correlation_id,
    )
    attributes["messaging.rabbitmq.message.delivery_tag"] = delivery_tag
    attributes["reliable_mq.attempt"] = attempt
    links = None
    parent = otel_context.Context()  # a root: the context current here is the consumer's
    if TRACEPARENT in headers:
        extracted = _propagate().extract(headers, getter=_GETTER)
        producer = trace.get_current_span(extracted).get_span_context()
        if producer.is_valid:
            links = [trace.Link(producer)]
            if parent_from_message:
                parent = extracted
                ambient = trace.get_current_span().get_span_context()
                if ambient.is_valid:
                    links.append(trace.Link(ambient))
    return tracer.start_span(
        f"process {destination}",
        context=parent,
        kind=trace.SpanKind.CONSUMER,
        attributes=attributes,
        links=links,
    )


@_guarded(_nothing)
def start_batch_process(
    tracer: Any, *, queue: str, processes: Sequence[Any], url: URL | None
) -> Any:
    """Start a CONSUMER span ``process {queue}`` for one call of a batch handler: a
    root with ``messaging.batch.message_count``, linked to the ``process`` span of
    each delivery in the batch (at most `MAX_SETTLE_LINKS`; each of those is linked
    to its producer). Current while the handler runs: the handler's own spans are
    its children, never one delivery's."""
    destination = queue or "amq.default"
    attributes = _attributes("process", "process", destination, url)
    attributes["messaging.batch.message_count"] = len(processes)
    links = [
        trace.Link(span.get_span_context())
        for span in processes[:MAX_SETTLE_LINKS]
        if span is not None
    ]
    return tracer.start_span(
        f"process {destination}",
        context=otel_context.Context(),
        kind=trace.SpanKind.CONSUMER,
        attributes=attributes,
        links=links,
    )


@_guarded(_nothing)
def batch_process_ended(span: Any, failed: int, error: BaseException | None) -> None:
    """The batch call ended: how many of its messages failed, and the error of a
    call that failed them all (a batch ``BatchFailed`` partly failed is no error)."""
    span.set_attribute("reliable_mq.batch.failed", failed)
    if error is not None:
        _failed(span, error)


@_guarded(_nothing)
def settled(span: Any, settle: str, outcome: str, error: BaseException | None) -> None:
    """The delivery was settled: how (``ack``, ``retry``, ``dead_letter``...), why
    (the outcome: ``returned``, ``raised``...) and the error of a failed delivery."""
    span.set_attribute("reliable_mq.settle", settle)
    span.set_attribute("reliable_mq.outcome", outcome)
    if outcome in _EVENTS:
        span.add_event(outcome)
    if error is not None:
        _failed(span, error)


_EVENTS = frozenset({"duplicate", "consumer_timeout"})
"""Outcomes also recorded as an event: no handler ran (a duplicate), or it was cut."""


def use_span(span: Any) -> Any:
    """A context manager that makes ``span`` current and ends it on exit."""
    return trace.use_span(
        span, end_on_exit=True, record_exception=False, set_status_on_exception=False
    )


# -- settle -----------------------------------------------------------------------------

CHANNEL_CLOSED = "channel_closed"
"""``error.type`` of a settle span whose frame never reached the broker: the channel
was gone first (the broker requeues the delivery)."""

MAX_SETTLE_LINKS = 128
"""Links a batched ack's span gets at most (the SDK's default span link limit)."""


class SettleTrace(NamedTuple):
    """One delivery's settle, decided and waiting for its frame (made only when traced).

    No span is open while it waits: the settle span is recorded once the frame is
    written or known lost (`settle_frame`), started at ``decided``.
    """

    process: Any
    """The delivery's ``process`` span."""
    decided: int
    """When the settle was decided (``time.time_ns()``)."""
    destination: str
    """The process span's destination."""
    queue: str
    settle: str
    """How it is settled (``reliable_mq.settle``: ``ack``, ``retry``, ``reject``...)."""
    tag: int
    message_id: str


def settle_trace(
    process: Any, decided: int, delivery: Any, queue: str, settle: str, tag: int
) -> SettleTrace:
    """The `SettleTrace` of ``delivery`` (a `reliable_mq.delivery.Delivery`) from ``queue``."""
    destination = consume_destination(delivery.exchange, delivery.routing_key, queue)
    return SettleTrace(process, decided, destination, queue, str(settle), tag, delivery.message_id)


@_guarded(_nothing)
def settle_frame(
    tracer: Any,
    operation: str,
    traces: Sequence[SettleTrace],
    count: int,
    frame_tag: int,
    url: URL | None,
    error: str | None,
) -> None:
    """Record one settle frame as a CLIENT span ``{operation} {destination}``, from the
    first decision it carries out to now (the frame written, or ``error``).

    One delivery: a child of its process span. A batched ack (``count`` > 1): a
    root span with ``messaging.batch.message_count`` and a link to the process
    span of each traced delivery it covers (at most `MAX_SETTLE_LINKS`).
    """
    first = traces[0]
    batch = count > 1
    settles = {t.settle for t in traces}
    destinations = {t.destination for t in traces}
    destination = first.destination if len(destinations) == 1 else first.queue
    attributes = _attributes("settle", operation, destination, url)
    attributes["messaging.rabbitmq.message.delivery_tag"] = frame_tag
    if len(settles) == 1:
        attributes["reliable_mq.settle"] = first.settle
    if batch:
        attributes["messaging.batch.message_count"] = count
        parent = otel_context.Context()  # a root: it belongs to no one delivery's trace
        links = [trace.Link(t.process.get_span_context()) for t in traces[:MAX_SETTLE_LINKS]]
    else:
        if first.message_id:
            attributes["messaging.message.id"] = first.message_id
        parent = trace.set_span_in_context(first.process)
        links = None
    span = tracer.start_span(
        f"{operation} {destination}",
        context=parent,
        kind=trace.SpanKind.CLIENT,
        attributes=attributes,
        links=links,
        start_time=min(t.decided for t in traces),
    )
    if error is not None:
        span.set_attribute("error.type", error)
        span.set_status(trace.Status(trace.StatusCode.ERROR, error))
    span.end()
