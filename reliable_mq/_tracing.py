"""OpenTelemetry spans for publish and process, and the W3C trace context in headers.

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
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from ._extras import missing_extra
from ._version import __version__
from .log import get_logger

if TYPE_CHECKING:
    from yarl import URL

try:
    from opentelemetry import propagate, trace
    from opentelemetry.propagators.textmap import Getter
except ImportError:  # the otel extra is not installed: tracing stays off
    trace = None  # type: ignore[assignment]
    Getter = object  # type: ignore[assignment,misc]

__all__ = (
    "TRACEPARENT",
    "Tracing",
    "consume_destination",
    "publish_destination",
    "publish_ended",
    "republished",
    "settled",
    "start_process",
    "start_publish",
    "use_span",
)

TRACEPARENT = "traceparent"
"""The W3C trace-context header: present, it is kept (a copy keeps its creation context)."""

_RECHECK = 2.0
"""Seconds between two looks at the global tracer provider (it may be set late)."""

_F = TypeVar("_F", bound=Callable[..., Any])
_warned: set[str] = set()


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
        propagate.inject(carrier, context=trace.set_span_in_context(span))
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
) -> Any:
    """Start a CONSUMER span ``process {destination}`` in the current context, linked
    to the producer's context found in ``headers`` (a link, not a parent: the
    message may be processed long after, in another trace)."""
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
    if TRACEPARENT in headers:
        producer = trace.get_current_span(propagate.extract(headers, getter=_GETTER))
        context = producer.get_span_context()
        if context.is_valid:
            links = [trace.Link(context)]
    return tracer.start_span(
        f"process {destination}",
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
