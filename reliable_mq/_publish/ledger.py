"""Who holds a window slot and a message id, and who still waits for an outcome.

The engine's accounting, kept apart from its policy: the publisher is *idle*
(``flush()`` and ``close()`` return) when no admitted message is outstanding,
no caller waits for admission and no ``publish_many()`` is running. A message
holds its slot and its id until it is both final and off every channel
(`release`); a later publish of the same id waits for that (`followers`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from .outgoing import Outgoing
from .window import Window

__all__ = ("Ledger",)


class Ledger:
    """The slots, ids and waiting callers of one publisher.

    Args:
        size: the window (``max_in_flight``).
        on_idle: called each time the publisher becomes idle.
    """

    __slots__ = ("_batches", "_by_id", "_idle", "_on_idle", "_outstanding", "_waiting", "window")

    def __init__(self, size: int, on_idle: Callable[[], None]) -> None:
        self.window = Window(size)
        self._on_idle = on_idle
        self._by_id: dict[str, Outgoing] = {}
        """Every admitted message until it is final and off every channel."""
        self._outstanding = 0
        """Admitted messages whose caller does not have the outcome yet."""
        self._waiting = 0
        """Callers between hand-over and admission (a window slot, their id, their exchange)."""
        self._batches = 0
        """``publish_many()`` calls running (their input was handed over as a whole)."""
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def pending(self) -> int:
        """Callers without an outcome: admitted and outstanding, or waiting for admission."""
        return self._outstanding + self._waiting

    @property
    def idle(self) -> bool:
        return self._idle.is_set()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    @property
    def busy(self) -> bool:
        """Anything admitted, waiting or running: a channel is still needed."""
        return bool(self._by_id) or bool(self._waiting or self._batches)

    def holder(self, message_id: str) -> Outgoing | None:
        """The admitted message that owns ``message_id`` now, if any."""
        return self._by_id.get(message_id)

    def admitted(self) -> list[Outgoing]:
        """Every admitted message, final or not, still holding its slot."""
        return list(self._by_id.values())

    def hold(self) -> None:
        """A caller waits for admission: not idle until `unhold`."""
        self._waiting += 1
        self._idle.clear()

    def unhold(self) -> None:
        self._waiting -= 1
        if not self._waiting and not self._outstanding:
            self._went_idle()

    def begin_batch(self) -> None:
        """A ``publish_many()`` runs: not idle until `end_batch`."""
        self._batches += 1
        self._idle.clear()

    def end_batch(self) -> None:
        self._batches -= 1
        if not self._batches and not self._outstanding:
            self._went_idle()

    def admit(self, out: Outgoing) -> None:
        """``out`` holds its slot (taken already) and now its id: its caller waits."""
        self._by_id[out.message_id] = out
        self._outstanding += 1
        if self._outstanding == 1:
            self._idle.clear()

    def resolved(self) -> None:
        """An admitted message's caller has its outcome."""
        self._outstanding -= 1
        if not self._outstanding:
            self._went_idle()

    def release(self, out: Outgoing) -> None:
        """``out`` is final and off every channel: its slot and its id are free."""
        if self._by_id.get(out.message_id) is out:
            del self._by_id[out.message_id]
            self.window.release()
            followers = out.followers
            if followers:
                out.followers = None
                for waiter in followers:
                    if not waiter.done():
                        waiter.set_result(None)

    def _went_idle(self) -> None:
        if self._waiting or self._batches:
            return
        self._idle.set()
        self._on_idle()
