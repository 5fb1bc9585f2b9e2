"""Settle frames of one consumer channel, in the order they were decided.

`Frames` owns the channel's [`AckTracker`][reliable_mq._consume.acks.AckTracker] and a
lock: the tracker's state changes under the same lock as the frame is written,
so a batched ``basic.ack(multiple=true)`` never overtakes a single settle of a
tag it covers (the broker would close the channel: ``PRECONDITION_FAILED -
unknown delivery tag``). Batched acks may also leave without the lock, when it
is free: `Frames.take_acks` changes the tracker and encodes the frames, and
they are queued before the next ``await`` (a full batch at once, the rest on the
consumer's one timer: `reliable_mq._consume.flusher.AckFlusher`). Once the
channel is gone, settles are dropped and counted as stale. `Shared` holds what
every channel of one consumer shares.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Coroutine
from typing import Any

from .._amqp import AMQP_ERRORS
from .._amqp import ConsumeChannel as Channel
from .._tracing import CHANNEL_CLOSED, SettleTrace, Tracing, settle_frame
from ..metrics import QueueMetrics
from ..publisher import ReliablePublisher
from ..settings import BrokerAddress, ConsumerSettings
from .acks import AckTracker
from .flusher import AckFlusher

__all__ = ("FrameKind", "Frames", "Shared", "broker_cut")


def broker_cut(consumer_timeout: float) -> float:
    """Seconds after its arrival that a delivery's handler is cut, so that its settle
    reaches the broker before the broker's ``consumer_timeout``: 85 % of it, and at
    most 30 s before it."""
    return max(consumer_timeout * 0.85, consumer_timeout - 30.0)


class FrameKind(enum.StrEnum):
    """The settle frames a consumer channel writes."""

    ACK = "ack"
    """``basic.ack`` of one delivery tag."""
    ACK_MULTIPLE = "ack_multiple"
    """``basic.ack(multiple=true)``: every unsettled tag up to this one."""
    NACK_REQUEUE = "nack_requeue"
    """``basic.nack(requeue=true)``: the broker delivers it again."""
    NACK_DROP = "nack_drop"
    """``basic.nack(requeue=false)``: dead-lettered by the broker, or dropped."""


# Module-level aliases: on Python 3.11 ``FrameKind.ACK`` is a slow class-attribute
# lookup (about 65 ns), an alias a plain global (an ``is`` test beats ``==`` on str).
_ACK = FrameKind.ACK
_ACK_MULTIPLE = FrameKind.ACK_MULTIPLE
_NACK_REQUEUE = FrameKind.NACK_REQUEUE
_NACK_DROP = FrameKind.NACK_DROP
_OPERATIONS = {_ACK: "ack", _ACK_MULTIPLE: "ack", _NACK_REQUEUE: "nack", _NACK_DROP: "nack"}
"""A frame kind's ``messaging.operation.name`` (RabbitMQ's method: ``basic.ack``/``basic.nack``)."""


class Shared:
    """What every session of one consumer shares: settings, state, the publisher.

    Events are counted per queue, in each route's `QueueMetrics`, not here.
    """

    __slots__ = (
        "acks",
        "active",
        "address",
        "broker_cut",
        "consumer_timeout",
        "exit_error",
        "idle",
        "max_active",
        "on_channel_lost",
        "on_exit",
        "publisher",
        "settings",
        "stopping",
        "tracing",
    )

    def __init__(self, settings: ConsumerSettings, tracing: Tracing | None = None) -> None:
        self.settings = settings
        self.acks = AckFlusher(settings.ack_flush_interval)
        """The one timer that writes every channel's batched acks."""
        self.tracing = tracing if tracing is not None else Tracing()
        """The ``process`` spans' tracer (see `reliable_mq._tracing`)."""
        self.address: Callable[[], BrokerAddress] | None = None
        """The broker address in use (the spans' ``server.*``), set by the consumer."""
        self.publisher: ReliablePublisher | None = None
        self.active = self.max_active = 0
        self.stopping = False
        self.idle: asyncio.Event | None = None
        self.exit_error: BaseException | None = None
        self.on_exit: Callable[[BaseException], None] | None = None
        self.on_channel_lost: Callable[[str], None] | None = None
        """Called with the queue's name when one of its channels is lost while consuming."""
        self.consumer_timeout: float | None = None
        self.broker_cut: float | None = None
        self.set_consumer_timeout(settings.consumer_timeout)

    def set_consumer_timeout(self, seconds: float | None) -> None:
        """The broker's ``consumer_timeout``: configured, or named by the broker when it
        closed a channel for it. Handlers are cut `broker_cut` after their delivery
        arrived (see `reliable_mq._consume.dispatch`)."""
        self.consumer_timeout = seconds
        self.broker_cut = None if seconds is None else broker_cut(seconds)

    def exited(self, error: BaseException) -> None:
        """A handler raised ``SystemExit`` or ``KeyboardInterrupt``: no new handler
        runs, and the consumer is told (once) to stop and re-raise ``error``."""
        self.stopping = True
        if self.exit_error is not None:
            return
        self.exit_error = error
        if self.on_exit is not None:
            self.on_exit(error)

    def enter(self) -> None:
        """A delivery starts being processed."""
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        if self.idle is not None:
            self.idle.clear()

    def leave(self) -> None:
        """A delivery's processing ended."""
        self.active -= 1
        if not self.active and self.idle is not None:
            self.idle.set()


class Frames:
    """One channel's settle frames: batched acks, single acks and nacks, in decision order."""

    def __init__(self, shared: Shared, metrics: QueueMetrics, channel: Channel) -> None:
        self.shared = shared
        self.metrics = metrics
        self.channel = channel
        self.alive = True
        self.tracker = AckTracker()
        self.lock = asyncio.Lock()
        self.flush_tasks: set[asyncio.Task[None]] = set()
        settings = shared.settings
        self.batch = settings.batch_ack
        # A full batch is written at once. Below a small prefetch, at half of it:
        # the broker sends nothing more on a channel whose prefetch is all unacked.
        half = max(settings.prefetch // 2, 1) if settings.prefetch else settings.ack_batch_size
        self.batch_size = min(settings.ack_batch_size, half)
        self.traced: dict[int, SettleTrace] = {}
        """Batched acks of traced deliveries, by tag, until their frame is written or lost."""

    def dead(self) -> bool:
        """True once the channel is gone (its delivery tags are void)."""
        return not self.alive or self.channel.is_closed

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` in the background; `end` cancels it with the channel."""
        task = asyncio.get_running_loop().create_task(coro)
        self.flush_tasks.add(task)
        task.add_done_callback(self.flush_tasks.discard)

    def stale(self, deliveries: int) -> None:
        """Count settles dropped because the channel died."""
        self.metrics.stale += deliveries

    async def _write(
        self, kind: FrameKind, tag: int, deliveries: int, *, wait: bool = False
    ) -> bool:
        """Write one settle frame; the caller holds `lock`. False if the channel is gone."""
        channel = self.channel
        if not self.alive or channel.is_closed:
            self.stale(deliveries)
            return False
        try:
            if kind is _ACK:
                await channel.basic_ack(tag, multiple=False, wait=wait)
            elif kind is _ACK_MULTIPLE:
                await channel.basic_ack(tag, multiple=True, wait=wait)
            elif kind is _NACK_REQUEUE:
                await channel.basic_nack(tag, multiple=False, requeue=True, wait=wait)
            else:
                await channel.basic_nack(tag, multiple=False, requeue=False, wait=wait)
        except AMQP_ERRORS:
            self.alive = False
            self.stale(deliveries)
            return False
        if kind is _ACK or kind is _ACK_MULTIPLE:
            self.metrics.ack_frames += 1
        return True

    async def _traced_write(
        self,
        kind: FrameKind,
        tag: int,
        deliveries: int,
        traces: list[SettleTrace],
        *,
        wait: bool = False,
    ) -> bool:
        """`_write`, recorded as a settle span (written, or lost: ``error.type``)."""
        written = False
        try:
            written = await self._write(kind, tag, deliveries, wait=wait)
        finally:
            self._record(kind, traces, deliveries, tag, None if written else CHANNEL_CLOSED)
        return written

    def _record(
        self,
        kind: FrameKind,
        traces: list[SettleTrace],
        deliveries: int,
        tag: int,
        error: str | None,
    ) -> None:
        tracer = self.shared.tracing.tracer()
        if tracer is not None:
            address = self.shared.address
            url = None if address is None else address().url
            settle_frame(tracer, _OPERATIONS[kind], traces, deliveries, tag, url, error)

    def _lost(self, trace: SettleTrace | None, kind: FrameKind = _ACK) -> None:
        """A traced settle found the channel dead: its span records the loss."""
        if trace is not None:
            self._record(kind, [trace], 1, trace.tag, CHANNEL_CLOSED)

    def _covered(self, tag: int) -> list[SettleTrace]:
        """The traced batched acks a multiple ack of ``tag`` settles (taken out)."""
        traced = self.traced
        covered = [trace for pending, trace in traced.items() if pending <= tag]
        for trace in covered:
            del traced[trace.tag]
        return covered

    async def _settle_single(
        self, kind: FrameKind, tag: int, trace: SettleTrace | None = None
    ) -> bool:
        """Settle ``tag`` by its own frame, unless it was settled already.

        The tracker's state changes under the same lock as the frame is written,
        so frames leave in the order the tracker decided them: a multiple ack
        decided after this settle can never overtake its frame, and one decided
        before it (while the tag was still in progress) never reaches this tag.
        """
        async with self.lock:
            if self.tracker.settle(tag):
                if trace is None:
                    return await self._write(kind, tag, 1)
                return await self._traced_write(kind, tag, 1, [trace])
        return True

    async def flush(self, *, stragglers: bool, wait: bool = False) -> None:
        """Send the batched acks: the finished prefix, and optionally the stragglers."""
        async with self.lock:
            tag, count = self.tracker.take_prefix()
            traced = self.traced
            if tag is not None:
                kind = _ACK_MULTIPLE if count > 1 else _ACK
                covered = self._covered(tag) if traced else None
                if covered:
                    await self._traced_write(kind, tag, count, covered, wait=wait)
                else:
                    await self._write(kind, tag, count, wait=wait)
            if stragglers:
                for single in self.tracker.take_stragglers():
                    trace = traced.pop(single, None) if traced else None
                    if trace is not None:
                        await self._traced_write(_ACK, single, 1, [trace], wait=wait)
                    else:
                        await self._write(_ACK, single, 1, wait=wait)

    def take_acks(self, *, stragglers: bool) -> bytes:
        """Take the finished prefix (and the stragglers) as encoded ack frames.

        The caller has checked that `lock` is free and the channel alive, and
        queues the frames (`reliable_mq._amqp.ConsumeChannel.write_now`) before
        its next ``await``: nothing may come between this decision and them.
        """
        channel, tracker, traced = self.channel, self.tracker, self.traced
        tag, count = tracker.take_prefix()
        frames = []
        if tag is not None:
            frames.append(channel.ack_frame(tag, multiple=count > 1))
            covered = self._covered(tag) if traced else None
            if covered:
                self._record(_ACK_MULTIPLE if count > 1 else _ACK, covered, count, tag, None)
        if stragglers:
            for single in tracker.take_stragglers():
                frames.append(channel.ack_frame(single, multiple=False))
                trace = traced.pop(single, None) if traced else None
                if trace is not None:
                    self._record(_ACK, [trace], 1, single, None)
        self.metrics.ack_frames += len(frames)
        return b"".join(frames)

    def _write_batch(self) -> bool:
        """Write the finished prefix now, without a task or an await, if the lock is
        free and the connection's write queue has room; False if not."""
        channel = self.channel
        if self.lock.locked() or not channel.has_room():
            return False
        frames = self.take_acks(stragglers=False)
        if frames:
            channel.write_now(frames)
        return True

    def end(self) -> None:
        """The channel is gone: stop flushes (a write to a dead connection can
        block forever in aiormq's bounded write queue)."""
        self.alive = False
        self.shared.acks.forget(self)
        for task in list(self.flush_tasks):
            task.cancel()
        if self.traced:  # batched acks never written: each delivery's settle span says so
            lost, self.traced = list(self.traced.values()), {}
            for trace in lost:
                self._lost(trace)

    async def final_flush(self) -> None:
        """Shutdown: send every batched ack now, and wait for the broker to take them."""
        self.shared.acks.forget(self)
        await self.flush(stragglers=True, wait=True)

    async def ack(self, tag: int, trace: SettleTrace | None = None) -> bool:
        """Ack ``tag``, batched (when batch acks are on) or now.

        ``trace``: the delivery is traced; its settle span is recorded with the frame.

        Returns:
            False if the channel was found dead (the ack is lost: the broker will
            deliver it again); True once written or batched.
        """
        if self.dead():
            self.stale(1)
            self._lost(trace)
            return False
        if self.batch:
            if not self.tracker.finish(tag):
                return True
            if trace is not None:
                self.traced[tag] = trace
            tracker = self.tracker
            if tracker.pending >= self.batch_size and not self._write_batch():
                await self.flush(stragglers=False)
            if tracker.pending:
                self.shared.acks.wait(self)
            return True
        return await self._settle_single(_ACK, tag, trace)

    def batch_ack(self, tag: int) -> None:
        """`ack` of a live channel with batched acks, without waiting: a full batch is
        written now if the lock is free and the connection has room, else by the
        consumer's timer (`reliable_mq._consume.flusher.AckFlusher`) or the next ack."""
        tracker = self.tracker
        if not tracker.finish(tag):
            return
        if tracker.pending >= self.batch_size:
            self._write_batch()
        if tracker.pending:
            self.shared.acks.wait(self)

    async def ack_now(self, tag: int, trace: SettleTrace | None = None) -> bool:
        """Ack ``tag`` in its own frame, now: used after a confirmed republish, so
        a channel loss cannot leave both the copy and the original behind.

        Returns:
            False if the channel was found dead (the ack is lost).
        """
        if self.dead():
            self.stale(1)
            self._lost(trace)
            return False
        return await self._settle_single(_ACK, tag, trace)

    async def nack(self, tag: int, *, requeue: bool, trace: SettleTrace | None = None) -> None:
        kind = _NACK_REQUEUE if requeue else _NACK_DROP
        if self.dead():
            self.stale(1)
            self._lost(trace, kind)
            return
        await self._settle_single(kind, tag, trace)

    def abort(self) -> None:
        """Close the channel now: the broker requeues every delivery still unacked."""
        self.alive = False
        self.spawn(self._close_quietly())

    async def _close_quietly(self) -> None:
        await self.channel.close()
