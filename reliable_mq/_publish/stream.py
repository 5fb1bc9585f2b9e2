"""The publisher's confirm-mode channel, as numbered generations, with coalesced writes.

What we own and why. aiormq keeps the socket, numbers channels, reads frames
and writes whatever is put on the connection's write queue. Its
``Channel.basic_publish`` costs a lock, a future and a queue round-trip per
message, and it maps ``basic.return`` by message id into per-message futures.
We publish below it: the frames of every message accepted in one event-loop
iteration are joined into one buffer and put on the write queue as one item
(one socket write), and three of aiormq's per-channel frame handlers are
replaced on our channel only:

* ``_on_confirm_frame``: a ``basic.ack``/``basic.nack`` settles a range of
  delivery tags in a `ConfirmTracker`;
* ``_on_return_frame``: a ``basic.return`` (which comes before its ack) is
  reported by message id;
* ``_on_close_frame``: a broker ``channel.close`` stops our writes at once
  (a frame sent after ``channel.close-ok`` closes the whole connection with
  504) and records the reply code and text.

Each channel is a *generation*. When it dies (or we replace it), its
unconfirmed messages are handed back in tag order with the classified
`Fault`, and the next generation opens.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

import aiormq
from aiormq.abc import ChannelFrame
from pamqp.commands import Basic

from .._amqp.faults import AMQP_ERRORS, Fault, classify, classify_close
from .._amqp.wire import publish_frames
from ..connection import ConnectionSupervisor
from ..errors import ClosedError
from .closing import task_end
from .confirms import ConfirmTracker
from .outgoing import Outgoing

__all__ = ("Generation", "StreamEvents", "StreamKeeper", "close_quietly")


class StreamEvents(Protocol):
    """What the publisher's policy does with channel events (see ``_engine``)."""

    def opened(self, generation: Generation) -> None: ...

    def confirmed(self, generation: Generation, items: list[Outgoing], ack: bool) -> None: ...

    def returned(self, generation: Generation, message_id: str, code: int, text: str) -> None: ...

    def lost(self, generation: Generation, items: list[Outgoing], fault: Fault | None) -> None: ...


class Generation:
    """One confirm-mode channel's life: its tag tracker and its write buffer."""

    __slots__ = (
        "_buffer",
        "_wake",
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

    def __init__(self, number: int, channel: aiormq.Channel, frame_max: int, now: float) -> None:
        self.number = number
        self.channel = channel
        self.frame_max = frame_max
        self.tracker: ConfirmTracker[Outgoing] = ConfirmTracker()
        self.closing = False
        """No more writes: the broker closed it, or we are replacing it."""
        self.close_fault: Fault | None = None
        self.replace_requested = asyncio.Event()
        self.last_ack = now
        self.nacks_since_ack = 0
        self._buffer: list[bytes] = []
        self._wake = asyncio.Event()

    def write(self, out: Outgoing) -> int:
        """Queue one attempt of ``out`` for the next write; return its delivery tag."""
        tag = self.tracker.add(out)
        self._buffer.append(publish_frames(self.channel.number, out.encoded, self.frame_max))
        if len(self._buffer) == 1:
            self._wake.set()
        return tag

    async def writer(self) -> None:
        """Put the buffered frames on the connection's write queue, one item per batch."""
        queue: asyncio.Queue[ChannelFrame] = self.channel.write_queue
        wake = self._wake
        spins = 0
        while True:
            await wake.wait()
            wake.clear()
            while self._buffer and not self.closing:
                if queue.full():  # aiormq's writer empties it within a loop iteration
                    spins += 1
                    await asyncio.sleep(0 if spins < 20 else 0.005)
                    continue
                spins = 0
                data = b"".join(self._buffer)
                self._buffer.clear()
                queue.put_nowait(ChannelFrame(payload=data, should_close=False))


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
            await close_quietly(current.channel)

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
            writer = asyncio.get_running_loop().create_task(generation.writer())
            self.current = generation
            self._log.debug("channel_open", generation=generation.number)
            if self._first_open is not None and not self._first_open.done():
                self._first_open.set_result(None)
            self._events.opened(generation)
            try:
                fault = await self._until_lost(generation)
            finally:
                generation.closing = True
                writer.cancel()
                if self.current is generation:
                    self.current = None
            if not generation.channel.is_closed:
                asyncio.get_running_loop().create_task(close_quietly(generation.channel))
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
        connection = await self._supervisor.wait_connected()
        transport = connection.transport
        if transport is None:
            raise ConnectionError("connection has no transport")
        amqp = transport.connection
        async with asyncio.timeout(self._open_timeout):
            channel = await amqp.channel(publisher_confirms=True)
        assert isinstance(channel, aiormq.Channel)
        self.generation += 1
        frame_max = int(amqp.connection_tune.frame_max or 131_072)
        generation = Generation(
            self.generation, channel, frame_max, asyncio.get_running_loop().time()
        )
        self._install_handlers(generation)
        return generation

    def _install_handlers(self, generation: Generation) -> None:
        channel = generation.channel
        events = self._events
        original_close = channel._on_close_frame
        read_header = channel._Channel__get_content_header  # type: ignore[attr-defined]

        async def on_confirm(frame: Basic.Ack | Basic.Nack | Basic.Reject) -> None:
            multiple = bool(getattr(frame, "multiple", False))
            items = generation.tracker.settle(frame.delivery_tag or 0, multiple)
            if items:
                events.confirmed(generation, items, isinstance(frame, Basic.Ack))

        async def on_return(frame: Basic.Return) -> None:
            header = await read_header()
            message = await channel._read_content(frame, header)
            message_id = message.header.properties.message_id
            if message_id:
                events.returned(
                    generation, message_id, frame.reply_code or 0, frame.reply_text or ""
                )

        async def on_close(frame: Any) -> None:
            generation.closing = True  # before close-ok is queued: nothing may follow it
            generation.close_fault = classify_close(
                frame.reply_code, frame.reply_text, connection_level=False
            )
            await original_close(frame)

        channel._on_confirm_frame = on_confirm  # type: ignore[method-assign]
        channel._on_return_frame = on_return  # type: ignore[method-assign]
        channel._on_close_frame = on_close  # type: ignore[method-assign]

    async def _until_lost(self, generation: Generation) -> Fault | None:
        closing = generation.channel.closing
        replace = asyncio.ensure_future(generation.replace_requested.wait())
        try:
            await asyncio.wait((closing, replace), return_when=asyncio.FIRST_COMPLETED)
        finally:
            replace.cancel()
        if generation.close_fault is not None:
            return generation.close_fault
        if closing.done() and not closing.cancelled():
            exc = closing.exception()
            if exc is not None:
                return classify(exc)
        return None


async def close_quietly(channel: aiormq.Channel) -> None:
    """Close a channel that may already be dead, without raising."""
    try:
        async with asyncio.timeout(5):
            await channel.close()
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
    except Exception:  # closing a dead channel may fail in many ways, none of them ours
        return
