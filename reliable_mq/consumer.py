"""ReliableConsumer: bounded prefetch, typed handlers, acks exactly once, delayed retries.

One channel per consumed queue, opened on a connection kept by a
`ConnectionSupervisor`. The hot path sits below aio-pika's per-message objects
and below aiormq's own delivery handling (``basic_ack`` without waiting for a
drain): see `reliable_mq._amqp.inbound` for what is owned there and why.

The consumer's jobs are split by module:

* `reliable_mq._amqp.inbound`: a delivery's frames decoded, and the delivery handed
  over from its channel, in tag order;
* `reliable_mq._consume.dispatch`: one delivery from its channel to an outcome (the
  handler returned, raised, timed out, the body did not decode...);
* `reliable_mq._consume.settle`: the pure decision, ``decide(policy, outcome, attempt)``,
  and the fallback ladder for a copy that cannot be published;
* `reliable_mq._consume.session`: per channel, `Session.apply` carries a decision out
  (dedup claim, copy, frame), exactly once per delivery; frames of one channel
  leave in the order they were decided (one lock), so an individual nack is
  never overtaken by a later multiple ack;
* `reliable_mq._consume.route`: a channel per queue, reopened whenever it dies;
* this module: the public class, its life cycle and the handler watchdog.

Outcomes (see [`AckPolicy`][reliable_mq.handlers.AckPolicy]):

* return: ack (batched into ``basic.ack(multiple=true)`` over the contiguous
  prefix of finished tags, flushed by count and every ``ack_flush_interval``);
* ``Retry`` or an error: republish with confirms to the retry queue of the
  attempt (same ``message_id``, ``x-reliable-mq-attempt`` + 1), then ack;
* ``Reject``, a malformed body, or attempts used up: publish with confirms to
  the DLQ with reason headers, then ack.

A copy that cannot be published (too large once our headers are added, refused
by the broker, its queue missing) never loops: a trimmed copy is tried, then
the broker's own dead-lettering (only on a queue declared with its DLQ), then
the delivery is requeued after a bounded, growing delay with an error logged.

De-duplication (on by default, see `ReliableConsumer`): before the handler
runs, the delivery's ``message_id`` is claimed in a `DedupStore`. Done already:
ack and skip. Claimed by another consumer, or the store cannot answer: defer
through the first retry queue without counting an attempt. Success: mark done,
then ack. Failure: release the claim, then retry or dead-letter as above.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

from prometheus_client import CollectorRegistry

from ._amqp.faults import AMQP_ERRORS
from ._consume.batches import check_batch
from ._consume.dedup_gate import DedupGate
from ._consume.dispatch import Dispatcher
from ._consume.preflight import check_settings
from ._consume.route import ChannelKeeper, Route
from ._consume.session import Shared
from ._consume.threads import HandlerThreads, pool_size
from ._tracing import Tracing
from .connection import ConnectionSupervisor
from .dedup.base import DedupStore
from .dedup.memory import MemoryDedupStore
from .errors import ClosedError, ConsumerError
from .handlers import USE_CONSUMER_DEDUP, HandlerSpec, Router
from .headers import DEAD_LETTER_HEADERS
from .log import get_logger
from .metrics import Metrics
from .publisher import ReliablePublisher
from .settings import ConnectionSettings, ConsumerSettings, PublisherSettings
from .streams import refuse_stream
from .topology import QueueTopology

__all__ = (
    "DEAD_LETTER_HEADERS",
    "ConsumerStats",
    "ReliableConsumer",
)

_METRICS_INTERVAL = 0.5
"""Seconds between two flushes of the per-queue metrics (multiprocess mode only)."""


def _retrieve(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()


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
    rejected: int = 0
    """Deliveries the handler nacked without requeue (``delivery.nack(requeue=False)``)."""
    fallbacks: int = 0
    """Copies (retry, DLQ, deferral) that could not be published as built; see
    `reliable_mq_settle_fallbacks_total` for the rung taken instead."""
    threads_busy: int = 0
    """Threads running a plain ``def`` handler now, late ones included (past
    ``handler_timeout`` or a shutdown: their delivery is settled, their result
    will be discarded)."""


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
        on_channel_lost: called (on the event loop) with the queue's name each time
            one of the consumer's channels is lost while it consumes: the
            deliveries unsettled on it go back to the queue, and the consumer
            opens a new channel. Not called when the consumer stops.
        tracer_provider: an OpenTelemetry ``TracerProvider`` for the ``process``, settle
            and copies' ``publish`` spans (default: the global one; none
            configured, no spans). See [Tracing](../tracing.md).

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
        on_channel_lost: Callable[[str], None] | None = None,
        tracer_provider: Any | None = None,
        **overrides: Any,
    ) -> None:
        super().__init__()
        connection = ConnectionSettings.of(connection)
        if overrides:
            base = settings.model_dump() if settings is not None else {}
            settings = ConsumerSettings(**{**base, **overrides})
        self.settings = settings if settings is not None else ConsumerSettings()
        self._tracer_provider = tracer_provider
        self._shared = Shared(self.settings, Tracing(tracer_provider))
        self._dispatcher = Dispatcher(self._shared)
        self._connection_settings = connection
        self._publisher_settings = publisher_settings
        self._registry = registry
        self._metrics_prefix = metrics_prefix
        self._metrics = Metrics.on(registry, metrics_prefix)
        self._supervisor = ConnectionSupervisor(connection, role="consumer", metrics=self._metrics)
        self._shared.address = lambda: self._supervisor.address
        self._keeper = ChannelKeeper(
            self._supervisor, connection, self._shared, self._dispatcher.intake
        )
        self._log = get_logger(__name__).bind(connection=self._supervisor.name)
        self._routes: dict[str, Route] = {}
        self._threads: dict[str, HandlerThreads] = {}  # plain def handlers, per queue
        self._watchdog_task: asyncio.Task[None] | None = None
        self._started = False
        self._stop_task: asyncio.Task[None] | None = None
        self._stop_requested: asyncio.Event | None = None
        self._in_run = False
        self._exit_task: asyncio.Task[None] | None = None
        self._shared.on_exit = self._on_handler_exit
        self._shared.on_channel_lost = on_channel_lost
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
            and not self._shared.stopping
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
        if spec.queue_only:
            return None
        return self._dedup if spec.dedup is USE_CONSUMER_DEDUP else spec.dedup

    def _uses_dedup(self) -> bool:
        return any(self.dedup_store(spec.queue) is not None for spec in self.handlers)

    def _add_spec(self, spec: HandlerSpec) -> None:
        if self._started:
            raise ConsumerError("register handlers before start()")
        check_batch(spec, self.settings)
        super()._add_spec(spec)

    def stats(self) -> ConsumerStats:
        """What every queue's metrics counted so far (the numbers Prometheus shows), summed."""
        shared = self._shared
        counts = [route.metrics for route in self._routes.values()]

        def total(name: str) -> int:
            return sum(getattr(metrics, name) for metrics in counts)

        return ConsumerStats(
            delivered=total("delivered"),
            acked=total("acked"),
            retried=total("retried"),
            dead_lettered=total("dead_lettered"),
            requeued=total("requeued"),
            stale=total("stale"),
            ack_frames=total("ack_frames"),
            in_progress=shared.active,
            max_in_progress=shared.max_active,
            channel_reopens=self._keeper.reopens,
            duplicates=total("duplicate"),
            deferred=total("deferred"),
            rejected=total("rejected"),
            fallbacks=total("fallback_count"),
            threads_busy=sum(threads.busy for threads in self._threads.values()),
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
        if self._shared.stopping:  # checked first: a stopped consumer stays started
            raise ClosedError("consumer is stopped: a stopped consumer cannot start again")
        if self._started:
            return
        if not self.handlers:
            raise ConsumerError("no handlers registered")
        self._started = True
        self._shared.idle = asyncio.Event()
        self._shared.idle.set()
        if self._stop_requested is None:  # run() makes it first
            self._stop_requested = asyncio.Event()
        lease = check_settings(
            self.settings,
            uses_dedup=self._uses_dedup(),
            consumer_timeout=self._shared.consumer_timeout,
            log=self._log,
        )
        for spec in self.handlers:
            store = self.dedup_store(spec.queue)
            metrics = self._metrics.for_queue(spec.queue, owner=self)
            gate = None
            if store is not None:
                gate = DedupGate(
                    store, lease=lease, owner_prefix=self._owner_prefix, metrics=metrics
                )
            threads = None
            if spec.sync:
                size = pool_size(self.settings.effective_concurrency, self.settings.prefetch)
                threads = self._threads[spec.queue] = HandlerThreads(
                    size, f"reliable_mq:{spec.queue}"
                )
            self._routes[spec.queue] = Route(
                spec,
                self.settings,
                metrics,
                self._supervisor.name,
                gate,
                threads=threads,
            )
        try:
            if not all(spec.queue_only for spec in self.handlers):  # copies may be needed
                self._shared.publisher = ReliablePublisher(
                    self._connection_settings,
                    settings=self._publisher_settings,
                    registry=self._registry,
                    metrics_prefix=self._metrics_prefix,
                    tracer_provider=self._tracer_provider,
                )
                await self._shared.publisher.start()
            await self._supervisor.start()
            for queue in self._routes:  # a stream needs offsets: refused (StreamNotSupported)
                await refuse_stream(await self._supervisor.wait_connected(), queue)
            loop = asyncio.get_running_loop()
            for route in self._routes.values():
                await self._keeper.open(route, first=True)
                route.keeper = loop.create_task(
                    self._keeper.keep(route), name=f"reliable_mq:consume:{route.queue}"
                )
        except BaseException:
            await self._close_resources()
            self._shared.stopping = True
            raise
        self._watchdog_task = asyncio.get_running_loop().create_task(
            self._housekeeping(), name="reliable_mq:housekeeping"
        )
        self._log.info("consumer_started", queues=list(self._routes))

    async def run(self) -> None:
        """Start, consume until `stop` or SIGTERM/SIGINT, then shut down gracefully.

        Signal handlers are installed only while ``run()`` runs (main thread
        only) and the previous ones are restored afterwards.

        A handler (plain or async) that raises ``SystemExit`` or
        ``KeyboardInterrupt`` asks for the process to end: its delivery counts
        as one failed attempt (retried, or dead-lettered after
        ``max_attempts``), the consumer stops as on `stop` (handlers still
        running get ``shutdown_grace``, deliveries not yet in a handler are
        requeued), and then ``run()`` raises that exception, so
        ``asyncio.run(consumer.run())`` ends the process with the handler's
        exit code. Without ``run()`` (``start``/``stop``, ``async with``), the
        exception is raised in the event loop once the consumer has stopped,
        as asyncio does for these two: ``asyncio.run()`` ends with it.

        Raises:
            SystemExit: a handler raised it (the first one, if several did).
            KeyboardInterrupt: a handler raised it.
        """
        self._in_run = True
        if self._stop_requested is None:
            self._stop_requested = asyncio.Event()
        # Installed before start(): a signal while it connects or declares stops it.
        restore = self._install_signal_handlers()
        try:
            if await self._start_unless_stopped(self._stop_requested):
                try:
                    await self._stop_requested.wait()
                finally:
                    restore()
                    await self.stop()
        finally:
            restore()
            self._in_run = False
        if self._shared.exit_error is not None:
            raise self._shared.exit_error

    async def _start_unless_stopped(self, stop: asyncio.Event) -> bool:
        """`start`, abandoned if a stop is asked for (a signal) before it ends.

        Returns:
            Whether the consumer started; False: the stop came first, and the
            start was cancelled (it closes what it had opened).
        """
        starting = asyncio.ensure_future(self.start())
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait((starting, stopped), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not starting.done():
                starting.cancel()
                await asyncio.wait((starting,))
        if starting.cancelled() and stop.is_set():
            self._log.info("consumer_start_abandoned", hint="stopped while starting")
            return False
        starting.result()  # start's error, or a cancel that was not ours
        return True

    def _on_handler_exit(self, error: BaseException) -> None:
        self._log.error(
            "consumer_stopping_on_handler_exit",
            error=repr(error)[:300],
            hint="a handler raised SystemExit or KeyboardInterrupt: its delivery counts as a "
            "failed attempt; the consumer stops, then the exception goes on",
        )
        if self._in_run:
            self.request_stop()
        elif self._exit_task is None:
            task = asyncio.get_running_loop().create_task(
                self._stop_then_raise(error), name="reliable_mq:handler_exit"
            )
            # The loop ends with the exception; asyncio.run's clean-up runs this, so
            # the task is not reported as "exception was never retrieved".
            task.add_done_callback(_retrieve)
            self._exit_task = task

    async def _stop_then_raise(self, error: BaseException) -> None:
        """Stop cleanly, then let the exit out of the event loop (as asyncio would have)."""
        await self.stop()
        raise error

    def request_stop(self) -> None:
        """Ask a running `run` to stop (safe from a signal handler or callback)."""
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
            self._shared.stopping = True
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

        def restore() -> None:  # idempotent
            while installed:
                sig, previous = installed.pop()
                with contextlib.suppress(ValueError, RuntimeError):
                    loop.remove_signal_handler(sig)
                    signal.signal(sig, previous)

        return restore

    def _on_signal(self, sig: signal.Signals) -> None:
        self._log.info("stop_signal", signal=sig.name)
        self.request_stop()

    async def _shutdown(self, grace: float) -> None:
        shared = self._shared
        self._log.info("consumer_stopping", in_progress=shared.active, grace=grace)
        # 1. No new deliveries; partial batches run now.
        for route in self._routes.values():
            if route.batcher is not None:
                route.batcher.flush()
            session = route.session
            if session is not None and session.alive and session.consumer_tag:
                with contextlib.suppress(*AMQP_ERRORS):
                    async with asyncio.timeout(5):
                        await session.channel.basic_cancel(session.consumer_tag)
        # 2. In-flight handlers get the grace period.
        assert shared.idle is not None
        if shared.active:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace):
                    await shared.idle.wait()
        # 3. The rest are requeued and cancelled; every batched ack is flushed.
        for route in self._routes.values():
            session = route.session
            if session is None:
                continue
            abandoned = await session.abandon()
            if abandoned:
                self._log.warning("shutdown_requeued", queue=route.queue, count=abandoned)
            await session.final_flush()
        flushes = [t for r in self._routes.values() if r.session for t in r.session.flush_tasks]
        if flushes:
            _, stuck = await asyncio.wait(flushes, timeout=5)
            for task in stuck:
                task.cancel()
        await self._close_resources()
        self._log.info("consumer_stopped", **self.stats()._asdict())

    async def _close_resources(self) -> None:
        for queue, threads in self._threads.items():
            if busy := threads.close():
                self._log.warning(
                    "handler_threads_still_running",
                    queue=queue,
                    count=busy,
                    hint="Python cannot stop a thread: each ends when its plain def handler "
                    "returns (its result is discarded; daemon threads do not keep the "
                    "process alive)",
                )
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
        self._shared.acks.close()
        for route in self._routes.values():
            if route.dedup is not None:
                await route.dedup.drain(5.0)
        if self._owned_dedup is not None:
            await self._owned_dedup.close()
        for route in self._routes.values():
            route.metrics.flush()

    async def _housekeeping(self) -> None:
        """Flush the per-queue metrics every `_METRICS_INTERVAL` (multiprocess mode: to
        prometheus_client's files; otherwise a scrape reads them live), and
        cancel handlers running past their deadline: ``handler_timeout``, or the cut
        before the broker's ``consumer_timeout`` (checked every tenth of the shorter)."""
        while True:
            limits = [t for t in (self.settings.handler_timeout, self._shared.broker_cut) if t]
            timeout = min(limits) if limits else None
            tick = _METRICS_INTERVAL
            if timeout is not None:
                tick = min(max(timeout / 10, 0.01), tick)
            await asyncio.sleep(tick)
            now = time.perf_counter()
            for route in self._routes.values():
                route.metrics.flush()
                session = route.session
                if session is not None and timeout is not None:
                    session.expire_overdue(now)
