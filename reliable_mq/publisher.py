"""ReliablePublisher: publisher confirms as a stream, republished until confirmed.

Every accepted message holds one slot of a bounded window until its outcome
is final, so memory stays bounded however many callers there are. Below the
facade, ``_publish.engine`` decides what happens to each message on every channel
event and ``_publish.stream`` owns the publish path under aiormq (coalesced writes,
confirms tracked by ranges of delivery tags).

Outcomes per message:

* ``basic.ack``: confirmed; ``publish()`` returns a [PublishResult][reliable_mq.outcomes.PublishResult].
* ``basic.nack``: republished with backoff, same ``message_id``, up to
  ``max_attempts``; then [PublishGaveUp][reliable_mq.errors.PublishGaveUp].
* ``basic.return`` (mandatory): [PublishUnroutable][reliable_mq.errors.PublishUnroutable],
  not retried.
* refused by the broker (a channel or connection close caused by this message):
  [PublishRefused][reliable_mq.errors.PublishRefused] with the reply code and
  text, not retried; a missing exchange is [ExchangeNotFound][reliable_mq.errors.ExchangeNotFound]
  and is found by a passive declare before the first publish to it.
* channel or connection lost: republished on the next channel, in the original
  order, never twice in flight on one channel; the caller keeps waiting.
* no connection for ``unavailable_timeout``: [PublishUnavailable][reliable_mq.errors.PublishUnavailable].
* deadline passed: [PublishTimeout][reliable_mq.errors.PublishTimeout].
"""

from __future__ import annotations

import asyncio
import enum
import functools
import secrets
from collections.abc import AsyncIterable, Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry
from typing_extensions import Unpack

from ._amqp.wire import check_timeout
from ._publish.batch import Batch, run_batch
from ._publish.closing import Closing, task_end
from ._publish.engine import Engine
from ._publish.exchanges import ExchangeCache
from ._publish.intake import Intake
from ._publish.outgoing import Outgoing, Preparer
from ._publish.ports import Stream, StreamEvents
from ._publish.stream import StreamKeeper
from ._publish.traced import BatchTrace
from ._tracing import Tracing, publish_ended
from .connection import ConnectionSupervisor
from .errors import (
    ClosedError,
    FlushTimeout,
    InvalidMessage,
    InvalidSettings,
    PublishError,
    ReliableMQError,
)
from .log import get_logger
from .message import Message, MessageOptions
from .metrics import Metrics, PublisherMetrics
from .outcomes import BatchResult, PendingPublish, PublisherStats, PublishResult
from .settings import ConnectionSettings, PublisherSettings

__all__ = (
    "BatchResult",
    "PendingPublish",
    "PublishResult",
    "PublisherState",
    "PublisherStats",
    "ReliablePublisher",
)

_YIELD_EVERY = 128
"""publish_many() lets the loop run (writes, confirms) after this many messages."""


class PublisherState(enum.StrEnum):
    """Where a [ReliablePublisher][reliable_mq.publisher.ReliablePublisher] is in its life."""

    IDLE = "idle"
    """Created, not started."""
    OPEN = "open"
    """Started: takes messages."""
    CLOSING = "closing"
    """``close()`` runs: no new messages, outstanding ones finish."""
    CLOSED = "closed"
    """Closed for good."""


class ReliablePublisher:
    """Publishes with confirms, republishes until confirmed, never waits forever.

    Use it as an async context manager:

    ```python
    async with ReliablePublisher("amqp://guest:guest@127.0.0.1/") as publisher:
        result = await publisher.publish({"order": 1}, routing_key="orders")
    ```

    Args:
        connection: an AMQP URL (several, comma separated, fail over), or
            [ConnectionSettings][reliable_mq.settings.ConnectionSettings]; default: from
            ``RELIABLE_MQ_*`` variables.
        settings: window, deadlines and retry policy; default: from
            ``RELIABLE_MQ_PUBLISHER_*`` variables.
        registry: the Prometheus registry for metrics (default: the global one).
        metrics_prefix: the metric name prefix.
        tracer_provider: an OpenTelemetry ``TracerProvider`` for the ``publish`` spans
            (default: the global one; none configured, no spans). See
            [Tracing](../tracing.md).
    """

    def __init__(
        self,
        connection: str | ConnectionSettings | None = None,
        *,
        settings: PublisherSettings | None = None,
        registry: CollectorRegistry | None = None,
        metrics_prefix: str = "reliable_mq",
        tracer_provider: Any | None = None,
    ) -> None:
        connection = ConnectionSettings.of(connection)
        self.settings = settings if settings is not None else PublisherSettings()
        self._metrics = Metrics.on(registry, metrics_prefix)
        self._supervisor = ConnectionSupervisor(connection, role="publisher", metrics=self._metrics)
        self._log = get_logger(__name__).bind(connection=self._supervisor.name)
        preparer = Preparer(self.settings, secrets.token_hex(8) + "-")
        self._tracing = Tracing(tracer_provider)
        self._counts: PublisherMetrics = self._metrics.for_publisher(
            self._supervisor.name, owner=self
        )
        self._intake = Intake(
            preparer, self._counts, self._tracing, lambda: self._supervisor.address.url
        )
        open_timeout = connection.connect_timeout

        def stream(events: StreamEvents, needed: Callable[[], bool]) -> Stream[Any]:
            keeper = StreamKeeper(
                self._supervisor, events, open_timeout=open_timeout, log=self._log, needed=needed
            )
            keeper.on_stopped = self._io_stopped
            return keeper

        self._engine = Engine(
            self.settings,
            preparer,
            exchanges=ExchangeCache(self._supervisor, open_timeout=open_timeout, log=self._log),
            link=self._supervisor,
            stream=stream,
            log=self._log,
            on_idle=self._flush_metrics,
        )
        self._closing = Closing(self._engine, self._log)
        self._supervisor.on_stopped = self._io_stopped
        self._watchdog: asyncio.Task[None] | None = None
        self._admitting: set[asyncio.Task[None]] = set()
        self._state = PublisherState.IDLE

    # -- life cycle ---------------------------------------------------------

    @property
    def state(self) -> PublisherState:
        return self._state

    @property
    def connected(self) -> bool:
        """True while a connection to the broker is open (False while reconnecting)."""
        return self._supervisor.connection is not None

    @property
    def connections(self) -> int:
        """Connections opened so far: 1 after `start()`, one more per reconnect.

        With [connected][reliable_mq.publisher.ReliablePublisher.connected], tells a caller
        whether the broker stayed reachable over some span: same count before
        and after, and connected at both ends.
        """
        return self._supervisor.generation

    @property
    def user(self) -> str | None:
        """The user name this publisher logs in as (None with ``auth=external``).

        RabbitMQ refuses a message whose ``user_id`` property is another name.
        """
        return self._supervisor.user

    async def __aenter__(self) -> ReliablePublisher:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Connect and open the confirm channel.

        If it fails, the publisher is closed (calls made meanwhile fail with
        ``PublishAborted``); make a new one to try again.

        Raises:
            BrokerUnavailable: no broker address accepted a connection.
            ClosedError: the publisher was closed.
        """
        if self._state is PublisherState.OPEN:
            return
        if self._state is not PublisherState.IDLE:
            raise ClosedError("publisher is closed")
        self._state = PublisherState.OPEN
        self._counts.window_size = self.settings.max_in_flight
        self._counts.flush()
        try:
            await self._supervisor.start()
            self._watchdog = asyncio.get_running_loop().create_task(
                self._watch(), name=f"reliable_mq:{self._supervisor.name}:deadlines"
            )
            self._watchdog.add_done_callback(self._watchdog_ended)
            await self._engine.start()
        except BaseException as exc:
            # Callers that came in meanwhile get their outcome; the publisher is
            # closed for good (its connection supervisor is).
            count = self._engine.abort(f"the publisher failed to start ({type(exc).__name__})")
            if count:
                self._log.error("start_failed_aborted", aborted=count, error=repr(exc)[:300])
            await self._shutdown()
            self._state = PublisherState.CLOSED
            raise

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until every message handed over has a final outcome.

        Callers still waiting for a window slot count: their messages were
        handed over too.

        Raises:
            FlushTimeout: ``timeout`` seconds passed first (the messages stay in flight).
        """
        engine = self._engine
        if engine.idle:
            return
        try:
            async with asyncio.timeout(timeout):
                await engine.wait_idle()
        except TimeoutError:
            raise FlushTimeout(
                f"{engine.pending} messages still unconfirmed after {timeout}s"
            ) from None

    async def close(self, timeout: float | None = None) -> None:
        """Stop taking messages, publish what was handed over, then close.

        New calls fail with [ClosedError][reliable_mq.errors.ClosedError] from
        the moment ``close()`` begins. Every message handed over before, including
        the callers still waiting for a window slot, keeps being published
        (republished, confirmed) for up to ``timeout`` seconds (default
        ``settings.close_timeout``). Whatever has no outcome then fails with
        [PublishAborted][reliable_mq.errors.PublishAborted], and an error
        ``close_aborted`` is logged with the count. When ``close()`` returns, every
        ``publish()``, ``enqueue()`` future, ``publish_with_callback()`` callback and
        ``publish_many()`` message has its outcome. It never waits on I/O that is
        gone: if the publisher's tasks were cancelled from outside (the event
        loop shutting down), the messages in flight fail with ``PublishAborted`` at
        once. Cancelling ``close()`` aborts the same way, then re-raises.

        Concurrent and later calls wait for the first one to finish.
        """
        closing = self._closing
        if closing.done is not None:
            await closing.done.wait()
            return
        closing.done = asyncio.Event()
        try:
            started = self._state in (PublisherState.OPEN, PublisherState.CLOSING)
            self._state = PublisherState.CLOSING
            self._engine.stop_taking()
            if started:
                try:
                    await closing.settle(
                        self.settings.close_timeout if timeout is None else timeout
                    )
                finally:
                    await self._shutdown()
        finally:
            self._state = PublisherState.CLOSED
            closing.done.set()

    def _io_stopped(self, why: str) -> None:
        """A task the publisher needs ended without ``close()`` (see `Closing.io_stopped`)."""
        if self._closing.io_stopped(why) and self._state is PublisherState.OPEN:
            self._state = PublisherState.CLOSING  # new calls: ClosedError

    def _watchdog_ended(self, task: asyncio.Task[None]) -> None:
        self._io_stopped(task_end(task, "its deadline sweep"))

    async def _shutdown(self) -> None:
        self._closing.stopping_io = True
        self._engine.stop_taking()
        for task in list(self._admitting):
            task.cancel()
        await asyncio.gather(*self._admitting, return_exceptions=True)
        await self._engine.close()
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
        self._flush_metrics()
        await self._supervisor.close(timeout=1.0 if self._engine.aborting else 5.0)

    # -- publishing ---------------------------------------------------------

    async def publish(
        self,
        body: Any,
        *,
        routing_key: str,
        exchange: str = "",
        timeout: float | None = None,
        **options: Unpack[MessageOptions],
    ) -> PublishResult:
        """Publish one message and return once the broker has confirmed it.

        Args:
            body: bytes, str, a pydantic model or JSON-able data.
            routing_key: the routing key (the queue name on the default exchange).
            exchange: the exchange name; "" is the default exchange.
            timeout: the deadline in seconds (default ``settings.publish_timeout``).
            **options: message properties, see [MessageOptions][reliable_mq.message.MessageOptions]
                (``message_id``, ``headers``, ``persistent``, ``mandatory``...).

        Raises:
            PublishUnroutable: returned by the broker (mandatory, no queue bound).
            ExchangeNotFound: the exchange does not exist.
            PublishRefused: the broker refused the message (reply code and text).
            PublishGaveUp: nacked or unconfirmed ``max_attempts`` times.
            PublishTimeout: the deadline passed; the outcome is unknown.
            PublishUnavailable: no connection for ``unavailable_timeout``.
            PublishAborted: ``close()`` gave up waiting for it.
            MessageTooLarge, InvalidMessage, InvalidBody: nothing was sent.
            ClosedError: the publisher is closed or not started.
        """
        out = self._prepare(body, routing_key, exchange, timeout, options)
        future: asyncio.Future[PublishResult] = asyncio.get_running_loop().create_future()
        out.future = future
        if not self._engine.admit_now(out):
            await self._engine.admit(out)
        return await future

    async def enqueue(
        self,
        body: Any,
        *,
        routing_key: str,
        exchange: str = "",
        timeout: float | None = None,
        **options: Unpack[MessageOptions],
    ) -> PendingPublish:
        """Like [publish][reliable_mq.publisher.ReliablePublisher.publish], but return once in flight.

        It waits for a window slot (that is the backpressure), sends the first
        attempt, and returns a [PendingPublish][reliable_mq.outcomes.PendingPublish] to
        await for the outcome. Errors that happen before the message is in
        flight are raised here.
        """
        out = self._prepare(body, routing_key, exchange, timeout, options)
        future: asyncio.Future[PublishResult] = asyncio.get_running_loop().create_future()
        out.future = future
        if not self._engine.admit_now(out):
            await self._engine.admit(out)
        return PendingPublish(out.message_id, future)

    async def _enqueue_copy(
        self,
        body: bytes,
        *,
        routing_key: str,
        properties: Mapping[str, Any],
        headers: Mapping[str, Any],
        timeout: float | None = None,
    ) -> asyncio.Future[PublishResult]:
        """Like ``enqueue()``, for a copy of a received message (the consumer's
        retry and DLQ copies, ``reliable-mq dlq move``): its properties exactly as
        ``properties`` gives them (see `reliable_mq._consume.copies.copy_properties`),
        to the default exchange, mandatory. Returns the outcome's future
        (awaiting it unshielded, as ``publish()`` does).
        """
        self._check_open()
        out = self._intake.copy(body, routing_key, properties, headers, timeout)
        future: asyncio.Future[PublishResult] = asyncio.get_running_loop().create_future()
        out.future = future
        if not self._engine.admit_now(out):
            await self._engine.admit(out)
        return future

    def publish_with_callback(
        self,
        callback: Callable[[PublishResult | None, ReliableMQError | None], None],
        body: Any,
        *,
        routing_key: str,
        exchange: str = "",
        timeout: float | None = None,
        **options: Unpack[MessageOptions],
    ) -> None:
        """Publish without a task or a future: ``callback`` gets the outcome.

        For code that runs the event loop itself, like the
        [BlockingPublisher][reliable_mq.sync.BlockingPublisher]. Call it on
        the publisher's loop; ``callback(result, None)`` or ``callback(None,
        error)`` is then called exactly once, on the loop, possibly before
        this returns (an invalid message). The errors are those of
        [publish][reliable_mq.publisher.ReliablePublisher.publish].
        """
        try:
            out = self._prepare(body, routing_key, exchange, timeout, options)
        except ReliableMQError as exc:
            callback(None, exc)
            return
        out.callback = callback
        engine = self._engine
        if not engine.admit_now(out):
            engine.hold()  # counted from now: close() waits for it like the others
            task = asyncio.get_running_loop().create_task(self._admit_for_callback(out))
            self._admitting.add(task)
            task.add_done_callback(functools.partial(self._admitted_for_callback, out))

    async def _admit_for_callback(self, out: Outgoing) -> None:
        """The slow path of ``publish_with_callback``: wait for a slot or a probe."""
        try:
            await self._engine.admit_held(out)  # held by publish_with_callback
        except PublishError as exc:  # not admitted: the engine will not call back
            _refuse(out, exc)

    def _admitted_for_callback(self, out: Outgoing, task: asyncio.Task[None]) -> None:
        """Its admission ended: a callback still owed (the task was cancelled, even
        before it ran) gets ``PublishAborted``."""
        self._admitting.discard(task)
        engine = self._engine
        if not task.cancelled() and (exc := task.exception()) is not None:
            self._log.error("publish_admission_failed", error=repr(exc))
        if out.callback is not None and not engine.owns(out):
            _refuse(out, engine.aborted_error(out))
        engine.unhold()

    async def publish_many(
        self,
        messages: Iterable[Message] | AsyncIterable[Message],
        *,
        timeout: float | None = None,
        max_failures: int | None = None,
        raise_on_error: bool = True,
    ) -> BatchResult:
        """Publish a stream of messages with confirms; return once every one has an outcome.

        The fastest form: no task or future per message, writes coalesced,
        confirms resolved by ranges. Memory stays flat for any number of
        messages (the window bounds what is in flight). A message that cannot
        be encoded, or that ends in a [PublishError][reliable_mq.errors.PublishError],
        is recorded as a failure with its index; the others go on.

        Args:
            messages: [Message][reliable_mq.message.Message] objects, from a plain or an
                async iterable (read once, lazily).
            timeout: each message's deadline in seconds from when it is read
                (default ``settings.publish_timeout``).
            max_failures: stop reading the input after this many failures
                (messages already in flight still get their outcome).
            raise_on_error: raise [PublishBatchError][reliable_mq.errors.PublishBatchError]
                (carrying the result) if any message failed.

        A batch running when ``close()`` begins was handed over: it goes on
        reading its input while ``close()``'s timeout lasts. If ``close()`` gives
        up first, the messages in flight fail with ``PublishAborted``, the next
        one read fails with ``ClosedError`` and the batch stops there
        (``stopped_early``).

        Raises:
            PublishBatchError: some messages failed and ``raise_on_error`` is set.
            InvalidMessage: ``timeout`` is not a finite positive number.
            ClosedError: the publisher is closed or not started.
        """
        self._check_open()
        if timeout is not None:
            check_timeout(timeout)
        if max_failures is not None and (
            isinstance(max_failures, bool) or not isinstance(max_failures, int) or max_failures < 1
        ):
            raise InvalidSettings("publish_many", [("max_failures", "must be an int >= 1")])
        engine = self._engine
        engine.begin_batch()  # close() waits for the whole batch: its input was handed over
        try:
            trace = self._intake.batch_trace(self.settings.trace_create_spans)
            take = functools.partial(
                self._take, timeout=timeout, max_failures=max_failures, trace=trace
            )
            batch = Batch()
            running = run_batch(messages, take, batch, raise_on_error=raise_on_error)
            return await (running if trace is None else trace.run(batch, running))
        finally:
            engine.end_batch()

    async def _take(
        self,
        batch: Batch,
        index: int,
        message: Any,
        *,
        timeout: float | None,
        max_failures: int | None,
        trace: BatchTrace | None,
    ) -> bool:
        """Read one message of a batch into flight; True when the batch must stop."""
        try:
            out = self._prepare_message(message, timeout, trace)
        except ClosedError as exc:  # close() began: the rest of the input is not read
            batch.rejected(index, getattr(message, "message_id", None) or "", exc)
            return True
        except ReliableMQError as exc:
            batch.rejected(index, getattr(exc, "message_id", ""), exc)
        else:
            out.batch = batch
            out.index = index
            batch.took()
            if not self._engine.admit_now(out):
                try:
                    await self._engine.admit(out)
                except PublishError as exc:
                    batch.failed(index, out.message_id, exc)
            elif not index % _YIELD_EVERY:
                await asyncio.sleep(0)  # let the writer and the confirms in
        return max_failures is not None and len(batch.failures) >= max_failures

    @property
    def in_flight(self) -> int:
        """Messages holding a window slot now."""
        return self._engine.in_flight

    def stats(self) -> PublisherStats:
        engine, counts = self._engine, self._counts
        return PublisherStats(
            published=counts.total("published"),
            confirmed=counts.total("confirmed"),
            nacked=counts.total("nacked"),
            returned=counts.total("returned"),
            republished=counts.total("republished"),
            failed=counts.total("failed"),
            in_flight=engine.in_flight,
            max_in_flight_seen=engine.high_water,
            channel_generation=engine.channel_generation,
        )

    # -- preparation --------------------------------------------------------------

    def _check_open(self) -> None:
        if self._state is not PublisherState.OPEN:
            if self._closing.io_gone is not None:
                raise ClosedError(f"publisher stopped: {self._closing.io_gone}")
            state = "not started" if self._state is PublisherState.IDLE else "closed"
            raise ClosedError(f"publisher is {state}")

    def _check_batch_open(self) -> None:
        """A running batch reads on while ``close()`` waits, not once it gave up."""
        if self._state is not PublisherState.CLOSING or self._engine.aborting:
            self._check_open()

    def _prepare(
        self,
        body: Any,
        routing_key: str,
        exchange: str,
        timeout: float | None,
        options: MessageOptions,
    ) -> Outgoing:
        self._check_open()
        return self._intake.message(body, routing_key, exchange, timeout, options)

    def _prepare_message(
        self, message: Any, timeout: float | None, trace: BatchTrace | None
    ) -> Outgoing:
        if not isinstance(message, Message):
            raise InvalidMessage(
                f"publish_many takes Message objects, not {type(message).__name__}"
            )
        if self._state is not PublisherState.OPEN:
            self._check_batch_open()
        return self._intake.batch_message(message, timeout, trace)

    # -- the periodic sweep -----------------------------------------------------------

    async def _watch(self) -> None:
        """Deadlines, stuck channels, outages and metrics, in one periodic sweep."""
        tick = min(0.05, self.settings.confirm_timeout / 4)
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(tick)
            self._engine.tick(loop.time())
            self._flush_metrics()

    def _flush_metrics(self) -> None:
        self._counts.in_flight = self._engine.in_flight
        self._counts.flush()  # multiprocess mode only: the gauges and counts to the files


def _refuse(out: Outgoing, error: ReliableMQError) -> None:
    """Call back a message that was never admitted (once: the callback is dropped)."""
    if out.span is not None:  # its admission never ran (cancelled first): end its span here
        publish_ended(out.span, out.message_id, out.attempts, error)
        out.span = None
    callback, out.callback = out.callback, None
    if callback is not None:
        callback(None, error)
