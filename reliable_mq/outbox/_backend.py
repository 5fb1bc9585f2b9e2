"""The relay's seam to its database: claim a batch, finish it, wait for work, count the backlog.

Two implementations: [PostgresBackend][reliable_mq.outbox._postgres.PostgresBackend]
(``FOR UPDATE SKIP LOCKED``, the batch's transaction held until its confirms are
in, ``LISTEN/NOTIFY``) and ``SQLiteBackend`` (a lease per claimed row, polling).

Both pick the same rows: the oldest pending rows without an ordering key, and
for each ordering key only its oldest pending row (its head), and only if that
row is free and due. Keys are visited ``scan_limit`` at a time, in key order,
each claim going on from where the last one stopped (wrapping around), so a key
with a long backlog takes one row per claim and never hides the other keys.
A key's next row is claimable once its head is gone (confirmed, or
dead-lettered); a head that backs off after a failure keeps its key waiting.
So one key's rows are dispatched one after the other, whichever relay takes
them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ("Backend", "Backlog", "OutboxRow", "RowOutcome", "RowResult")


@dataclass(frozen=True, slots=True)
class OutboxRow:
    """One claimed outbox row, as the relay publishes it.

    Attributes:
        id: the row's id (its place in the outbox order).
        message_id: the id the message carries; consumers dedupe by it.
        exchange: the exchange to publish to ("" is the default exchange).
        routing_key: the routing key.
        ordering_key: rows with the same key are dispatched in ``id`` order.
        body: the encoded body.
        properties: ``content_type``, ``headers`` and the other AMQP properties.
        attempts: failed dispatch attempts before this one.
        created_at: when the writing transaction started (Unix seconds).
    """

    id: int
    message_id: str
    exchange: str
    routing_key: str
    ordering_key: str | None
    body: bytes
    properties: dict[str, Any]
    attempts: int
    created_at: float


class RowOutcome(enum.StrEnum):
    """What one dispatch attempt did to a row."""

    CONFIRMED = "confirmed"
    """The broker confirmed it: the row is deleted (or kept as ``sent``)."""

    RETRY = "retry"
    """Nacked, or not confirmed while the broker was reachable: one attempt counted,
    pending again after a backoff (``dead`` once ``max_attempts`` are spent)."""

    DEFERRED = "deferred"
    """The broker could not be reached: pending again as it was, no attempt counted."""

    DEAD = "dead"
    """Refused for good (unroutable, too large, refused), or out of attempts:
    moved to the ``dead`` state with its reason."""


@dataclass(frozen=True, slots=True)
class RowResult:
    """The outcome of one row in a batch, with the reason for RETRY and DEAD."""

    row: OutboxRow
    outcome: RowOutcome
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Backlog:
    """Pending rows now, and the age in seconds of the oldest (0 when none)."""

    pending: int
    oldest_age: float


class Backend(Protocol):
    """One relay's connection(s) to the outbox table.

    Every method raises ``OutboxUnavailable`` when the database cannot be
    used; the relay then calls `reset()` and tries again later.
    """

    async def open(self) -> None:
        """Connect (and start listening, where the backend can)."""
        ...

    async def close(self) -> None:
        """Release a batch in progress and disconnect; never raises."""
        ...

    async def reset(self) -> None:
        """Drop the connections after a failure; the next call reconnects."""
        ...

    async def claim(self, limit: int) -> list[OutboxRow]:
        """Claim up to ``limit`` rows; the batch stays open until `finish()` or `abandon()`."""
        ...

    async def finish(self, results: list[RowResult]) -> None:
        """Record every row's outcome and end the batch (one commit)."""
        ...

    async def abandon(self) -> None:
        """End the batch recording nothing: its rows are free to claim again."""
        ...

    async def wait_for_work(self, timeout: float) -> bool:
        """Wait until new rows may be there (a notification) or ``timeout``; True if notified."""
        ...

    def forget_notifications(self) -> None:
        """Forget notifications seen so far (called before each claim)."""
        ...

    @property
    def listening(self) -> bool:
        """True while notifications can wake the relay."""
        ...

    async def backlog(self) -> Backlog:
        """Count pending rows and measure the oldest one's age."""
        ...

    async def cleanup(self, *, keep_sent: float, keep_dead: float | None, batch: int) -> int:
        """Delete ``sent`` rows older than ``keep_sent`` and ``dead`` rows older than
        ``keep_dead`` (never if None), ``batch`` rows per statement; return how many."""
        ...
