"""Batch handlers: a route's deliveries gathered into batches, one handler call per batch.

A delivery of a batch route takes the single path (`reliable_mq._consume.dispatch`) up
to its handler: the attempt and ``consumer_timeout`` checks, the dedup claim (a
done id is acked there, never reaching a batch) and the body's decoding each end
it on its own. Then, instead of calling the handler, it joins the route's open
batch (`Batcher.join`). The first delivery of a batch leads it: its task waits
until the batch holds ``max_size`` deliveries or ``max_wait`` has passed (or the
consumer stops: `Batcher.flush`), closes it, and calls the handler once with the
list. How the call ended becomes one [`Cause`][reliable_mq._consume.settle.Cause]
per delivery (`BatchFailed` names the failed ones; anything else raised fails
them all), and each delivery's own task settles its own cause through
`Session.apply`, so every delivery is decided by ``decide`` and settled exactly
once, as on the single path. Acks batch as usual; a batch route's channel flushes
them by ``max(ack_batch_size, max_size)``, so a batch is acked in one frame where
its tags are contiguous.

Batches never mix channels: a delivery of a new channel starts a new batch (the
old channel's deliveries are settled stale by its death). ``handler_timeout``
applies to the batch's call, and so does the cut before the broker's
``consumer_timeout``, counted from the batch's oldest delivery. ``concurrency``
bounds the batches running at once (not the deliveries). A message id is
counted in `Route.running` from the moment it joins a batch until the call
ends (a thread's: when it returns), so a copy of it arriving meanwhile is
deferred, never run in the same or another batch alongside.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

from .._tracing import batch_process_ended, start_batch_process, use_span
from ..dedup.base import AlreadyProcessed
from ..delivery import Delivery, Settle
from ..errors import InvalidSettings
from ..handlers import AsyncHandlerFunc, BatchFailed, HandlerSpec, Reject, Retry
from ..log import get_logger
from ..metrics import QueueMetrics
from ..settings import ConsumerSettings
from .session import Session, Shared, Ticket
from .settle import Cause, Outcome
from .threads import HandlerThreads, _for_thread

__all__ = ("BatchRoute", "Batcher", "check_batch")

_EXITS = (KeyboardInterrupt, SystemExit)
_RETURNED = Cause(Outcome.RETURNED, note="handler did not settle")
_SHUTDOWN = Cause(Outcome.SHUTDOWN)
_CHANNEL_DEAD = Cause(Outcome.CHANNEL_DEAD)


class BatchRoute(Protocol):
    """What a batcher needs of its route (`reliable_mq._consume.route.Route`)."""

    spec: HandlerSpec
    handler: AsyncHandlerFunc
    threads: HandlerThreads | None
    running: dict[str, int]
    metrics: QueueMetrics

    def handler_ended(self, message_id: str) -> None: ...

    def ack_lost(self, message_id: str, attempt: int) -> None: ...


def check_batch(spec: HandlerSpec, settings: ConsumerSettings) -> None:
    """Refuse a batch handler whose batches could never fill.

    Raises:
        InvalidSettings: ``prefetch`` (when limited) is below the handler's ``max_size``:
            the broker would never hand over a full batch.
    """
    batch = spec.batch
    if batch is not None and settings.prefetch and settings.prefetch < batch.max_size:
        problem = (
            f"{settings.prefetch} is below the batch handler's max_size={batch.max_size} "
            f"for queue {spec.queue!r}: raise prefetch, or lower max_size"
        )
        raise InvalidSettings("ConsumerSettings", [("prefetch", problem)])


class _Batch:
    """One batch: its deliveries in arrival order, and how the followers get their cause.

    A batch is either led by its first delivery's task (`Batcher.join`), or has a
    task of its own that settles every delivery of it (``task``: `Batcher.add`).
    """

    __slots__ = ("bodies", "full", "futures", "released", "session", "task", "tickets")

    def __init__(self, session: Session) -> None:
        self.session = session
        self.tickets: list[Ticket] = []
        self.bodies: list[Any] = []
        self.futures: list[asyncio.Future[Cause] | None] = []  # None: the leader's, or added
        self.full = asyncio.Event()
        self.released = False
        self.task: asyncio.Task[None] | None = None


class Batcher:
    """Gathers one route's deliveries into batches and runs its batch handler."""

    def __init__(self, route: BatchRoute, shared: Shared) -> None:
        batch = route.spec.batch
        assert batch is not None
        self.route = route
        self.shared = shared
        self.max_size = batch.max_size
        self.max_wait = batch.max_wait
        limit = shared.settings.effective_concurrency
        self.slots = asyncio.Semaphore(limit) if limit else None
        self._open: _Batch | None = None
        self.log = get_logger(__name__).bind(queue=route.spec.queue)

    def flush(self) -> None:
        """Run the open batch now with what it has (the consumer is stopping)."""
        if self._open is not None:
            self._close(self._open)

    def _close(self, batch: _Batch) -> None:
        if self._open is batch:
            self._open = None
        batch.full.set()

    def _opened(self, ticket: Ticket, added: bool) -> _Batch | None:
        """The open batch ``ticket`` joins (None: it opens a new one). A batch never
        mixes channels, nor deliveries with and without tasks of their own."""
        batch = self._open
        if batch is None:
            return None
        if batch.session is ticket.session and (batch.task is not None) is added:
            return batch
        self._close(batch)  # it runs now with what it has
        return None

    def _enter(
        self, batch: _Batch, ticket: Ticket, body: Any, future: asyncio.Future[Cause] | None
    ) -> None:
        message_id = ticket.delivery.message_id
        if message_id:
            running = self.route.running
            running[message_id] = running.get(message_id, 0) + 1
        batch.tickets.append(ticket)
        batch.bodies.append(body)
        batch.futures.append(future)
        if len(batch.tickets) >= self.max_size:
            self._close(batch)

    def add(self, ticket: Ticket, body: Any) -> None:
        """Add a delivery that has no task of its own (see
        `reliable_mq._consume.dispatch.Dispatcher._to_batch`) to the open batch. The
        batch's task runs the handler and settles it (`_run_added`); it is the
        ticket's task (what a dead channel or a shutdown cancels)."""
        batch = self._opened(ticket, added=True)
        if batch is None:
            batch = self._open = _Batch(ticket.session)
            batch.task = asyncio.get_running_loop().create_task(self._run_added(batch))
        ticket.task = batch.task
        self._enter(batch, ticket, body, None)

    async def join(self, ticket: Ticket, body: Any) -> Cause:
        """Add ``ticket``'s delivery to the open batch; its cause once the batch ran."""
        batch = self._opened(ticket, added=False)
        lead = batch is None
        if batch is None:
            batch = self._open = _Batch(ticket.session)
        future: asyncio.Future[Cause] | None = None
        if not lead:
            future = asyncio.get_running_loop().create_future()
        self._enter(batch, ticket, body, future)
        if future is not None:
            return await future
        return await self._lead(batch)

    async def _wait_and_call(self, batch: _Batch) -> list[Cause]:
        """Wait until the batch is full or ``max_wait`` passed, then run it."""
        if not batch.full.is_set() and not self.shared.stopping:  # stopping: run now
            try:
                async with asyncio.timeout(self.max_wait):
                    await batch.full.wait()
            except TimeoutError:
                pass
        self._close(batch)
        if self.slots is None:
            return await self._traced(batch)
        async with self.slots:
            return await self._traced(batch)

    async def _run_added(self, batch: _Batch) -> None:
        """The task of a batch of deliveries without tasks: run it, then settle each."""
        try:
            if batch.session.dead():  # its channel died before this task started
                self._close(batch)
                causes = [_CHANNEL_DEAD] * len(batch.tickets)
            else:
                causes = await self._wait_and_call(batch)
        except asyncio.CancelledError:  # a shutdown past its grace, or a dead channel
            self._close(batch)
            await self._settle_rest(batch.tickets, self._interrupted(batch.session))
            raise
        except BaseException as exc:  # a bug of ours: settle them by the error path all the same
            self._close(batch)
            self.log.error(
                "consumer_failed", error=repr(exc), exc_info=exc, batch=len(batch.tickets)
            )
            if isinstance(exc, _EXITS):
                self.shared.exited(exc)
            await self._settle_rest(batch.tickets, Cause(Outcome.RAISED, exc))
            return
        finally:
            self._release(batch)
        await self._settle_added(batch, causes)

    async def _settle_added(self, batch: _Batch, causes: list[Cause]) -> None:
        """Settle each delivery of an added batch by its cause: those the handler
        returned in order, here (their acks batch into one frame); the others (a copy
        to publish, say) each in a task of its own, at once: the ticket's task from
        then on, which a dead channel or a shutdown cancels as any delivery's."""
        session = batch.session
        inline: list[Ticket] = []
        start = asyncio.get_running_loop().create_task
        for ticket, cause in zip(batch.tickets, causes, strict=True):
            if cause is _RETURNED:
                inline.append(ticket)
            else:
                ticket.task = start(self._settle_one(ticket, cause))
        try:
            for ticket in inline:
                if not session.ack_at_once(ticket, _RETURNED):
                    await ticket.settle(_RETURNED)
        except asyncio.CancelledError:
            await self._settle_rest(inline, self._interrupted(session), forget=False)
            raise
        finally:
            self._forget(inline)

    async def _settle_one(self, ticket: Ticket, cause: Cause) -> None:
        try:
            await ticket.settle(cause)
        except asyncio.CancelledError:
            if not ticket.settled:
                await asyncio.shield(ticket.settle(self._interrupted(ticket.session)))
            raise
        finally:
            self._forget([ticket])

    async def _settle_rest(
        self, tickets: list[Ticket], cause: Cause, *, forget: bool = True
    ) -> None:
        """Settle by ``cause`` every ticket not settled yet (the batch's run was cut
        short): shielded, so a second cancel cannot leave one unsettled."""
        try:
            rest = [ticket.settle(cause) for ticket in tickets if not ticket.settled]
            if rest:
                await asyncio.shield(asyncio.gather(*rest, return_exceptions=True))
        finally:
            if forget:
                self._forget(tickets)

    def _forget(self, tickets: list[Ticket]) -> None:
        """These deliveries' processing ended."""
        shared = self.shared
        for ticket in tickets:
            ticket.session.forget(ticket)
            shared.leave()

    def _interrupted(self, session: Session) -> Cause:
        if session.dead():
            return _CHANNEL_DEAD
        if self.shared.stopping:
            return _SHUTDOWN
        return Cause(Outcome.RAISED, RuntimeError("the batch's run was interrupted"))

    async def _lead(self, batch: _Batch) -> Cause:
        """The leader's part: wait for the batch, run it, hand each follower its cause."""
        try:
            causes = await self._wait_and_call(batch)
        except BaseException:
            self._close(batch)
            self._orphaned(batch)
            raise
        finally:
            self._release(batch)
        for future, cause in zip(batch.futures, causes, strict=True):
            if future is not None and not future.done():
                future.set_result(cause)
        return causes[0]

    def _orphaned(self, batch: _Batch) -> None:
        """The leader's task ended early (cancelled): settle what still waits on it."""
        cause = self._interrupted(batch.session)
        for future in batch.futures:
            if future is not None and not future.done():
                future.set_result(cause)

    def _release(self, batch: _Batch) -> None:
        """The batch's call ended (or never started): its ids no longer run here."""
        if batch.released:
            return
        batch.released = True
        ended = self.route.handler_ended
        for ticket in batch.tickets:
            if ticket.delivery.message_id:
                ended(ticket.delivery.message_id)

    async def _traced(self, batch: _Batch) -> list[Cause]:
        """`_run` inside the batch's ``process`` span when tracing is on (a root linked
        to each delivery's ``process`` span), so the handler's spans belong to the
        batch and not to the delivery that led it."""
        tracer = self.shared.tracing.tracer()
        if tracer is None:
            return await self._run(batch)
        address = self.shared.address
        span = start_batch_process(
            tracer,
            queue=self.route.spec.queue,
            processes=[ticket.span for ticket in batch.tickets],
            url=None if address is None else address().url,
        )
        if span is None:  # the tracer failed (logged once): no span, same work
            return await self._run(batch)
        with use_span(span):
            causes = await self._run(batch)
            failed = [c for c in causes if c.outcome is not Outcome.RETURNED]
            error = failed[0].error if len(failed) == len(causes) and failed else None
            batch_process_ended(span, len(failed), error)
        return causes

    async def _run(self, batch: _Batch) -> list[Cause]:  # noqa: PLR0911, PLR0912 (one return per way a call ends)
        """Call the handler with the batch; how it ended, as one cause per delivery."""
        route, tickets = self.route, batch.tickets
        size = len(tickets)
        threads, spec = route.threads, route.spec
        args = _arguments(spec, batch, threads is not None)
        started = time.perf_counter()
        for ticket in tickets:
            ticket.started = started
        timeout, for_broker = self._timeout(batch, started)
        if threads is None:
            call = route.handler(*args)
        else:
            batch.released = True  # released when the thread really ends
            on_end = partial(_thread_ended, route, tickets)
            call = threads.run(spec.func, *args, on_end=on_end)  # type: ignore[arg-type]
        metrics = route.metrics
        metrics.batch_sizes.observe(size)
        metrics.handlers_running += 1
        deadline = asyncio.timeout(timeout)
        task = asyncio.current_task()
        try:
            async with deadline:
                await call
        except asyncio.CancelledError as exc:
            if task is not None and task.cancelling():
                raise  # a shutdown past its grace, or a dead channel
            return [Cause(Outcome.CANCELLED, exc)] * size
        except TimeoutError as exc:
            if deadline.expired():
                return self._timed_out(size, for_broker, time.perf_counter() - started)
            return [Cause(Outcome.RAISED, exc)] * size
        except BatchFailed as exc:
            return self._failed(batch, exc)
        except _EXITS as exc:
            self.log.error("handler_exited", error=repr(exc)[:300], batch=size)
            self.shared.exited(exc)
            return [Cause(Outcome.EXITED, exc)] * size
        except BaseException as exc:  # Retry, Reject, any error: the whole batch
            return [cause_of(exc)] * size
        finally:
            metrics.handlers_running -= 1
            metrics.handler_ended(time.perf_counter() - started)
            self._release(batch)
        if deadline.expired():  # the handler swallowed the timeout's cancel
            return self._timed_out(size, for_broker, time.perf_counter() - started)
        if task is not None and task.cancelling():
            raise asyncio.CancelledError  # it swallowed a shutdown's or dead channel's cancel
        return [_RETURNED] * size

    def _timeout(self, batch: _Batch, started: float) -> tuple[float | None, bool]:
        """Seconds the call may run: ``handler_timeout``, or less, the cut before the
        broker's ``consumer_timeout`` counted from the oldest unsettled delivery."""
        timeout = self.shared.settings.handler_timeout
        cut = self.shared.broker_cut
        if cut is not None:
            admitted = [t.admitted for t in batch.tickets if not t.settled]
            if admitted:
                left = min(admitted) + cut - started
                if timeout is None or left < timeout:
                    return max(left, 0.0), True
        return timeout, False

    def _timed_out(self, size: int, for_broker: bool, ran: float) -> list[Cause]:
        if for_broker:
            limit = self.shared.consumer_timeout
            self.log.warning(
                "handler_cut_for_consumer_timeout", consumer_timeout=limit, ran=ran, batch=size
            )
            error = TimeoutError(
                f"the batch handler ran {ran:.1f}s and was cut to be settled within the "
                f"broker's consumer_timeout ({limit:g}s)"
            )
            return [Cause(Outcome.CONSUMER_TIMEOUT, error, "consumer_timeout")] * size
        seconds = self.shared.settings.handler_timeout
        self.log.warning("handler_timeout", seconds=seconds, batch=size)
        error = TimeoutError(f"batch handler exceeded handler_timeout={seconds}s")
        return [Cause(Outcome.TIMED_OUT, error)] * size

    def _failed(self, batch: _Batch, failed: BatchFailed) -> list[Cause]:
        """`BatchFailed`: the messages it names fail, each by its own exception; the rest returned.

        A key that names no message of the batch fails every message: which one
        failed cannot be known, and acking it would lose it.
        """
        tickets = batch.tickets
        size = len(tickets)
        causes = [_RETURNED] * size
        ids: dict[str, int] | None = None
        for key, error in failed.failures.items():
            index: int | None = None
            if isinstance(key, int) and not isinstance(key, bool):
                index = key if 0 <= key < size else None
            elif isinstance(key, str):
                if ids is None:
                    ids = {t.delivery.message_id: i for i, t in enumerate(tickets)}
                index = ids.get(key)
            if index is None:
                self.log.error(
                    "batch_failure_unknown",
                    key=repr(key)[:100],
                    batch=size,
                    hint="BatchFailed names messages by index in the batch or message_id; "
                    "the whole batch fails instead",
                )
                unknown = LookupError(f"BatchFailed names no message of the batch: {key!r:.100}")
                unknown.__cause__ = failed
                return [Cause(Outcome.RAISED, unknown)] * size
            causes[index] = cause_of(error)
        return causes


def _arguments(spec: HandlerSpec, batch: _Batch, in_thread: bool) -> tuple[Any, ...]:
    """The handler's arguments: the bodies, the deliveries, or both (as lists)."""
    deliveries = [ticket.delivery for ticket in batch.tickets]
    if in_thread:  # read-only copies: a thread cannot settle
        deliveries = [_for_thread(delivery) for delivery in deliveries]
    if spec.decode is None:
        return (deliveries,)
    if spec.wants_delivery:
        return (list(batch.bodies), deliveries)
    return (list(batch.bodies),)


def cause_of(error: object) -> Cause:
    """The cause of one message failed by ``error`` (a handler signal, or any error)."""
    match error:
        case Retry():
            return Cause(Outcome.RETRY_SIGNAL, error, error.reason, error.delay)
        case Reject():
            return Cause(Outcome.REJECT_SIGNAL, error, error.reason)
        case AlreadyProcessed():
            return Cause(Outcome.ALREADY_PROCESSED, error)
        case BaseException():
            return Cause(Outcome.RAISED, error)
    return Cause(Outcome.RAISED, TypeError(f"not an exception: {error!r:.100}"))


def _thread_ended(route: BatchRoute, tickets: list[Ticket], returned: bool) -> None:
    """A plain ``def`` batch handler's thread really ended: its ids no longer run. Those it
    did (it returned) whose channel died meanwhile are acked without running again."""
    ended: Callable[[str], None] = route.handler_ended
    for ticket in tickets:
        delivery: Delivery = ticket.delivery
        if delivery.message_id:
            ended(delivery.message_id)
            if returned and ticket.outcome is Settle.STALE:
                route.ack_lost(delivery.message_id, delivery.attempt)
