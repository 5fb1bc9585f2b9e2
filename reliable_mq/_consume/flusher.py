"""One ack flusher for every channel of a consumer: one timer, one write per tick.

A consumer serving K queues has K channels, and each batches its acks
(`reliable_mq._consume.frames.Frames`). When each channel sees few messages,
few batches fill up to ``ack_batch_size``: most acks leave on the
``ack_flush_interval`` timer. One timer, one task, one lock and one socket
write per channel and tick cost more than the deliveries themselves at K = 200,
and aiormq's write queue holds ten items, so the flush tasks queued behind one
another and the acks lagged ever further behind the handlers.

`AckFlusher` keeps the set of channels with batched acks waiting and one timer
for all of them. A channel joins the set when its first ack is batched, so no
ack waits longer than ``ack_flush_interval`` (plus the loop's lag) for its
frame. On the tick, in one synchronous step, it takes every waiting channel's
finished prefix and stragglers (`Frames.take_acks`) and queues their frames
as one item per connection (`reliable_mq._amqp.ConsumeChannel.write_now`).

Nothing awaits between taking the tags and queuing their frames, so no other
frame of those channels can come between the decision and the write. A channel
whose lock is held (a single settle is being written) is left to a flush of its
own, under its lock, as before. When the connection's write queue is full, one
task waits for room and ticks again. Each frame names its own channel's tags
only; a dead channel's tags are never written (its deliveries are back on the
queue).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Protocol

from .._amqp import ConsumeChannel
from .acks import AckTracker

__all__ = ("AckFlusher", "Frames")


class Frames(Protocol):
    """What the flusher needs of a channel's `reliable_mq._consume.frames.Frames`."""

    channel: ConsumeChannel
    tracker: AckTracker
    lock: asyncio.Lock

    def dead(self) -> bool: ...

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None: ...

    async def flush(self, *, stragglers: bool, wait: bool = False) -> None: ...

    def take_acks(self, *, stragglers: bool) -> bytes: ...


class AckFlusher:
    """The consumer-wide timer that writes every channel's batched acks together."""

    __slots__ = ("_handle", "_task", "_waiting", "interval")

    def __init__(self, interval: float) -> None:
        self.interval = interval
        """The longest a batched ack waits for its frame (``ack_flush_interval``)."""
        self._waiting: dict[Frames, None] = {}
        self._handle: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        """Channels with batched acks waiting for the next tick."""
        return len(self._waiting)

    def wait(self, frames: Frames) -> None:
        """``frames`` has a batched ack: write it on the next tick."""
        self._waiting[frames] = None
        if self._handle is None and self._task is None:
            self._handle = asyncio.get_running_loop().call_later(self.interval, self.tick)

    def forget(self, frames: Frames) -> None:
        """``frames``'s channel is gone: drop it."""
        self._waiting.pop(frames, None)

    def tick(self) -> None:
        """Write every waiting channel's batched acks now, one item per connection."""
        self._handle = None
        waiting, self._waiting = self._waiting, {}
        batches: dict[int, list[bytes]] = {}
        writers: dict[int, Frames] = {}
        for frames in waiting:
            if frames.dead() or not frames.tracker.pending:
                continue
            channel = frames.channel
            if frames.lock.locked():  # a single settle is on its way: flush after it
                frames.spawn(frames.flush(stragglers=True))
                continue
            key = channel.link_key
            if key not in batches:
                if not channel.has_room():
                    self._waiting[frames] = None
                    continue
                batches[key] = []
                writers[key] = frames
            batches[key].append(frames.take_acks(stragglers=True))
        for key, encoded in batches.items():
            writers[key].channel.write_now(b"".join(encoded))
        if self._waiting:
            self._task = asyncio.get_running_loop().create_task(self._wait_for_room())

    async def _wait_for_room(self) -> None:
        """The write queue was full: tick again once it has room."""
        try:
            spins = 0
            while self._waiting and not any(
                frames.dead() or frames.channel.has_room() for frames in self._waiting
            ):
                spins += 1
                await asyncio.sleep(0 if spins < 20 else 0.005)
        finally:
            self._task = None
        self.tick()

    def close(self) -> None:
        """Stop the timer and the wait (the consumer has flushed every channel)."""
        self._waiting.clear()
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._task is not None:
            self._task.cancel()
            self._task = None
