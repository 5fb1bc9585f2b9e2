"""How a publisher ends: ``close(timeout)``, its abort, and I/O that stops under it.

Every caller handed over gets an outcome, on every path:

* ``close()`` waits while its timeout lasts for the engine to be idle (nothing
  outstanding, nobody waiting for admission, no batch running): what was
  handed over keeps being published. Then it aborts: every caller without an
  outcome fails with ``PublishAborted``, counted in one error line.
* a cancelled ``close()`` aborts the same way at once, then re-raises.
* a task the publisher cannot work without (its channel keeper, its deadline
  sweep, its connection supervision) ending without ``close()``, as the event
  loop's shutdown does to every task: nothing in flight can be confirmed any
  more, so every caller fails now rather than after ``close_timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Protocol

__all__ = ("Closable", "Closing", "task_end")

_LEAVE_TIMEOUT = 1.0
"""Seconds an abort waits for the callers it woke to leave admission (they only
need a loop iteration each; the bound is for a caller stuck elsewhere)."""


class Closable(Protocol):
    """What closing asks of the engine (`reliable_mq._publish.engine.Engine`)."""

    @property
    def idle(self) -> bool:
        """No caller waits for an outcome."""
        ...

    async def wait_idle(self) -> None: ...

    def stop_taking(self) -> None:
        """No channel is needed once nothing is left to send."""
        ...

    def abort(self, why: str = "") -> int:
        """Fail every caller without an outcome; return how many."""
        ...


class Closing:
    """The end of one publisher's life; owns ``close()``'s once-only state.

    Args:
        engine: the publisher's engine (its idle event and its abort).
        log: the publisher's bound logger.
    """

    __slots__ = ("_log", "done", "engine", "io_gone", "stopping_io")

    def __init__(self, engine: Closable, log: Any) -> None:
        self.engine = engine
        self._log = log
        self.done: asyncio.Event | None = None
        """Created by the first ``close()``, set when it has finished."""
        self.io_gone: str | None = None
        """Why the publisher's I/O stopped without ``close()`` (see `io_stopped`)."""
        self.stopping_io = False
        """The publisher is stopping its own tasks: their ends are expected."""

    async def settle(self, wait: float) -> None:
        """Let every caller get its outcome within ``wait`` seconds; abort the rest.

        Raises:
            CancelledError: ``close()`` was cancelled (every caller was aborted first).
        """
        engine = self.engine
        try:
            if not engine.idle:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await engine.wait_idle()
            if not engine.idle:
                await self.abort(f"close() waited {wait:g}s", timeout=wait)
        except asyncio.CancelledError:
            await self.abort("close() was cancelled", cancelled=True)
            raise

    async def abort(self, why: str, **fields: Any) -> None:
        """Fail every caller without an outcome (PublishAborted); log how many."""
        engine = self.engine
        count = engine.abort()
        if count:
            self._log.error("close_aborted", aborted=count, reason=why, **fields)
        # Callers waiting for admission were woken with their error: let them leave.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_LEAVE_TIMEOUT):
                await engine.wait_idle()

    def io_stopped(self, why: str) -> bool:
        """A task the publisher needs ended, not by ``close()``: fail every caller now.

        Returns:
            True the first time (the publisher then refuses new calls).
        """
        if self.stopping_io or self.io_gone is not None:
            return False
        self.io_gone = why
        engine = self.engine
        engine.stop_taking()
        count = engine.abort(f"the publisher stopped ({why})")
        if count:
            self._log.error("publisher_io_stopped", reason=why, aborted=count)
        else:
            self._log.info("publisher_io_stopped", reason=why, aborted=0)
        return True


def task_end(task: asyncio.Task[Any], what: str) -> str:
    """How ``task`` (one of the publisher's, named ``what``) ended, in words."""
    if task.cancelled():
        return f"{what} was cancelled"
    exc = task.exception()
    return f"{what} failed: {exc!r}" if exc is not None else f"{what} ended"
