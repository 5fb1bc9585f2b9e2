"""Per-channel delivery state of the consumer: acks, retries and dead letters.

A `Session` lives as long as one channel of one consumed queue. Every
delivery is settled through the session it came from; once its channel is gone
(`Session.dead()`) settles are dropped and counted as stale, because the
broker has already requeued those deliveries and their tags mean nothing on
any other channel.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import aiormq
from aiormq import Channel

from ._acks import AckTracker
from ._dedup_gate import DedupGate
from .delivery import ATTEMPT_HEADER, Delivery
from .errors import ClosedError, PublishError
from .handlers import HandlerSpec
from .log import get_logger
from .metrics import Metrics
from .publisher import ReliablePublisher
from .settings import ConsumerSettings
from .topology import QueueTopology, QueueType

__all__ = (
    "CHANNEL_ERRORS",
    "DEAD_LETTER_HEADERS",
    "LAST_ERROR_HEADER",
    "NO_CONTENT_TYPE_HEADER",
    "ORIGINAL_EXCHANGE_HEADER",
    "ORIGINAL_ROUTING_KEY_HEADER",
    "Route",
    "Session",
    "Shared",
    "delivery_log",
    "int_header",
)

_H = "x-reliable-mq-"
ORIGINAL_EXCHANGE_HEADER = _H + "original-exchange"
ORIGINAL_ROUTING_KEY_HEADER = _H + "original-routing-key"
LAST_ERROR_HEADER = _H + "last-error"
NO_CONTENT_TYPE_HEADER = _H + "no-content-type"
"""Set on a republished copy whose original had no content type (the publisher
always sets one), so the copy decodes exactly like the original."""
DEAD_LETTER_HEADERS = (
    _H + "reason",
    _H + "error-type",
    _H + "error-message",
    _H + "attempts",
    _H + "queue",
    _H + "dead-lettered-at",
)
"""Headers a dead-lettered message carries: why, what raised, how often, where, when."""

CHANNEL_ERRORS: tuple[type[BaseException], ...] = (
    aiormq.exceptions.AMQPError,
    aiormq.exceptions.ChannelInvalidStateError,
    ConnectionError,
    OSError,
    TimeoutError,
    RuntimeError,
)
_STRIP_ON_REPUBLISH = ("x-delivery-count",)


class Shared:
    """What every session of one consumer shares: settings, counters, the publisher."""

    __slots__ = (
        "ack_frames",
        "acked",
        "dead_lettered",
        "deferred",
        "duplicates",
        "publisher",
        "requeued",
        "retried",
        "settings",
        "stale",
    )

    def __init__(self, settings: ConsumerSettings) -> None:
        self.settings = settings
        self.publisher: ReliablePublisher | None = None
        self.acked = self.retried = self.dead_lettered = 0
        self.requeued = self.stale = self.ack_frames = 0
        self.duplicates = self.deferred = 0


class RouteMetrics:
    """Labelled children for one queue (``labels()`` is slow on a hot path)."""

    __slots__ = (
        "ack_batches",
        "acked",
        "dead_lettered",
        "duration",
        "in_progress",
        "metrics",
        "queue",
        "redeliveries",
        "requeued",
        "retried",
        "stale",
        "stale_settles",
    )

    def __init__(self, metrics: Metrics, queue: str) -> None:
        self.metrics = metrics
        self.queue = queue
        self.acked = metrics.deliveries.labels(queue, "acked")
        self.retried = metrics.deliveries.labels(queue, "retried")
        self.dead_lettered = metrics.deliveries.labels(queue, "dead_lettered")
        self.requeued = metrics.deliveries.labels(queue, "requeued")
        self.stale = metrics.deliveries.labels(queue, "stale")
        self.redeliveries = metrics.redeliveries.labels(queue)
        self.duration = metrics.handler_duration.labels(queue)
        self.in_progress = metrics.in_progress.labels(queue)
        self.stale_settles = metrics.stale_settles.labels(queue)
        self.ack_batches = metrics.ack_batches.labels(queue)


class Route:
    """One consumed queue: its handler, topology, metrics and current session."""

    def __init__(
        self,
        spec: HandlerSpec,
        settings: ConsumerSettings,
        metrics: Metrics,
        name: str,
        dedup: DedupGate | None = None,
    ) -> None:
        self.spec = spec
        self.dedup = dedup
        self.queue = spec.queue
        self.topology = QueueTopology(
            queue=spec.queue,
            queue_type=spec.queue_type,
            retry_delays=settings.retry_delays,
            arguments=spec.queue_arguments,
        )
        self.quorum = spec.queue_type is QueueType.QUORUM
        self.metrics = RouteMetrics(metrics, spec.queue)
        limit = settings.effective_concurrency
        self.semaphore = asyncio.Semaphore(limit) if limit else None
        self.session: Session | None = None
        self.keeper: asyncio.Task[None] | None = None
        self.ready = asyncio.Event()
        self.log = get_logger(__name__).bind(connection=name, queue=spec.queue)


class Session:
    """One channel's life for one route; the `Settler` of its deliveries."""

    def __init__(self, shared: Shared, route: Route, channel: Channel) -> None:
        self.shared = shared
        self.route = route
        self.channel = channel
        self.alive = True
        self.tracker = AckTracker()
        self.lock = asyncio.Lock()
        self.inflight: dict[int, tuple[Delivery, asyncio.Task[Any] | None]] = {}
        self.running: dict[int, tuple[asyncio.Task[Any], float]] = {}  # tag: (task, deadline)
        self.expired: set[int] = set()
        self.consumer_tag: str | None = None
        self.flush_handle: asyncio.TimerHandle | None = None
        self.flush_tasks: set[asyncio.Task[None]] = set()
        self.batch = shared.settings.batch_ack
        self.batch_size = shared.settings.ack_batch_size

    def dead(self) -> bool:
        """True once the channel is gone (its delivery tags are void)."""
        return not self.alive or self.channel.is_closed

    # -- frames -------------------------------------------------------------

    def _stale(self, deliveries: int) -> None:
        self.shared.stale += deliveries
        self.route.metrics.stale_settles.inc(deliveries)
        self.route.metrics.stale.inc(deliveries)

    async def _write(self, kind: str, tag: int, deliveries: int, *, wait: bool = False) -> bool:
        """Write one settle frame; the caller holds `lock`. False if the channel is gone."""
        channel = self.channel
        if not self.alive or channel.is_closed:
            self._stale(deliveries)
            return False
        try:
            if kind == "ack":
                await channel.basic_ack(tag, multiple=False, wait=wait)
            elif kind == "ack_multiple":
                await channel.basic_ack(tag, multiple=True, wait=wait)
            elif kind == "nack_requeue":
                await channel.basic_nack(tag, multiple=False, requeue=True, wait=wait)
            else:  # "nack_drop"
                await channel.basic_nack(tag, multiple=False, requeue=False, wait=wait)
        except CHANNEL_ERRORS:
            self.alive = False
            self._stale(deliveries)
            return False
        if kind.startswith("ack"):
            self.shared.ack_frames += 1
            self.route.metrics.ack_batches.inc()
        return True

    async def _settle_single(self, kind: str, tag: int) -> None:
        """Settle ``tag`` by its own frame, unless it was settled already.

        The tracker's state changes under the same lock as the frame is written,
        so frames leave in the order the tracker decided them: a multiple ack
        decided after this settle can never overtake its frame, and one decided
        before it (while the tag was still in progress) never reaches this tag.
        """
        async with self.lock:
            if self.tracker.settle(tag):
                await self._write(kind, tag, 1)

    async def flush(self, *, stragglers: bool, wait: bool = False) -> None:
        """Send the batched acks: the finished prefix, and optionally the stragglers."""
        async with self.lock:
            tag, count = self.tracker.take_prefix()
            if tag is not None:
                await self._write("ack_multiple" if count > 1 else "ack", tag, count, wait=wait)
            if stragglers:
                for single in self.tracker.take_stragglers():
                    await self._write("ack", single, 1, wait=wait)

    def _on_flush_timer(self) -> None:
        self.flush_handle = None
        if self.tracker.pending and not self.dead():
            task = asyncio.get_running_loop().create_task(self.flush(stragglers=True))
            self.flush_tasks.add(task)
            task.add_done_callback(self.flush_tasks.discard)

    def end(self) -> None:
        """The channel is gone: stop timers and flushes (a write to a dead
        connection can block forever in aiormq's bounded write queue)."""
        self.alive = False
        if self.flush_handle is not None:
            self.flush_handle.cancel()
            self.flush_handle = None
        for task in list(self.flush_tasks):
            task.cancel()

    async def ack(self, tag: int, *, count: bool = True) -> None:
        """Ack ``tag`` (batched or now); ``count``: report it as an "acked" outcome."""
        if count:
            self.shared.acked += 1
            self.route.metrics.acked.inc()
        if self.dead():
            self._stale(1)
            return
        if self.batch:
            if not self.tracker.finish(tag):
                return
            if self.tracker.pending >= self.batch_size:
                await self.flush(stragglers=False)
            if self.tracker.pending and self.flush_handle is None:
                self.flush_handle = asyncio.get_running_loop().call_later(
                    self.shared.settings.ack_flush_interval, self._on_flush_timer
                )
        else:
            await self._settle_single("ack", tag)

    async def ack_now(self, tag: int) -> None:
        """Ack ``tag`` in its own frame, now: used after a confirmed republish, so
        a channel loss cannot leave both the copy and the original behind."""
        if self.dead():
            self._stale(1)
            return
        await self._settle_single("ack", tag)

    async def nack(self, tag: int, *, requeue: bool) -> None:
        if self.dead():
            self._stale(1)
            return
        await self._settle_single("nack_requeue" if requeue else "nack_drop", tag)

    # -- Settler protocol ------------------------------------------------------

    async def settle_ack(self, delivery: Delivery) -> None:
        # De-duplication: the id is marked done before the ack, never after.
        if delivery._dedup_owner is not None and not await self._complete(delivery):
            return
        await self.ack(delivery.delivery_tag)

    async def _complete(self, delivery: Delivery) -> bool:
        """Mark the id done; if the store stays down, requeue instead of acking."""
        gate = self.route.dedup
        assert gate is not None
        if (gate.nowait is not None and gate.complete_nowait(delivery)) or await gate.complete(
            delivery
        ):
            return True
        self.shared.requeued += 1
        self.route.metrics.requeued.inc()
        await self.nack(delivery.delivery_tag, requeue=True)
        return False

    async def _release(self, delivery: Delivery) -> None:
        if delivery._dedup_owner is not None:
            gate = self.route.dedup
            assert gate is not None
            await gate.release(delivery)

    async def settle_nack(self, delivery: Delivery, requeue: bool) -> None:
        await self._release(delivery)
        self.shared.requeued += 1
        self.route.metrics.requeued.inc()
        await self.nack(delivery.delivery_tag, requeue=requeue)

    async def settle_retry(
        self, delivery: Delivery, reason: str, delay: float | None, error: BaseException | None
    ) -> None:
        await self._release(delivery)
        shared = self.shared
        if delivery.attempt >= shared.settings.max_attempts:
            await self.settle_dead_letter(
                delivery, "max_attempts", error, detail=None if error is not None else reason
            )
            return
        if self.dead():  # the broker requeued it already; a republish would duplicate
            self._stale(1)
            return
        topology = self.route.topology
        if delay is None:
            queue, delay = topology.retry_queue_for(delivery.attempt)
        else:
            queue, delay = topology.nearest_retry_queue(delay)
        headers = republish_headers(delivery)
        headers[ATTEMPT_HEADER] = delivery.attempt + 1
        headers[LAST_ERROR_HEADER] = truncate(
            f"{type(error).__name__}: {error}" if error is not None else reason
        )
        if await self._republish(delivery, queue, headers, "retry"):
            shared.retried += 1
            self.route.metrics.retried.inc()
            delivery_log(delivery).info(
                "delivery_retry_scheduled", reason=reason, delay=delay, retry_queue=queue
            )
            await self.ack_now(delivery.delivery_tag)

    async def settle_dead_letter(
        self,
        delivery: Delivery,
        reason: str,
        error: BaseException | None,
        *,
        detail: str | None = None,
    ) -> None:
        await self._release(delivery)
        if self.dead():
            self._stale(1)
            return
        topology = self.route.topology
        headers = republish_headers(delivery)
        headers[_H + "reason"] = reason
        headers[_H + "error-type"] = type(error).__name__ if error is not None else reason
        message = str(error) if error is not None else ""
        if detail:
            message = f"{detail}: {message}" if message else detail
        headers[_H + "error-message"] = truncate(message or reason)
        headers[_H + "attempts"] = delivery.attempt
        headers[_H + "queue"] = delivery.queue
        headers[_H + "dead-lettered-at"] = datetime.now(UTC).isoformat()
        if await self._republish(delivery, topology.dead_letter_queue, headers, "dead_letter"):
            self.shared.dead_lettered += 1
            self.route.metrics.dead_lettered.inc()
            self.route.metrics.metrics.dead_lettered.labels(delivery.queue, reason).inc()
            delivery_log(delivery).warning(
                "delivery_dead_lettered",
                reason=reason,
                error=headers[_H + "error-message"],
                dlq=topology.dead_letter_queue,
            )
            await self.ack_now(delivery.delivery_tag)

    async def settle_defer(self, delivery: Delivery, reason: str) -> None:
        """Send the delivery round the first retry queue *without* counting an attempt.

        For a message id another consumer holds now (``BUSY``) or a dedup store
        that cannot answer: the handler did not run, so the copy comes back
        with the same attempt number after ``retry_delays[0]`` seconds.
        """
        if self.dead():
            self._stale(1)
            return
        queue, delay = self.route.topology.nearest_retry_queue(self.shared.settings.retry_delays[0])
        headers = republish_headers(delivery)
        headers[ATTEMPT_HEADER] = delivery.attempt
        if await self._republish(delivery, queue, headers, "defer"):
            self.shared.deferred += 1
            gate = self.route.dedup
            if gate is not None:
                gate.deferred.inc()
            delivery_log(delivery).debug(
                "delivery_deferred", reason=reason, delay=delay, retry_queue=queue
            )
            await self.ack_now(delivery.delivery_tag)

    async def _republish(
        self, delivery: Delivery, queue: str, headers: dict[str, Any], what: str
    ) -> bool:
        """Publish a copy with confirms; on failure requeue the original (never drop it)."""
        publisher = self.shared.publisher
        try:
            if publisher is None:
                raise ClosedError("consumer has no publisher")
            await publisher.publish(
                delivery.body,
                routing_key=queue,
                message_id=delivery.message_id or None,
                headers=headers,
                content_type=delivery.content_type or "application/octet-stream",
                correlation_id=delivery.correlation_id,
                reply_to=delivery.reply_to,
                timeout=self.shared.settings.republish_timeout,
                persistent=True,
                mandatory=True,
            )
        except (PublishError, ClosedError) as exc:
            delivery_log(delivery).error(
                "republish_failed", target=queue, purpose=what, error=repr(exc)
            )
            # Requeue after a pause so a missing retry queue does not spin.
            await asyncio.sleep(min(self.shared.settings.retry_delays[0], 1.0))
            self.shared.requeued += 1
            self.route.metrics.requeued.inc()
            await self.nack(delivery.delivery_tag, requeue=True)
            return False
        return True


def truncate(text: str, limit: int = 1000) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def republish_headers(delivery: Delivery) -> dict[str, Any]:
    headers = {k: v for k, v in delivery.headers.items() if k not in _STRIP_ON_REPUBLISH}
    if delivery.content_type is None:
        headers[NO_CONTENT_TYPE_HEADER] = True
    headers.setdefault(ORIGINAL_EXCHANGE_HEADER, delivery.exchange)
    headers.setdefault(ORIGINAL_ROUTING_KEY_HEADER, delivery.routing_key)
    return headers


def delivery_log(delivery: Delivery) -> Any:
    return get_logger(__name__).bind(
        queue=delivery.queue, message_id=delivery.message_id, attempt=delivery.attempt
    )


def int_header(headers: Mapping[str, Any], name: str) -> int | None:
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
