"""One consumed queue (`Route`) and the task that keeps a channel consuming it (`ChannelKeeper`).

Each route has one channel at a time, a `Session`. When the channel dies (a
connection loss, a broker-side close, the broker cancelling our consumer), the
keeper opens a new one and consumes again, backing off while it fails; it
never gives up while the consumer runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, cast

from .._amqp import ConsumeChannel, OnDelivery, classify
from ..connection import ConnectionSupervisor
from ..errors import ClosedError, ConsumerError
from ..handlers import AsyncHandlerFunc, HandlerSpec
from ..log import get_logger
from ..metrics import QueueMetrics
from ..settings import ConnectionSettings, ConsumerSettings
from ..topology import QueueTopology, QueueType, prepare_topology
from .acks import LostAcks
from .dedup_gate import DedupGate
from .session import Session, Shared
from .threads import HandlerThreads

if TYPE_CHECKING:
    from ..delivery import Delivery
    from .batches import Batcher

__all__ = ("ChannelKeeper", "Intake", "Overran", "Route")

Intake = Callable[["Route", Session], OnDelivery]
"""Makes the function a session's channel hands each delivery to."""

HELD_MESSAGES = 1024
"""Messages whose requeue-later holds a route remembers (least recently held forgotten)."""


class Overran(NamedTuple):
    """A handler run that the broker's ``consumer_timeout`` cut off (see `Route.overran`)."""

    attempt: int
    """The attempt that ran."""
    ran: float
    """Seconds the handler had run when the broker closed the channel."""
    limit: float | None
    """The broker's ``consumer_timeout`` in seconds, if its close text named it."""


class Route:
    """One consumed queue: its handler, topology, metrics and current session."""

    def __init__(
        self,
        spec: HandlerSpec,
        settings: ConsumerSettings,
        metrics: QueueMetrics,
        name: str,
        dedup: DedupGate | None = None,
        threads: HandlerThreads | None = None,
    ) -> None:
        self.spec = spec
        # What the dispatcher calls: the async def, or the plain def through the
        # route's thread pool (see reliable_mq._consume.threads).
        if spec.sync and threads is None:
            raise ValueError(f"the plain def handler of {spec.queue!r} needs handler threads")
        self.handler = cast(AsyncHandlerFunc, spec.func)
        self.threads = threads
        self.running: dict[str, int] = {}
        """Handlers running now per message id, late ones (a thread past its
        deadline, a handler that swallowed its cancel) included: a delivery of an
        id in here is deferred, never run alongside."""
        self._overran: OrderedDict[str | int, Overran] = OrderedDict()
        self.lost_acks = LostAcks()
        """Messages done whose ack a dead channel may have lost (see `ack_lost`)."""
        self.settings = settings
        self.dedup = dedup
        self.queue = spec.queue
        self.topology = QueueTopology(
            queue=spec.queue,
            queue_type=spec.queue_type,
            retry_delays=settings.retry_delays,
            arguments=spec.queue_arguments,
        )
        self.quorum = spec.queue_type is QueueType.QUORUM
        self.metrics = metrics
        limit = settings.effective_concurrency
        # A batch handler's limit counts batches (`Batcher.slots`), not deliveries.
        self.semaphore = asyncio.Semaphore(limit) if limit and spec.batch is None else None
        self.batcher: Batcher | None = None
        """A batch handler's batches (made with the route's first channel)."""
        self.session: Session | None = None
        self.keeper: asyncio.Task[None] | None = None
        self.ready = asyncio.Event()
        self.log = get_logger(__name__).bind(connection=name, queue=spec.queue)
        self.queue_has_dlx = False  # known once a channel is open (see ChannelKeeper.open)
        self._unpublishable = 0  # deliveries requeued later in a row (no copy published)
        self._held: OrderedDict[str | int, int] = OrderedDict()
        """Times each message (by `_backoff_key`) was requeued later in a row; the
        most recently held `HELD_MESSAGES` are remembered."""

    def next_requeue_delay(self, delivery: Delivery) -> float:
        """The hold before requeueing ``delivery``, no copy of which could be published.

        ``fallback_delay`` doubled for each time in a row, up to
        ``fallback_max_delay``, counted two ways, and the larger count wins: per
        message (its own holds in a row, ended only by a copy *of it*), so a
        hopeless message backs off even while other messages' copies are
        published; and per route (holds of any message since the last copy
        published), so that when every copy fails the holds grow across messages.
        """
        key = _backoff_key(delivery)
        held = self._held
        count = held.pop(key, 0)
        held[key] = count + 1
        if len(held) > HELD_MESSAGES:
            held.popitem(last=False)
        streak = self._unpublishable
        self._unpublishable += 1
        settings = self.settings
        delay = settings.fallback_delay * 2 ** min(max(count, streak), 30)
        return float(min(delay, settings.fallback_max_delay))

    def handler_ended(self, message_id: str) -> None:
        """A handler of ``message_id`` really ended (for a thread: its call returned)."""
        count = self.running.get(message_id, 0) - 1
        if count > 0:
            self.running[message_id] = count
        else:
            self.running.pop(message_id, None)

    def overran(self, delivery: Delivery, ran: float, limit: float | None) -> None:
        """The broker's ``consumer_timeout`` cut off a run of ``delivery``'s handler.

        The broker redelivers the original unchanged (on classic queues its
        attempt number does not rise): the record lets `take_overran` count
        that run as an attempt when it comes back. Kept for the
        `HELD_MESSAGES` most recent ones, in memory (a restart forgets them).
        """
        overran = self._overran
        overran[_backoff_key(delivery)] = Overran(delivery.attempt, ran, limit)
        overran.move_to_end(_backoff_key(delivery))
        if len(overran) > HELD_MESSAGES:
            overran.popitem(last=False)

    def take_overran(self, delivery: Delivery) -> Overran | None:
        """The cut-off run ``delivery`` is the broker's redelivery of, if it is one.

        On a quorum queue the broker counted that run already (``x-delivery-count``):
        the delivery's attempt is brought back to the run's, so it is counted once.
        """
        record = self._overran.pop(_backoff_key(delivery), None)
        if record is None or not delivery.redelivered:
            return None
        if delivery.attempt == record.attempt + 1 and self.quorum:
            delivery.attempt = record.attempt
        return record if delivery.attempt == record.attempt else None

    @property
    def has_overran(self) -> bool:
        return bool(self._overran)

    def ack_lost(self, message_id: str, attempt: int) -> None:
        """``message_id`` at ``attempt`` is done (handled, or its copy published), and its
        channel died before the broker surely had the ack: its redelivery is acked
        without running again (`take_ack_lost`)."""
        self.lost_acks.add(message_id, attempt, time.monotonic())

    def take_ack_lost(self, delivery: Delivery) -> bool:
        """``delivery`` is the broker's return of a message done here (`ack_lost`)."""
        message_id = delivery.message_id
        return bool(message_id) and self.lost_acks.take(
            message_id, delivery.attempt, time.monotonic(), counts_returns=self.quorum
        )

    def copy_published(self, delivery: Delivery) -> None:
        """A copy of ``delivery`` was published: its holds, and the route's streak, end."""
        self._unpublishable = 0
        if self._held:
            self._held.pop(_backoff_key(delivery), None)


def _backoff_key(delivery: Delivery) -> str | int:
    """What identifies a message across its redeliveries: its id, else its body."""
    return delivery.message_id or hash(delivery.body)


class ChannelKeeper:
    """Opens a route's channel, consumes, and reopens it whenever it dies."""

    def __init__(
        self,
        supervisor: ConnectionSupervisor,
        connection_settings: ConnectionSettings,
        shared: Shared,
        intake: Intake,
    ) -> None:
        self.supervisor = supervisor
        self.connection_settings = connection_settings
        self.shared = shared
        self.intake = intake
        self.reopens = 0

    async def open(self, route: Route, *, first: bool = False) -> None:
        """Open a channel for ``route``, declare its topology, set prefetch and consume.

        Raises:
            ConsumerError: on the first open, the broker refused the queue
                (e.g. it exists with other arguments).
        """
        link = await self.supervisor.wait_connected()
        channel: ConsumeChannel | None = None
        try:
            async with asyncio.timeout(self.connection_settings.connect_timeout):
                check = await prepare_topology(
                    link,
                    route.topology,
                    declare=route.spec.declare,
                    queue_only=route.spec.queue_only,
                )
                channel = await link.consume_channel()
                await channel.qos(self.shared.settings.prefetch)
                session = Session(self.shared, route, channel)
                # Deliveries go to our dispatcher, in tag order (see reliable_mq._amqp.consume);
                # our tasks are cancelled by us, not by aiormq, when the channel closes.
                channel.on_closed(session.interrupt)
                consumer_tag = await channel.consume(route.queue, self.intake(route, session))
        except BaseException as exc:
            if channel is not None and not channel.is_closed:
                with contextlib.suppress(asyncio.CancelledError):
                    await channel.close(timeout=2)
            fault = classify(exc)
            if first and fault is not None and fault.refusal:
                raise ConsumerError(f"cannot consume {route.queue!r}: {fault.describe()}") from exc
            raise
        session.consumer_tag = consumer_tag
        # Only a work queue declared with our arguments is known to dead-letter to
        # its DLQ. A reject on an adopted one could drop the message (its DLX, if a
        # policy gives it one, is invisible to us), so its last rung is a requeue.
        route.queue_has_dlx = route.spec.queue_has_dlx and not check.adopted
        route.session = session
        route.ready.set()
        if first:
            if check.adopted:
                route.log.warning("queue_used_as_is", detail=check.warning(route.topology))
            route.log.info(
                "consuming", prefetch=self.shared.settings.prefetch, messages=check.messages
            )
        else:
            route.log.debug("consuming", consumer_tag=consumer_tag)

    async def wait_end(self, session: Session) -> str:
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
                not self.shared.stopping
                and session.consumer_tag is not None
                and not session.channel.has_consumer(session.consumer_tag)
            ):
                session.alive = False
                await session.channel.close()
                return "consumer cancelled by the broker"

    def _stopping(self) -> bool:
        """Re-read the flag (it changes while we await)."""
        return self.shared.stopping

    async def keep(self, route: Route) -> None:
        """Wait for the route's channel to die; open a new one until stopped."""
        failures = 0
        while not self.shared.stopping:
            session = route.session
            if session is not None and session.alive:
                reason = await self.wait_end(session)
                session.end()
                route.ready.clear()
                if self._stopping():
                    return
                route.log.warning(
                    "consumer_channel_lost", reason=reason[:300], in_flight=len(session.inflight)
                )
            try:
                await self.open(route)
            except ClosedError:
                return
            except Exception as exc:  # never give up while running; aiormq may raise RuntimeError
                failures += 1
                route.log.info("consumer_channel_open_failed", error=repr(exc), attempt=failures)
                await asyncio.sleep(min(0.1 * 2**failures, 5.0))
                continue
            failures = 0
            self.reopens += 1
            route.log.info("consumer_channel_recovered")
