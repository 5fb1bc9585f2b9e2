"""Carry a synchronous iterable's items to an async consumer on a loop, in chunks.

The blocking ``publish_many()`` iterates the caller's iterable in the caller's
thread (it may be a generator doing I/O: it must not run on the event loop)
and hands the items over in chunks, so the loop is woken once per chunk, not
once per message. A bounded number of chunks in transit keeps memory flat
however long the iterable is.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Generic, TypeVar

__all__ = ("ChunkFeed",)

_T = TypeVar("_T")

CHUNK_SIZE = 256
"""Items per chunk at most."""
CHUNK_AGE = 0.005
"""A partial chunk is handed over once its first item is this old (seconds)."""
MAX_CHUNKS = 8
"""Chunks in transit at most; the producer waits beyond that (backpressure)."""


class ChunkFeed(Generic[_T]):
    """One producer thread, one async consumer on ``loop``.

    The producer calls `produce` (it blocks while the feed is full), the
    consumer iterates `items`. Either side may stop early: the
    producer stops taking items once the consumer is gone.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._chunks: deque[list[_T]] = deque()
        self._space = threading.Semaphore(MAX_CHUNKS)
        self._waiting = False
        self._wake: asyncio.Future[None] | None = None
        self._finished = False
        self.stopped = False
        """The consumer is gone (it stopped early, or ended)."""

    # -- producer side (the caller's thread) ----------------------------------

    def produce(self, items: Iterable[_T], alive: Callable[[], bool]) -> None:
        """Hand every item over, until the consumer stops or ``alive()`` turns false.

        Errors from iterating ``items`` propagate (the items before are still
        handed over); call `finish` afterwards in every case.
        """
        chunk: list[_T] = []
        born = 0.0
        try:
            for item in items:
                if not chunk:
                    if self.stopped:
                        return
                    born = time.monotonic()
                chunk.append(item)
                if len(chunk) >= CHUNK_SIZE or time.monotonic() - born >= CHUNK_AGE:
                    if not self._put(chunk, alive):
                        return
                    chunk = []
        finally:
            if chunk:  # also when iterating raised: the items before it still go
                self._put(chunk, alive)

    def finish(self) -> None:
        """No more items: the consumer ends once it has taken what is in transit."""
        self._finished = True
        self._poke()

    def _put(self, chunk: list[_T], alive: Callable[[], bool]) -> bool:
        while not self._space.acquire(timeout=0.5):
            if self.stopped or not alive():
                return False
        if self.stopped:
            return False
        self._chunks.append(chunk)
        self._poke()
        return True

    def _poke(self) -> None:
        # Read after the append: if the consumer set _waiting before we read it,
        # we wake it; if not, it re-checks the chunks after setting it.
        if self._waiting:
            self._waiting = False
            try:
                self._loop.call_soon_threadsafe(self._wake_consumer)
            except RuntimeError:  # the loop is closed: nobody to wake
                self.stopped = True

    # -- consumer side (the loop) ----------------------------------------------

    def _wake_consumer(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def items(self) -> AsyncIterator[_T]:
        """Yield the items in order; ends when the producer is finished."""
        chunks = self._chunks
        try:
            while True:
                if chunks:
                    chunk = chunks.popleft()
                    self._space.release()
                    for item in chunk:
                        yield item
                    continue
                if self._finished:
                    if chunks:  # appended just before finish()
                        continue
                    return
                self._wake = self._loop.create_future()
                self._waiting = True
                if chunks or self._finished:
                    self._waiting = False
                    continue
                await self._wake
        finally:
            self.stopped = True
            self._space.release()  # wake a producer waiting for room
