"""The settle decision, as pure functions: no I/O, no state, tested as tables.

Every way a delivery can end is an [`Outcome`][reliable_mq._consume.settle.Outcome]
(the handler returned, raised, timed out, the body did not decode, the id was
done already, the consumer is shutting down...). [`decide`][reliable_mq._consume.settle.decide]
maps ``(policy, outcome, attempt)`` to one [`Settle`][reliable_mq.delivery.Settle],
and ``Session.apply`` carries it out: the only place that writes a settle frame.

When the copy a settle needs (retry, DLQ, deferral) cannot be published,
[`next_rung`][reliable_mq._consume.settle.next_rung] walks a ladder that always ends:

```
full copy ──invalid/refused──▶ trimmed copy ──fails──▶ broker dead-lettering ──▶ requeue later
    │                                                  (reject onto the work
    └──unroutable/nacked──────────────────────────────▶ queue's DLX, only if it
    └──no answer / no connection──────────────────────────────────▶ has one)
```
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from ..delivery import Settle
from ..errors import (
    ClosedError,
    ExchangeNotFound,
    InvalidMessage,
    PublishError,
    PublishGaveUp,
    PublishOutcomeUnknown,
    PublishRefused,
    PublishUnavailable,
    PublishUnroutable,
)
from ..handlers import AckPolicy
from ..headers import DeadLetterReason

__all__ = (
    "UNPUBLISHABLE_COPY",
    "Cause",
    "CopyFault",
    "Decision",
    "Outcome",
    "Rung",
    "copy_fault",
    "decide",
    "next_rung",
)


class Outcome(enum.StrEnum):
    """What happened to one delivery, as far as settling it is concerned."""

    ACCEPTED = "accepted"
    """Decoded and claimed; the handler runs next (only ``ACK_FIRST`` settles here)."""
    RETURNED = "returned"
    """The handler returned."""
    RAISED = "raised"
    """The handler raised an exception (any ``Exception``: ``RecursionError`` and
    ``MemoryError`` included)."""
    EXITED = "exited"
    """The handler raised ``SystemExit`` or ``KeyboardInterrupt`` (plain or async,
    in any step it runs: the body's validators too). A failed attempt like
    ``RAISED``, so a handler that always exits ends in the DLQ after
    ``max_attempts`` restarts of its process; the consumer then stops (see
    `ReliableConsumer.run`). Any other ``BaseException`` is ``RAISED``."""
    CANCELLED = "cancelled"
    """The handler raised ``CancelledError`` itself: not our timeout, shutdown or
    dead channel (its task was not cancelled). Treated as an error."""
    TIMED_OUT = "timed_out"
    """Cancelled by the consumer's watchdog after ``handler_timeout``."""
    CONSUMER_TIMEOUT = "consumer_timeout"
    """The broker's redelivery of a delivery whose handler ran past the broker's
    ``consumer_timeout`` (the broker closed the channel): that run is a failed
    attempt, and the handler does not run again for it."""
    RETRY_SIGNAL = "retry_signal"
    """``Retry`` raised, or ``delivery.retry()`` called."""
    REJECT_SIGNAL = "reject_signal"
    """``Reject`` raised, or ``delivery.reject()`` called."""
    ACK_CALLED = "ack_called"
    """``delivery.ack()`` called."""
    NACK_CALLED = "nack_called"
    """``delivery.nack(requeue=True)`` called."""
    DROP_CALLED = "drop_called"
    """``delivery.nack(requeue=False)`` called."""
    INVALID_BODY = "invalid_body"
    """The body did not decode for the handler's annotation (any exception from
    the decoder or a validator, ``MemoryError`` aside)."""
    UNDECODABLE = "undecodable"
    """A string in the properties (a header name included) or the routing key is
    not UTF-8, or a timestamp is out of range: the delivery cannot be shown as
    sent, and the handler does not run."""
    TOO_MANY_ATTEMPTS = "too_many_attempts"
    """Delivered with an attempt number over ``max_attempts``."""
    ALREADY_PROCESSED = "already_processed"
    """The handler raised ``AlreadyProcessed``: another copy committed first."""
    DUPLICATE = "duplicate"
    """De-duplication: the id is done; the handler did not run."""
    BUSY = "busy"
    """De-duplication: another consumer holds the id now."""
    STORE_DOWN = "store_down"
    """De-duplication: the store could not answer the claim."""
    WAITED = "waited"
    """It waited for a handler slot for half the time the broker's
    ``consumer_timeout`` leaves it (`Shared.broker_cut`): it does not run now,
    it goes round the first retry queue, not counted as an attempt."""
    UNRECORDED = "unrecorded"
    """The handler succeeded but the store could not record the id as done."""
    SHUTDOWN = "shutdown"
    """The consumer is stopping: arrived late, or still running past the grace period."""
    CHANNEL_DEAD = "channel_dead"
    """The delivery's channel is gone: the broker has requeued it already."""


class Decision(NamedTuple):
    """What to do with a delivery.

    Attributes:
        settle: the settle to carry out.
        reason: for ``DEAD_LETTER``, the reason header value.
        mark_done: the handler's effect happened: record the id as done (in
            the dedup store) before the ack; otherwise a held claim is released.
    """

    settle: Settle
    reason: DeadLetterReason | None = None
    mark_done: bool = False


@dataclass(frozen=True, slots=True)
class Cause:
    """An outcome with what the settle needs to describe it.

    Attributes:
        outcome: what happened.
        error: the exception, if one was raised.
        note: human text for logs and headers (a ``Retry``/``Reject`` reason).
        delay: a retry delay asked by the handler (``Retry(delay=...)``).
    """

    outcome: Outcome
    error: BaseException | None = None
    note: str = ""
    delay: float | None = None


_HOLD = Decision(Settle.HOLD)
_ACK = Decision(Settle.ACK)
_ACK_DONE = Decision(Settle.ACK, mark_done=True)
_REQUEUE = Decision(Settle.REQUEUE)
_DEFER = Decision(Settle.DEFER)
_HANDLER_FAILED = (
    Outcome.RAISED,
    Outcome.EXITED,
    Outcome.CANCELLED,
    Outcome.TIMED_OUT,
    Outcome.CONSUMER_TIMEOUT,
)
_DEAD_LETTER_REASON = {
    Outcome.TIMED_OUT: DeadLetterReason.HANDLER_TIMEOUT,
    Outcome.CONSUMER_TIMEOUT: DeadLetterReason.CONSUMER_TIMEOUT,
}


def _retry(attempt: int, max_attempts: int) -> Decision:
    if attempt >= max_attempts:
        return Decision(Settle.DEAD_LETTER, DeadLetterReason.MAX_ATTEMPTS)
    return Decision(Settle.RETRY)


def decide(policy: AckPolicy, outcome: Outcome, attempt: int, max_attempts: int) -> Decision:  # noqa: PLR0911, PLR0912 (one return per row of the decision table)
    """The settle for ``outcome`` under ``policy``, at ``attempt`` of ``max_attempts``.

    A retry at the last attempt becomes a dead letter (``max_attempts``). Under
    ``ACK_FIRST`` the delivery was acked before the handler ran, so whatever
    the handler does, the decision is that ack (the consumer only logs errors).
    """
    match outcome:
        case Outcome.ACCEPTED:
            return _ACK_DONE if policy is AckPolicy.ACK_FIRST else _HOLD
        case Outcome.RETURNED:
            if policy is AckPolicy.MANUAL:  # returned without settling
                return _retry(attempt, max_attempts)
            return _ACK_DONE
        case Outcome.ACK_CALLED:
            return _ACK_DONE
        case Outcome.ALREADY_PROCESSED:
            return Decision(Settle.DUPLICATE, mark_done=True)
        case Outcome.DUPLICATE:
            return Decision(Settle.DUPLICATE)
        case Outcome.INVALID_BODY:
            return Decision(Settle.DEAD_LETTER, DeadLetterReason.INVALID_BODY)
        case Outcome.UNDECODABLE:
            return Decision(Settle.DEAD_LETTER, DeadLetterReason.INVALID_PROPERTIES)
        case Outcome.TOO_MANY_ATTEMPTS:
            return Decision(Settle.DEAD_LETTER, DeadLetterReason.MAX_ATTEMPTS)
        case Outcome.NACK_CALLED | Outcome.UNRECORDED | Outcome.SHUTDOWN:
            return _REQUEUE
        case Outcome.DROP_CALLED:
            return Decision(Settle.REJECT)
        case Outcome.BUSY | Outcome.STORE_DOWN | Outcome.WAITED:
            return _DEFER
        case Outcome.CHANNEL_DEAD:
            return Decision(Settle.STALE)
    # What the handler did: only the policy tells these apart.
    if policy is AckPolicy.ACK_FIRST:
        return _ACK
    if outcome is Outcome.REJECT_SIGNAL:
        return Decision(Settle.DEAD_LETTER, DeadLetterReason.REJECTED)
    if outcome is Outcome.RETRY_SIGNAL:
        return _retry(attempt, max_attempts)
    assert outcome in _HANDLER_FAILED, outcome
    if policy is AckPolicy.DEAD_LETTER_ON_ERROR:
        reason = _DEAD_LETTER_REASON.get(outcome, DeadLetterReason.HANDLER_ERROR)
        return Decision(Settle.DEAD_LETTER, reason)
    return _retry(attempt, max_attempts)


# -- the republish ladder ----------------------------------------------------------


UNPUBLISHABLE_COPY = "unpublishable_copy"
"""The ``reason`` label of ``dead_lettered_messages_total`` for a retry the broker
dead-lettered (`Rung.BROKER_DEAD_LETTER`) because no copy of it could be published:
no [`DeadLetterReason`][reliable_mq.headers.DeadLetterReason] applies."""


class Rung(enum.StrEnum):
    """One step of the ladder for a copy (retry, DLQ, deferral) that must be published."""

    FULL_COPY = "full_copy"
    """The copy with every original header plus ours."""
    TRIMMED_COPY = "trimmed_copy"
    """Body, properties and our headers only; the original's other headers are
    dropped (and named in ``x-reliable-mq-dropped-headers``)."""
    BROKER_DEAD_LETTER = "broker_dead_letter"
    """``basic.nack(requeue=false)``: the broker dead-letters the original onto
    the work queue's dead-letter exchange (only when the queue is known to have one)."""
    REQUEUE_LATER = "requeue_later"
    """Hold the delivery for a bounded, growing delay, then requeue it; an error
    is logged and counted. The last rung: it always succeeds or the channel is dead."""


class CopyFault(enum.StrEnum):
    """Why a copy could not be published."""

    INVALID = "invalid"
    """It cannot be sent as built (too large for the frame, not encodable)."""
    REFUSED = "refused"
    """The broker refused this copy (a channel or connection close naming it)."""
    NACKED = "nacked"
    """The target queue would not take it (nacked: full with ``reject-publish``...)."""
    UNROUTABLE = "unroutable"
    """The target queue (or exchange) does not exist."""
    UNKNOWN = "unknown"
    """No answer in time: the copy may be there. Nothing is dropped or trimmed."""
    UNAVAILABLE = "unavailable"
    """No connection, or the consumer is closing."""


def copy_fault(error: BaseException) -> CopyFault:  # noqa: PLR0911 (one return per kind of publish error)
    """Classify an error raised while publishing a copy (any exception at all)."""
    match error:
        case PublishUnavailable() | ClosedError():
            return CopyFault.UNAVAILABLE
        case PublishUnroutable() | ExchangeNotFound():
            return CopyFault.UNROUTABLE
        case PublishRefused():
            return CopyFault.REFUSED
        case PublishGaveUp():
            return CopyFault.NACKED
        case PublishOutcomeUnknown():
            return CopyFault.UNKNOWN
        case InvalidMessage():
            return CopyFault.INVALID
        case PublishError():  # MessageTooLarge, or a kind added later: the copy itself
            return CopyFault.INVALID
    # Not a publish error at all (TypeError from an encoder, RecursionError...):
    # something about this copy; a trimmed one may go through.
    return CopyFault.INVALID


def next_rung(
    rung: Rung,
    fault: CopyFault,
    *,
    purpose: Settle,
    queue_has_dlx: bool,
    copy_goes_to_dlx_target: bool,
) -> Rung:
    """The rung after ``rung`` failed with ``fault``; never ``FULL_COPY``.

    Args:
        rung: the rung that failed (``FULL_COPY`` or ``TRIMMED_COPY``).
        fault: why it failed.
        purpose: ``RETRY``, ``DEAD_LETTER`` or ``DEFER``.
        queue_has_dlx: the work queue is known to have a dead-letter exchange
            (the consumer declared it so). Without one a reject drops the message.
        copy_goes_to_dlx_target: the copy was for the queue the work queue
            dead-letters to (the DLQ): if that queue is missing or full, the
            broker's dead-lettering would drop the message there.
    """
    if rung not in (Rung.FULL_COPY, Rung.TRIMMED_COPY):
        raise ValueError(f"{rung} is not a copy rung")
    if fault in (CopyFault.UNKNOWN, CopyFault.UNAVAILABLE):
        return Rung.REQUEUE_LATER
    if rung is Rung.FULL_COPY and fault in (CopyFault.INVALID, CopyFault.REFUSED):
        return Rung.TRIMMED_COPY
    target_broken = fault in (CopyFault.NACKED, CopyFault.UNROUTABLE) and copy_goes_to_dlx_target
    if purpose is Settle.DEFER or not queue_has_dlx or target_broken:
        return Rung.REQUEUE_LATER
    return Rung.BROKER_DEAD_LETTER
