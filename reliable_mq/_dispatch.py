"""The consumer's hot path: one delivery, from the channel's callback to its settle.

`Dispatcher.on_message` turns whatever happens (a bad body, a dedup answer, the
handler returning, raising anything, cancelling itself, timing out; a
shutdown; a dead channel) into an [`Outcome`][reliable_mq._settle.Outcome] and
hands it to the delivery's ticket, which settles it through `Session.apply`.
No path leaves a delivery unsettled: every exception is caught and becomes an
outcome, and a bug of ours is settled by the error path.

Cancellation is told apart by who asked for it: the watchdog flags the ticket
(`Ticket.timed_out`) before it cancels; a shutdown sets `Shared.stopping`; a
dead channel shows as `Session.dead`. A ``CancelledError`` while the task was
not cancelled (``task.cancelling() == 0``) was raised by the handler itself,
and counts as a handler error.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any, cast

import structlog
from aiormq.abc import DeliveredMessage

from ._route import Route
from ._session import Session, Shared, Ticket, delivery_log
from ._settle import Cause, Outcome
from .dedup.base import AlreadyProcessed, ClaimResult
from .delivery import Delivery, Settle
from .handlers import Reject, Retry
from .headers import ATTEMPT_HEADER, DELIVERY_COUNT_HEADER, NO_CONTENT_TYPE_HEADER

__all__ = ("Dispatcher", "int_header")


class Dispatcher:
    """Runs deliveries of every route of one consumer."""

    def __init__(self, shared: Shared) -> None:
        self.shared = shared
        self.settings = shared.settings

    async def on_message(self, route: Route, session: Session, message: DeliveredMessage) -> None:
        """aiormq's consumer callback (one task per delivery)."""
        frame = message.delivery
        tag = cast(int, frame.delivery_tag)  # type: ignore[union-attr]
        ticket = session.admit(tag, asyncio.current_task())
        delivery = ticket.delivery = _delivery(route, message, ticket)
        shared = self.shared
        shared.delivered += 1
        if delivery.redelivered:
            route.metrics.redeliveries.inc()
        if shared.stopping:  # raced the basic.cancel: give it back at once
            await ticket.settle(Cause(Outcome.SHUTDOWN))
            session.forget(ticket)
            return
        shared.enter()
        try:
            if route.semaphore is None:
                await self._process(route, ticket)
            else:
                async with route.semaphore:
                    await self._process(route, ticket)
        except asyncio.CancelledError as exc:  # shutdown past grace, dead channel, or unknown
            if not ticket.settled:
                await ticket.settle(self._interrupted(session, exc))
            raise
        except Exception as exc:  # a bug of ours: settle it by the error path all the same
            delivery_log(delivery).error("consumer_failed", error=repr(exc), exc_info=exc)
            if not ticket.settled:
                await ticket.settle(Cause(Outcome.RAISED, exc))
        except BaseException:  # SystemExit, KeyboardInterrupt from a handler: give it back
            if not ticket.settled:
                await ticket.settle(Cause(Outcome.SHUTDOWN))
            raise
        finally:
            session.forget(ticket)
            shared.leave()

    def _interrupted(self, session: Session, exc: asyncio.CancelledError) -> Cause:
        if session.dead():
            return Cause(Outcome.CHANNEL_DEAD)
        if self.shared.stopping:
            return Cause(Outcome.SHUTDOWN)
        # Someone else cancelled the task (the handler cancelled itself, say):
        # an error of this delivery, not ours to hide.
        return Cause(Outcome.CANCELLED, exc)

    async def _process(self, route: Route, ticket: Ticket) -> None:
        cause = await self._run(route, ticket)
        if cause is None:
            return
        if not ticket.settled:
            await ticket.settle(cause)
            return
        error = cause.error
        if error is None or isinstance(error, (Retry, Reject)):
            return
        log = delivery_log(ticket.delivery)
        if ticket.outcome is Settle.ACK and cause.outcome is not Outcome.ALREADY_PROCESSED:
            # ACK_FIRST (or an ack by the handler itself): the message is gone.
            log.error("handler_failed_after_settle", error=repr(error), exc_info=error)
        else:
            log.warning("handler_failed_after_settle", error=repr(error))

    async def _run(self, route: Route, ticket: Ticket) -> Cause | None:
        """Everything up to the handler's end, as a cause (None: settled already)."""
        delivery, spec, settings = ticket.delivery, route.spec, self.settings
        structlog.contextvars.bind_contextvars(
            queue=delivery.queue, message_id=delivery.message_id, attempt=delivery.attempt
        )
        if delivery.attempt > settings.max_attempts:
            return Cause(
                Outcome.TOO_MANY_ATTEMPTS,
                note=f"delivered {delivery.attempt} times, max_attempts={settings.max_attempts}",
            )
        gate = route.dedup
        if gate is not None:
            if not delivery.message_id:
                gate.unkeyed()
            else:
                message_id = delivery.message_id
                result, claim = (
                    gate.claim_nowait(message_id)
                    if gate.nowait is not None
                    else await gate.claim(message_id)
                )
                if claim is None:
                    if result is ClaimResult.DONE:
                        return Cause(Outcome.DUPLICATE)
                    if result is ClaimResult.BUSY:
                        gate.busy()
                        return Cause(Outcome.BUSY, note="message id claimed by another consumer")
                    return Cause(Outcome.STORE_DOWN, note="dedup store unavailable")
                ticket.claim = claim
        body: Any = None
        if spec.decode is not None:
            try:
                body = spec.decode(delivery.body, delivery.content_type)
            except MemoryError as exc:  # not the body's fault, maybe: retry
                return Cause(Outcome.RAISED, exc)
            except Exception as exc:  # BodyDecodeError, a validator's KeyError, RecursionError...
                return Cause(Outcome.INVALID_BODY, exc)
        await ticket.settle(Cause(Outcome.ACCEPTED))  # ACK_FIRST acks here; others hold
        if ticket.settled and ticket.outcome is not Settle.ACK:
            return None  # the id could not be recorded: requeued, the handler does not run
        return await self._call(route, ticket, body)

    async def _call(self, route: Route, ticket: Ticket, body: Any) -> Cause:
        """Run the handler; every way it can end becomes a cause."""
        spec, delivery, session = route.spec, ticket.delivery, ticket.session
        func = route.handler
        if spec.decode is None:
            coro = func(delivery)
        elif spec.wants_delivery:
            coro = func(body, delivery)
        else:
            coro = func(body)
        metrics = route.metrics
        metrics.in_progress.inc()
        started = time.perf_counter()
        timeout = self.settings.handler_timeout
        if timeout is not None and ticket.task is not None:
            session.watch(ticket, started + timeout)  # enforced by the consumer's watchdog
        try:
            await coro
        except asyncio.CancelledError as exc:
            return self._cancelled(ticket, exc)
        except Retry as exc:
            return Cause(Outcome.RETRY_SIGNAL, exc, exc.reason, exc.delay)
        except Reject as exc:
            return Cause(Outcome.REJECT_SIGNAL, exc, exc.reason)
        except AlreadyProcessed as exc:
            return Cause(Outcome.ALREADY_PROCESSED, exc)
        except Exception as exc:  # RecursionError and MemoryError included
            return Cause(Outcome.RAISED, exc)
        finally:
            metrics.in_progress.dec()
            metrics.duration.observe(time.perf_counter() - started)
            session.unwatch(ticket)
        if ticket.timed_out:  # the handler swallowed the watchdog's cancel
            return self._timed_out(ticket)
        return Cause(Outcome.RETURNED, note="handler did not settle")

    def _cancelled(self, ticket: Ticket, exc: asyncio.CancelledError) -> Cause:
        task = ticket.task
        if ticket.timed_out:
            return self._timed_out(ticket)
        if task is None or task.cancelling() == 0:
            # Nobody cancelled the task: the handler raised CancelledError itself.
            return Cause(Outcome.CANCELLED, exc)
        raise exc  # a shutdown or a dead channel: on_message settles it

    def _timed_out(self, ticket: Ticket) -> Cause:
        task = ticket.task
        ticket.timed_out = False
        if task is not None and task.uncancel() > 0:
            # Cancelled by someone else as well (a shutdown): that one wins.
            raise asyncio.CancelledError
        seconds = self.settings.handler_timeout
        delivery_log(ticket.delivery).warning("handler_timeout", seconds=seconds)
        return Cause(
            Outcome.TIMED_OUT, TimeoutError(f"handler exceeded handler_timeout={seconds}s")
        )


def _delivery(route: Route, message: DeliveredMessage, ticket: Ticket) -> Delivery:
    frame = message.delivery
    props = message.header.properties
    headers: Mapping[str, Any] = props.headers or {}
    attempt = max(int_header(headers, ATTEMPT_HEADER) or 1, 1)
    if route.quorum:
        attempt += max(int_header(headers, DELIVERY_COUNT_HEADER) or 0, 0)
    return Delivery(
        body=message.body,
        message_id=props.message_id or "",
        headers=headers,
        redelivered=bool(frame.redelivered),  # type: ignore[union-attr]
        attempt=attempt,
        queue=route.queue,
        exchange=frame.exchange or "",  # type: ignore[union-attr]
        routing_key=frame.routing_key or "",  # type: ignore[union-attr]
        content_type=None if headers and NO_CONTENT_TYPE_HEADER in headers else props.content_type,
        correlation_id=props.correlation_id,
        reply_to=props.reply_to,
        delivery_tag=ticket.tag,
        properties=props,
        settler=ticket,
    )


def int_header(headers: Mapping[str, Any], name: str) -> int | None:
    """An int header's value (ints, and strings of digits); None otherwise."""
    value = headers.get(name)
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, (str, bytes)):
        try:
            return int(value)
        except ValueError:
            return None
    return None
