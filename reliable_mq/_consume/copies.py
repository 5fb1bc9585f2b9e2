"""The copies the consumer republishes (retry, DLQ, deferral): queue, headers, trimming, size.

Pure functions: no I/O. A copy is the message: the body and every basic
property of the original, as it had them (an empty string stays empty, a
property it did not have stays absent), with two exceptions that follow what
RabbitMQ's own dead-lettering does, and one the publisher needs
(`copy_properties`):

* ``expiration`` is not copied (the copy would expire in a retry queue or the
  DLQ); the original's value is kept in ``x-reliable-mq-original-expiration``;
* ``user_id`` is copied only when it names the user the copy is published as
  (the broker refuses any other, 406); else it moves to
  ``x-reliable-mq-original-user-id``;
* a message without a ``message_id`` (or with an empty one) gets one, kept by
  every later copy: the publisher matches a ``basic.return`` to its message by id.

A *full* copy carries every header of the original (but the broker's
``x-delivery-count``) plus ours; a *trimmed* copy, for when the full one cannot
be published, keeps the body, the properties and only the wire-contract
headers of [`reliable_mq.headers`][reliable_mq.headers] and the W3C trace
context (``traceparent``, ``tracestate``) whose values are small, and names what it dropped in ``x-reliable-mq-dropped-headers``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from .._tracing import TRACEPARENT, TRACESTATE
from ..delivery import Delivery, Settle
from ..headers import (
    ATTEMPT_HEADER,
    ATTEMPTS_HEADER,
    DEAD_LETTERED_AT_HEADER,
    DELIVERY_COUNT_HEADER,
    DROPPED_HEADERS_HEADER,
    ERROR_MESSAGE_HEADER,
    ERROR_TYPE_HEADER,
    LAST_ERROR_HEADER,
    ORIGINAL_EXCHANGE_HEADER,
    ORIGINAL_EXPIRATION_HEADER,
    ORIGINAL_ROUTING_KEY_HEADER,
    ORIGINAL_USER_ID_HEADER,
    QUEUE_HEADER,
    REASON_HEADER,
    WIRE_CONTRACT,
)
from ..topology import QueueTopology
from .settle import Cause, Decision

__all__ = ("COPIED_PROPERTIES", "Copy", "build_copy", "copy_properties", "text_of", "truncate")

TEXT_LIMIT = 1000
"""Longest text header we write (error messages, dropped header names)."""
_SMALL_VALUE = 256
_TRACE_CONTEXT = frozenset({TRACEPARENT, TRACESTATE})
_STRIP_ON_REPUBLISH = frozenset({DELIVERY_COUNT_HEADER})


COPIED_PROPERTIES = (
    "content_type",
    "content_encoding",
    "delivery_mode",
    "priority",
    "correlation_id",
    "reply_to",
    "message_id",
    "timestamp",
    "message_type",
    "app_id",
    "cluster_id",
)
"""The basic properties a copy takes as they are (with ``headers``, and ``user_id``
when it may): all but ``expiration``."""


@dataclass(frozen=True, slots=True)
class Copy:
    """One copy to publish: where, with which properties and headers, and why.

    Attributes:
        purpose: ``RETRY``, ``DEAD_LETTER`` or ``DEFER``.
        queue: the target queue (through the default exchange).
        delay: the retry queue's delay, for logs (None for the DLQ).
        headers: the copy's headers.
        properties: its other properties, ``encode_properties`` keywords (see `copy_properties`).
        trimmed: the original's large or foreign headers were dropped.
    """

    purpose: Settle
    queue: str
    delay: float | None
    headers: dict[str, Any]
    properties: dict[str, Any]
    trimmed: bool = False


def copy_properties(original: Any, headers: dict[str, Any], *, user: str | None) -> dict[str, Any]:
    """The properties of a copy of ``original`` (pamqp ``Basic.Properties``), but headers.

    Every property as the original had it, None where it had none, except
    ``expiration`` (recorded in ``headers`` as `ORIGINAL_EXPIRATION_HEADER`) and
    a ``user_id`` that is not ``user`` (recorded as `ORIGINAL_USER_ID_HEADER`).
    An absent or empty ``message_id`` is None: the publisher generates one.

    Args:
        original: the received properties.
        headers: the copy's headers; the two above are added to it.
        user: the user the copy is published as (None: unknown, no ``user_id`` is kept).
    """
    properties = {name: getattr(original, name, None) for name in COPIED_PROPERTIES}
    properties["message_id"] = properties["message_id"] or None
    properties["cluster_id"] = properties["cluster_id"] or None  # pamqp: "" when absent
    expiration = getattr(original, "expiration", None)
    if expiration is not None:
        headers[ORIGINAL_EXPIRATION_HEADER] = expiration
    user_id = getattr(original, "user_id", None)
    if user_id is not None:
        if user is not None and user_id == user:
            properties["user_id"] = user_id
        else:
            headers[ORIGINAL_USER_ID_HEADER] = user_id
    return properties


def truncate(text: str, limit: int = TEXT_LIMIT) -> str:
    """``text`` cut to ``limit`` characters (with ``...``), and encodable as UTF-8.

    Our text headers carry what a handler raised or a reason it gave: a lone
    surrogate there (``"\\ud800"``) is written escaped, so the copy it goes on can
    be published (the publisher refuses text that is not UTF-8).
    """
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _small(value: Any) -> bool:
    if isinstance(value, (bool, int, float)):
        return True
    return isinstance(value, (str, bytes)) and len(value) <= _SMALL_VALUE


def _kept_when_trimmed(key: str) -> bool:
    """A wire-contract header (ours) or the W3C trace context (a copy links to the
    original's creation context, trimmed or not)."""
    return (key in WIRE_CONTRACT and key != DROPPED_HEADERS_HEADER) or key in _TRACE_CONTEXT


def _base_headers(delivery: Delivery, *, trimmed: bool) -> dict[str, Any]:
    source: Mapping[str, Any] = delivery.headers
    if not trimmed:
        headers = {k: v for k, v in source.items() if k not in _STRIP_ON_REPUBLISH}
    else:
        headers = {}
        dropped: list[str] = []
        for key, value in source.items():
            if key in _STRIP_ON_REPUBLISH:
                continue
            if _kept_when_trimmed(key) and _small(value):
                headers[key] = value
            else:
                dropped.append(str(key))
        if dropped:
            headers[DROPPED_HEADERS_HEADER] = truncate(",".join(dropped))
    headers.setdefault(ORIGINAL_EXCHANGE_HEADER, delivery.exchange)
    headers.setdefault(ORIGINAL_ROUTING_KEY_HEADER, delivery.routing_key)
    return headers


def text_of(value: object) -> str:
    """``str(value)``, or a placeholder when it cannot be turned into text (a handler's
    exception, or a ``Reject`` reason, whose ``__str__`` raises or returns a non-string)."""
    if isinstance(value, str):
        return value
    try:
        return str(value)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:
        return f"<{type(value).__name__}: str() failed>"


def _error_line(cause: Cause) -> str:
    error = cause.error
    if error is not None:
        return f"{type(error).__name__}: {text_of(error)}"
    return text_of(cause.note) or cause.outcome.value


def build_copy(
    delivery: Delivery,
    topology: QueueTopology,
    first_delay: float,
    decision: Decision,
    cause: Cause,
    *,
    trimmed: bool = False,
    user: str | None = None,
) -> Copy:
    """The copy that carries out ``decision`` (``RETRY``, ``DEAD_LETTER`` or ``DEFER``).

    Args:
        delivery: the original.
        topology: its queue set.
        first_delay: the first retry delay (a deferral goes round that queue).
        decision: what to do; ``reason`` is the DLQ reason header.
        cause: what happened (error, note, a delay asked by ``Retry``).
        trimmed: build the trimmed copy.
        user: the user the copy is published as (whether ``user_id`` can be kept).
    """
    headers = _base_headers(delivery, trimmed=trimmed)
    properties = copy_properties(_received(delivery), headers, user=user)
    purpose = decision.settle
    delay: float | None
    if purpose is Settle.RETRY:
        if cause.delay is None:
            queue, delay = topology.retry_queue_for(delivery.attempt)
        else:
            queue, delay = topology.nearest_retry_queue(cause.delay)
        headers[ATTEMPT_HEADER] = delivery.attempt + 1
        headers[LAST_ERROR_HEADER] = truncate(_error_line(cause))
    elif purpose is Settle.DEAD_LETTER:
        queue, delay = topology.dead_letter_queue, None
        reason = str(decision.reason or cause.outcome.value)
        error = cause.error
        message = text_of(error) if error is not None else ""
        note = text_of(cause.note)
        if note and note != message:
            message = f"{note}: {message}" if message else note
        headers[REASON_HEADER] = reason
        headers[ERROR_TYPE_HEADER] = type(error).__name__ if error is not None else reason
        headers[ERROR_MESSAGE_HEADER] = truncate(message or reason)
        headers[ATTEMPTS_HEADER] = delivery.attempt
        headers[QUEUE_HEADER] = delivery.queue
        headers[DEAD_LETTERED_AT_HEADER] = datetime.now(UTC).isoformat()
    elif purpose is Settle.DEFER:
        queue, delay = topology.nearest_retry_queue(first_delay)
        headers[ATTEMPT_HEADER] = delivery.attempt
    else:
        raise ValueError(f"{purpose} needs no copy")
    return Copy(purpose, queue, delay, headers, properties, trimmed)


class _Fields:
    """The properties of a `Delivery` made without them (tests, tools): what it knows."""

    def __init__(self, delivery: Delivery) -> None:
        self.content_type = delivery.content_type
        self.correlation_id = delivery.correlation_id
        self.reply_to = delivery.reply_to
        self.message_id = delivery.message_id


def _received(delivery: Delivery) -> Any:
    return delivery.properties if delivery.properties is not None else _Fields(delivery)
