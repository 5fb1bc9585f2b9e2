"""A delivery's `Settler` once its processing has ended: what it was settled as.

A `Delivery` asks its `reliable_mq._consume.session.Ticket` to settle it, and
the ticket keeps the delivery for the settle: a reference cycle per delivery,
which only the cyclic garbage collector can free. On a busy consumer those
cycles were most of what the collector walked (about 1 µs per delivery, a
fifteenth of the client's CPU). When the processing of a settled delivery
ends, the session hands the delivery this stand-in instead
(`reliable_mq._consume.session.Session.forget`), one per session and outcome:
the delivery still says how it was settled, and a late ``delivery.ack()`` (from
a handler that kept it) gets the same answer as from its ticket, with nothing
to keep the ticket alive.
"""

from __future__ import annotations

from typing import Protocol

from ..delivery import Delivery, Settle
from .settle import Outcome

__all__ = ("Settled", "SettledAgain")


class SettledAgain(Protocol):
    """What the stand-in asks of its session (`reliable_mq._consume.session.Session`)."""

    def settled_again(self, delivery: Delivery, first: Settle, outcome: Outcome) -> None:
        """``delivery``, settled as ``first``, was asked to settle again by ``outcome``."""
        ...


class Settled:
    """The settler of a delivery whose processing ended, settled as ``outcome``."""

    __slots__ = ("_session", "outcome")

    def __init__(self, session: SettledAgain, outcome: Settle) -> None:
        self._session = session
        self.outcome: Settle | None = outcome

    def _again(self, delivery: Delivery, outcome: Outcome) -> bool:
        assert self.outcome is not None
        self._session.settled_again(delivery, self.outcome, outcome)
        return False

    async def settle_ack(self, delivery: Delivery) -> bool:
        return self._again(delivery, Outcome.ACK_CALLED)

    async def settle_nack(self, delivery: Delivery, requeue: bool) -> bool:
        return self._again(delivery, Outcome.NACK_CALLED if requeue else Outcome.DROP_CALLED)

    async def settle_retry(self, delivery: Delivery, reason: str, delay: float | None) -> bool:
        return self._again(delivery, Outcome.RETRY_SIGNAL)

    async def settle_dead_letter(self, delivery: Delivery, reason: str) -> bool:
        return self._again(delivery, Outcome.REJECT_SIGNAL)
