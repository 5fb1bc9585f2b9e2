"""ReliableConsumer: bounded prefetch, typed handlers, acks exactly once, delayed retries.

One channel per consumed queue, opened on a connection kept by a
`ConnectionSupervisor`. The hot path sits on
aiormq (``basic_consume`` with a plain callback, ``basic_ack`` without waiting
for a drain), below aio-pika's per-message objects.

Every channel is a *session* with its own `AckTracker`
and send lock. A delivery is settled through the session it came from, once
(`Delivery.claim()`). When that channel has died, the settle is dropped and
counted (``stale_settles``): the broker already requeued the message, and its
old tag must never reach a new channel (``PRECONDITION_FAILED - unknown
delivery tag`` would close it).

Outcomes (see [`AckPolicy`][reliable_mq.handlers.AckPolicy]):

* return: ack (batched into ``basic.ack(multiple=true)`` over the contiguous
  prefix of finished tags, flushed by count and every ``ack_flush_interval``);
* ``Retry`` or an error: republish with confirms to the retry queue of the
  attempt (same ``message_id``, ``x-reliable-mq-attempt`` + 1), then ack;
* ``Reject``, a malformed body, or attempts used up: publish with confirms to
  the DLQ with reason headers, then ack.

Frames of one channel are written in the order they were decided (a FIFO
lock), so an individual nack is never overtaken by a later multiple ack.

De-duplication (on by default, see `ReliableConsumer`): before the
handler runs, the delivery's ``message_id`` is claimed in a
[`DedupStore`][reliable_mq.dedup.DedupStore]. Done already: ack and skip. Claimed by
another consumer, or the store cannot answer: defer through the first retry
queue without counting an attempt. Success: mark done, then ack. Failure:
release the claim, then retry or dead-letter as above.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, Literal, NamedTuple, cast

import aiormq
import structlog
from aiormq import Channel
from aiormq.abc import DeliveredMessage
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from ._dedup_gate import DedupGate
from ._session import (
    CHANNEL_ERRORS,
    DEAD_LETTER_HEADERS,
    NO_CONTENT_TYPE_HEADER,
    Route,
    Session,
    Shared,
    delivery_log,
    int_header,
)
from .connection import ConnectionSupervisor
from .dedup.base import AlreadyProcessed, ClaimResult, DedupStore
from .dedup.memory import MemoryDedupStore
from .delivery import ATTEMPT_HEADER, Delivery
from .errors import ClosedError, ConsumerError
from .handlers import (
    USE_CONSUMER_DEDUP,
    AckPolicy,
    BodyDecodeError,
    HandlerSpec,
    Reject,
    Retry,
    Router,
)
from .log import get_logger
from .metrics import Metrics
from .publisher import ReliablePublisher
from .settings import ConnectionSettings, ConsumerSettings, PublisherSettings
from .topology import QueueTopology, prepare_topology

__all__ = (
    "DEAD_LETTER_HEADERS",
    "ConsumerStats",
    "ReliableConsumer",
)

_REOPEN_ERRORS: tuple[type[BaseException], ...] = (*CHANNEL_ERRORS, ConsumerError)


class ConsumerStats(NamedTuple):
    """Counters of one consumer since it started (cheap to read)."""

    delivered: int
    acked: int
    retried: int
    dead_lettered: int
    requeued: int
    stale: int
    ack_frames: int
    in_progress: int
    max_in_progress: int
    channel_reopens: int
    duplicates: int = 0
    """Deliveries acked without running the handler (their id was done)."""
    deferred: int = 0
    """Deliveries sent round a retry queue unhandled (id busy, or dedup store down)."""


class ReliableConsumer(Router):
    """Consumes queues with manual acks, bounded prefetch, delayed retries and a DLQ.

    ```python
    consumer = ReliableConsumer("amqp://guest:guest@127.0.0.1/", prefetch=200)

    @consumer.handler("orders")
    async def on_order(order: Order, delivery: Delivery) -> None: ...

    await consumer.run()  # until stop(), SIGTERM or SIGINT
    ```

    De-duplication is on by default: each consumer gets a
    [`MemoryDedupStore`][reliable_mq.dedup.MemoryDedupStore] of its own (settings
    ``dedup_retention``, ``dedup_max_entries``), which catches redeliveries and
    republished copies that reach *this* process. Several consumer processes on
    one queue need a shared store (``RedisDedupStore``); ``dedup=None`` turns
    de-duplication off. Per handler, ``@consumer.handler(queue, dedup=...)``
    overrides it. A delivery without a ``message_id`` is processed without
    de-duplication (counted, and a warning once per queue).

    Args:
        connection: an AMQP URL (several, comma separated, fail over), or
            `ConnectionSettings`; default: from ``RELIABLE_MQ_*`` variables.
        settings: prefetch, concurrency, retries...; default: from
            ``RELIABLE_MQ_CONSUMER_*`` variables. Keyword ``overrides`` (for
            example ``prefetch=50``) replace single fields.
        publisher_settings: for the internal publisher that sends retries and
            dead letters with confirms.
        registry: the Prometheus registry for metrics (default: the global one).
        metrics_prefix: the metric name prefix.
        dedup: ``"memory"`` (default): a [`MemoryDedupStore`][reliable_mq.dedup.MemoryDedupStore]
            owned and closed by this consumer; a
            [`DedupStore`][reliable_mq.dedup.DedupStore] (shared, e.g. Redis; the
            caller closes it); or ``None``: no de-duplication.

    Raises:
        InvalidSettings: an override is invalid.
    """

    def __init__(
        self,
        connection: str | ConnectionSettings | None = None,
        *,
        settings: ConsumerSettings | None = None,
        publisher_settings: PublisherSettings | None = None,
        registry: CollectorRegistry | None = None,
        metrics_prefix: str = "reliable_mq",
        dedup: DedupStore | Literal["memory"] | None = "memory",
        **overrides: Any,
    ) -> None:
        super().__init__()
        if connection is None:
            connection = ConnectionSettings()
        elif isinstance(connection, str):
            connection = ConnectionSettings(url=SecretStr(connection))
        if overrides:
            base = settings.model_dump() if settings is not None else {}
            settings = ConsumerSettings(**{**base, **overrides})
        self.settings = settings if settings is not None else ConsumerSettings()
        self._shared = Shared(self.settings)
        self._connection_settings = connection
        self._publisher_settings = publisher_settings
        self._registry = registry
        self._metrics_prefix = metrics_prefix
        self._metrics = Metrics.on(registry, metrics_prefix)
        self._supervisor = ConnectionSupervisor(connection, role="consumer", metrics=self._metrics)
        self._log = get_logger(__name__).bind(connection=self._supervisor.name)
        self._routes: dict[str, Route] = {}
        self._watchdog_task: asyncio.Task[None] | None = None
        self._started = False
        self._stopping = False
        self._stop_task: asyncio.Task[None] | None = None
        self._stop_requested: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._active = 0
        self._max_active = 0
        self._delivered = self._reopens = 0
        if dedup == "memory":
            self._dedup: DedupStore | None = MemoryDedupStore(
                max_entries=self.settings.dedup_max_entries,
                retention=self.settings.dedup_retention,
            )
            self._owned_dedup: DedupStore | None = self._dedup
        elif dedup is None or isinstance(dedup, DedupStore):
            self._dedup, self._owned_dedup = dedup, None
        else:
            raise TypeError(f"dedup must be a DedupStore, 'memory' or None, not {dedup!r}")
        self._owner_prefix = f"{uuid.uuid4().hex[:12]}:{os.getpid()}:"

    @property
    def connection_name(self) -> str:
        """The AMQP connection name of the consuming connection (as the broker shows it)."""
        return self._supervisor.name

    @property
    def consuming(self) -> bool:
        """True while every registered queue has a live consumer on the broker."""
        return (
            self._started
            and not self._stopping
            and all(route.ready.is_set() for route in self._routes.values())
        )

    @property
    def dedup(self) -> DedupStore | None:
        """The consumer's default de-duplication store (None: off)."""
        return self._dedup

    def dedup_store(self, queue: str) -> DedupStore | None:
        """The store that de-duplicates ``queue`` (its handler's, else the consumer's).

        Raises:
            KeyError: no handler is registered for ``queue``.
        """
        spec = next((s for s in self.handlers if s.queue == queue), None)
        if spec is None:
            raise KeyError(queue)
        return self._dedup if spec.dedup is USE_CONSUMER_DEDUP else spec.dedup

    def _uses_dedup(self) -> bool:
        return any(self.dedup_store(spec.queue) is not None for spec in self.handlers)

    def _add_spec(self, spec: HandlerSpec) -> None:
        if self._started:
            raise ConsumerError("register handlers before start()")
        super()._add_spec(spec)

    def stats(self) -> ConsumerStats:
        return ConsumerStats(
            delivered=self._delivered,
            acked=self._shared.acked,
            retried=self._shared.retried,
            dead_lettered=self._shared.dead_lettered,
            requeued=self._shared.requeued,
            stale=self._shared.stale,
            ack_frames=self._shared.ack_frames,
            in_progress=self._active,
            max_in_progress=self._max_active,
            channel_reopens=self._reopens,
            duplicates=self._shared.duplicates,
            deferred=self._shared.deferred,
        )

    def topology(self, queue: str) -> QueueTopology:
        """The queue set (work, retry, DLQ) the consumer uses for ``queue``.

        Raises:
            KeyError: no handler is registered for ``queue``.
        """
        spec = next((s for s in self.handlers if s.queue == queue), None)
        if spec is None:
            raise KeyError(queue)
        return QueueTopology(
            queue=queue,
            queue_type=spec.queue_type,
            retry_delays=self.settings.retry_delays,
            arguments=spec.queue_arguments,
        )

    # -- life cycle ---------------------------------------------------------

    async def __aenter__(self) -> ReliableConsumer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Connect, declare topologies, and start consuming every registered queue.

        Raises:
            BrokerUnavailable: no broker address accepted a connection.
            ConsumerError: no handlers, or a queue could not be declared/consumed.
            ClosedError: the consumer was stopped.
        """
        if self._started:
            return
        if self._stopping:
            raise ClosedError("consumer is stopped")
        if not self.handlers:
            raise ConsumerError("no handlers registered")
        self._started = True
        self._idle = asyncio.Event()
        self._idle.set()
        self._stop_requested = asyncio.Event()
        if self.settings.prefetch == 0:
            self._log.warning("unlimited_prefetch", hint="memory use is unbounded")
        lease = self.settings.effective_dedup_lease
        timeout = self.settings.handler_timeout
        if timeout is not None and lease <= timeout and self._uses_dedup():
            self._log.warning(
                "dedup_lease_shorter_than_handler_timeout",
                dedup_lease=lease,
                handler_timeout=timeout,
                hint="a slow handler's message may run twice at once",
            )
        for spec in self.handlers:
            store = self.dedup_store(spec.queue)
            gate = None
            if store is not None:
                gate = DedupGate(
                    store,
                    lease=lease,
                    owner_prefix=self._owner_prefix,
                    metrics=self._metrics,
                    queue=spec.queue,
                )
            self._routes[spec.queue] = Route(
                spec, self.settings, self._metrics, self._supervisor.name, gate
            )
        try:
            self._shared.publisher = ReliablePublisher(
                self._connection_settings,
                settings=self._publisher_settings,
                registry=self._registry,
                metrics_prefix=self._metrics_prefix,
            )
            await self._shared.publisher.start()
            await self._supervisor.start()
            loop = asyncio.get_running_loop()
            for route in self._routes.values():
                await self._open_session(route, first=True)
                route.keeper = loop.create_task(
                    self._keep_route(route), name=f"reliable_mq:consume:{route.queue}"
                )
        except BaseException:
            await self._close_resources()
            self._stopping = True
            raise
        if self.settings.handler_timeout is not None:
            self._watchdog_task = asyncio.get_running_loop().create_task(
                self._watchdog(self.settings.handler_timeout), name="reliable_mq:watchdog"
            )
        self._log.info("consumer_started", queues=list(self._routes))

    async def run(self) -> None:
        """Start, consume until `stop()` or SIGTERM/SIGINT, then shut down gracefully.

        Signal handlers are installed only while ``run()`` runs (main thread
        only) and the previous ones are restored afterwards.
        """
        await self.start()
        assert self._stop_requested is not None
        restore = self._install_signal_handlers()
        try:
            await self._stop_requested.wait()
        finally:
            restore()
            await self.stop()

    def request_stop(self) -> None:
        """Ask a running `run()` to stop (safe from a signal handler or callback)."""
        if self._stop_requested is not None:
            self._stop_requested.set()

    async def stop(self, grace: float | None = None) -> None:
        """Stop gracefully: cancel the consumers, let handlers finish, settle, close.

        Handlers still running after ``grace`` seconds (default
        ``settings.shutdown_grace``) are cancelled and their messages requeued.
        Safe to call more than once and concurrently.
        """
        if self._stop_requested is not None:
            self._stop_requested.set()
        if self._stop_task is None:
            self._stopping = True
            if not self._started:
                return
            self._stop_task = asyncio.get_running_loop().create_task(
                self._shutdown(self.settings.shutdown_grace if grace is None else grace)
            )
        await asyncio.shield(self._stop_task)

    def _install_signal_handlers(self) -> Callable[[], None]:
        loop = asyncio.get_running_loop()
        installed: list[tuple[signal.Signals, Any]] = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                previous = signal.getsignal(sig)
                loop.add_signal_handler(sig, self._on_signal, sig)
            except (ValueError, RuntimeError, NotImplementedError):
                continue  # not the main thread, or no signal support
            installed.append((sig, previous))

        def restore() -> None:
            for sig, previous in installed:
                with contextlib.suppress(ValueError, RuntimeError):
                    loop.remove_signal_handler(sig)
                    signal.signal(sig, previous)

        return restore

    def _on_signal(self, sig: signal.Signals) -> None:
        self._log.info("stop_signal", signal=sig.name)
        self.request_stop()

    async def _shutdown(self, grace: float) -> None:
        self._log.info("consumer_stopping", in_progress=self._active, grace=grace)
        # 1. No new deliveries.
        for route in self._routes.values():
            session = route.session
            if session is not None and session.alive and session.consumer_tag:
                with contextlib.suppress(*CHANNEL_ERRORS):
                    async with asyncio.timeout(5):
                        await session.channel.basic_cancel(session.consumer_tag)
        # 2. In-flight handlers get the grace period.
        assert self._idle is not None
        if self._active:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace):
                    await self._idle.wait()
        # 3. The rest are requeued and cancelled; every batched ack is flushed.
        for route in self._routes.values():
            session = route.session
            if session is None:
                continue
            abandoned = [item for item in session.inflight.values() if not item[0].settled]
            for delivery, task in abandoned:
                if delivery.claim("requeue"):
                    self._shared.requeued += 1
                    route.metrics.requeued.inc()
                    await session.nack(delivery.delivery_tag, requeue=True)
                if task is not None:
                    task.cancel()
            if abandoned:
                self._log.warning("shutdown_requeued", queue=route.queue, count=len(abandoned))
            if session.flush_handle is not None:
                session.flush_handle.cancel()
                session.flush_handle = None
            await session.flush(stragglers=True, wait=True)
        flushes = [t for r in self._routes.values() if r.session for t in r.session.flush_tasks]
        if flushes:
            _, stuck = await asyncio.wait(flushes, timeout=5)
            for task in stuck:
                task.cancel()
        await self._close_resources()
        self._log.info("consumer_stopped", **self.stats()._asdict())

    async def _close_resources(self) -> None:
        if self._watchdog_task is not None:
            self._watchdog_task.cancel()
            await asyncio.gather(self._watchdog_task, return_exceptions=True)
        for route in self._routes.values():
            if route.keeper is not None:
                route.keeper.cancel()
                await asyncio.gather(route.keeper, return_exceptions=True)
        if self._shared.publisher is not None:
            await self._shared.publisher.close()
        await self._supervisor.close()
        for route in self._routes.values():
            if route.session is not None:
                route.session.end()
        for route in self._routes.values():
            if route.dedup is not None:
                await route.dedup.drain(5.0)
        if self._owned_dedup is not None:
            await self._owned_dedup.close()

    async def _watchdog(self, timeout: float) -> None:
        """Cancel handlers running past ``handler_timeout`` (checked every tenth of it)."""
        tick = min(max(timeout / 10, 0.01), 1.0)
        while True:
            await asyncio.sleep(tick)
            now = time.perf_counter()
            for route in self._routes.values():
                session = route.session
                if session is None or not session.running:
                    continue
                for tag, (task, deadline) in list(session.running.items()):
                    if now >= deadline and tag not in session.expired:
                        session.expired.add(tag)
                        task.cancel()

    def _is_stopping(self) -> bool:
        """Re-read the flag (it changes while we await)."""
        return self._stopping

    # -- channels -------------------------------------------------------------

    async def _open_session(self, route: Route, *, first: bool = False) -> None:
        connection = await self._supervisor.wait_connected()
        aio_channel = None
        try:
            async with asyncio.timeout(self._connection_settings.connect_timeout):
                check = await prepare_topology(
                    connection, route.topology, declare=route.spec.declare
                )
                aio_channel = await connection.channel(publisher_confirms=False)
                channel = cast(Channel, await aio_channel.get_underlay_channel())
                await channel.basic_qos(prefetch_count=self.settings.prefetch)
                session = Session(self._shared, route, channel)
                ok = await channel.basic_consume(
                    route.queue, partial(self._on_message, route, session), no_ack=False
                )
        except BaseException as exc:
            if aio_channel is not None and not aio_channel.is_closed:
                with contextlib.suppress(*CHANNEL_ERRORS, asyncio.CancelledError):
                    async with asyncio.timeout(2):
                        await aio_channel.close()
            if first and isinstance(exc, aiormq.exceptions.ChannelClosed):
                raise ConsumerError(f"cannot consume {route.queue!r}: {exc}") from exc
            raise
        session.consumer_tag = ok.consumer_tag
        route.session = session
        route.ready.set()
        if first:
            if check.adopted:
                route.log.warning("queue_used_as_is", detail=check.warning(route.topology))
            route.log.info("consuming", prefetch=self.settings.prefetch, messages=check.messages)
        else:
            route.log.debug("consuming", consumer_tag=ok.consumer_tag)

    async def _wait_session_end(self, session: Session) -> str:
        """Wait until the channel closes, or the broker cancels our consumer.

        A broker-side ``basic.cancel`` (the queue was deleted, a quorum leader
        moved) leaves the channel open but silent: we close it and start over.
        """
        closing = session.channel.closing
        while True:
            done, _ = await asyncio.wait((closing,), timeout=1.0)
            if done:
                if closing.cancelled():
                    return "closed"
                exc = closing.exception()
                return repr(exc) if exc is not None else "closed"
            if (
                not self._is_stopping()
                and session.consumer_tag is not None
                and session.consumer_tag not in session.channel.consumers
            ):
                session.alive = False
                with contextlib.suppress(*CHANNEL_ERRORS):
                    async with asyncio.timeout(5):
                        await session.channel.close()
                return "consumer cancelled by the broker"

    async def _keep_route(self, route: Route) -> None:
        """Wait for the route's channel to die; open a new one until stopped."""
        failures = 0
        while not self._stopping:
            session = route.session
            if session is not None and session.alive:
                reason = await self._wait_session_end(session)
                session.end()
                route.ready.clear()
                if self._is_stopping():
                    return
                route.log.warning(
                    "consumer_channel_lost", reason=reason[:300], in_flight=len(session.inflight)
                )
            try:
                await self._open_session(route)
            except ClosedError:
                return
            except _REOPEN_ERRORS as exc:
                failures += 1
                route.log.info("consumer_channel_open_failed", error=repr(exc), attempt=failures)
                await asyncio.sleep(min(0.1 * 2**failures, 5.0))
                continue
            failures = 0
            self._reopens += 1
            route.log.info("consumer_channel_recovered")

    # -- the hot path ---------------------------------------------------------------

    async def _on_message(self, route: Route, session: Session, message: DeliveredMessage) -> None:
        frame = message.delivery
        tag = cast(int, frame.delivery_tag)  # type: ignore[union-attr]
        session.tracker.delivered(tag)
        props = message.header.properties
        headers: Mapping[str, Any] = props.headers or {}
        attempt = int_header(headers, ATTEMPT_HEADER) or 1
        if route.quorum:
            attempt += int_header(headers, "x-delivery-count") or 0
        redelivered = bool(frame.redelivered)  # type: ignore[union-attr]
        delivery = Delivery(
            body=message.body,
            message_id=props.message_id or "",
            headers=headers,
            redelivered=redelivered,
            attempt=attempt,
            queue=route.queue,
            exchange=frame.exchange or "",  # type: ignore[union-attr]
            routing_key=frame.routing_key or "",  # type: ignore[union-attr]
            content_type=None
            if headers and NO_CONTENT_TYPE_HEADER in headers
            else props.content_type,
            correlation_id=props.correlation_id,
            reply_to=props.reply_to,
            delivery_tag=tag,
            properties=props,
            settler=session,
        )
        self._delivered += 1
        metrics = route.metrics
        if redelivered:
            metrics.redeliveries.inc()
        if self._stopping:  # raced the basic.cancel: give it back at once
            if delivery.claim("requeue"):
                self._shared.requeued += 1
                metrics.requeued.inc()
                await session.nack(tag, requeue=True)
            return
        task = asyncio.current_task()
        session.inflight[tag] = (delivery, task)
        self._active += 1
        self._max_active = max(self._max_active, self._active)
        assert self._idle is not None
        self._idle.clear()
        try:
            if route.semaphore is None:
                await self._process(route, session, delivery, task)
            else:
                async with route.semaphore:
                    await self._process(route, session, delivery, task)
        finally:
            session.inflight.pop(tag, None)
            self._active -= 1
            if not self._active:
                self._idle.set()

    async def _process(
        self,
        route: Route,
        session: Session,
        delivery: Delivery,
        task: asyncio.Task[Any] | None,
    ) -> None:
        spec = route.spec
        structlog.contextvars.bind_contextvars(
            queue=delivery.queue, message_id=delivery.message_id, attempt=delivery.attempt
        )
        if delivery.attempt > self.settings.max_attempts:
            if delivery.claim("dead_letter"):
                await session.settle_dead_letter(
                    delivery,
                    "max_attempts",
                    None,
                    detail=f"delivered {delivery.attempt} times, max_attempts="
                    f"{self.settings.max_attempts}",
                )
            return
        gate = route.dedup
        if gate is not None:
            if not delivery.message_id:
                gate.unkeyed()
            else:
                claimed = (
                    gate.claim_nowait(delivery)
                    if gate.nowait is not None
                    else await gate.claim(delivery)
                )
                if claimed is not ClaimResult.CLAIMED:
                    await self._unclaimed(session, gate, delivery, claimed)
                    return
        body: Any = None
        if spec.decode is not None:
            try:
                body = spec.decode(delivery.body, delivery.content_type)
            except BodyDecodeError as exc:
                if delivery.claim("dead_letter"):
                    await session.settle_dead_letter(delivery, "invalid_body", exc)
                return
        policy = spec.ack_policy
        if policy is AckPolicy.ACK_FIRST and delivery.claim("ack"):
            await session.ack(delivery.delivery_tag)
        func = spec.func
        if spec.decode is None:
            coro = func(delivery)
        elif spec.wants_delivery:
            coro = func(body, delivery)
        else:
            coro = func(body)
        metrics = route.metrics
        metrics.in_progress.inc()
        started = time.perf_counter()
        error: BaseException | None = None
        timed_out = False
        tag = delivery.delivery_tag
        handler_timeout = self.settings.handler_timeout
        if handler_timeout is not None and task is not None:
            # Enforced by _watchdog: far cheaper than asyncio.timeout() per delivery.
            session.running[tag] = (task, started + handler_timeout)
        try:
            await coro
        except asyncio.CancelledError:
            if tag in session.expired:  # our watchdog, not a shutdown or a dead channel
                timed_out = True
            else:
                # The channel died (aiormq cancels its consumer tasks) or shutdown
                # gave up on this handler; either way the broker requeues it.
                if not delivery.settled and session.dead():
                    delivery.claim("stale")
                    session._stale(1)
                if gate is not None:
                    gate.release_soon(delivery)
                raise
        except Exception as exc:
            error = exc
        finally:
            metrics.in_progress.dec()
            metrics.duration.observe(time.perf_counter() - started)
            if handler_timeout is not None:
                session.running.pop(tag, None)
        if tag in session.expired:
            session.expired.discard(tag)
            timed_out = True
            if task is not None:
                task.uncancel()
        await self._settle_outcome(session, delivery, policy, error, timed_out)
        if gate is not None and delivery._dedup_owner is not None:
            # Settled before the handler ended (ACK_FIRST, or by the handler).
            if error is None and not timed_out and delivery.outcome == "ack":
                await gate.complete(delivery)
            else:
                await gate.release(delivery)

    async def _unclaimed(
        self,
        session: Session,
        gate: DedupGate,
        delivery: Delivery,
        claimed: ClaimResult | None,
    ) -> None:
        """Settle a delivery whose id was done, busy, or not claimable (store down)."""
        if claimed is ClaimResult.DONE:
            if delivery.claim("duplicate"):
                self._shared.duplicates += 1
                gate.duplicate.inc()
                gate.skipped.inc()
                delivery_log(delivery).debug("duplicate_skipped")
                await session.ack(delivery.delivery_tag, count=False)
            return
        if claimed is ClaimResult.BUSY:
            gate.busy()
            reason = "message id claimed by another consumer"
        else:
            reason = "dedup store unavailable"
        if delivery.claim("defer"):
            await session.settle_defer(delivery, reason)

    async def _settle_outcome(
        self,
        session: Session,
        delivery: Delivery,
        policy: AckPolicy,
        error: BaseException | None,
        timed_out: bool,
    ) -> None:
        if error is None and not timed_out:
            if not delivery.settled:
                if policy is AckPolicy.MANUAL:
                    delivery_log(delivery).warning("handler_did_not_settle")
                    if delivery.claim("retry"):
                        await session.settle_retry(delivery, "handler did not settle", None, None)
                elif delivery.claim("ack"):
                    if delivery._dedup_owner is None:
                        await session.ack(delivery.delivery_tag)
                    else:  # mark the id done first
                        await session.settle_ack(delivery)
            return
        log = delivery_log(delivery)
        if isinstance(error, AlreadyProcessed) and not delivery.settled:
            # An exactly-once effect (SQLiteDedupStore.run_once) found the id
            # done: another copy committed first. Ack it as a duplicate.
            if delivery.claim("duplicate"):
                gate = session.route.dedup
                if gate is not None:
                    await gate.complete(delivery)
                metrics = session.route.metrics.metrics
                metrics.deliveries.labels(delivery.queue, "duplicate").inc()
                metrics.duplicates_skipped.labels(delivery.queue).inc()
                self._shared.duplicates += 1
                log.debug("duplicate_skipped", by="handler")
                await session.ack(delivery.delivery_tag, count=False)
            return
        if delivery.settled:
            if error is not None and not isinstance(error, (Retry, Reject)):
                log.warning("handler_failed_after_settle", error=repr(error))
            return
        if timed_out:
            timeout_error = TimeoutError(
                f"handler exceeded handler_timeout={self.settings.handler_timeout}s"
            )
            log.warning("handler_timeout", seconds=self.settings.handler_timeout)
            if policy is AckPolicy.DEAD_LETTER_ON_ERROR:
                if delivery.claim("dead_letter"):
                    await session.settle_dead_letter(delivery, "handler_timeout", timeout_error)
            elif delivery.claim("retry"):
                await session.settle_retry(delivery, "handler_timeout", None, timeout_error)
            return
        assert error is not None
        if isinstance(error, Retry):
            if delivery.claim("retry"):
                await session.settle_retry(delivery, error.reason, error.delay, error)
        elif isinstance(error, Reject):
            if delivery.claim("dead_letter"):
                await session.settle_dead_letter(delivery, "rejected", error)
        elif policy is AckPolicy.ACK_FIRST:
            log.error("handler_failed", error=repr(error), exc_info=error)
        elif policy is AckPolicy.DEAD_LETTER_ON_ERROR:
            log.warning("handler_failed", error=repr(error), exc_info=error)
            if delivery.claim("dead_letter"):
                await session.settle_dead_letter(delivery, "handler_error", error)
        else:
            log.warning("handler_failed", error=repr(error), exc_info=error)
            if delivery.claim("retry"):
                await session.settle_retry(delivery, "handler_error", None, error)
