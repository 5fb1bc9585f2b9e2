"""The sink of one ``publish_many()`` call: counts outcomes without a future per message."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable, Awaitable, Callable, Iterable
from typing import Any

from ..errors import PublishBatchError, ReliableMQError
from ..outcomes import BatchFailure, BatchResult

__all__ = ("Batch", "run_batch")


class Batch:
    """Collects the outcomes of one batch; `wait()` returns when all are in."""

    __slots__ = (
        "_done",
        "_started",
        "confirmed",
        "failures",
        "open",
        "pending",
        "republished",
        "taken",
    )

    def __init__(self) -> None:
        self._started = time.monotonic()
        self._done = asyncio.Event()
        self.taken = 0
        self.pending = 0
        self.confirmed = 0
        self.republished = 0
        self.open = True
        """True while the input is still being read."""
        self.failures: list[BatchFailure] = []

    def took(self) -> None:
        self.taken += 1
        self.pending += 1

    def succeeded(self) -> None:
        self.confirmed += 1
        self._settled()

    def failed(self, index: int, message_id: str, error: ReliableMQError) -> None:
        self.failures.append(BatchFailure(index, message_id, error))
        self._settled()

    def rejected(self, index: int, message_id: str, error: ReliableMQError) -> None:
        """A message that failed before it was taken in flight (could not be encoded)."""
        self.taken += 1
        self.failures.append(BatchFailure(index, message_id, error))

    def _settled(self) -> None:
        self.pending -= 1
        if not self.pending and not self.open:
            self._done.set()

    def close_input(self) -> None:
        self.open = False
        if not self.pending:
            self._done.set()

    async def wait(self) -> None:
        await self._done.wait()

    def result(self, stopped_early: bool) -> BatchResult:
        self.failures.sort(key=lambda failure: failure.index)
        return BatchResult(
            taken=self.taken,
            confirmed=self.confirmed,
            failures=tuple(self.failures),
            republished=self.republished,
            seconds=time.monotonic() - self._started,
            stopped_early=stopped_early,
        )


async def run_batch(
    messages: Iterable[Any] | AsyncIterable[Any],
    take: Callable[[Batch, int, Any], Awaitable[bool]],
    batch: Batch,
    *,
    raise_on_error: bool,
) -> BatchResult:
    """Hand each message to ``take(batch, index, message)`` until it says stop; wait for
    every outcome (counted in ``batch``), and return the result.

    Raises:
        PublishBatchError: some messages failed and ``raise_on_error`` is set.
    """
    stopped_early = False
    try:
        if isinstance(messages, AsyncIterable):
            index = 0
            async for message in messages:
                if await take(batch, index, message):
                    stopped_early = True
                    break
                index += 1
        else:
            for index, message in enumerate(messages):
                if await take(batch, index, message):
                    stopped_early = True
                    break
    finally:
        batch.close_input()
    await batch.wait()
    result = batch.result(stopped_early)
    if raise_on_error and result.failures:
        first = result.failures[0]
        raise PublishBatchError(
            f"{len(result.failures)} of {result.taken} messages failed; first "
            f"(index {first.index}): {type(first.error).__name__}: {first.error}",
            result,
        )
    return result
