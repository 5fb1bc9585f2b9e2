"""The bounded in-flight window: backpressure for publishers.

A semaphore whose waiters carry deadlines that one periodic sweep enforces
(a timer per waiting caller was a measurable share of the hot path), that can
fail every waiter at once (for ``close()``), and that remembers its high-water
mark (for tests and the bounds suite).
"""

from __future__ import annotations

import asyncio
from collections import deque

__all__ = ("Window",)


class Window:
    """At most ``size`` slots taken; acquirers beyond that wait in FIFO order."""

    __slots__ = ("_earliest", "_waiters", "high_water", "size", "taken")

    def __init__(self, size: int) -> None:
        self.size = size
        self.taken = 0
        self.high_water = 0
        self._waiters: deque[tuple[asyncio.Future[None], float]] = deque()
        self._earliest = float("inf")  # no waiter's deadline is before this

    def try_acquire(self) -> bool:
        """Take a slot if one is free right now, without waiting."""
        waiters = self._waiters
        while waiters and waiters[0][0].done():
            waiters.popleft()  # timed out or cancelled while queued
        if self.taken < self.size and not waiters:
            self.taken += 1
            self.high_water = max(self.high_water, self.taken)
            return True
        return False

    async def acquire(self, deadline: float) -> None:
        """Wait for a slot until ``deadline`` (loop time; enforced by `expire()`).

        Raises:
            TimeoutError: the deadline passed first.
        """
        if self.try_acquire():
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((waiter, deadline))
        self._earliest = min(self._earliest, deadline)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.release()  # we were handed a slot but are leaving: pass it on
            raise

    def release(self) -> None:
        """Free a slot, handing it straight to the oldest live waiter."""
        waiters = self._waiters
        while waiters:
            waiter, _ = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot moves to the waiter: taken stays
                return
        self.taken -= 1

    def expire(self, now: float) -> None:
        """Fail every waiter whose deadline has passed (a no-op until the earliest one)."""
        if now < self._earliest:
            return
        earliest = float("inf")
        for waiter, deadline in self._waiters:
            if waiter.done():
                continue
            if deadline <= now:
                waiter.set_exception(TimeoutError())
            else:
                earliest = min(earliest, deadline)
        self._earliest = earliest

    def fail_waiters(self, exc: BaseException) -> None:
        """Make every current waiter raise ``exc`` (used when closing)."""
        while self._waiters:
            waiter, _ = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(exc)
