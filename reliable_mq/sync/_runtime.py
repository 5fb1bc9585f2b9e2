"""The per-process half of a BlockingPublisher: loop thread, async publisher, hand-over queue.

Callers append submissions to a deque from any thread; the loop is woken once
per batch of appends (``scheduled`` is cleared before the queue is emptied, so
no append is missed) and hands each message to ``publish_with_callback`` (no
task, no future per message). Each outcome goes to
the submission's *sink*: a ``concurrent.futures.Future`` for ``submit()``, or
a `Waiter` (a bare lock, cheaper) for a blocking ``publish()``.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections import deque
from functools import partial
from typing import Any, Protocol, TypeAlias

from ..errors import PublishAborted, ReliableMQError
from ..message import MessageOptions
from ..outcomes import PublishResult
from ..publisher import ReliablePublisher
from ._loop import LoopThread

__all__ = ("Runtime", "Sink", "Submission", "Waiter")


class Sink(Protocol):
    """Where one submission's outcome goes (a concurrent Future fits)."""

    def set_running_or_notify_cancel(self) -> bool: ...
    def set_result(self, result: PublishResult) -> None: ...
    def set_exception(self, exception: BaseException | None) -> None: ...


class Waiter:
    """A one-shot outcome for a blocking ``publish()``: one lock, released once."""

    __slots__ = ("_done", "error", "result")

    def __init__(self) -> None:
        self._done = threading.Lock()
        self._done.acquire()
        self.result: PublishResult | None = None
        self.error: BaseException | None = None

    def set_running_or_notify_cancel(self) -> bool:
        return True

    def set_result(self, result: PublishResult) -> None:
        self.result = result
        self._done.release()

    def set_exception(self, exception: BaseException | None) -> None:
        self.error = exception
        self._done.release()

    def wait(self, timeout: float) -> bool:
        """True once the outcome is in (then read ``result`` or ``error``)."""
        return self._done.acquire(timeout=timeout)


Submission: TypeAlias = tuple[
    Sink,
    Any,  # body
    str,  # routing key
    str,  # exchange
    "float | None",  # timeout
    MessageOptions,
    contextvars.Context,
    bool,  # holds a max_pending slot (submit())
]


class Runtime:
    """The loop thread and the async publisher it owns, for one process."""

    __slots__ = (
        "active",
        "dead",
        "idle",
        "pending",
        "publisher",
        "queue",
        "scheduled",
        "slots",
        "thread",
    )

    def __init__(self, thread: LoopThread, publisher: ReliablePublisher, max_pending: int) -> None:
        self.thread = thread
        self.publisher = publisher
        self.slots = threading.BoundedSemaphore(max_pending)
        self.queue: deque[Submission] = deque()
        self.scheduled = False
        self.dead = False
        self.active = 0
        """Loop thread only: publishes started and not yet settled."""
        self.pending: dict[Sink, str] = {}
        """Sinks handed to the async publisher and not settled yet, with their message
        ids. Whoever pops a sink settles it: the loop thread, or `abandon` when the
        loop thread did not finish in time (dict.pop is atomic)."""
        self.idle: asyncio.Event | None = None

    def push(self, item: Submission) -> None:
        """Any thread: queue a message and wake the loop if no drain is pending."""
        self.queue.append(item)
        if self.dead:
            self.sweep()
        elif not self.scheduled:
            # A drain clears `scheduled` before it empties the queue, so an item
            # appended before we read True here is still taken by that drain.
            self.scheduled = True
            try:
                self.thread.loop.call_soon_threadsafe(self.drain)
            except RuntimeError:  # the loop is closed
                self.dead = True
                self.sweep()

    def drain(self) -> None:
        """Loop thread: start every queued message (no task per message)."""
        self.scheduled = False
        queue = self.queue
        publish = self.publisher.publish_with_callback
        settle = self.settle
        while queue:
            sink, body, routing_key, exchange, timeout, options, context, bounded = queue.popleft()
            if not sink.set_running_or_notify_cancel():
                if bounded:
                    self.slots.release()  # cancelled by the caller before we took it
                continue
            self.active += 1
            self.pending[sink] = options.get("message_id") or ""
            context.run(
                publish,
                partial(settle, sink, bounded),
                body,
                routing_key=routing_key,
                exchange=exchange,
                timeout=timeout,
                **options,
            )

    def settle(
        self,
        sink: Sink,
        bounded: bool,
        result: PublishResult | None,
        error: ReliableMQError | None,
    ) -> None:
        """Loop thread: pass a finished publish to its sink."""
        if bounded:
            self.slots.release()
        self.active -= 1
        if not self.active and self.idle is not None:
            self.idle.set()
        if self.pending.pop(sink, None) is None:
            return  # abandoned already (the close gave up on this thread)
        if error is None:
            assert result is not None
            sink.set_result(result)
        else:
            sink.set_exception(error)

    def sweep(self) -> int:
        """Any thread: fail messages the loop never took (it stopped first); how many.

        Each fails with ``PublishAborted`` (``attempts=0``: never sent).
        """
        count = 0
        while True:
            try:
                sink, _, _, _, _, options, _, bounded = self.queue.popleft()
            except IndexError:
                return count
            if bounded:
                self.slots.release()
            if sink.set_running_or_notify_cancel():
                sink.set_exception(
                    PublishAborted(
                        "the publisher closed before this message was sent; never sent",
                        message_id=options.get("message_id") or "",
                        attempts=0,
                    )
                )
                count += 1

    def abandon(self) -> int:
        """Any thread: the loop thread did not finish closing; fail what it still holds.

        Each message it had taken and not settled fails with ``PublishAborted``
        (its outcome is unknown: the broker may have it). Returns how many.
        """
        count = 0
        while self.pending:
            try:
                sink, message_id = self.pending.popitem()
            except KeyError:
                break  # the loop thread settled the last ones meanwhile
            sink.set_exception(
                PublishAborted(
                    "the publisher's loop thread did not finish closing in time; "
                    "the broker may have it",
                    message_id=message_id,
                    attempts=0,
                )
            )
            count += 1
        return count

    async def flush(self) -> None:
        """Loop thread: return once every message handed over so far is settled."""
        self.drain()
        if self.active:
            if self.idle is None:
                self.idle = asyncio.Event()
            self.idle.clear()
            await self.idle.wait()

    async def close(self, wait: float) -> None:
        """Loop thread: publish what was handed over, then close the async publisher.

        Every message drained here is counted by the async publisher at once
        (admitted, or waiting for a slot): its ``close()`` waits for them all.
        """
        self.drain()
        await self.publisher.close(wait)
