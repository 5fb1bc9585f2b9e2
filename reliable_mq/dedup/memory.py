"""The default store: a bounded, expiring LRU map in this process's memory.

It costs a dictionary lookup per call, so it is the store to use when one
consumer process sees every copy of a message. It protects nothing across
processes or restarts, and under pressure (more than ``max_entries`` ids within
the retention window) it forgets the least recently used *done* ids first; a
claim still in progress is never forgotten.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict

from .base import ClaimResult, DedupStoreUnavailable

__all__ = ("MemoryDedupStore",)

_CLAIMED = ClaimResult.CLAIMED
_DONE = ClaimResult.DONE
_BUSY = ClaimResult.BUSY


class MemoryDedupStore:
    """A [`DedupStore`][reliable_mq.dedup.DedupStore] for one process.

    Claims in progress and done ids are kept apart: only done ids are evicted
    (least recently used first), never a claim whose lease still runs, so a
    second copy of a message cannot start while the first one runs, however
    many other ids pass by. Claims count towards ``max_entries`` and may exceed
    it while they are held (they are bounded by the deliveries in flight);
    claims whose lease ended are dropped when room is needed.

    Args:
        max_entries: the most ids kept (claims and done ids); beyond it the
            least recently used done id is evicted.
        retention: seconds a done id is remembered after ``complete``.
    """

    def __init__(self, max_entries: int = 100_000, retention: float = 3600) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        if retention <= 0:
            raise ValueError("retention must be positive")
        self.max_entries = max_entries
        self.retention = float(retention)
        self._done: OrderedDict[str, float] = OrderedDict()  # message_id -> expires_at
        self._claims: dict[str, tuple[str, float]] = {}  # message_id -> (owner, lease end)
        self._first_lease_end = math.inf  # no claim ends before this
        self._closed = False

    def __len__(self) -> int:
        """Ids held now (claims and done ids), expired ones included until dropped."""
        return len(self._done) + len(self._claims)

    async def claim(self, message_id: str, *, owner: str, lease: float) -> ClaimResult:
        """Claim ``message_id`` (see `DedupStore.claim`)."""
        return self.claim_nowait(message_id, owner=owner, lease=lease)

    async def complete(self, message_id: str, *, owner: str) -> None:
        """Mark ``message_id`` done (see `DedupStore.complete`)."""
        self.complete_nowait(message_id, owner=owner)

    async def release(self, message_id: str, *, owner: str) -> None:
        """Drop ``owner``'s claim (see `DedupStore.release`)."""
        self.release_nowait(message_id, owner=owner)

    def claim_nowait(self, message_id: str, *, owner: str, lease: float) -> ClaimResult:
        """`claim` without a coroutine (the consumer's hot path uses it)."""
        if self._closed:
            raise DedupStoreUnavailable("the dedup store is closed")
        if lease <= 0:
            raise ValueError("lease must be positive")
        now = time.monotonic()
        claims = self._claims
        held = claims.get(message_id)
        if held is not None:
            if held[1] > now:
                return _BUSY
            # The holder's lease ended: it is taken over below.
        else:
            done = self._done
            done_until = done.get(message_id)
            if done_until is not None:
                if done_until > now:
                    done.move_to_end(message_id)
                    return _DONE
                del done[message_id]
        until = now + lease
        claims[message_id] = (owner, until)
        if until < self._first_lease_end:  # noqa: PLR1730 (hot path: a min() call costs more)
            self._first_lease_end = until
        if held is None and len(claims) + len(self._done) > self.max_entries:
            self._evict(now)
        return _CLAIMED

    def complete_nowait(self, message_id: str, *, owner: str) -> None:
        """`complete` without a coroutine."""
        if self._closed:
            raise DedupStoreUnavailable("the dedup store is closed")
        self._claims.pop(message_id, None)  # done is a fact, whoever holds the lease
        done = self._done
        present = message_id in done
        now = time.monotonic()
        done[message_id] = now + self.retention
        if present:
            done.move_to_end(message_id)
        elif len(self._claims) + len(done) > self.max_entries:
            self._evict(now)

    def release_nowait(self, message_id: str, *, owner: str) -> None:
        """`release` without a coroutine."""
        if self._closed:
            raise DedupStoreUnavailable("the dedup store is closed")
        held = self._claims.get(message_id)
        if held is not None and held[0] == owner:
            del self._claims[message_id]

    def _evict(self, now: float) -> None:
        """Make room: done ids first (least recently used), then claims whose lease ended."""
        done, claims = self._done, self._claims
        while done and len(claims) + len(done) > self.max_entries:
            done.popitem(last=False)
        if len(claims) + len(done) > self.max_entries and now >= self._first_lease_end:
            # Only claims are left. Never evict one in progress; drop the expired
            # ones (their holders are gone). Only when one may have expired.
            for message_id in [k for k, (_, until) in claims.items() if until <= now]:
                del claims[message_id]
            self._first_lease_end = min((until for _, until in claims.values()), default=math.inf)

    async def close(self) -> None:
        """Forget everything; later calls raise ``DedupStoreUnavailable``."""
        self._closed = True
        self._done.clear()
        self._claims.clear()
