"""TEMPORARY: ``publish_many`` types and a stand-in, until the async one lands on main.

The lead is adding ``Message``, ``BatchResult``, ``BatchFailure`` and
``ReliablePublisher.publish_many`` (see notes/TEAM.md). Until that is merged,
this module gives the blocking facade the same contract, built on
``ReliablePublisher.enqueue()``. Once main has them, delete this module and
import the real ones: the facade calls :func:`publish_many` in one place only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..errors import PublishBatchError, ReliableMQError
from ..outcomes import PendingPublish
from ..publisher import ReliablePublisher

__all__ = ("BatchFailure", "BatchResult", "Message", "publish_many")


@dataclass(frozen=True, slots=True)
class Message:
    """One outgoing message for ``publish_many()``."""

    body: Any
    routing_key: str
    exchange: str = ""
    message_id: str | None = None
    headers: Mapping[str, Any] | None = None
    persistent: bool | None = None
    mandatory: bool | None = None
    content_type: str | None = None
    correlation_id: str | None = None
    reply_to: str | None = None
    expiration: float | None = None
    priority: int | None = None
    message_type: str | None = None
    app_id: str | None = None
    timestamp: datetime | None = None


@dataclass(frozen=True)
class BatchFailure:
    """One message of a batch that did not end confirmed."""

    index: int
    message_id: str
    error: ReliableMQError


@dataclass(frozen=True)
class BatchResult:
    """What a ``publish_many()`` call did."""

    taken: int
    confirmed: int
    failures: tuple[BatchFailure, ...]
    republished: int
    seconds: float
    stopped_early: bool


_OPTION_FIELDS = (
    "message_id",
    "headers",
    "persistent",
    "mandatory",
    "content_type",
    "correlation_id",
    "reply_to",
    "expiration",
    "priority",
    "message_type",
    "app_id",
    "timestamp",
)


async def publish_many(
    publisher: ReliablePublisher,
    messages: AsyncIterable[Message],
    *,
    timeout: float | None = None,
    max_failures: int | None = None,
    raise_on_error: bool = True,
) -> BatchResult:
    """Publish a stream of messages through ``enqueue()`` (the window bounds memory)."""
    started = time.monotonic()
    republished_before = publisher.stats().republished
    failures: list[BatchFailure] = []
    waiting: set[asyncio.Task[None]] = set()
    confirmed = taken = 0
    stopped_early = False

    async def outcome(index: int, pending: PendingPublish) -> None:
        nonlocal confirmed
        try:
            await pending
        except ReliableMQError as exc:
            failures.append(BatchFailure(index, pending.message_id, exc))
        else:
            confirmed += 1

    async for message in messages:
        if max_failures is not None and len(failures) >= max_failures:
            stopped_early = True
            break
        index = taken
        taken += 1
        options = {name: getattr(message, name) for name in _OPTION_FIELDS}
        try:
            pending = await publisher.enqueue(
                message.body,
                routing_key=message.routing_key,
                exchange=message.exchange,
                timeout=timeout,
                **{k: v for k, v in options.items() if v is not None},
            )
        except ReliableMQError as exc:
            failures.append(BatchFailure(index, message.message_id or "", exc))
            continue
        task = asyncio.get_running_loop().create_task(outcome(index, pending))
        waiting.add(task)
        task.add_done_callback(waiting.discard)
    if waiting:
        await asyncio.gather(*waiting)
    result = BatchResult(
        taken=taken,
        confirmed=confirmed,
        failures=tuple(sorted(failures, key=lambda failure: failure.index)),
        republished=publisher.stats().republished - republished_before,
        seconds=time.monotonic() - started,
        stopped_early=stopped_early,
    )
    if failures and raise_on_error:
        raise PublishBatchError(f"{len(failures)} of {taken} messages failed", result)
    return result
