"""Per-channel delivery state of the consumer: settle frames, tickets, and `Session.apply`.

A `Session` lives as long as one channel of one consumed queue. Every delivery
gets a `Ticket` (its settle state, and the `Settler` its `Delivery` calls), and
every settle, whoever asks for it (the consumer after the handler, the handler
through ``delivery.ack()``, a shutdown, a dead channel), goes through
`Session.apply`: it takes the one pure decision (`reliable_mq._consume.settle.decide`),
reserves the ticket so that nothing settles it twice, completes or releases its
dedup claim, and writes the frame (or publishes the copy first, walking the
fallback ladder of `reliable_mq._consume.settle.next_rung` when the copy cannot
be published: `reliable_mq._consume.republish`, the base of `Session`). The
common end, an ack after the handler returned, has a twin without a coroutine,
`Session.ack_at_once`: the same decision, the claim completed in memory, the ack
batched; whatever it cannot do goes to `apply`.
Once the channel is gone (`Session.dead`) settles are dropped and
counted as stale: the broker has already requeued those deliveries and their
tags mean nothing on any other channel.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import time
from typing import Any

from .._amqp import ConsumeChannel as Channel
from .._amqp.faults import Fault, FaultKind, classify, consumer_timeout_of
from .._tracing import settled
from ..delivery import Delivery, Settle
from ..handlers import AckPolicy, Reject, Retry
from .acks import TagState
from .dedup_gate import Claim
from .frames import Shared, broker_cut
from .republish import Republisher, SessionRoute, delivery_log
from .settle import Cause, Decision, Outcome, decide
from .settled import Settled

__all__ = (
    "Session",
    "SessionRoute",
    "Shared",
    "Ticket",
    "delivery_log",
)

# Outcomes a handler asks for by calling the delivery: a second one is worth a warning.
_CALLED = frozenset(
    {
        Outcome.ACK_CALLED,
        Outcome.NACK_CALLED,
        Outcome.DROP_CALLED,
        Outcome.RETRY_SIGNAL,
        Outcome.REJECT_SIGNAL,
    }
)
_RETURNED, _ACK = Outcome.RETURNED, Settle.ACK  # read for every delivery (`Session.ack_at_once`)
# Outcomes whose cause is an error of the delivery (the process span's ``error.type``).
_FAILED = frozenset(
    {
        Outcome.RAISED,
        Outcome.EXITED,
        Outcome.CANCELLED,
        Outcome.TIMED_OUT,
        Outcome.CONSUMER_TIMEOUT,
        Outcome.INVALID_BODY,
        Outcome.UNDECODABLE,
    }
)


class Ticket:
    """The settle state of one delivery: settled once, through its session.

    It is the delivery's [`Settler`][reliable_mq.delivery.Settler]: the
    handler's ``delivery.ack()`` and friends arrive here as outcomes.

    Attributes:
        tag: the delivery tag.
        task: the task processing the delivery (None outside a task).
        delivery: the delivery (set right after the ticket is made).
        claim: the dedup claim held for it, until the settle completes or releases it.
        timed_out: the watchdog cancelled its handler.
        settling: a settle is being carried out; the watchdog waits for its end
            (a copy the handler asked for is not cut off half-way by its deadline).
        deadline: when the handler times out (``perf_counter`` seconds; infinite
            while no handler runs).
        started: when its handler started (``perf_counter`` seconds; 0 before).
        admitted: when it arrived (``perf_counter`` seconds).
        for_broker: its deadline is the broker's ``consumer_timeout`` (`Shared.broker_cut`),
            not ``handler_timeout``.
    """

    __slots__ = (
        "_outcome",
        "admitted",
        "claim",
        "deadline",
        "decided",
        "delivery",
        "for_broker",
        "session",
        "settling",
        "span",
        "started",
        "tag",
        "task",
        "timed_out",
    )

    def __init__(self, session: Session, tag: int, task: asyncio.Task[Any] | None) -> None:
        self.session = session
        self.tag = tag
        self.task = task
        self.delivery: Delivery
        self.claim: Claim | None = None
        self.timed_out = False
        self.deadline = math.inf
        self._outcome: Settle | None = None
        self.settling = False
        self.started = 0.0
        self.admitted = time.perf_counter()
        self.for_broker = False
        self.span: Any = None
        """Its ``process`` span (None: tracing is off)."""
        self.decided: int  # when its settle was decided (time_ns), set only if it has a span

    @property
    def outcome(self) -> Settle | None:
        """The settle chosen (the final one once carried out), or None."""
        return self._outcome

    @property
    def settled(self) -> bool:
        return self._outcome is not None

    async def settle(self, cause: Cause) -> bool:
        """Settle by ``cause`` unless settled already; True if this call settled it."""
        return await self.session.apply(self, cause)

    # -- Settler: what the handler asks for ---------------------------------------

    async def settle_ack(self, delivery: Delivery) -> bool:
        return await self.settle(Cause(Outcome.ACK_CALLED))

    async def settle_nack(self, delivery: Delivery, requeue: bool) -> bool:
        return await self.settle(Cause(Outcome.NACK_CALLED if requeue else Outcome.DROP_CALLED))

    async def settle_retry(self, delivery: Delivery, reason: str, delay: float | None) -> bool:
        signal = Retry(reason, delay=delay)
        return await self.settle(Cause(Outcome.RETRY_SIGNAL, signal, reason, delay))

    async def settle_dead_letter(self, delivery: Delivery, reason: str) -> bool:
        return await self.settle(Cause(Outcome.REJECT_SIGNAL, Reject(reason), reason))


class Session(Republisher):
    """One channel's life for one route: its frames, its tickets, its settles."""

    def __init__(self, shared: Shared, route: SessionRoute, channel: Channel) -> None:
        super().__init__(shared, route.metrics, channel)
        self.route = route
        self.inflight: dict[int, Ticket] = {}
        self.consumer_tag: str | None = None
        self._stand_ins: dict[Settle, Settled] = {}
        # A handler's return decides the same for every attempt, unless the policy is
        # MANUAL: decided once here for `ack_at_once`, which runs for every delivery.
        policy = route.spec.ack_policy
        returned = decide(policy, Outcome.RETURNED, 1, shared.settings.max_attempts)
        self._returned_acks = (
            policy is not AckPolicy.MANUAL and returned.settle is Settle.ACK and returned.mark_done
        )

    # -- tickets ------------------------------------------------------------

    def admit(self, tag: int, task: asyncio.Task[Any] | None) -> Ticket:
        """Record a new delivery and make its ticket (the caller sets ``ticket.delivery``)."""
        self.tracker.delivered(tag)
        ticket = Ticket(self, tag, task)
        self.inflight[tag] = ticket
        return ticket

    def forget(self, ticket: Ticket) -> None:
        """The delivery's processing ended (it was settled).

        A delivery settled for good (no settle under way) trades its ticket for a
        stand-in that keeps its outcome (`reliable_mq._consume.settled`): no cycle
        between the two is left for the garbage collector.
        """
        self.inflight.pop(ticket.tag, None)
        outcome = ticket._outcome
        if outcome is not None and not ticket.settling:
            stand_in = self._stand_ins.get(outcome)
            if stand_in is None:
                stand_in = self._stand_ins[outcome] = Settled(self, outcome)
            ticket.delivery._settler = stand_in

    def settled_again(self, delivery: Delivery, first: Settle, outcome: Outcome) -> None:
        """``delivery``, settled as ``first``, was asked by its handler to settle again
        (``outcome``): nothing is sent; a warning says so unless the policy holds it."""
        settle = decide(
            self.route.spec.ack_policy, outcome, delivery.attempt, self.shared.settings.max_attempts
        ).settle
        if settle is not Settle.HOLD and outcome in _CALLED:
            delivery_log(delivery).warning("delivery_already_settled", first=first, second=settle)

    def watch(self, ticket: Ticket, deadline: float) -> None:
        """Put the ticket's handler under the watchdog until `unwatch`."""
        ticket.deadline = deadline

    def unwatch(self, ticket: Ticket) -> None:
        ticket.deadline = math.inf

    def expire_overdue(self, now: float) -> None:
        """Cancel every watched handler past its deadline (flagged as timed out first).

        A handler carrying out a settle it asked for (``delivery.retry()``
        publishing its copy, say) is left to finish it; it is cancelled at a
        later tick if it still runs then.
        """
        overdue = [
            t
            for t in self.inflight.values()
            if now >= t.deadline
            and not t.timed_out
            and not t.settling
            and not (t.for_broker and t.settled)  # acked by the handler: the broker has it
        ]
        for ticket in overdue:
            ticket.timed_out = True
            if ticket.task is not None:
                ticket.task.cancel()

    def interrupt(self, error: BaseException | None = None) -> None:
        """The channel closed: cancel the tasks of its deliveries (the broker requeued them).

        Each settles as `Outcome.CHANNEL_DEAD` (stale: nothing can be written).
        A task that has not started yet is left to start: cancelled now, it
        would never run, and its delivery would never be settled; started, it
        finds the channel dead and settles it as stale before anything else.

        ``error``: why the channel closed. When the broker closed it for its
        ``consumer_timeout``, the deliveries that exceeded it are recorded
        first (`consumer_timed_out`), while their handlers still run.
        """
        fault = classify(error) if error is not None else None
        if fault is not None and fault.kind is FaultKind.CONSUMER_TIMEOUT:
            self.consumer_timed_out(fault)
        shared = self.shared
        if not shared.stopping and shared.on_channel_lost is not None:
            try:
                shared.on_channel_lost(self.route.spec.queue)
            except Exception as exc:  # the caller's hook: it must not stop the cancels below
                self.route.log.error("on_channel_lost_failed", error=repr(exc))
        for ticket in list(self.inflight.values()):
            task = ticket.task
            if task is None or task.done():
                continue
            coro = task.get_coro()
            if (
                inspect.iscoroutine(coro)
                and inspect.getcoroutinestate(coro) == inspect.CORO_CREATED
            ):
                continue
            task.cancel()

    def consumer_timed_out(self, fault: Fault) -> None:
        """The broker closed the channel: a delivery stayed unacked past its ``consumer_timeout``.

        The broker names no delivery: it checks the oldest unacked one. That one,
        and any other whose handler has run longer than the timeout the broker
        names (3.9+), exceeded it. Each is logged as an error; each whose
        handler was running has that run recorded on its route
        (`Route.overran`), so that its redelivery is settled as one failed
        attempt (`Outcome.CONSUMER_TIMEOUT`) instead of running again.
        """
        now = time.perf_counter()
        limit = consumer_timeout_of(fault)
        shared = self.shared
        if limit is not None and limit != shared.consumer_timeout:
            self.route.log.warning(
                "consumer_timeout_learned",
                consumer_timeout=limit,
                configured=shared.consumer_timeout,
                cut_after=round(broker_cut(limit), 3),
                hint="from now on a handler is cut (and retried) before the broker's "
                "consumer_timeout; set ConsumerSettings.consumer_timeout to it",
            )
            shared.set_consumer_timeout(limit)
        unacked = sorted(
            (t for t in self.inflight.values() if TagState.unacked(self.tracker.state(t.tag))),
            key=lambda t: t.tag,
        )
        for index, ticket in enumerate(unacked):
            state = self.tracker.state(ticket.tag)
            running = ticket.started > 0 and state is TagState.IN_PROGRESS and not ticket.settled
            ran = now - ticket.started if running else None
            if index and (ran is None or limit is None or ran < limit):
                continue  # not over the broker's timeout (only the oldest is known to be)
            if running:
                assert ran is not None
                self.route.overran(ticket.delivery, ran, limit)
            delivery_log(ticket.delivery).error(
                "consumer_timeout",
                consumer_timeout=limit,
                handler_ran=None if ran is None else round(ran, 3),
                waiting=_waiting_for(ticket, state) if ran is None else None,
                counted=running,
                hint="the broker closed the channel (406 PRECONDITION_FAILED) and requeued "
                "every delivery unacked on it; keep handler_timeout below the broker's "
                "consumer_timeout (ConsumerSettings.consumer_timeout), or raise it",
            )

    async def abandon(self) -> int:
        """Shutdown past its grace: requeue every unsettled delivery, cancel its handler."""
        abandoned = [t for t in self.inflight.values() if not t.settled]
        for ticket in abandoned:
            await ticket.settle(Cause(Outcome.SHUTDOWN))
            if ticket.task is not None:
                ticket.task.cancel()
        return len(abandoned)

    # -- apply: the one way a delivery is settled -------------------------------

    async def apply(self, ticket: Ticket, cause: Cause) -> bool:
        """Settle ``ticket`` by ``cause``: decide, reserve, finish the claim, write.

        Returns:
            True if this call settled it; False if it was settled before (or the
            decision is to hold it unsettled for now).
        """
        delivery = ticket.delivery
        decision = decide(
            self.route.spec.ack_policy,
            cause.outcome,
            delivery.attempt,
            self.shared.settings.max_attempts,
        )
        if decision.settle is Settle.HOLD:
            return False
        if ticket._outcome is not None:
            self.settled_again(delivery, ticket._outcome, cause.outcome)
            return False
        ticket._outcome = decision.settle  # reserved: nothing else settles this delivery
        if ticket.span is not None:
            ticket.decided = time.time_ns()
        ticket.settling = True  # the handler's deadline waits for the end of the settle
        try:
            final = await self._carry_out(ticket, decision, cause)
        except asyncio.CancelledError:
            # A dead channel or the end of a shutdown interrupted us mid-way.
            ticket._outcome = self._requeue_soon(ticket)
            raise
        except Exception as exc:  # a bug of ours: the delivery must still end settled
            delivery_log(delivery).error("settle_failed", error=repr(exc), exc_info=exc)
            final = await self._last_resort(ticket)
        finally:
            ticket.settling = False
        ticket._outcome = final
        if ticket.span is not None:
            error = cause.error if cause.outcome in _FAILED else None
            settled(ticket.span, final, cause.outcome, error)
        return True

    def ack_at_once(self, ticket: Ticket, cause: Cause) -> bool:
        """`apply` for the common end, without a coroutine: ``cause`` decides an ack
        that marks the id done, the claim (if any) completes in memory, and the ack
        joins the channel's batch. False: nothing was done, `apply` must run (a
        traced delivery, one acked singly, a claim the store must be awaited for,
        any other decision)."""
        if ticket._outcome is not None or ticket.span is not None or not self.batch:
            return False
        route = self.route
        if cause.outcome is not _RETURNED or not self._returned_acks:
            decision = decide(
                route.spec.ack_policy,
                cause.outcome,
                ticket.delivery.attempt,
                self.shared.settings.max_attempts,
            )
            if decision.settle is not Settle.ACK or not decision.mark_done:
                return False
        if self.dead():
            return False
        claim = ticket.claim
        if claim is not None:
            gate = route.dedup
            if gate is None or not gate.complete_at_once(claim):
                return False
            ticket.claim = None
        ticket._outcome = _ACK
        route.metrics.acked += 1
        self.batch_ack(ticket.tag)
        return True

    async def _carry_out(self, ticket: Ticket, decision: Decision, cause: Cause) -> Settle:
        settle = decision.settle
        if cause.outcome is Outcome.RETURNED and settle is not Settle.ACK:
            delivery_log(ticket.delivery).warning("handler_did_not_settle")
        claim, ticket.claim = ticket.claim, None
        if claim is not None:
            gate = self.route.dedup
            assert gate is not None
            if not decision.mark_done:
                await gate.release(claim)
            elif not await gate.complete(claim):  # never ack an effect the store did not record
                decision = decide(
                    self.route.spec.ack_policy,
                    Outcome.UNRECORDED,
                    ticket.delivery.attempt,
                    self.shared.settings.max_attempts,
                )
                settle = decision.settle
        metrics, tag = self.route.metrics, ticket.tag
        trace = None if ticket.span is None else self._trace(ticket, settle)
        match settle:
            case Settle.ACK:
                metrics.acked += 1
                if not await self.ack(tag, trace):
                    self._ack_lost(ticket.delivery)
            case Settle.DUPLICATE:
                metrics.duplicate += 1
                delivery_log(ticket.delivery).debug("duplicate_skipped", by=cause.outcome)
                await self.ack(tag, trace)
            case Settle.REQUEUE:
                metrics.requeued += 1
                await self.nack(tag, requeue=True, trace=trace)
            case Settle.REJECT:
                metrics.rejected += 1
                await self.nack(tag, requeue=False, trace=trace)
            case Settle.STALE:
                self.stale(1)
            case Settle.RETRY | Settle.DEAD_LETTER | Settle.DEFER:
                settle = await self._republish(ticket, decision, cause)
        return settle


def _waiting_for(ticket: Ticket, state: TagState | None) -> str:
    """What a delivery that no handler is running was waiting for."""
    if state is TagState.ACK_PENDING:
        return "its batched ack"
    if ticket.settling:
        return "its settle (a copy being published)"
    if ticket.started:
        return "its settle"
    return "a handler slot (prefetch is larger than concurrency allows in that time)"
