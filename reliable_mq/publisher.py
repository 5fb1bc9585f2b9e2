"""ReliablePublisher: publisher confirms as a stream, republished until confirmed.

Every ``publish()`` holds one slot of a bounded window from the moment it is
accepted until its outcome is final, so memory stays bounded however many
callers there are. The hot path goes one layer below aio-pika's objects, to
aiormq's ``Channel.basic_publish``: aiormq already maps delivery tags to
futures and fans out ``multiple=true`` acks and nacks, so we do not keep a
second tag table; we react to each message's outcome.

Outcomes per message:

* ``basic.ack``: confirmed, ``publish()`` returns a `PublishResult`.
* ``basic.nack``: republished with backoff, same ``message_id``, up to
  ``max_attempts``; then [`PublishGaveUp`][reliable_mq.errors.PublishGaveUp].
* ``basic.return`` (mandatory): [`PublishUnroutable`][reliable_mq.errors.PublishUnroutable],
  not retried.
* channel or connection lost: republished on the next channel, in the original
  order, never twice in flight on one channel; the caller keeps waiting.
* deadline passed: [`PublishTimeout`][reliable_mq.errors.PublishTimeout].
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiormq
from aiormq import Channel
from prometheus_client import CollectorRegistry
from pydantic import SecretStr
from typing_extensions import Unpack

from ._confirm_channel import LOST_ERRORS, Aborted, ConfirmChannel
from ._outgoing import MessageOptions, Outgoing, encode_message
from ._window import Window
from .connection import ConnectionSupervisor
from .errors import (
    ClosedError,
    ExchangeNotFound,
    FlushTimeout,
    InvalidMessage,
    PublishAborted,
    PublishError,
    PublishGaveUp,
    PublishTimeout,
    PublishUnroutable,
)
from .log import get_logger
from .metrics import Metrics, exchange_label
from .outcomes import PendingPublish, PublisherStats, PublishResult
from .settings import ConnectionSettings, PublisherSettings

__all__ = ("PendingPublish", "PublishResult", "PublisherStats", "ReliablePublisher")


class _ExchangeMetrics:
    """The per-exchange children of the publisher's collectors.

    The two per-message counters are counted in plain ints and added to
    Prometheus on each watchdog tick (every 50 ms) and on close: a locked
    ``inc()`` per message was a visible share of the hot path.
    """

    __slots__ = (
        "confirmed",
        "latency",
        "nacked",
        "pending_confirmed",
        "pending_published",
        "published",
        "returned",
    )

    def __init__(self, metrics: Metrics, exchange: str) -> None:
        label = exchange_label(exchange)
        self.published = metrics.published.labels(label)
        self.confirmed = metrics.confirmed.labels(label)
        self.nacked = metrics.nacked.labels(label)
        self.returned = metrics.returned.labels(label)
        self.latency = metrics.confirm_latency.labels(label)
        self.pending_published = 0
        self.pending_confirmed = 0

    def flush(self) -> None:
        if self.pending_published:
            self.published.inc(self.pending_published)
            self.pending_published = 0
        if self.pending_confirmed:
            self.confirmed.inc(self.pending_confirmed)
            self.pending_confirmed = 0


class ReliablePublisher:
    """Publishes with confirms, republishes until confirmed, never waits forever.

    Use it as an async context manager::

        async with ReliablePublisher("amqp://guest:guest@127.0.0.1/") as publisher:
            result = await publisher.publish({"order": 1}, routing_key="orders")

    Args:
        connection: an AMQP URL (several, comma separated, fail over), or
            `ConnectionSettings`; default: from ``RELIABLE_MQ_*`` variables.
        settings: window, deadlines and retry policy; default: from
            ``RELIABLE_MQ_PUBLISHER_*`` variables.
        registry: the Prometheus registry for metrics (default: the global one).
        metrics_prefix: the metric name prefix.
    """

    def __init__(
        self,
        connection: str | ConnectionSettings | None = None,
        *,
        settings: PublisherSettings | None = None,
        registry: CollectorRegistry | None = None,
        metrics_prefix: str = "reliable_mq",
    ) -> None:
        if connection is None:
            connection = ConnectionSettings()
        elif isinstance(connection, str):
            connection = ConnectionSettings(url=SecretStr(connection))
        self.settings = settings if settings is not None else PublisherSettings()
        self._metrics = Metrics.on(registry, metrics_prefix)
        self._supervisor = ConnectionSupervisor(connection, role="publisher", metrics=self._metrics)
        self._log = get_logger(__name__).bind(connection=self._supervisor.name)
        self._window = Window(self.settings.max_in_flight)
        self._in_flight_gauge = self._metrics.in_flight.labels(self._supervisor.name)
        self._labelled: dict[str, _ExchangeMetrics] = {}
        self._confirm = ConfirmChannel(
            self._supervisor,
            open_timeout=connection.connect_timeout,
            log=self._log,
            needed=lambda: not self._closed or self._outstanding > 0,
        )
        self._watchdog: asyncio.Task[None] | None = None
        self._started = False
        self._closed = False
        self._aborting = False
        self._seq = 0
        self._outstanding = 0
        self._idle: asyncio.Event | None = None
        self._busy_ids: dict[str, list[asyncio.Future[None]] | None] = {}
        self._published = self._confirmed = self._nacked = self._returned = 0
        self._republished = self._failed = 0

    # -- life cycle ---------------------------------------------------------

    async def __aenter__(self) -> ReliablePublisher:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Connect and open the confirm channel.

        Raises:
            BrokerUnavailable: no broker address accepted a connection.
        """
        if self._started:
            return
        if self._closed:
            raise ClosedError("publisher is closed")
        self._started = True
        self._idle = asyncio.Event()
        self._idle.set()
        self._metrics.window_size.labels(self._supervisor.name).set(self.settings.max_in_flight)
        await self._supervisor.start()
        self._watchdog = asyncio.get_running_loop().create_task(
            self._watch_deadlines(), name=f"reliable_mq:{self._supervisor.name}:deadlines"
        )
        try:
            await self._confirm.start()
        except BaseException:
            await self._shutdown()
            raise

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until every accepted message has a final outcome.

        Raises:
            FlushTimeout: ``timeout`` seconds passed first (the messages stay in flight).
        """
        if self._idle is None or self._outstanding == 0:
            return
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        except TimeoutError:
            raise FlushTimeout(
                f"{self._outstanding} messages still unconfirmed after {timeout}s"
            ) from None

    async def close(self, timeout: float | None = None) -> None:
        """Stop taking messages, wait for outstanding confirms, then close.

        Messages still unconfirmed after ``timeout`` (default
        ``settings.close_timeout``) fail with `PublishAborted`; nothing is
        dropped silently.
        """
        if self._closed:
            return
        self._closed = True
        if not self._started:
            return
        wait = self.settings.close_timeout if timeout is None else timeout
        try:
            await self.flush(wait)
        except FlushTimeout:
            self._log.warning("close_abandoning_messages", outstanding=self._outstanding)
            await self._abort_outstanding()
        await self._shutdown()

    async def _abort_outstanding(self) -> None:
        self._aborting = True
        self._window.fail_waiters(Aborted())
        self._confirm.fail_waiters(Aborted())
        # Reject every pending confirm now, without a round trip: on a stalled
        # link a polite channel.close() would wait for the broker's reply.
        await self._confirm.reject_pending(Aborted())
        assert self._idle is not None
        try:
            async with asyncio.timeout(5):
                await self._idle.wait()
        except TimeoutError:  # pragma: no cover - defensive
            self._log.error("close_abort_stuck", outstanding=self._outstanding)

    async def _shutdown(self) -> None:
        self._closed = True
        await self._confirm.close()
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
        self._flush_metrics()
        await self._supervisor.close(timeout=1.0 if self._aborting else 5.0)

    # -- public publishing API ----------------------------------------------

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
            **options: message properties, see `MessageOptions`
                (``message_id``, ``headers``, ``persistent``, ``mandatory``...).

        Raises:
            PublishUnroutable: returned by the broker (mandatory, no queue bound).
            ExchangeNotFound: the exchange does not exist.
            PublishGaveUp: nacked or unconfirmed ``max_attempts`` times.
            PublishTimeout: the deadline passed; the outcome is unknown.
            PublishAborted: ``close()`` gave up waiting for it.
            MessageTooLarge, InvalidMessage, InvalidBody: nothing was sent.
            ClosedError: the publisher is closed or not started.
        """
        return await self._deliver(self._prepare(body, routing_key, exchange, timeout, options))

    async def enqueue(
        self,
        body: Any,
        *,
        routing_key: str,
        exchange: str = "",
        timeout: float | None = None,
        **options: Unpack[MessageOptions],
    ) -> PendingPublish:
        """Like `publish()`, but return as soon as the message is in flight.

        It waits for a window slot (that is the backpressure), writes the first
        attempt, and returns a `PendingPublish` to await for the outcome.
        Errors that happen before the message is in flight are raised here.
        """
        out = self._prepare(body, routing_key, exchange, timeout, options)
        loop = asyncio.get_running_loop()
        out.sent = loop.create_future()
        task = loop.create_task(self._deliver(out))
        task.add_done_callback(_retrieve)
        try:
            await out.sent  # resolved once written, or when the task ends early
        except asyncio.CancelledError:
            task.cancel()
            raise
        if out.attempts == 0 and task.done():
            task.result()  # raises the error that stopped it before sending
        return PendingPublish(out.message_id, task)

    @property
    def in_flight(self) -> int:
        """Messages holding a window slot now."""
        return self._window.taken

    def stats(self) -> PublisherStats:
        return PublisherStats(
            published=self._published,
            confirmed=self._confirmed,
            nacked=self._nacked,
            returned=self._returned,
            republished=self._republished,
            failed=self._failed,
            in_flight=self._window.taken,
            max_in_flight_seen=self._window.high_water,
            channel_generation=self._confirm.generation,
        )

    # -- message preparation --------------------------------------------------

    def _prepare(
        self,
        body: Any,
        routing_key: str,
        exchange: str,
        timeout: float | None,
        options: MessageOptions,
    ) -> Outgoing:
        if self._closed or not self._started:
            raise ClosedError("publisher is closed" if self._closed else "publisher not started")
        settings = self.settings
        deadline_in = settings.publish_timeout if timeout is None else timeout
        if deadline_in <= 0:
            raise InvalidMessage("timeout must be positive")
        message_id, payload, properties = encode_message(
            settings, body, routing_key=routing_key, exchange=exchange, options=options
        )
        self._seq += 1
        self._outstanding += 1
        if self._outstanding == 1:
            assert self._idle is not None
            self._idle.clear()
        self._published += 1
        self._exchange_metrics(exchange).pending_published += 1
        return Outgoing(
            seq=self._seq,
            message_id=message_id,
            body=payload,
            properties=properties,
            exchange=exchange,
            routing_key=routing_key,
            mandatory=settings.mandatory
            if options.get("mandatory") is None
            else bool(options["mandatory"]),
            deadline=asyncio.get_running_loop().time() + deadline_in,
            started=time.monotonic(),
        )

    def _exchange_metrics(self, exchange: str) -> _ExchangeMetrics:
        """Labelled children cached per exchange: ``labels()`` is slow on a hot path."""
        children = self._labelled.get(exchange)
        if children is None:
            children = self._labelled[exchange] = _ExchangeMetrics(self._metrics, exchange)
        return children

    # -- delivery -------------------------------------------------------------

    async def _deliver(self, out: Outgoing) -> PublishResult:
        try:
            if out.message_id in self._busy_ids:
                await self._wait_for_same_id(out)
            self._busy_ids[out.message_id] = None
            try:
                await self._take_slot(out)
                try:
                    return await self._send_until_final(out)
                finally:
                    self._window.release()
            finally:
                for waiter in self._busy_ids.pop(out.message_id, None) or ():
                    if not waiter.done():
                        waiter.set_result(None)
        except PublishError as exc:
            self._failed += 1
            self._metrics.publish_failed.labels(out.label, type(exc).__name__).inc()
            self._log.warning(
                "publish_failed",
                message_id=out.message_id,
                exchange=out.exchange,
                routing_key=out.routing_key,
                attempts=out.attempts,
                error=type(exc).__name__,
                reason=str(exc),
            )
            raise
        finally:
            if out.sent is not None and not out.sent.done():
                out.sent.set_result(None)
            self._outstanding -= 1
            if self._outstanding == 0 and self._idle is not None:
                self._idle.set()
                self._flush_metrics()  # a burst ended: make the counters exact now

    async def _wait_for_same_id(self, out: Outgoing) -> None:
        """Two publishes of one message_id never overlap (aiormq maps returns by id)."""
        loop = asyncio.get_running_loop()
        while out.message_id in self._busy_ids:
            waiter: asyncio.Future[None] = loop.create_future()
            waiters = self._busy_ids[out.message_id]
            if waiters is None:
                waiters = self._busy_ids[out.message_id] = []
            waiters.append(waiter)
            try:
                async with asyncio.timeout_at(out.deadline):
                    await waiter
            except TimeoutError:
                raise self._timeout_error(out) from None

    async def _take_slot(self, out: Outgoing) -> None:
        if self._window.try_acquire():
            return
        try:
            await self._window.acquire(out.deadline)
        except TimeoutError:
            raise self._timeout_error(out) from None
        except Aborted:
            raise self._aborted_error(out) from None

    async def _send_until_final(self, out: Outgoing) -> PublishResult:
        loop = asyncio.get_running_loop()
        confirm_timeout = self.settings.confirm_timeout
        while True:
            channel = self._confirm.channel
            if channel is None or self._aborting:
                channel = await self._wait_for_channel(out)
            out.attempts += 1
            if out.attempts > 1:
                self._republished += 1
                self._metrics.republished.labels(out.label, out.retry_reason).inc()
                self._log.info(
                    "republish",
                    message_id=out.message_id,
                    routing_key=out.routing_key,
                    attempt=out.attempts,
                    reason=out.retry_reason,
                )
            sent_at = loop.time()
            task = asyncio.current_task()
            assert task is not None
            # The watchdog interrupts the attempt at this deadline (no timer per message).
            generation = self._confirm.begin(task, min(out.deadline, sent_at + confirm_timeout))
            back_off = False
            try:
                if out.sent is not None and not out.sent.done():
                    loop.call_soon(_resolve, out.sent)
                await channel.basic_publish(
                    out.body,
                    exchange=out.exchange,
                    routing_key=out.routing_key,
                    properties=out.properties,
                    mandatory=out.mandatory,
                    wait=False,
                )
            except aiormq.exceptions.PublishError as exc:
                self._returned += 1
                self._exchange_metrics(out.exchange).returned.inc()
                if not self._return_may_be_transient(out, loop.time()):
                    frame = exc.frame
                    raise PublishUnroutable(
                        message_id=out.message_id,
                        attempts=out.attempts,
                        exchange=out.exchange,
                        routing_key=out.routing_key,
                        reply_code=getattr(frame, "reply_code", None),
                        reply_text=getattr(frame, "reply_text", None),
                    ) from None
                # Right after a reconnect a restarted broker may still be recovering
                # its durable queues: retry with backoff while the grace period lasts.
                out.returns += 1
                out.retry_reason = "returned_after_reconnect"
                back_off = True
            except aiormq.exceptions.DeliveryError:
                self._nacked += 1
                self._exchange_metrics(out.exchange).nacked.inc()
                out.failures += 1
                if out.failures >= self.settings.max_attempts:
                    raise PublishGaveUp(
                        f"nacked by the broker {out.failures} times",
                        message_id=out.message_id,
                        attempts=out.attempts,
                    ) from None
                out.retry_reason = "nack"
                if self._confirm.nacked(generation, loop.time()):
                    # RabbitMQ 3.10 (seen on 3.10.8): a channel that first published to a
                    # quorum queue while it had no leader nacks every later publish to
                    # it, even after a new leader is elected; a fresh channel works.
                    self._confirm.replace(generation)
                back_off = True  # below, once this attempt has left the channel
            except Aborted:
                raise self._aborted_error(out) from None
            except asyncio.CancelledError:
                why = self._confirm.interruption(task)
                if why is not None:
                    if task.uncancel():
                        raise  # the caller cancelled us too
                elif task.cancelling():
                    raise
                if why == "expired":
                    self._confirm_expired(out, generation)
                else:  # the keeper gave up on this channel, or aiormq cancelled the confirm
                    self._channel_lost(generation, out)
                continue
            except aiormq.exceptions.ChannelNotFoundEntity as exc:
                if _names_missing_exchange(exc, out.exchange):
                    raise ExchangeNotFound(
                        f"exchange {out.exchange!r} does not exist",
                        message_id=out.message_id,
                        attempts=out.attempts,
                    ) from None
                self._channel_lost(generation, out)
                continue
            except LOST_ERRORS:
                self._channel_lost(generation, out)
                continue
            except (TypeError, ValueError) as exc:
                if out.attempts == 1:
                    raise InvalidMessage(f"cannot encode the message: {exc}") from exc
                raise
            finally:
                self._confirm.end(task, generation)
            if back_off:
                # Outside the attempt: a channel recycled during the backoff must
                # not interrupt (cancel) it as an attempt stuck on that channel.
                await self._backoff(out)
                continue
            now = loop.time()
            self._confirm.acked(generation, now)
            self._confirmed += 1
            latency = now - sent_at
            children = self._exchange_metrics(out.exchange)
            children.pending_confirmed += 1
            children.latency.observe(latency)
            return PublishResult(
                message_id=out.message_id,
                attempts=out.attempts,
                confirm_latency=latency,
                elapsed=time.monotonic() - out.started,
            )

    def _return_may_be_transient(self, out: Outgoing, now: float) -> bool:
        """A basic.return soon after a REconnect may mean "queue not recovered yet"."""
        grace = self.settings.returns_retried_after_reconnect
        return (
            grace > 0
            and self._supervisor.generation > 1
            and now - self._supervisor.connected_at < grace
        )

    def _confirm_expired(self, out: Outgoing, generation: int) -> None:
        """No confirm by the attempt's deadline: give up, or call the channel stuck."""
        if asyncio.get_running_loop().time() >= out.deadline:
            raise self._timeout_error(out)
        confirm_timeout = self.settings.confirm_timeout
        out.failures += 1
        out.retry_reason = "confirm_timeout"
        self._log.warning(
            "confirm_timeout",
            message_id=out.message_id,
            attempt=out.attempts,
            seconds=confirm_timeout,
        )
        self._confirm.replace(generation)
        if out.failures >= self.settings.max_attempts:
            raise PublishGaveUp(
                f"not confirmed within {confirm_timeout}s, {out.failures} times",
                message_id=out.message_id,
                attempts=out.attempts,
            )

    async def _watch_deadlines(self) -> None:
        """Enforce slot and confirm deadlines in one periodic sweep."""
        tick = min(0.05, self.settings.confirm_timeout / 4)
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(tick)
            now = loop.time()
            self._window.expire(now)
            self._confirm.expire(now)
            self._flush_metrics()

    def _flush_metrics(self) -> None:
        self._in_flight_gauge.set(self._window.taken)
        for children in self._labelled.values():
            children.flush()

    async def _backoff(self, out: Outgoing) -> None:
        delay = self.settings.backoff(max(out.failures, out.returns))
        loop = asyncio.get_running_loop()
        if loop.time() + delay >= out.deadline:
            await asyncio.sleep(max(out.deadline - loop.time(), 0))
            raise self._timeout_error(out)
        await asyncio.sleep(delay)

    def _timeout_error(self, out: Outgoing) -> PublishError:
        if self._aborting:
            return self._aborted_error(out)
        return PublishTimeout(
            "deadline passed before a confirm; the broker may still have it",
            message_id=out.message_id,
            attempts=out.attempts,
        )

    def _aborted_error(self, out: Outgoing) -> PublishAborted:
        return PublishAborted(
            "publisher closed before a confirm; the broker may still have it",
            message_id=out.message_id,
            attempts=out.attempts,
        )

    async def _wait_for_channel(self, out: Outgoing) -> Channel:
        """Queue behind the reconnect; waiters are released in publish order."""
        if self._aborting:
            raise self._aborted_error(out)
        try:
            return await self._confirm.wait(out.seq, out.deadline)
        except TimeoutError:
            raise self._timeout_error(out) from None
        except Aborted:
            raise self._aborted_error(out) from None

    def _channel_lost(self, generation: int, out: Outgoing) -> None:
        out.retry_reason = "connection_lost"
        self._confirm.replace(generation)


def _names_missing_exchange(exc: BaseException, exchange: str) -> bool:
    return bool(exchange) and f"no exchange '{exchange}'" in str(exc)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Mark a background task's error as seen: it is logged and reported elsewhere."""
    if not task.cancelled():
        task.exception()
