"""The consumer's hot path: one delivery, from its channel to its settle.

The coroutine `Dispatcher.intake` runs for each delivery turns whatever happens
(a bad body, a dedup answer, the handler returning, raising anything,
cancelling itself, timing out; a shutdown; a dead channel) into an
[`Outcome`][reliable_mq._consume.settle.Outcome] and hands it to the delivery's
ticket, which settles it through `Session.apply`.
No path leaves a delivery unsettled: every exception is caught and becomes an
outcome, and a bug of ours is settled by the error path. ``KeyboardInterrupt``
and ``SystemExit`` from a handler (`Outcome.EXITED`) count as one failed
attempt too (retried, or dead-lettered after ``max_attempts``, so a handler
that always exits cannot crash-loop its process). They do not leave the task:
no new handler starts (`Shared.exited`), and the consumer stops as on
``stop()`` (deliveries still waiting for a handler slot are requeued, running
handlers get the grace period), so every other delivery in flight is settled
once too; ``run()`` then re-raises the exception.

A message id runs one handler at a time in this process (`Route.running`,
released when the handler really ends: a thread's when it returns, even
late); a delivery of an id still running is deferred, not counted. A
handler's deadline is ``handler_timeout``, or sooner the cut before the
broker's ``consumer_timeout`` (`Shared.broker_cut`, counted from the
delivery's arrival). When the broker closed a channel for its
``consumer_timeout`` anyway, its redelivery of the run it cut
(`Route.take_overran`) is settled as `Outcome.CONSUMER_TIMEOUT` without
running again.

Cancellation is told apart by who asked for it: the watchdog flags the ticket
(`Ticket.timed_out`) before it cancels; a shutdown sets `Shared.stopping`; a
dead channel shows as `Session.dead`. A ``CancelledError`` while the task was
not cancelled (``task.cancelling() == 0``) was raised by the handler itself,
and counts as a handler error.

The common path is kept light, since it runs once per message: the channel
hands a delivery over synchronously (`Dispatcher.intake`, see
`reliable_mq._amqp.inbound`), which records it in tag order and hands its
coroutine to `reliable_mq._consume.eager.Eager` (run at once, a Task of its own
only if it waits); a batch route's delivery is screened, claimed and decoded
right there and added to its batch (`Dispatcher._to_batch`); the ack after a
handler that returned takes no coroutine (`Session.ack_at_once`); causes that
carry nothing but their outcome are shared constants; the
decision for ``ACCEPTED`` is taken once per route, not per delivery (it does
not depend on the attempt); counters are plain ints that the consumer adds to
Prometheus periodically. No logging context is bound per delivery: our own
events bind theirs when they are emitted (`delivery_log`).
"""

from __future__ import annotations

import asyncio
import math
import time
from functools import partial
from typing import Any

from .._amqp import Basic, OnDelivery, Undecodable
from .._tracing import start_process, use_span
from ..dedup.base import AlreadyProcessed, ClaimResult
from ..delivery import Settle
from ..handlers import HandlerSpec, Reject, Retry
from ..log import get_logger
from .batches import Batcher
from .dedup_gate import DedupGate
from .eager import Eager
from .received import received
from .route import Overran, Route
from .session import Session, Shared, Ticket, delivery_log
from .settle import Cause, Outcome, decide

__all__ = ("Dispatcher",)

_EXITS = (KeyboardInterrupt, SystemExit)
"""The only exceptions asyncio lets out of the event loop: a handler raising one
asks for the process to end (`Outcome.EXITED`). Any other exception from a
handler (``GeneratorExit``, a ``BaseException`` subclass of its own) is a
handler error like any other."""

# Causes that carry nothing but their outcome: one shared (frozen) instance each.
_ACCEPTED = Cause(Outcome.ACCEPTED)
_RETURNED = Cause(Outcome.RETURNED, note="handler did not settle")
_SHUTDOWN = Cause(Outcome.SHUTDOWN)
_CHANNEL_DEAD = Cause(Outcome.CHANNEL_DEAD)
_DUPLICATE = Cause(Outcome.DUPLICATE)
_BUSY = Cause(Outcome.BUSY, note="message id claimed by another consumer")
_STORE_DOWN = Cause(Outcome.STORE_DOWN, note="dedup store unavailable")
_RUNNING_HERE = Cause(
    Outcome.BUSY, note="a handler of this message id still runs in this process (a late run)"
)
_ACK_LOST = Cause(
    Outcome.DUPLICATE, note="done here before; the broker returned it when the channel died"
)
_WAITED = Cause(Outcome.WAITED, note="waited for a handler slot too long to run safely")


class Dispatcher:
    """Runs deliveries of every route of one consumer."""

    def __init__(self, shared: Shared) -> None:
        self.shared = shared
        self.settings = shared.settings
        self.log = get_logger(__name__)
        self.eager: Eager | None = None
        """Runs each delivery's task (made on the first channel: it needs the loop)."""

    def intake(self, route: Route, session: Session) -> OnDelivery:
        """The function the channel of ``session`` hands each delivery to (in tag order).

        It records the delivery (its tag, its ticket) and starts the one Task
        that processes it. Should that fail (a bug of ours, a tag out of order),
        the channel is closed, so the broker requeues what it delivered on it.
        """
        loop = asyncio.get_running_loop()
        if self.eager is None or self.eager.loop is not loop:  # started again in another loop
            self.eager = Eager(loop)
        submit = self.eager.submit
        if route.spec.batch is not None:
            if route.batcher is None:
                route.batcher = Batcher(route, self.shared)
            # One ack frame per batch where its tags are contiguous.
            session.batch_size = max(session.batch_size, route.spec.batch.max_size)
        deliver, traced, tracing = self._deliver, self._traced, self.shared.tracing
        metrics = route.metrics
        # A queue consumed alone gets every delivery as it came, strings that did
        # not decode kept escaped: its handler settles it, nothing is dead-lettered.
        as_it_came = route.spec.queue_only
        # Whether the policy settles a delivery before its handler runs: decided
        # once (ACCEPTED does not depend on the attempt).
        acks_first = (
            decide(route.spec.ack_policy, Outcome.ACCEPTED, 1, self.settings.max_attempts).settle
            is not Settle.HOLD
        )

        # A batch route's deliveries join their batch without a task each, where
        # nothing before the handler needs to wait (`_to_batch`).
        shared, batcher, gate = self.shared, route.batcher, route.dedup
        to_batch = (
            partial(self._to_batch, route, batcher)
            if batcher is not None
            and not as_it_came
            and not acks_first
            and (gate is None or gate.nowait is not None)
            else None
        )

        def on_delivery(
            frame: Basic.Deliver,
            properties: Basic.Properties,
            body: bytes,
            undecodable: Undecodable | None,
        ) -> None:
            try:
                ticket = session.admit(frame.delivery_tag or 0, None)
                delivery = ticket.delivery = received(route, frame, properties, body, ticket)
                metrics.delivered += 1
                if delivery.redelivered:
                    metrics.redelivered += 1
                cause = None
                if undecodable is not None and not as_it_came:
                    cause = Cause(Outcome.UNDECODABLE, undecodable.error, undecodable.describe())
                tracer = tracing.tracer()
                if tracer is None:
                    if to_batch and cause is None and not shared.stopping and not session.dead():
                        to_batch(ticket)
                    else:
                        submit(ticket, deliver(route, ticket, acks_first, cause))
                else:
                    submit(ticket, traced(tracer, route, ticket, acks_first, cause))
            except Exception as exc:
                self.log.error(
                    "consumer_intake_failed", queue=route.queue, error=repr(exc), exc_info=exc
                )
                session.abort()

        return on_delivery

    async def _deliver(
        self, route: Route, ticket: Ticket, acks_first: bool, undecodable: Cause | None = None
    ) -> None:
        """One delivery's task: process it, and settle it whatever happens.

        ``undecodable``: the delivery's properties or routing key did not decode
        (`reliable_mq._amqp.inbound.Undecodable`); it is settled by that cause, and
        no handler runs.
        """
        session, shared = ticket.session, self.shared
        if shared.stopping or session.dead():
            # Raced the basic.cancel: give it back at once. Or its channel died
            # before this task started (`Session.interrupt` lets it start): stale.
            await ticket.settle(_SHUTDOWN if shared.stopping else _CHANNEL_DEAD)
            session.forget(ticket)
            return
        shared.enter()
        try:
            if undecodable is not None:
                delivery_log(ticket.delivery).error(
                    "delivery_undecodable", error=undecodable.note, detail=repr(undecodable.error)
                )
                await ticket.settle(undecodable)
            elif route.semaphore is None:
                await self._process(route, ticket, acks_first)
            else:
                async with route.semaphore:
                    await self._process(route, ticket, acks_first)
        except asyncio.CancelledError as exc:  # shutdown past grace, dead channel, or unknown
            if not ticket.settled:
                await ticket.settle(self._interrupted(session, exc))
            raise
        except _EXITS as exc:  # not the handler's (that is an outcome): a signal's, say
            if not ticket.settled:
                await ticket.settle(self._exited(ticket, exc))
            else:
                shared.exited(exc)
        except BaseException as exc:  # a bug of ours: settle it by the error path all the same
            delivery_log(ticket.delivery).error("consumer_failed", error=repr(exc), exc_info=exc)
            if not ticket.settled:
                await ticket.settle(Cause(Outcome.RAISED, exc))
        finally:
            session.forget(ticket)
            shared.leave()

    async def _traced(
        self,
        tracer: Any,
        route: Route,
        ticket: Ticket,
        acks_first: bool,
        undecodable: Cause | None,
    ) -> None:
        """`_deliver` inside a ``process`` span, current while it runs (the handler's
        spans and the copies' ``publish`` spans are its children); `Session.apply`
        records the settle on it (`Ticket.span`)."""
        delivery = ticket.delivery
        address = self.shared.address
        ticket.span = start_process(
            tracer,
            queue=route.queue,
            exchange=delivery.exchange,
            routing_key=delivery.routing_key,
            headers=delivery.headers,
            message_id=delivery.message_id,
            correlation_id=delivery.correlation_id,
            delivery_tag=ticket.tag,
            attempt=delivery.attempt,
            url=None if address is None else address().url,
            parent_from_message=self.settings.trace_parent_from_message,
        )
        if ticket.span is None:  # the tracer failed (logged once): no span, same work
            await self._deliver(route, ticket, acks_first, undecodable)
            return
        with use_span(ticket.span):
            await self._deliver(route, ticket, acks_first, undecodable)

    def _interrupted(self, session: Session, exc: asyncio.CancelledError) -> Cause:
        if session.dead():
            return _CHANNEL_DEAD
        if self.shared.stopping:
            return _SHUTDOWN
        # Someone else cancelled the task (the handler cancelled itself, say):
        # an error of this delivery, not ours to hide.
        return Cause(Outcome.CANCELLED, exc)

    async def _process(self, route: Route, ticket: Ticket, acks_first: bool) -> None:
        if self.shared.stopping:  # waited for a handler slot while the consumer stopped
            await ticket.settle(_SHUTDOWN)
            return
        cause = await self._run(route, ticket, acks_first)
        if cause is None:
            return
        if not ticket.settled:
            if cause is not _RETURNED or not ticket.session.ack_at_once(ticket, cause):
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

    async def _run(self, route: Route, ticket: Ticket, acks_first: bool) -> Cause | None:  # noqa: PLR0911 (hot path: every delivery; one return per way a run ends before the handler)
        """Everything up to the handler's end, as a cause (None: settled already)."""
        delivery, spec = ticket.delivery, route.spec
        if spec.queue_only:  # as it came: the handler settles every delivery itself
            return await self._call(route, ticket, None)
        screened = self._screen(route, ticket, acks_first)
        if screened is not None:
            return screened
        gate = route.dedup
        if gate is not None:
            if gate.nowait is not None or not delivery.message_id:
                unclaimed = _claim_at_once(gate, ticket)
            else:
                result, ticket.claim = await gate.claim(delivery.message_id)
                _raise_swallowed_cancel(ticket)
                unclaimed = None if ticket.claim is not None else _unclaimed(gate, result)
            if unclaimed is not None:
                return unclaimed
        invalid, body = self._decode(spec, ticket)
        if invalid is not None:
            return invalid
        if acks_first:
            await ticket.settle(_ACCEPTED)  # ACK_FIRST acks here
        # (Under the other policies ACCEPTED is a hold: nothing to carry out.)
        if ticket.settled and ticket.outcome is not Settle.ACK:
            # Settled meanwhile (a shutdown), or the id could not be recorded:
            # requeued, the handler does not run.
            return None
        batcher = route.batcher
        if batcher is not None:  # a batch handler: the batch's call ends it
            return await batcher.join(ticket, body)
        return await self._call(route, ticket, body)

    def _screen(self, route: Route, ticket: Ticket, acks_first: bool) -> Cause | None:
        """The checks before the dedup claim: a cause that settles the delivery without
        a handler, or None."""
        delivery, settings = ticket.delivery, self.settings
        if route.has_overran:
            overran = route.take_overran(delivery)
            if overran is not None:  # the broker's redelivery of a run it cut off
                return _consumer_timeout(overran)
        if route.lost_acks and route.take_ack_lost(delivery):
            delivery_log(delivery).info(
                "redelivery_acked_without_run",
                why="its work was done here; the channel died before the broker took the ack",
            )
            return _ACK_LOST
        if delivery.attempt > settings.max_attempts:
            return Cause(
                Outcome.TOO_MANY_ATTEMPTS,
                note=f"delivered {delivery.attempt} times, max_attempts={settings.max_attempts}",
            )
        if delivery.message_id in route.running:
            return _RUNNING_HERE  # never twice at once: a late run of this id goes on
        cut = self.shared.broker_cut
        if cut is not None and not acks_first:
            waited = time.perf_counter() - ticket.admitted
            if waited >= cut / 2:
                return _waited(ticket, waited, cut)
        return None

    def _decode(self, spec: HandlerSpec, ticket: Ticket) -> tuple[Cause | None, Any]:
        """The body for the handler, or the cause that settles the delivery instead."""
        if spec.decode is None:
            return None, None
        delivery = ticket.delivery
        try:
            return None, spec.decode(delivery.body, delivery.content_type)
        except MemoryError as exc:  # not the body's fault, maybe: retry
            return Cause(Outcome.RAISED, exc), None
        except _EXITS as exc:  # a validator that exits: as from the handler
            return self._exited(ticket, exc), None
        except BaseException as exc:  # BodyDecodeError, a validator's KeyError...
            return Cause(Outcome.INVALID_BODY, exc), None

    def _to_batch(self, route: Route, batcher: Batcher, ticket: Ticket) -> None:
        """A batch route's delivery, without a task of its own: screened, claimed (a
        store that answers at once) and decoded here, then added to the open batch,
        whose one task runs the handler and settles every delivery of it
        (`Batcher.add`). One screened out gets a task that settles it."""
        cause = self._screen(route, ticket, False)
        body: Any = None
        gate = route.dedup
        if cause is None and gate is not None:
            cause = _claim_at_once(gate, ticket)
        if cause is None:
            cause, body = self._decode(route.spec, ticket)
        self.shared.enter()
        if cause is None:
            batcher.add(ticket, body)
        else:
            ticket.task = asyncio.get_running_loop().create_task(self._settle_alone(ticket, cause))

    async def _settle_alone(self, ticket: Ticket, cause: Cause) -> None:
        """Settle a delivery of the batch path that no handler will see, by ``cause``."""
        session = ticket.session
        try:
            await ticket.settle(cause)
        except asyncio.CancelledError as exc:
            if not ticket.settled:
                await ticket.settle(self._interrupted(session, exc))
            raise
        except BaseException as exc:  # a bug of ours: settle it by the error path all the same
            delivery_log(ticket.delivery).error("consumer_failed", error=repr(exc), exc_info=exc)
            if not ticket.settled:
                await ticket.settle(Cause(Outcome.RAISED, exc))
        finally:
            session.forget(ticket)
            self.shared.leave()

    async def _call(self, route: Route, ticket: Ticket, body: Any) -> Cause:  # noqa: PLR0911, PLR0912 (hot path: every delivery; one return per way a handler ends)
        """Run the handler; every way it can end becomes a cause."""
        spec, delivery, session = route.spec, ticket.delivery, ticket.session
        if spec.decode is None:
            args: tuple[Any, ...] = (delivery,)
        elif spec.wants_delivery:
            args = (body, delivery)
        else:
            args = (body,)
        # Running until the handler really ends (route.running): a thread only
        # then, late or not; a coroutine when this call ends.
        key = delivery.message_id
        if key:
            running = route.running
            running[key] = running.get(key, 0) + 1
        threads = route.threads
        if threads is None:
            coro = route.handler(*args)
        else:
            on_end = partial(_thread_ended, route, ticket) if key else None
            coro = threads.run(spec.func, *args, on_end=on_end)  # type: ignore[arg-type]
        metrics = route.metrics
        metrics.handlers_running += 1
        started = ticket.started = time.perf_counter()
        timeout = self.settings.handler_timeout
        cut = self.shared.broker_cut
        if (timeout is not None or cut is not None) and ticket.task is not None:
            # Enforced by the consumer's watchdog.
            session.watch(ticket, _deadline(ticket, started, timeout, cut))
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
        except _EXITS as exc:
            return self._exited(ticket, exc)
        except BaseException as exc:  # any Exception, GeneratorExit, a BaseException of its own
            return Cause(Outcome.RAISED, exc)
        finally:
            metrics.handlers_running -= 1
            metrics.handler_ended(time.perf_counter() - started)
            session.unwatch(ticket)
            if key and threads is None:
                route.handler_ended(key)
        if ticket.timed_out:  # the handler swallowed the watchdog's cancel
            return self._timed_out(ticket)
        task = ticket.task
        if task is not None and task.cancelling():
            # It swallowed the cancel of a dead channel or a shutdown: its work was
            # cut short, not done (never mark the id done). _deliver settles it.
            raise asyncio.CancelledError
        return _RETURNED

    def _exited(self, ticket: Ticket, exc: BaseException) -> Cause:
        """``SystemExit``/``KeyboardInterrupt``: one failed attempt; the consumer stops.

        The exception is not let out of this task (asyncio would end the event
        loop with it at once, before the settles of this delivery and of every
        other one in flight reached the broker): the consumer re-raises it once
        it has stopped cleanly (`ReliableConsumer.run`).
        """
        delivery_log(ticket.delivery).error("handler_exited", error=repr(exc)[:300])
        self.shared.exited(exc)
        return Cause(Outcome.EXITED, exc)

    def _cancelled(self, ticket: Ticket, exc: asyncio.CancelledError) -> Cause:
        task = ticket.task
        if ticket.timed_out:
            return self._timed_out(ticket)
        if task is None or task.cancelling() == 0:
            # Nobody cancelled the task: the handler raised CancelledError itself.
            return Cause(Outcome.CANCELLED, exc)
        raise exc  # a shutdown or a dead channel: _deliver settles it

    def _timed_out(self, ticket: Ticket) -> Cause:
        task = ticket.task
        ticket.timed_out = False
        if task is not None and task.uncancel() > 0:
            # Cancelled by someone else as well (a shutdown): that one wins.
            raise asyncio.CancelledError
        log = delivery_log(ticket.delivery)
        if ticket.for_broker:
            limit = self.shared.consumer_timeout
            ran = time.perf_counter() - ticket.started
            log.warning("handler_cut_for_consumer_timeout", consumer_timeout=limit, ran=ran)
            return Cause(
                Outcome.CONSUMER_TIMEOUT,
                TimeoutError(
                    f"the handler ran {ran:.1f}s and was cut to be settled within the "
                    f"broker's consumer_timeout ({limit:g}s)"
                ),
                "consumer_timeout",
            )
        seconds = self.settings.handler_timeout
        log.warning("handler_timeout", seconds=seconds)
        return Cause(
            Outcome.TIMED_OUT, TimeoutError(f"handler exceeded handler_timeout={seconds}s")
        )


def _deadline(ticket: Ticket, started: float, timeout: float | None, cut: float | None) -> float:
    """When the handler is cut: ``handler_timeout`` after it started, or sooner, `Shared.broker_cut`
    after its delivery arrived (unless settled first: ``ACK_FIRST``)."""
    deadline = math.inf if timeout is None else started + timeout
    if cut is not None and not ticket.settled and ticket.admitted + cut < deadline:
        ticket.for_broker = True
        return ticket.admitted + cut
    return deadline


def _waited(ticket: Ticket, waited: float, cut: float) -> Cause:
    """Half its time before the broker's consumer_timeout went waiting for a slot."""
    delivery_log(ticket.delivery).warning(
        "delivery_deferred_before_consumer_timeout",
        waited=round(waited, 3),
        cut_after=round(cut, 3),
        hint="it waited for a handler slot: lower prefetch, or raise concurrency",
    )
    return _WAITED


def _claim_at_once(gate: DedupGate, ticket: Ticket) -> Cause | None:
    """Claim ``ticket``'s id in a store that answers at once (nothing to claim without
    an id: counted, processed without dedup). None: go on; else why not."""
    message_id = ticket.delivery.message_id
    if not message_id:
        gate.unkeyed()
        return None
    result, ticket.claim = gate.claim_nowait(message_id)
    return None if ticket.claim is not None else _unclaimed(gate, result)


def _raise_swallowed_cancel(ticket: Ticket) -> None:
    """Raise the cancel (a dead channel's, a shutdown's) that came while the store was
    awaited and that the store swallowed (``asyncio.wait_for`` returns a result that
    arrived meanwhile): the handler must not run. `Dispatcher._deliver` settles the
    delivery, and releases the claim (kept on the ticket) for its redelivery."""
    task = ticket.task
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def _unclaimed(gate: DedupGate, result: ClaimResult | None) -> Cause:
    """Why the dedup store gave no claim: done already, claimed elsewhere, or down."""
    if result is ClaimResult.DONE:
        return _DUPLICATE
    if result is ClaimResult.BUSY:
        gate.busy()
        return _BUSY
    return _STORE_DOWN


def _consumer_timeout(overran: Overran) -> Cause:
    limit = "" if overran.limit is None else f" ({overran.limit:g}s)"
    error = TimeoutError(
        f"the handler ran {overran.ran:.1f}s, past the broker's consumer_timeout{limit}: "
        "the broker closed the channel and redelivered the message"
    )
    return Cause(Outcome.CONSUMER_TIMEOUT, error, "consumer_timeout")


def _thread_ended(route: Route, ticket: Ticket, returned: bool) -> None:
    """A plain ``def`` handler's thread really ended. One that returned after its
    channel died (settled stale, the broker will deliver it again) did its work:
    that redelivery is acked without running again."""
    delivery = ticket.delivery
    route.handler_ended(delivery.message_id)
    if returned and ticket.outcome is Settle.STALE:
        route.ack_lost(delivery.message_id, delivery.attempt)
