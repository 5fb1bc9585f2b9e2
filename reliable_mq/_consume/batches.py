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
    """One batch: its deliveries in arrival order, and how the followers get their cause."""

    __slots__ = ("bodies", "full", "futures", "released", "session", "tickets")

    def __init__(self, session: Session) -> None:
        self.session = session
        self.tickets: list[Ticket] = []
        self.bodies: list[Any] = []
        self.futures: list[asyncio.Future[Cause] | None] = []  # None: the leader's
        self.full = asyncio.Event()
        self.released = False


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

    async def join(self, ticket: Ticket, body: Any) -> Cause:
        """Add ``ticket``'s delivery to the open batch; its cause once the batch ran."""
        batch = self._open
        lead = batch is None or batch.session is not ticket.session
        if lead:
            batch = self._open = _Batch(ticket.session)
        assert batch is not None
        message_id = ticket.delivery.message_id
        if message_id:
            running = self.route.running
            running[message_id] = running.get(message_id, 0) + 1
        batch.tickets.append(ticket)
        batch.bodies.append(body)
        future: asyncio.Future[Cause] | None = None
        if not lead:
            future = asyncio.get_running_loop().create_future()
        batch.futures.append(future)
        if len(batch.tickets) >= self.max_size:
            self._close(batch)
        if future is not None:
            return await future
        return await self._lead(batch)

    async def _lead(self, batch: _Batch) -> Cause:
        """The leader's part: wait for the batch, run it, hand each follower its cause."""
        try:
            if not batch.full.is_set() and not self.shared.stopping:  # stopping: run now
                try:
                    async with asyncio.timeout(self.max_wait):
                        await batch.full.wait()
                except TimeoutError:
                    pass
            self._close(batch)
            if self.slots is None:
                causes = await self._traced(batch)
            else:
                async with self.slots:
                    causes = await self._traced(batch)
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
        if self.shared.stopping:
            cause = _SHUTDOWN
        elif batch.session.dead():
            cause = _CHANNEL_DEAD
        else:
            cause = Cause(Outcome.RAISED, RuntimeError("the batch's run was interrupted"))
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
