"""What a publish ends with: a result, a pending handle, a batch's result, and counters."""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, NamedTuple

from .errors import ReliableMQError

__all__ = (
    "BatchFailure",
    "BatchResult",
    "PendingPublish",
    "PublishResult",
    "PublisherStats",
)


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


@dataclass(frozen=True, slots=True)
class BatchFailure:
    """One message of a ``publish_many()`` batch that did not end confirmed.

    Attributes:
        index: its position in the input (0-based).
        message_id: its id ("" if it failed before one was assigned).
        error: why: a [PublishError][reliable_mq.errors.PublishError], or an
            [InvalidMessage][reliable_mq.errors.InvalidMessage] if it could not
            be encoded (then nothing was sent).
    """

    index: int
    message_id: str
    error: ReliableMQError


@dataclass(frozen=True, slots=True)
class BatchResult:
    """The outcome of ``publish_many()``.

    Every message taken from the input ended confirmed or is in
    `failures`; ``confirmed + len(failures) == taken`` always holds.

    Attributes:
        taken: messages taken from the input.
        confirmed: messages the broker confirmed.
        failures: the others, in input order.
        republished: sends beyond the first (nacks, lost connections...).
        seconds: wall time of the call.
        stopped_early: ``max_failures`` was reached, so the input was not read to its end.
    """

    taken: int
    confirmed: int
    failures: tuple[BatchFailure, ...]
    republished: int
    seconds: float
    stopped_early: bool = False

    @property
    def ok(self) -> bool:
        """True when every message taken was confirmed."""
        return not self.failures


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
    """A message in flight; ``await`` it for its [PublishResult][reliable_mq.outcomes.PublishResult].

    Returned by [enqueue][reliable_mq.publisher.ReliablePublisher.enqueue] once the
    message holds a window slot and its first attempt is written. Cancelling a
    task that awaits it does not cancel the message.
    """

    __slots__ = ("_future", "message_id")

    def __init__(self, message_id: str, future: asyncio.Future[PublishResult]) -> None:
        self.message_id = message_id
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> PublishResult:
        """The result of a finished publish (raises its error; InvalidStateError if pending)."""
        return self._future.result()

    def __await__(self) -> Generator[Any, None, PublishResult]:
        return asyncio.shield(self._future).__await__()
