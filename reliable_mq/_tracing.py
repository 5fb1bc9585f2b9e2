"""OpenTelemetry spans for publish, process and settle, and the W3C trace context in headers.

The only module that imports ``opentelemetry`` (the ``otel`` extra: the API
alone). Without it, or without a real tracer provider, tracing is off and costs
one cached check per message: no span objects, no headers added.

On import nothing is installed: no provider, no propagator, no logging.
Attributes follow the OpenTelemetry messaging conventions for RabbitMQ
(``messaging.*``, ``server.*``, ``error.type``); ours are ``reliable_mq.*``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from ._extras import missing_extra
from ._version import __version__
from .log import get_logger

if TYPE_CHECKING:
    from yarl import URL

try:
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.propagators.textmap import Getter
except ImportError:  # the otel extra is not installed: tracing stays off
    trace = None  # type: ignore[assignment]
    Getter = object  # type: ignore[assignment,misc]

__all__ = (
    "CHANNEL_CLOSED",
    "MAX_SETTLE_LINKS",
    "TRACEPARENT",
    "TRACESTATE",
    "SettleTrace",
    "Tracing",
    "batch_ended",
    "batch_message",
    "consume_destination",
    "created",
    "linked",
    "partition_ended",
    "publish_destination",
    "publish_ended",
    "republished",
    "settle_frame",
    "settle_trace",
    "settled",
    "stamp_creation",
    "start_batch",
    "start_partition",
    "start_process",
    "start_publish",
    "use_span",
)

TRACEPARENT = "traceparent"
"""The W3C trace-context header: present, it is kept (a copy keeps its creation context)."""
TRACESTATE = "tracestate"
"""The W3C header that goes with it (vendor state): kept on every copy too."""

_RECHECK = 2.0
"""Seconds between two looks at the global tracer provider (it may be set late)."""

_F = TypeVar("_F", bound=Callable[..., Any])
_warned: set[str] = set()


@functools.cache
def _propagate() -> Any:
    """``opentelemetry.propagate``, imported on first traced use: its import loads the
    configured propagators (entry points), about 20 ms that an untraced process never pays."""
    from opentelemetry import propagate  # noqa: PLC0415 (lazy on purpose, see above)

    return propagate


def _guarded(fallback: Callable[..., Any]) -> Callable[[_F], _F]:
    """A tracer provider that raises must never break a publish or a settle: the
    call's error is logged once per function (``tracing_failed``) and ``fallback``
    (given the call's arguments) answers instead."""

    def wrap(func: _F) -> _F:
        @functools.wraps(func)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return func(*args, **kwargs)
            except Exception as exc:
                if func.__name__ not in _warned:
                    _warned.add(func.__name__)
                    get_logger(__name__).warning(
                        "tracing_failed", call=func.__name__, error=repr(exc)[:300]
                    )
                return fallback(*args, **kwargs)

        return guarded  # type: ignore[return-value]

    return wrap


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _no_span(
    tracer: Any,
    exchange: str,
    routing_key: str,
    headers: Any,
    correlation_id: Any,
    url: URL | None,
) -> tuple[Any, Any]:
    return None, headers


class Tracing:
    """The tracer of one publisher or consumer, or None when tracing is off.

    Args:
        tracer_provider: an OpenTelemetry ``TracerProvider``; None: the global one,
            looked at again every couple of seconds (it may be set after we start).
            The API's default proxy (no SDK configured) and the no-op provider mean off.

    Raises:
        ImportError: a provider was given but ``opentelemetry-api`` is not installed.
    """

    __slots__ = ("_checked_at", "_provider", "_tracer")

    def __init__(self, tracer_provider: Any | None = None) -> None:
        self._provider = tracer_provider
        self._tracer: Any | None = None
        self._checked_at = -_RECHECK
        if tracer_provider is not None:
            if trace is None:
                raise ImportError(missing_extra("tracer_provider needs opentelemetry-api", "otel"))
            self._tracer = _tracer_of(tracer_provider)

    def tracer(self) -> Any | None:
        """The tracer to start spans with now; None when tracing is off (cheap)."""
        if self._provider is not None or trace is None:
            return self._tracer
        now = time.monotonic()
        if now - self._checked_at >= _RECHECK:
            self._checked_at = now
            self._tracer = _tracer_of(trace.get_tracer_provider())
        return self._tracer


def _tracer_of(provider: Any) -> Any | None:
    if isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return None  # no SDK configured: nothing would be recorded
    return provider.get_tracer("reliable_mq", __version__)


# -- destinations ---------------------------------------------------------------------


def publish_destination(exchange: str, routing_key: str) -> str:
    """``{exchange}:{routing key}``, the empty one left out; ``amq.default`` if both are."""
    if exchange and routing_key:
        return f"{exchange}:{routing_key}"
    return exchange or routing_key or "amq.default"


def consume_destination(exchange: str, routing_key: str, queue: str) -> str:
    """``{exchange}:{routing key}:{queue}``, empty parts left out, the queue once if it
    is the routing key (the convention's consumer side)."""
    parts = [part for part in (exchange, routing_key) if part]
    if queue and queue != routing_key:
        parts.append(queue)
    return ":".join(parts) or "amq.default"


def _server(url: URL | None, attributes: dict[str, Any]) -> None:
    if url is not None:
        if url.host:
            attributes["server.address"] = url.host
        if url.port:
            attributes["server.port"] = url.port


# -- publish ----------------------------------------------------------------------------


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
    destination = publish_destination(exchange, routing_key)
    attributes: dict[str, Any] = {
        "messaging.system": "rabbitmq",
        "messaging.operation.type": "send",
        "messaging.operation.name": "publish",
        "messaging.destination.name": destination,
    }
    if routing_key:
        attributes["messaging.rabbitmq.destination.routing_key"] = routing_key
    if correlation_id and isinstance(correlation_id, str):
        attributes["messaging.message.conversation_id"] = correlation_id
    _server(url, attributes)
    span = tracer.start_span(
        f"publish {destination}", kind=trace.SpanKind.PRODUCER, attributes=attributes
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


def _failed(span: Any, error: BaseException) -> None:
    span.set_attribute("error.type", type(error).__name__)
    span.set_status(trace.Status(trace.StatusCode.ERROR, str(error)[:300]))


# -- publish_many ---------------------------------------------------------------------


def _batch_fallback(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
    return None, kwargs["headers"], None


@_guarded(_nothing)
def start_batch(tracer: Any, url: URL | None) -> Any:
    """Start the PRODUCER span of one ``publish_many()`` call in the current context.

    Named ``publish`` until `batch_ended` knows whether every message went to one
    destination (then ``publish {destination}``).
    """
    attributes: dict[str, Any] = {
        "messaging.system": "rabbitmq",
        "messaging.operation.type": "send",
        "messaging.operation.name": "publish",
    }
    _server(url, attributes)
    return tracer.start_span("publish", kind=trace.SpanKind.PRODUCER, attributes=attributes)


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
    destination = publish_destination(exchange, routing_key)
    attributes: dict[str, Any] = {
        "messaging.system": "rabbitmq",
        "messaging.operation.type": "create",
        "messaging.operation.name": "create",
        "messaging.destination.name": destination,
    }
    if routing_key:
        attributes["messaging.rabbitmq.destination.routing_key"] = routing_key
    if correlation_id and isinstance(correlation_id, str):
        attributes["messaging.message.conversation_id"] = correlation_id
    _server(url, attributes)
    span = tracer.start_span(
        f"create {destination}", kind=trace.SpanKind.PRODUCER, attributes=attributes
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


# -- process ----------------------------------------------------------------------------


class _HeaderGetter(Getter):  # type: ignore[type-arg]
    """Reads AMQP headers: a value may be ``str``, ``bytes`` (a long string not UTF-8)
    or ``bytearray`` (a byte array: pika and aio-pika send a ``bytes`` value as one)."""

    def get(self, carrier: Mapping[str, Any], key: str) -> list[str] | None:
        value = carrier.get(key)
        if isinstance(value, (bytes, bytearray)):
            value = value.decode("latin-1")
        return [value] if isinstance(value, str) else None

    def keys(self, carrier: Mapping[str, Any]) -> list[str]:
        return list(carrier)


_GETTER = _HeaderGetter() if trace is not None else None


def _extracted(headers: Mapping[str, Any]) -> Any | None:
    """The valid span context of the ``traceparent`` in ``headers``, or None."""
    context = trace.get_current_span(_propagate().extract(headers, getter=_GETTER))
    span_context = context.get_span_context()
    return span_context if span_context.is_valid else None


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
    attributes: dict[str, Any] = {
        "messaging.system": "rabbitmq",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": destination,
        "messaging.rabbitmq.message.delivery_tag": delivery_tag,
        "reliable_mq.attempt": attempt,
    }
    if routing_key:
        attributes["messaging.rabbitmq.destination.routing_key"] = routing_key
    if message_id:
        attributes["messaging.message.id"] = message_id
    if correlation_id and isinstance(correlation_id, str):
        attributes["messaging.message.conversation_id"] = correlation_id
    _server(url, attributes)
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
    destination = publish_destination(exchange, routing_key)
    attributes: dict[str, Any] = {
        "messaging.system": "rabbitmq",
        "messaging.operation.type": "create",
        "messaging.operation.name": "create",
        "messaging.destination.name": destination,
        "messaging.message.id": message_id,
    }
    if routing_key:
        attributes["messaging.rabbitmq.destination.routing_key"] = routing_key
    span = tracer.start_span(
        f"create {destination}", kind=trace.SpanKind.PRODUCER, attributes=attributes
    )
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
    attributes: dict[str, Any] = {
        "messaging.system": "rabbitmq",
        "messaging.operation.type": "settle",
        "messaging.operation.name": operation,
        "messaging.destination.name": destination,
        "messaging.rabbitmq.message.delivery_tag": frame_tag,
    }
    if len(settles) == 1:
        attributes["reliable_mq.settle"] = first.settle
    _server(url, attributes)
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
