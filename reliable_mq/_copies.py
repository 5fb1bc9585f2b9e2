"""The copies the consumer republishes (retry, DLQ, deferral): queue, headers, trimming, size.

Pure functions: no I/O. A *full* copy carries every header of the original
(but the broker's ``x-delivery-count``) plus ours; a *trimmed* copy, for when
the full one cannot be published, keeps the body, the properties and only the
wire-contract headers of [`reliable_mq.headers`][reliable_mq.headers] whose
values are small, and names what it dropped in ``x-reliable-mq-dropped-headers``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ._settle import Cause, Decision
from .delivery import Delivery, Settle
from .headers import (
    ATTEMPT_HEADER,
    ATTEMPTS_HEADER,
    DEAD_LETTERED_AT_HEADER,
    DELIVERY_COUNT_HEADER,
    DROPPED_HEADERS_HEADER,
    ERROR_MESSAGE_HEADER,
    ERROR_TYPE_HEADER,
    LAST_ERROR_HEADER,
    NO_CONTENT_TYPE_HEADER,
    ORIGINAL_EXCHANGE_HEADER,
    ORIGINAL_ROUTING_KEY_HEADER,
    QUEUE_HEADER,
    REASON_HEADER,
    WIRE_CONTRACT,
)
from .topology import QueueTopology

__all__ = ("Copy", "build_copy", "text_of", "truncate")

TEXT_LIMIT = 1000
"""Longest text header we write (error messages, dropped header names)."""
_SMALL_VALUE = 256
_STRIP_ON_REPUBLISH = frozenset({DELIVERY_COUNT_HEADER})


@dataclass(frozen=True, slots=True)
class Copy:
    """One copy to publish: where, with which headers, and why.

    Attributes:
        purpose: ``RETRY``, ``DEAD_LETTER`` or ``DEFER``.
        queue: the target queue (through the default exchange).
        delay: the retry queue's delay, for logs (None for the DLQ).
        headers: the copy's headers.
        trimmed: the original's large or foreign headers were dropped.
    """

    purpose: Settle
    queue: str
    delay: float | None
    headers: dict[str, Any]
    trimmed: bool = False


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
            if key in WIRE_CONTRACT and key != DROPPED_HEADERS_HEADER and _small(value):
                headers[key] = value
            else:
                dropped.append(str(key))
        if dropped:
            headers[DROPPED_HEADERS_HEADER] = truncate(",".join(dropped))
    if delivery.content_type is None:
        headers[NO_CONTENT_TYPE_HEADER] = True
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
) -> Copy:
    """The copy that carries out ``decision`` (``RETRY``, ``DEAD_LETTER`` or ``DEFER``).

    Args:
        delivery: the original.
        topology: its queue set.
        first_delay: the first retry delay (a deferral goes round that queue).
        decision: what to do; ``reason`` is the DLQ reason header.
        cause: what happened (error, note, a delay asked by ``Retry``).
        trimmed: build the trimmed copy.
    """
    headers = _base_headers(delivery, trimmed=trimmed)
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
    return Copy(purpose, queue, delay, headers, trimmed)
