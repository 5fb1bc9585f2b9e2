"""A settle that publishes a copy (retry, dead letter, deferral), and the ladder
when the copy cannot be published.

`Republisher` is the part of a `reliable_mq._consume.session.Session` that
carries out the decisions needing a copy: build it (`reliable_mq._consume.copies`),
publish it with confirms through the consumer's publisher, and only then ack
the original in its own frame, so a channel loss cannot leave both behind.
When the copy cannot be published, it walks the fallback ladder
(`reliable_mq._consume.settle.next_rung`): a trimmed copy, the broker's own
dead-lettering, and last a requeue after a bounded, growing hold. The
decision itself (`decide`) and which rung follows which are pure, in
`reliable_mq._consume.settle`; this module is their I/O.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from .._tracing import SettleTrace, settle_trace
from ..delivery import Delivery, Settle
from ..errors import ClosedError
from ..handlers import HandlerSpec
from ..headers import ERROR_MESSAGE_HEADER
from ..log import get_logger
from ..metrics import QueueMetrics
from ..topology import QueueTopology
from .copies import Copy, build_copy
from .dedup_gate import DedupGate
from .frames import Frames
from .settle import (
    UNPUBLISHABLE_COPY,
    Cause,
    CopyFault,
    Decision,
    Rung,
    copy_fault,
    next_rung,
)

__all__ = ("Republisher", "SessionRoute", "Settling", "delivery_log")


class SessionRoute(Protocol):
    """What a session needs of its consumed queue (`reliable_mq._consume.route.Route`)."""

    spec: HandlerSpec
    metrics: QueueMetrics
    dedup: DedupGate | None
    topology: QueueTopology
    queue_has_dlx: bool
    """A reject without requeue dead-letters to the queue's DLQ (it was declared so)."""
    log: Any

    def overran(self, delivery: Delivery, ran: float, limit: float | None) -> None:
        """The broker's ``consumer_timeout`` cut off a run of ``delivery``'s handler."""
        ...

    def copy_published(self, delivery: Delivery) -> None:
        """A copy of ``delivery`` was published: its requeue-later holds end."""
        ...

    def ack_lost(self, message_id: str, attempt: int) -> None:
        """``message_id`` is done, and its ack may not have reached the broker."""
        ...

    def next_requeue_delay(self, delivery: Delivery) -> float:
        """The hold before requeueing ``delivery`` (no copy of it could be published)."""
        ...


class Settling(Protocol):
    """What the ladder needs of a delivery being settled (`reliable_mq._consume.session.Ticket`)."""

    tag: int
    delivery: Delivery
    span: Any
    decided: int


class Republisher(Frames):
    """A channel's settle frames, and the copies published before an ack."""

    route: SessionRoute

    def _ack_lost(self, delivery: Delivery) -> None:
        """``delivery``'s work is done (handled, or its copy published) but its ack found
        the channel dead: the broker will deliver it again, and that redelivery is
        acked without running (see `reliable_mq._consume.acks.LostAcks`)."""
        if delivery.message_id:
            self.route.ack_lost(delivery.message_id, delivery.attempt)

    async def _republish(self, ticket: Settling, decision: Decision, cause: Cause) -> Settle:
        """Publish the copy, then ack the original; walk the ladder if it cannot be published."""
        if self.dead():  # the broker requeued it already; a copy would duplicate it
            self.stale(1)
            return Settle.STALE
        delivery, route = ticket.delivery, self.route
        purpose = decision.settle
        publisher = self.shared.publisher
        user = publisher.user if publisher is not None else None
        rung = Rung.FULL_COPY
        while rung in (Rung.FULL_COPY, Rung.TRIMMED_COPY):
            copy: Copy | None = None
            fault: CopyFault | None
            trimmed = rung is Rung.TRIMMED_COPY
            try:
                copy = build_copy(
                    delivery,
                    route.topology,
                    self.shared.settings.retry_delays[0],
                    decision,
                    cause,
                    trimmed=trimmed,
                    user=user,
                )
            except Exception as exc:  # a copy that cannot even be built walks the ladder too
                fault, error = CopyFault.INVALID, repr(exc)[:500]
            else:
                fault, error = await self._publish(delivery, copy)
            if fault is None:
                assert copy is not None
                route.copy_published(delivery)
                self._copied(delivery, decision, copy)
                if not await self.ack_now(ticket.tag, self._trace(ticket, purpose)):
                    self._ack_lost(delivery)  # its return must not make a second copy
                return purpose
            if self.dead():
                self.stale(1)
                return Settle.STALE
            rung = next_rung(
                rung,
                fault,
                purpose=purpose,
                queue_has_dlx=route.queue_has_dlx,
                copy_goes_to_dlx_target=purpose is Settle.DEAD_LETTER,
            )
            route.metrics.fallback(rung)
            delivery_log(delivery).error(
                "copy_not_published",
                purpose=purpose,
                target=copy.queue if copy else None,
                trimmed=trimmed,
                fault=fault,
                error=error,
                next=rung,
            )
        if rung is Rung.BROKER_DEAD_LETTER:
            route.metrics.dead_lettered += 1
            route.metrics.dead_letter_reason(decision.reason or UNPUBLISHABLE_COPY)
            await self.nack(
                ticket.tag, requeue=False, trace=self._trace(ticket, Settle.DEAD_LETTER)
            )
            return Settle.DEAD_LETTER
        await self._requeue_later(ticket)
        return Settle.REQUEUE

    async def _publish(self, delivery: Delivery, copy: Copy) -> tuple[CopyFault | None, str]:
        """Publish ``copy`` with confirms: None, or why not (any exception is classified).

        The publisher refuses locally what cannot be sent (headers over the
        connection's ``frame_max`` once ours are added, values it cannot encode):
        ``InvalidMessage``, classified as `CopyFault.INVALID`.
        """
        publisher = self.shared.publisher
        try:
            if publisher is None:
                raise ClosedError("consumer has no publisher")
            outcome = await publisher._enqueue_copy(
                delivery.body,
                routing_key=copy.queue,
                properties=copy.properties,
                headers=copy.headers,
                timeout=self.shared.settings.republish_timeout,
            )
            await outcome
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # typed publish errors, and anything an encoder may raise
            return copy_fault(exc), repr(exc)[:500]
        return None, ""

    def _copied(self, delivery: Delivery, decision: Decision, copy: Copy) -> None:
        metrics, log = self.route.metrics, delivery_log(delivery)
        if copy.purpose is Settle.RETRY:
            metrics.retried += 1
            log.info(
                "delivery_retry_scheduled",
                delay=copy.delay,
                retry_queue=copy.queue,
                trimmed=copy.trimmed,
            )
        elif copy.purpose is Settle.DEAD_LETTER:
            metrics.dead_lettered += 1
            reason = str(decision.reason)
            metrics.dead_letter_reason(reason)
            log.warning(
                "delivery_dead_lettered",
                reason=reason,
                error=copy.headers.get(ERROR_MESSAGE_HEADER),
                dlq=copy.queue,
                trimmed=copy.trimmed,
            )
        else:
            metrics.deferred += 1
            log.debug("delivery_deferred", delay=copy.delay, retry_queue=copy.queue)

    async def _requeue_later(self, ticket: Settling) -> None:
        """The last rung: hold the delivery a bounded, growing delay, then requeue it."""
        delay = 0.0 if self.shared.stopping else self.route.next_requeue_delay(ticket.delivery)
        delivery_log(ticket.delivery).error(
            "delivery_requeued_later",
            delay=delay,
            hint="no copy could be published and the broker cannot dead-letter it",
        )
        self.route.metrics.requeued += 1
        if delay:
            await asyncio.sleep(delay)
        await self.nack(ticket.tag, requeue=True, trace=self._trace(ticket, Settle.REQUEUE))

    async def _last_resort(self, ticket: Settling) -> Settle:
        try:
            await self._requeue_later(ticket)
        except Exception as exc:
            # Nothing can be written: closing the channel makes the broker requeue it.
            delivery_log(ticket.delivery).critical("settle_impossible", error=repr(exc))
            self.abort()
            return Settle.STALE
        return Settle.REQUEUE

    def _requeue_soon(self, ticket: Settling) -> Settle:
        """Requeue in the background: the settling task is being cancelled mid-way.

        A frame already written for the tag (the copy's ack) wins: the tracker
        then refuses this one.
        """
        if self.dead():
            self.stale(1)
            return Settle.STALE
        self.spawn(self.nack(ticket.tag, requeue=True, trace=self._trace(ticket, Settle.REQUEUE)))
        return Settle.REQUEUE

    def _trace(self, ticket: Settling, settle: Settle) -> SettleTrace | None:
        """What the settle span of ``ticket``'s frame needs; None: not traced."""
        if ticket.span is None:
            return None
        return settle_trace(
            ticket.span, ticket.decided, ticket.delivery, self.route.spec.queue, settle, ticket.tag
        )


def delivery_log(delivery: Delivery) -> Any:
    """The consumer's logger, bound to ``delivery``'s queue, message id and attempt."""
    return get_logger("reliable_mq._consume").bind(
        queue=delivery.queue, message_id=delivery.message_id, attempt=delivery.attempt
    )
