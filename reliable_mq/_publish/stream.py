"""The publisher's confirm-mode channel, as numbered generations.

A generation is one channel of the seam (`reliable_mq._amqp.ConfirmChannel`:
the fast path's coalesced writes, or the plain path's ``basic_publish``) and
the `ConfirmTracker` of what was written on it. When the channel dies (or we
replace it), its unconfirmed messages are handed back in tag order with the
classified `Fault`, and the next generation opens.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from .._amqp import AMQP_ERRORS, ConfirmChannel, Fault
from ..connection import ConnectionSupervisor
from ..errors import ClosedError
from .closing import task_end
from .confirms import ConfirmTracker
from .outgoing import Outgoing

__all__ = ("Generation", "StreamEvents", "StreamKeeper")


class StreamEvents(Protocol):
    """What the publisher's policy does with channel events (see ``_engine``)."""

    def opened(self, generation: Generation) -> None: ...

    def confirmed(self, generation: Generation, items: list[Outgoing], ack: bool) -> None: ...

    def returned(self, generation: Generation, message_id: str, code: int, text: str) -> None: ...

    def lost(self, generation: Generation, items: list[Outgoing], fault: Fault | None) -> None: ...


class Generation:
    """One confirm-mode channel's life: its channel and its tag tracker.

    It is the channel's `reliable_mq._amqp.ConfirmEvents`: confirms settle tags
    in the tracker and go to the policy with the messages they settle.
    """

    __slots__ = (
        "_events",
        "channel",
        "close_fault",
        "closing",
        "frame_max",
        "last_ack",
        "nacks_since_ack",
        "number",
        "replace_requested",
        "tracker",
    )

    def __init__(self, number: int, events: StreamEvents, now: float) -> None:
        self.number = number
        self._events = events
        self.channel: ConfirmChannel
        """Set right after the channel opens (it reports to this generation)."""
        self.frame_max = 0
        self.tracker: ConfirmTracker[Outgoing] = ConfirmTracker()
        self.closing = False
        """No more writes: the broker closed it, or we are replacing it."""
        self.close_fault: Fault | None = None
        self.replace_requested = asyncio.Event()
        self.last_ack = now
        self.nacks_since_ack = 0

    def write(self, out: Outgoing) -> int:
        """Publish one attempt of ``out`` on this channel; return its delivery tag."""
        tag = self.tracker.add(out)
        self.channel.send(tag, out)
        return tag

    # -- ConfirmEvents ------------------------------------------------------------

    def confirmed(self, tag: int, multiple: bool, ack: bool) -> None:
        items = self.tracker.settle(tag, multiple)
        if items:
            self._events.confirmed(self, items, ack)

    def returned(self, message_id: str, code: int, text: str) -> None:
        self._events.returned(self, message_id, code, text)

    def channel_closed(self, fault: Fault | None) -> None:
        self.closing = True
        self.close_fault = fault


class StreamKeeper:
    """Keeps one confirm channel open on the supervisor's connection, generation by generation.

    Args:
        supervisor: the connection to open channels on.
        events: the policy that reacts to opens, confirms, returns and losses.
        open_timeout: how long one channel open may take.
        log: the publisher's bound logger.
        needed: whether a channel is still wanted.
    """

    def __init__(
        self,
        supervisor: ConnectionSupervisor,
        events: StreamEvents,
        *,
        open_timeout: float,
        log: Any,
        needed: Callable[[], bool],
    ) -> None:
        self._supervisor = supervisor
        self._events = events
        self._open_timeout = open_timeout
        self._log = log
        self._needed = needed
        self.current: Generation | None = None
        """The live generation, or None between generations."""
        self.generation = 0
        self._keeper: asyncio.Task[None] | None = None
        self._first_open: asyncio.Future[None] | None = None
        self._closing = False
        self.on_stopped: Callable[[str], None] | None = None
        """Called once if the keeper task ends before `close` (cancelled from outside, as
        the event loop's shutdown does, or failed): no channel will open again, and
        no confirm or loss of the messages in flight will ever be reported."""

    async def start(self) -> None:
        """Open the first channel (bounded by ``open_timeout``)."""
        loop = asyncio.get_running_loop()
        self._first_open = loop.create_future()
        self._keeper = loop.create_task(
            self._keep(), name=f"reliable_mq:{self._supervisor.name}:channel"
        )
        self._keeper.add_done_callback(self._keeper_ended)
        async with asyncio.timeout(self._open_timeout):
            await asyncio.shield(self._first_open)

    def _keeper_ended(self, task: asyncio.Task[None]) -> None:
        first = self._first_open
        if first is not None and not first.done():
            # Failed before the first channel opened (an UnsupportedDependency, say):
            # start() raises it now rather than at its timeout.
            error = None if task.cancelled() else task.exception()
            first.set_exception(error or ClosedError("the channel keeper stopped"))
        if self._closing or self.on_stopped is None:
            return
        self.on_stopped(task_end(task, "its channel keeper"))

    async def close(self) -> None:
        self._closing = True
        if self._keeper is not None:
            self._keeper.cancel()
            await asyncio.gather(self._keeper, return_exceptions=True)
        current, self.current = self.current, None
        if current is not None:
            current.closing = True
            await current.channel.close()

    def replace(self, generation: Generation) -> None:
        """Give up on ``generation`` (stuck, or poisoned): its messages go to the next one."""
        if generation is self.current:
            generation.closing = True
            generation.replace_requested.set()

    # -- the keeper ---------------------------------------------------------------

    async def _keep(self) -> None:
        failures = 0
        while self._needed():
            try:
                generation = await self._open()
            except ClosedError:
                return
            except AMQP_ERRORS as exc:
                failures += 1
                self._log.info("channel_open_failed", error=repr(exc), attempt=failures)
                await asyncio.sleep(min(0.05 * 2**failures, 2.0))
                continue
            failures = 0
            self.current = generation
            self._log.debug("channel_open", generation=generation.number)
            if self._first_open is not None and not self._first_open.done():
                self._first_open.set_result(None)
            self._events.opened(generation)
            try:
                fault = await self._until_lost(generation)
            finally:
                generation.closing = True
                generation.channel.stop()
                if self.current is generation:
                    self.current = None
            if not generation.channel.is_closed:
                asyncio.get_running_loop().create_task(generation.channel.close())
            self._log.info(
                "channel_lost",
                generation=generation.number,
                reason=fault.describe() if fault is not None else "replaced",
            )
            self._events.lost(generation, generation.tracker.drain(), fault)
            if fault is not None and fault.refusal:
                # A refusal repeats if the same message goes out again: the policy
                # isolates it; a short pause keeps a misbehaving loop from storming.
                await asyncio.sleep(0.05)

    async def _open(self) -> Generation:
        link = await self._supervisor.wait_connected()
        generation = Generation(
            self.generation + 1, self._events, asyncio.get_running_loop().time()
        )
        channel = await link.confirm_channel(generation, timeout=self._open_timeout)
        self.generation += 1
        generation.channel = channel
        generation.frame_max = channel.frame_max
        return generation

    async def _until_lost(self, generation: Generation) -> Fault | None:
        replace = asyncio.ensure_future(generation.replace_requested.wait())
        try:
            fault = await generation.channel.wait_closed(replace)
        finally:
            replace.cancel()
        if generation.close_fault is not None:
            return generation.close_fault
        return fault
