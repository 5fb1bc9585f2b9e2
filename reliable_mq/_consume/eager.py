"""Deliveries run at once in a worker task, with a Task of their own only when they wait.

A Task per delivery (``loop.create_task``) was the largest single cost of the
consumer's hot path after the frames themselves: the Task, its first step
scheduled with ``call_soon``, the loop's turn to run it. Most deliveries never
wait: their handler returns without suspending, their dedup claim is answered
from memory, their ack is batched. `Eager` runs each delivery's coroutine
(`reliable_mq._consume.dispatch.Dispatcher._deliver`) in a worker task, one step,
at once; when that step finishes the delivery, the worker takes the next one.

When a delivery does wait (its handler awaits I/O, a slot of ``concurrency``,
a settle's lock), the worker stays with it until it ends, exactly as its own
Task would have (``asyncio.current_task()``, cancels, ``asyncio.timeout`` in the
handler all see one task per waiting delivery), and a new worker takes the
deliveries behind it. So a consumer whose handlers always wait has one task per
delivery, as before, and one whose handlers never wait has one task per batch of
deliveries the connection hands over at once.

Each delivery runs in its own copy of the context, as a Task would: a handler's
context variables never reach the next delivery. A worker whose delivery left a
cancel on it (a handler cancelling its own task) takes no further delivery.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import types
from collections.abc import Coroutine, Generator
from typing import Any

__all__ = ("Eager",)

Step = Coroutine[Any, Any, None]
_ENDED: Any = object()


class Eager:
    """Runs coroutines in worker tasks, one step at once each, in submission order.

    Every coroutine submitted is run to its end: by the worker that takes it, or
    by a worker of its own once it waits. ``on_task`` is told the task running
    it just before its first step (the delivery's ticket records it).
    """

    __slots__ = ("_pending", "_worker", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._pending: collections.deque[tuple[Any, Step]] = collections.deque()
        self._worker: asyncio.Task[None] | None = None

    def submit(self, ticket: Any, coro: Step) -> None:
        """Run ``coro`` soon, after those submitted before it; ``ticket.task`` is set to
        the task running it before it starts."""
        self._pending.append((ticket, coro))
        if self._worker is None:
            self._worker = self.loop.create_task(self._work())

    def _next_worker(self) -> None:
        self._worker = None
        if self._pending:
            self._worker = self.loop.create_task(self._work())

    async def _work(self) -> None:
        pending = self._pending
        task = asyncio.current_task()
        assert task is not None
        copy_context = contextvars.copy_context
        while pending:
            ticket, coro = pending.popleft()
            ticket.task = task
            context = copy_context()
            try:
                # next() with a default: a coroutine that ends returning None raises no
                # StopIteration (coro.send would make one per delivery).
                waits_on = context.run(next, coro.__await__(), _ENDED)
            except BaseException:
                waits_on = _ENDED
            if waits_on is _ENDED:
                if task.cancelling():  # it left a cancel on this task: another takes the rest
                    break
                continue
            # It waits: this task stays with it to its end; another takes the rest.
            self._next_worker()
            await _follow(coro, context, waits_on)
            return
        self._next_worker()


@types.coroutine
def _follow(coro: Step, context: contextvars.Context, waits_on: Any) -> Generator[Any, Any, None]:
    """Drive ``coro`` on from its first suspension, in ``context``, as its Task would:
    what it yields goes to the task running this, what the task sends or throws
    goes to it."""
    send, throw = coro.send, coro.throw
    while True:
        try:
            value = yield waits_on
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as exc:  # a cancel, thrown in by the task: the coroutine's own
            try:
                waits_on = context.run(throw, exc)
            except StopIteration:
                return
        else:
            try:
                waits_on = context.run(send, value)
            except StopIteration:
                return
