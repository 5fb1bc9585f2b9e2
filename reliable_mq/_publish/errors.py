"""The error each publish outcome ends with: pure constructors, one wording per condition."""

from __future__ import annotations

from .._amqp.faults import Fault, FaultKind
from ..errors import (
    ExchangeNotFound,
    PublishAborted,
    PublishError,
    PublishOutcomeUnknown,
    PublishRefused,
    PublishTimeout,
    PublishUnavailable,
)
from .outgoing import Outgoing

__all__ = (
    "aborted_error",
    "exchange_error",
    "refused_error",
    "timeout_error",
    "unavailable_error",
)


def timeout_error(out: Outgoing) -> PublishTimeout:
    return PublishTimeout(
        "deadline passed before a confirm; the broker may still have it",
        message_id=out.message_id,
        attempts=out.attempts,
    )


def aborted_error(out: Outgoing, why: str = "") -> PublishAborted:
    """``close()`` gave up on ``out`` (or ``why``: the publisher could no longer send)."""
    reason = why or "publisher closed before a confirm"
    return PublishAborted(
        f"{reason}; the broker may still have it" if out.attempts else f"{reason}; never sent",
        message_id=out.message_id,
        attempts=out.attempts,
    )


def unavailable_error(out: Outgoing, seconds: float) -> PublishUnavailable:
    sent = " (an earlier attempt may have reached the broker)" if out.attempts else ""
    return PublishUnavailable(
        f"no connection to the broker for {seconds:g}s (unavailable_timeout){sent}",
        message_id=out.message_id,
        attempts=out.attempts,
    )


def refused_error(out: Outgoing, fault: Fault) -> PublishError:
    """The broker refused ``out``: ``PublishRefused``, unless an earlier attempt may have landed."""
    if out.maybe_routed:
        return PublishOutcomeUnknown(
            f"refused by the broker ({fault.describe()}) after an earlier attempt was "
            "lost unconfirmed: the broker may have that one; retry with the same message_id",
            message_id=out.message_id,
            attempts=out.attempts,
        )
    return PublishRefused(
        f"refused by the broker: {fault.describe()}",
        message_id=out.message_id,
        attempts=out.attempts,
        reply_code=fault.reply_code,
        reply_text=fault.reply_text,
    )


def exchange_error(out: Outgoing, name: str, fault: Fault) -> PublishError:
    """A publish to exchange ``name`` met ``fault`` (a 404, or another refusal naming it)."""
    if fault.kind is not FaultKind.NOT_FOUND:
        return refused_error(out, fault)
    if out.maybe_routed:
        return PublishOutcomeUnknown(
            f"exchange {name!r} was deleted while this message was unconfirmed: "
            "the broker may have routed it before; retry with the same message_id",
            message_id=out.message_id,
            attempts=out.attempts,
        )
    return ExchangeNotFound(
        f"exchange {name!r} does not exist",
        message_id=out.message_id,
        attempts=out.attempts,
        reply_code=fault.reply_code,
        reply_text=fault.reply_text,
    )
