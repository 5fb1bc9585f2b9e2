"""The tracer, the guard, destinations and the W3C headers: what the span modules share.

With `reliable_mq._tracing.publish` and `reliable_mq._tracing.consume`, the only
modules that import ``opentelemetry`` (the ``otel`` extra: the API
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

from .._extras import missing_extra
from .._version import __version__
from ..log import get_logger

if TYPE_CHECKING:
    from yarl import URL

try:
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.propagators.textmap import Getter
except ImportError:  # the otel extra is not installed: tracing stays off
    trace = None  # type: ignore[assignment]
    otel_context = None  # type: ignore[assignment]
    Getter = object  # type: ignore[assignment,misc]


__all__ = (
    "TRACEPARENT",
    "TRACESTATE",
    "Tracing",
    "consume_destination",
    "otel_context",
    "publish_destination",
    "trace",
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


def _attributes(
    operation_type: str,
    operation: str,
    destination: str | None,
    url: URL | None,
    *,
    routing_key: str = "",
    message_id: str | None = None,
    correlation_id: Any = None,
) -> dict[str, Any]:
    """The conventions' attributes our spans share: system, operation, destination,
    the broker (``server.*``), and the message's routing key, id and correlation id
    when it has them."""
    attributes: dict[str, Any] = {
        "messaging.system": "rabbitmq",
        "messaging.operation.type": operation_type,
        "messaging.operation.name": operation,
    }
    if destination is not None:
        attributes["messaging.destination.name"] = destination
    if routing_key:
        attributes["messaging.rabbitmq.destination.routing_key"] = routing_key
    if message_id:
        attributes["messaging.message.id"] = message_id
    if correlation_id and isinstance(correlation_id, str):
        attributes["messaging.message.conversation_id"] = correlation_id
    _server(url, attributes)
    return attributes


def _server(url: URL | None, attributes: dict[str, Any]) -> None:
    if url is not None:
        if url.host:
            attributes["server.address"] = url.host
        if url.port:
            attributes["server.port"] = url.port


def _failed(span: Any, error: BaseException) -> None:
    span.set_attribute("error.type", type(error).__name__)
    span.set_status(trace.Status(trace.StatusCode.ERROR, str(error)[:300]))


# -- reading headers ---------------------------------------------------------------


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
