"""Declare a work queue with its delayed-retry queues and its dead-letter queue.

For a work queue ``orders`` with retry delays 1 s, 5 s and 30 s:

```
orders              the work queue (x-dead-letter-exchange → orders.dlq, a safety net
                    for plain rejects)
orders.retry.1s     x-message-ttl 1000, dead-letters back to "orders"
orders.retry.5s     x-message-ttl 5000, dead-letters back to "orders"
orders.retry.30s    x-message-ttl 30000, dead-letters back to "orders"
orders.dlq          where poison and malformed messages end, with reason headers
```

A failed message is republished (with confirms) to the retry queue of its
attempt; the broker expires it after the TTL and dead-letters it through the
default exchange back to the work queue. Every queue holds one delay, so
expiry is FIFO and exact (per-message TTLs in one queue would block behind the
head). For quorum queues every queue is a quorum queue and the retry queues
dead-letter ``at-least-once`` (which needs ``x-overflow: reject-publish``), so
the hop back cannot lose a message.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from aio_pika.abc import AbstractChannel

__all__ = ("QueueTopology", "QueueType", "declare_topology", "delete_topology")


class QueueType(enum.StrEnum):
    """The RabbitMQ queue type to declare."""

    CLASSIC = "classic"
    """Classic durable queues; redeliveries only show as the ``redelivered`` flag."""
    QUORUM = "quorum"
    """Replicated quorum queues; the broker counts deliveries in ``x-delivery-count``."""


def _delay_label(seconds: float) -> str:
    return f"{seconds:g}s"


@dataclass(frozen=True)
class QueueTopology:
    """The queues that serve one work queue.

    Attributes:
        queue: the work queue name.
        queue_type: classic or quorum (applies to every queue of the set).
        retry_delays: seconds before attempt 2, 3, ...; the last one repeats.
        dead_letter_queue: the DLQ name (default ``{queue}.dlq``).
        arguments: extra ``x-`` arguments for the work queue only.
    """

    queue: str
    queue_type: QueueType = QueueType.CLASSIC
    retry_delays: tuple[float, ...] = (1.0, 5.0, 30.0)
    dead_letter_queue: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.queue:
            raise ValueError("queue name must not be empty")
        if not self.retry_delays or any(d <= 0 for d in self.retry_delays):
            raise ValueError("retry_delays must be a non-empty list of positive seconds")
        if not self.dead_letter_queue:
            object.__setattr__(self, "dead_letter_queue", f"{self.queue}.dlq")
        object.__setattr__(self, "queue_type", QueueType(self.queue_type))

    def retry_queue(self, delay: float) -> str:
        """The retry queue name for ``delay`` seconds."""
        return f"{self.queue}.retry.{_delay_label(delay)}"

    def retry_queue_for(self, failed_attempt: int) -> tuple[str, float]:
        """The retry queue (and its delay) after attempt ``failed_attempt`` failed."""
        index = min(max(failed_attempt, 1) - 1, len(self.retry_delays) - 1)
        delay = self.retry_delays[index]
        return self.retry_queue(delay), delay

    def nearest_retry_queue(self, delay: float) -> tuple[str, float]:
        """The declared retry queue whose delay is closest to ``delay``."""
        best = min(self.retry_delays, key=lambda d: abs(d - delay))
        return self.retry_queue(best), best

    @property
    def retry_queues(self) -> tuple[str, ...]:
        """Every retry queue name, one per distinct delay."""
        return tuple(self.retry_queue(d) for d in sorted(set(self.retry_delays)))

    @property
    def all_queues(self) -> tuple[str, ...]:
        return (self.queue, *self.retry_queues, self.dead_letter_queue)

    def _type_args(self) -> dict[str, Any]:
        if self.queue_type is QueueType.QUORUM:
            return {"x-queue-type": "quorum"}
        return {}

    def work_queue_arguments(self) -> dict[str, Any]:
        return {
            **self._type_args(),
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": self.dead_letter_queue,
            **self.arguments,
        }

    def retry_queue_arguments(self, delay: float) -> dict[str, Any]:
        args: dict[str, Any] = {
            **self._type_args(),
            "x-message-ttl": max(1, round(delay * 1000)),
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": self.queue,
        }
        if self.queue_type is QueueType.QUORUM:
            args["x-dead-letter-strategy"] = "at-least-once"
            args["x-overflow"] = "reject-publish"
        return args

    def dead_letter_queue_arguments(self) -> dict[str, Any]:
        return self._type_args()


async def declare_topology(channel: AbstractChannel, topology: QueueTopology) -> None:
    """Declare (idempotently) every queue of ``topology``, all durable.

    Raises:
        aio_pika.exceptions.ChannelPreconditionFailed: a queue exists with other
            arguments (the channel is closed by the broker).
    """
    await channel.declare_queue(
        topology.dead_letter_queue, durable=True, arguments=topology.dead_letter_queue_arguments()
    )
    for delay in sorted(set(topology.retry_delays)):
        await channel.declare_queue(
            topology.retry_queue(delay),
            durable=True,
            arguments=topology.retry_queue_arguments(delay),
        )
    await channel.declare_queue(
        topology.queue, durable=True, arguments=topology.work_queue_arguments()
    )


async def delete_topology(channel: AbstractChannel, topology: QueueTopology) -> None:
    """Delete every queue of ``topology`` (their messages are lost; for tests and tooling)."""
    for name in topology.all_queues:
        await channel.queue_delete(name)
