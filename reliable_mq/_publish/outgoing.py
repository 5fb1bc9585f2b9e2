"""An outgoing message: validated and encoded once, and its delivery state until final."""

from __future__ import annotations

import asyncio
import datetime as dt
import enum
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

from .._amqp.wire import FRAME_OVERHEAD, Encoded, check_timeout, encode_properties, encode_publish
from .._codec import encode_body
from ..errors import InvalidBody, InvalidMessage, MessageTooLarge, ReliableMQError
from ..message import Message, MessageOptions
from ..settings import PublisherSettings

if TYPE_CHECKING:
    from ..metrics import ExchangeMetrics
    from .batch import Batch

__all__ = ("MessageOptions", "Outgoing", "Preparer", "RetryReason", "by_seq")

_METHOD_CACHE_SIZE = 4096


class RetryReason(enum.StrEnum):
    """Why a message was sent again (the ``reason`` label of the republish metric)."""

    NACK = "nack"
    CONNECTION_LOST = "connection_lost"
    CONFIRM_TIMEOUT = "confirm_timeout"
    RETURNED_AFTER_RECONNECT = "returned_after_reconnect"
    REFUSED_NEARBY = "refused_nearby"
    """Another message on its channel was refused: it is re-sent while the culprit is isolated."""


class Outgoing:
    """One accepted message and its delivery state; lives until its outcome is final.

    It holds a window slot and its ``message_id`` from acceptance until it is
    both ``finished`` (the caller has its outcome) and off every channel
    (``tag == 0``): a message whose caller timed out still occupies its slot
    while its last attempt may be confirmed.
    """

    __slots__ = (
        "attempts",
        "batch",
        "callback",
        "deadline",
        "encoded",
        "exchange",
        "failures",
        "finished",
        "followers",
        "future",
        "generation",
        "index",
        "mandatory",
        "maybe_routed",
        "message_id",
        "metrics",
        "refusals",
        "retry_reason",
        "returned",
        "returns",
        "routing_key",
        "sent_at",
        "seq",
        "span",
        "started",
        "tag",
    )

    def __init__(
        self,
        seq: int,
        message_id: str,
        encoded: Encoded,
        exchange: str,
        routing_key: str,
        mandatory: bool,
        deadline: float,
        started: float,
        metrics: ExchangeMetrics,
    ) -> None:
        self.seq = seq
        self.message_id = message_id
        self.encoded = encoded
        self.exchange = exchange
        self.routing_key = routing_key
        self.mandatory = mandatory
        self.deadline = deadline
        self.started = started
        self.metrics = metrics
        self.attempts = 0
        self.failures = 0
        self.returns = 0
        self.refusals = 0
        self.maybe_routed = False
        """An earlier attempt was lost unconfirmed: the broker may have routed it."""
        self.retry_reason = RetryReason.NACK
        self.tag = 0
        """Delivery tag of the attempt on a channel now; 0 when on none."""
        self.generation = 0
        """The channel generation of that attempt."""
        self.sent_at = 0.0
        self.returned: tuple[int, str] | None = None
        self.finished = False
        self.future: asyncio.Future[Any] | None = None
        self.batch: Batch | None = None
        self.callback: Callable[[Any, ReliableMQError | None], None] | None = None
        """Called once with ``(result, None)`` or ``(None, error)`` (the blocking publisher's sink)."""
        self.index = 0
        self.followers: list[asyncio.Future[None]] | None = None
        self.span: Any = None
        """Its OpenTelemetry span, ended with the outcome (None: tracing is off)."""

    def __repr__(self) -> str:
        return f"<Outgoing {self.message_id} seq={self.seq} attempts={self.attempts}>"


def by_seq(out: Outgoing) -> int:
    """The sort key of publish order (a message's ``seq``)."""
    return out.seq


class Preparer:
    """Validates and encodes messages for one publisher (caches what repeats)."""

    __slots__ = ("_id_prefix", "_methods", "frame_max", "settings")

    def __init__(self, settings: PublisherSettings, id_prefix: str) -> None:
        self.settings = settings
        self._id_prefix = id_prefix
        self._methods: dict[tuple[str, str, bool], bytes] = {}
        self.frame_max = 131_072
        """The negotiated frame size of the current connection (set on connect)."""

    def method(self, exchange: str, routing_key: str, mandatory: bool) -> bytes:
        """The ``basic.publish`` payload, cached (the same routes repeat)."""
        key = (exchange, routing_key, mandatory)
        try:
            payload = self._methods.get(key)
        except TypeError:  # unhashable: not a str, which encode_publish names
            return encode_publish(exchange, routing_key, mandatory)
        if payload is None:
            payload = encode_publish(exchange, routing_key, mandatory)
            if len(self._methods) >= _METHOD_CACHE_SIZE:
                self._methods.clear()
            self._methods[key] = payload
        return payload

    def encode(
        self,
        seq: int,
        body: Any,
        routing_key: str,
        exchange: str,
        *,
        message_id: str | None = None,
        headers: Mapping[str, Any] | None = None,
        persistent: bool | None = None,
        mandatory: bool | None = None,
        content_type: str | None = None,
        content_encoding: str | None = None,
        correlation_id: str | None = None,
        reply_to: str | None = None,
        expiration: float | None = None,
        priority: int | None = None,
        message_type: str | None = None,
        user_id: str | None = None,
        app_id: str | None = None,
        timestamp: dt.datetime | None = None,
    ) -> tuple[str, Encoded, bool]:
        """Check and encode one message: ``(message_id, encoded, mandatory)``.

        Whatever a value's own code raises while it is encoded (a serializer, a
        mapping's ``__iter__``, a ``datetime`` subclass...; any ``Exception``) is
        this message's `InvalidBody` or `InvalidMessage`: it fails alone.

        Raises:
            InvalidMessage, InvalidBody, MessageTooLarge: it cannot be sent as given.
        """
        settings = self.settings
        try:
            payload, inferred_type = encode_body(body)
        except RecursionError:
            raise InvalidBody("body is nested too deeply to encode as JSON") from None
        except ReliableMQError:
            raise
        except Exception as exc:
            raise InvalidBody(
                f"cannot encode a {type(body).__name__} body: {_describe(exc)}"
            ) from exc
        if message_id is None:
            message_id = f"{self._id_prefix}{seq:x}"
        elif not isinstance(message_id, str) or not message_id:
            raise InvalidMessage(
                f"message_id must be a non-empty str, not {type(message_id).__name__} "
                f"{message_id!r:.40}"
            )
        if len(payload) > settings.max_message_size:
            raise MessageTooLarge(
                f"body is {len(payload)} bytes, over max_message_size={settings.max_message_size}",
                message_id=message_id,
                attempts=0,
            )
        try:
            sticky = _flag(mandatory, settings.mandatory, "mandatory")
            method = self.method(exchange, routing_key, sticky)
            header = encode_properties(
                len(payload),
                # An empty content type is the caller's: only None means "infer it".
                content_type=inferred_type if content_type is None else content_type,
                content_encoding=content_encoding,
                delivery_mode=2 if _flag(persistent, settings.persistent, "persistent") else 1,
                message_id=message_id,
                headers=_headers(headers),
                priority=priority,
                correlation_id=correlation_id,
                reply_to=reply_to,
                expiration=expiration,
                timestamp=timestamp,
                message_type=message_type,
                user_id=user_id,
                app_id=app_id,
            )
        except Exception as exc:
            _not_encodable(exc)
        self._check_frame(header)
        return message_id, Encoded(method, header, payload), sticky

    def encode_message(
        self, seq: int, message: Message, headers: Mapping[str, Any] | None
    ) -> tuple[str, Encoded, bool]:
        """`encode` a [Message][reliable_mq.message.Message] of a batch, with ``headers``
        instead of its own (they may carry a trace context its own do not)."""
        return self.encode(
            seq,
            message.body,
            message.routing_key,
            message.exchange,
            message_id=message.message_id,
            headers=headers,
            persistent=message.persistent,
            mandatory=message.mandatory,
            content_type=message.content_type,
            content_encoding=message.content_encoding,
            correlation_id=message.correlation_id,
            reply_to=message.reply_to,
            expiration=message.expiration,
            priority=message.priority,
            message_type=message.message_type,
            user_id=message.user_id,
            app_id=message.app_id,
            timestamp=message.timestamp,
        )

    def encode_copy(
        self,
        seq: int,
        body: bytes,
        routing_key: str,
        properties: Mapping[str, Any],
        headers: Mapping[str, Any],
    ) -> tuple[str, Encoded]:
        """Encode a copy of a received message: ``properties`` exactly as given.

        ``properties`` are the keyword arguments of
        [`encode_properties`][reliable_mq._amqp.wire.encode_properties] but ``headers``
        (None leaves a property out; see `reliable_mq._consume.copies.copy_properties`).
        Sent to the default exchange, mandatory. A copy needs a message id on the
        wire (a ``basic.return`` is matched by it): one is generated when
        ``properties`` has none, or an empty one.

        Raises:
            InvalidMessage, MessageTooLarge: it cannot be sent as given.
        """
        message_id = properties.get("message_id") or f"{self._id_prefix}{seq:x}"
        if len(body) > self.settings.max_message_size:
            raise MessageTooLarge(
                f"body is {len(body)} bytes, over max_message_size="
                f"{self.settings.max_message_size}",
                message_id=message_id,
                attempts=0,
            )
        try:
            method = self.method("", routing_key, True)
            header = encode_properties(
                len(body), **{**properties, "message_id": message_id, "headers": headers}
            )
        except Exception as exc:
            _not_encodable(exc)
        self._check_frame(header)
        return message_id, Encoded(method, header, body)

    def _check_frame(self, header: bytes) -> None:
        if len(header) + FRAME_OVERHEAD > self.frame_max:
            raise InvalidMessage(
                f"properties and headers take {len(header)} bytes, over the connection's "
                f"frame_max={self.frame_max} (they must fit in one frame)"
            )

    def deadline_in(self, timeout: Any) -> float:
        """The publish deadline in seconds from now (``timeout`` or the default)."""
        if timeout is None:
            return self.settings.publish_timeout
        return check_timeout(timeout)


def _not_encodable(exc: Exception) -> NoReturn:
    """Raise what an exception from encoding the frames means (ours as they are)."""
    if isinstance(exc, ReliableMQError):
        raise exc
    if isinstance(exc, RecursionError):
        raise InvalidMessage("headers are nested too deeply to encode") from None
    raise InvalidMessage(
        f"cannot encode the routing key, properties or headers: {_describe(exc)}"
    ) from exc


def _describe(exc: BaseException) -> str:
    """``"Type: text"``, safe to print: text not UTF-8 escaped, a failing ``str()`` survived."""
    try:
        text = str(exc)
    except Exception:
        text = "<str() failed>"
    return f"{type(exc).__name__}: {text}".encode("utf-8", "backslashreplace").decode("utf-8")


def _flag(value: Any, default: bool, field: str) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidMessage(f"{field} must be a bool, not {type(value).__name__}")
    return value


def _headers(value: Any) -> Mapping[str, Any] | None:
    if value is None or isinstance(value, Mapping):
        return value
    raise InvalidMessage(f"headers must be a mapping, not {type(value).__name__}")
