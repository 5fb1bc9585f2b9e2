"""Handing a message's caller its outcome: a result or a typed error, exactly once.

A message's caller waits in one of three ways: a future (``publish()``,
``enqueue()``), a callback (the sync facade) or a slot in a batch
(``publish_many()``). These functions give it the outcome, end the message's
trace span and count a failure in the message's metrics. The window slot and
the ledger are the engine's: it releases them after.
"""

from __future__ import annotations

import time
from typing import Any

from .._tracing import publish_ended
from ..errors import PublishError, ReliableMQError
from ..outcomes import PublishResult
from .outgoing import Outgoing

__all__ = ("fail", "not_admitted", "succeed")


def succeed(out: Outgoing, now: float) -> None:
    """``out`` was confirmed (``now``: the loop's time)."""
    out.finished = True
    if out.span is not None:
        publish_ended(out.span, out.message_id, out.attempts, None)
    batch = out.batch
    if batch is not None:
        batch.succeeded()
        return
    result = PublishResult(
        out.message_id, out.attempts, now - out.sent_at, time.monotonic() - out.started
    )
    future = out.future
    if future is not None:
        if not future.done():
            future.set_result(result)
    elif out.callback is not None:
        out.callback(result, None)


def fail(out: Outgoing, error: ReliableMQError, log: Any) -> None:
    """``out`` ends with ``error`` (logged at debug with the message's coordinates)."""
    out.finished = True
    out.metrics.failure(type(error).__name__)
    if out.span is not None:
        publish_ended(out.span, out.message_id, out.attempts, error)
    log.debug(
        "publish_failed",
        message_id=out.message_id,
        exchange=out.exchange,
        routing_key=out.routing_key,
        attempts=out.attempts,
        error=type(error).__name__,
        reason=str(error),
    )
    batch = out.batch
    if batch is not None:
        batch.failed(out.index, out.message_id, error)
    elif out.future is not None:
        if not out.future.done():
            out.future.set_exception(error)
    elif out.callback is not None:
        out.callback(None, error)


def not_admitted(out: Outgoing, exc: BaseException) -> None:
    """``out`` was never admitted: its caller gets ``exc`` raised (no outcome to give)."""
    if isinstance(exc, PublishError):
        out.metrics.failure(type(exc).__name__)
    if out.span is not None:
        publish_ended(out.span, out.message_id, out.attempts, exc)
        out.span = None
