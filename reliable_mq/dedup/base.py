"""The de-duplication seam: claim a message id, run the handler, complete or release.

A delivery's ``message_id`` is claimed with a lease before its handler runs, so
two consumers holding copies of one message (a publisher republish, a
redelivery after a dead channel) never run it at the same time; completing it
keeps the id as *done* for a retention window, so later copies are acked and
skipped. A lease outlives its claimer only ``lease`` seconds: if the process
died, another consumer may claim the id again.

Every store raises `DedupStoreUnavailable` when it cannot answer. That
is fail safe on purpose: the caller must neither ack nor run the handler, but
leave the message to be delivered again later.
"""

from __future__ import annotations

import enum
from typing import Protocol, runtime_checkable

from ..errors import ConsumerError

__all__ = (
    "AlreadyProcessed",
    "ClaimResult",
    "DedupStore",
    "DedupStoreUnavailable",
    "InvalidBatch",
)


class ClaimResult(enum.Enum):
    """What `DedupStore.claim()` decided for one delivery."""

    CLAIMED = "claimed"
    """The id is now yours until the lease ends: run the handler, then complete or release."""

    DONE = "done"
    """Already processed within the retention window: ack and skip the handler."""

    BUSY = "busy"
    """Another claim holds an unexpired lease: defer (retry later), do not ack as done."""


class DedupStoreUnavailable(ConsumerError):
    """The store could not be reached or failed; the outcome of the call is unknown.

    Do not ack the message and do not run its handler: let it come back later.
    Also raised by a store that was closed.
    """


class AlreadyProcessed(ConsumerError):
    """An exactly-once effect found its message id already done; roll its transaction back.

    Raised by ``SQLiteDedupStore.mark_done_in`` and ``run_once``: another
    delivery of the same message committed its effect first (a lease expired
    while this one ran). The caller should ack and skip, like ``ClaimResult.DONE``.
    """

    def __init__(self, message_id: str) -> None:
        self.message_id = message_id
        super().__init__(f"message {message_id!r} was already processed")


class InvalidBatch(ConsumerError, ValueError):
    """A batch for ``run_once_batch``/``mark_batch_done_in`` holds an id no store can keep.

    Raised before any statement runs, so nothing of the batch was marked: an
    item with no ``str`` id, an empty one (a message no publisher gave an id),
    one longer than 255 UTF-8 bytes (AMQP's limit) or holding NUL, or a bare
    string passed as the batch.
    """


@runtime_checkable
class DedupStore(Protocol):
    """Where consumers record which message ids are in progress or done.

    ``owner`` names the claimer (say, consumer id plus delivery tag); it lets a
    claimer release only its own claim, never one taken over after its lease.
    """

    async def claim(self, message_id: str, *, owner: str, lease: float) -> ClaimResult:
        """Try to take ``message_id`` for ``lease`` seconds.

        A claim over an unexpired lease is ``BUSY`` even for the same owner, so
        one delivery never runs twice at once.

        Raises:
            DedupStoreUnavailable: the store cannot answer (do not ack).
        """
        ...

    async def complete(self, message_id: str, *, owner: str) -> None:
        """Mark ``message_id`` done for the store's retention window.

        Done is a fact about the effect, so this holds whoever owns the lease
        now: a late finisher whose lease expired still records its effect.

        Raises:
            DedupStoreUnavailable: the mark may not be stored (do not ack).
        """
        ...

    async def release(self, message_id: str, *, owner: str) -> None:
        """Drop ``owner``'s claim after a failed handler, so a retry can claim it.

        Does nothing if ``owner`` does not hold the claim (expired and taken
        over, or already done).

        Raises:
            DedupStoreUnavailable: the claim may remain until its lease ends.
        """
        ...

    async def close(self) -> None:
        """Release the store's resources; later calls raise ``DedupStoreUnavailable``."""
        ...
