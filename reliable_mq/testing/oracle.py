"""The loss oracle: what was attempted, confirmed, delivered and applied, by message_id.

Queue-length counters can be wrong right after a broker restart; counting ids
is not. At the end of a run, drain the queue completely, then ask the oracle:

* lost = confirmed - delivered (must be empty: a confirm is a promise),
* unexpected = delivered - attempted (must be empty: nothing appears from nowhere),
* duplicate effects = ids whose effect was applied more than once (must be none),
* unresolved = publishes with no outcome by their deadline (must be none).

Broker-side duplicates (delivered more than once) are allowed and reported:
a republish after a cut can duplicate a message the broker already had.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ("LossOracle", "OracleReport")


@dataclass(frozen=True)
class OracleReport:
    """The verdict of a `LossOracle`; ``ok`` when nothing forbidden happened."""

    attempted: int
    confirmed: int
    delivered: int
    distinct_delivered: int
    effects: int
    lost: frozenset[str]
    unexpected: frozenset[str]
    duplicate_effects: frozenset[str]
    unresolved: frozenset[str]
    broker_duplicates: int = field(default=0)

    @property
    def ok(self) -> bool:
        return not (self.lost or self.unexpected or self.duplicate_effects or self.unresolved)

    def summary(self) -> str:
        return (
            f"attempted={self.attempted} confirmed={self.confirmed} delivered={self.delivered} "
            f"broker_duplicates={self.broker_duplicates} lost={len(self.lost)} "
            f"unexpected={len(self.unexpected)} duplicate_effects={len(self.duplicate_effects)} "
            f"unresolved={len(self.unresolved)}"
        )


class LossOracle:
    """Thread-safe bookkeeping keyed by message_id (handlers may run in threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._attempted: set[str] = set()
        self._resolved: set[str] = set()
        self._confirmed: set[str] = set()
        self._delivered: Counter[str] = Counter()
        self._effects: Counter[str] = Counter()

    def attempted(self, message_id: str) -> None:
        """A publish of ``message_id`` was started."""
        with self._lock:
            self._attempted.add(message_id)

    def confirmed(self, message_id: str) -> None:
        """The broker confirmed ``message_id`` (the caller was told it is safe)."""
        with self._lock:
            self._confirmed.add(message_id)
            self._resolved.add(message_id)

    def failed(self, message_id: str) -> None:
        """The publish ended in an error the caller saw (not a loss: nobody was promised)."""
        with self._lock:
            self._resolved.add(message_id)

    def delivered(self, message_id: str) -> None:
        """A consumer (or the final drain) received ``message_id``."""
        with self._lock:
            self._delivered[message_id] += 1

    def delivered_many(self, message_ids: Iterable[str]) -> None:
        with self._lock:
            self._delivered.update(message_ids)

    def applied(self, message_id: str) -> None:
        """The handler's effect for ``message_id`` was applied."""
        with self._lock:
            self._effects[message_id] += 1

    def report(self) -> OracleReport:
        with self._lock:
            delivered = set(self._delivered)
            return OracleReport(
                attempted=len(self._attempted),
                confirmed=len(self._confirmed),
                delivered=sum(self._delivered.values()),
                distinct_delivered=len(delivered),
                effects=sum(self._effects.values()),
                lost=frozenset(self._confirmed - delivered),
                unexpected=frozenset(delivered - self._attempted),
                duplicate_effects=frozenset(m for m, n in self._effects.items() if n > 1),
                unresolved=frozenset(self._attempted - self._resolved),
                broker_duplicates=sum(n - 1 for n in self._delivered.values() if n > 1),
            )
