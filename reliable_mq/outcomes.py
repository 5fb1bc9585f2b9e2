"""What a publish ends with: a result, a pending handle, and the publisher's counters."""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = ("PendingPublish", "PublishResult", "PublisherStats")


@dataclass(frozen=True, slots=True)
class PublishResult:
    """A confirmed message.

    Attributes:
        message_id: the id it carried on every attempt.
        attempts: how many times it was sent (more than 1 means republished).
        confirm_latency: seconds from the last send to the broker's ack.
        elapsed: seconds from ``publish()`` to the ack, waits included.
    """

    message_id: str
    attempts: int
    confirm_latency: float
    elapsed: float


class PublisherStats(NamedTuple):
    """Counters of one publisher since it started (cheap to read)."""

    published: int
    confirmed: int
    nacked: int
    returned: int
    republished: int
    failed: int
    in_flight: int
    max_in_flight_seen: int
    channel_generation: int


class PendingPublish:
    """A message in flight; ``await`` it for its `PublishResult`.

    Returned by `ReliablePublisher.enqueue()` once the message holds a
    window slot and its first attempt is written to the channel.
    """

    __slots__ = ("_task", "message_id")

    def __init__(self, message_id: str, task: asyncio.Task[PublishResult]) -> None:
        self.message_id = message_id
        self._task = task

    def done(self) -> bool:
        return self._task.done()

    def result(self) -> PublishResult:
        """The result of a finished publish (raises its error; InvalidStateError if pending)."""
        return self._task.result()

    def __await__(self) -> Generator[Any, None, PublishResult]:
        return asyncio.shield(self._task).__await__()
