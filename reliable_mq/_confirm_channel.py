"""The publisher's confirm-mode channel, replaced whenever it dies or gets stuck.

Each channel is a *generation*. Attempts register while they are inside a
channel, so that when it is lost the keeper can (1) interrupt any attempt
stuck in it, (2) wait for all of them to report back, and only then (3) open
the next generation and release the waiters in publish order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, cast

import aiormq
from aiormq import Channel

from .connection import ConnectionSupervisor
from .errors import ClosedError

__all__ = ("LOST_ERRORS", "Aborted", "ConfirmChannel")

LOST_ERRORS: tuple[type[BaseException], ...] = (
    aiormq.exceptions.AMQPError,
    aiormq.exceptions.ChannelInvalidStateError,
    ConnectionError,
    OSError,
)
"""Errors that mean "this channel is gone": republish on the next one."""

_OPEN_ERRORS: tuple[type[BaseException], ...] = (TimeoutError, *LOST_ERRORS)

_NACK_ONLY_SECONDS = 2.0
"""A channel that got only nacks (at least three, no ack) for this long is replaced."""


class Aborted(Exception):
    """Internal: the publisher's close() gave up; waiters turn it into PublishAborted."""


class ConfirmChannel:
    """Keeps one confirm channel open on the supervisor's connection.

    Args:
        supervisor: the connection to open channels on.
        open_timeout: how long one channel open may take.
        log: the publisher's bound logger.
        needed: whether a channel is still wanted (False once closed and drained).
    """

    def __init__(
        self,
        supervisor: ConnectionSupervisor,
        *,
        open_timeout: float,
        log: Any,
        needed: Callable[[], bool],
    ) -> None:
        self._supervisor = supervisor
        self._open_timeout = open_timeout
        self._log = log
        self._needed = needed
        self.channel: Channel | None = None
        """The live channel, or None between generations."""
        self.generation = 0
        self._attempts_on: dict[int, int] = {}
        self._sending: dict[asyncio.Task[Any], tuple[int, float]] = {}
        self._interrupted: dict[asyncio.Task[Any], str] = {}
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._recycle_requested = asyncio.Event()
        self._attempts_drained = asyncio.Event()
        self._keeper: asyncio.Task[None] | None = None
        self._last_ack = 0.0
        self._nacks_since_ack = 0

    async def start(self) -> None:
        """Open the first channel (bounded by ``open_timeout``)."""
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((0, ready))
        self._keeper = asyncio.get_running_loop().create_task(
            self._keep(), name=f"reliable_mq:{self._supervisor.name}:channel"
        )
        async with asyncio.timeout(self._open_timeout):
            await ready

    async def close(self) -> None:
        if self._keeper is not None:
            self._keeper.cancel()
            await asyncio.gather(self._keeper, return_exceptions=True)
        self.channel = None

    async def wait(self, seq: int, deadline: float) -> Channel:
        """Wait for a live channel; waiters are released in ``seq`` order.

        Raises:
            TimeoutError: ``deadline`` (loop time) passed.
            Aborted: the publisher is aborting.
        """
        loop = asyncio.get_running_loop()
        while True:
            channel = self.channel
            if channel is not None and not channel.is_closed:
                return channel
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append((seq, waiter))
            async with asyncio.timeout_at(deadline):
                await waiter

    def fail_waiters(self, exc: BaseException) -> None:
        self._wake_waiters(exc)

    async def reject_pending(self, exc: BaseException) -> None:
        """Fail every confirm pending on the live channel now, without a round trip."""
        channel = self.channel
        if channel is not None:
            await channel._cancel_tasks(exc)
            asyncio.get_running_loop().create_task(close_quietly(channel))

    # -- attempts -------------------------------------------------------------

    def begin(self, task: asyncio.Task[Any], deadline: float) -> int:
        """Register an attempt about to use the channel; returns its generation.

        ``deadline`` (loop time) is when `expire()` interrupts the attempt.
        """
        generation = self.generation
        self._attempts_on[generation] = self._attempts_on.get(generation, 0) + 1
        self._sending[task] = (generation, deadline)
        return generation

    def end(self, task: asyncio.Task[Any], generation: int) -> None:
        self._sending.pop(task, None)
        left = self._attempts_on[generation] - 1
        if left:
            self._attempts_on[generation] = left
            return
        del self._attempts_on[generation]
        if not self._attempts_on:
            self._attempts_drained.set()  # the keeper may be waiting to reopen in order

    def interruption(self, task: asyncio.Task[Any]) -> str | None:
        """Why we cancelled ``task`` (once): "lost" (its channel died), "expired", or None."""
        return self._interrupted.pop(task, None)

    def expire(self, now: float) -> None:
        """Interrupt every attempt past its deadline (one sweep instead of a timer each)."""
        for task, (_, deadline) in list(self._sending.items()):
            if deadline <= now:
                self._interrupt(task, "expired")

    def _interrupt(self, task: asyncio.Task[Any], reason: str) -> None:
        if task not in self._interrupted and not task.done():
            self._interrupted[task] = reason
            task.cancel()

    def acked(self, generation: int, now: float) -> None:
        """Note a confirm on ``generation`` (it shows the channel is healthy)."""
        if generation == self.generation:
            self._last_ack = now
            self._nacks_since_ack = 0

    def nacked(self, generation: int, now: float) -> bool:
        """Note a nack; True when the channel looks poisoned and should be replaced.

        A full ``reject-publish`` queue nacks too, but acks keep arriving for
        whatever fits; a channel that only ever nacks for a while is the
        RabbitMQ 3.10 quorum-failover quirk, and a fresh channel cures it.
        """
        if generation != self.generation:
            return False
        self._nacks_since_ack += 1
        return self._nacks_since_ack >= 3 and now - self._last_ack >= _NACK_ONLY_SECONDS

    def replace(self, generation: int) -> None:
        """Ask for a fresh channel: generation ``generation`` died or is stuck."""
        if generation == self.generation:
            self.channel = None
            self._recycle_requested.set()

    # -- the keeper -------------------------------------------------------------

    async def _keep(self) -> None:
        failures = 0
        while self._needed():
            try:
                connection = await self._supervisor.wait_connected()
                async with asyncio.timeout(self._open_timeout):
                    aio_channel = await connection.channel(
                        publisher_confirms=True, on_return_raises=True
                    )
                    channel = cast(Channel, await aio_channel.get_underlay_channel())
            except ClosedError:
                return
            except _OPEN_ERRORS as exc:
                failures += 1
                self._log.info("channel_open_failed", error=repr(exc), attempt=failures)
                await asyncio.sleep(min(0.05 * 2**failures, 2.0))
                continue
            failures = 0
            await self._drain_old_attempts()
            self.generation += 1
            self._recycle_requested.clear()
            self._last_ack = asyncio.get_running_loop().time()
            self._nacks_since_ack = 0
            self.channel = channel
            self._log.debug("channel_open", generation=self.generation)
            self._wake_waiters()
            await self._until_lost(channel)
            if self.channel is channel:
                self.channel = None
            self._abandon_attempts(self.generation)
            if not channel.is_closed:
                asyncio.get_running_loop().create_task(close_quietly(channel))
            self._log.info("channel_lost", generation=self.generation)

    async def _until_lost(self, channel: Channel) -> None:
        closing = channel.closing
        recycle = asyncio.ensure_future(self._recycle_requested.wait())
        try:
            await asyncio.wait((closing, recycle), return_when=asyncio.FIRST_COMPLETED)
        finally:
            recycle.cancel()
            if not closing.done():
                closing.cancel()
            elif not closing.cancelled():
                closing.exception()

    def _wake_waiters(self, exc: BaseException | None = None) -> None:
        waiters = sorted(self._waiters, key=lambda item: item[0])
        self._waiters.clear()
        for _, waiter in waiters:
            if waiter.done():
                continue
            if exc is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(exc)

    def _abandon_attempts(self, generation: int) -> None:
        """Interrupt every attempt still waiting on a dead channel.

        aiormq does not always wake them: a publish blocked on the connection's
        full write queue (holding the channel lock) waits forever when the
        writer died (aio-pika #636, #689). We cancel those tasks; the attempt
        sees `interruption()` and turns it into "channel lost, republish".
        """
        for task, (on, _) in list(self._sending.items()):
            if on == generation:
                self._interrupt(task, "lost")

    async def _drain_old_attempts(self) -> None:
        """Let attempts on dead channels report back first, so republish keeps order.

        aiormq rejects a dead channel's confirms in no particular order; waiting
        for all of them (briefly) lets `_wake_waiters()` sort them.
        """
        if not self._attempts_on:
            return
        self._attempts_drained.clear()
        try:
            async with asyncio.timeout(1.0):
                await self._attempts_drained.wait()
        except TimeoutError:
            self._log.warning(
                "republish_order_not_guaranteed", stuck=sum(self._attempts_on.values())
            )


async def close_quietly(channel: Channel) -> None:
    """Close a channel that may already be dead, without raising."""
    try:
        async with asyncio.timeout(5):
            await channel.close()
    except BaseException as exc:  # closing a dead channel may fail in many ways
        if isinstance(exc, asyncio.CancelledError):
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
