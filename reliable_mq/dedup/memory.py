"""The default store: a bounded, expiring LRU map in this process's memory.

It costs a dictionary lookup per call, so it is the store to use when one
consumer process sees every copy of a message. It protects nothing across
processes or restarts, and under pressure (more than ``max_entries`` ids within
the retention window) it forgets the least recently used ids first.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from .base import ClaimResult, DedupStoreUnavailable

__all__ = ("MemoryDedupStore",)

_CLAIMED = ClaimResult.CLAIMED
_DONE = ClaimResult.DONE
_BUSY = ClaimResult.BUSY


class MemoryDedupStore:
    """A [`DedupStore`][reliable_mq.dedup.DedupStore] for one process.

    Args:
        max_entries: the most ids kept (claims and done ids); beyond it the
            least recently used id is evicted.
        retention: seconds a done id is remembered after ``complete``.
    """

    def __init__(self, max_entries: int = 100_000, retention: float = 3600) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        if retention <= 0:
            raise ValueError("retention must be positive")
        self.max_entries = max_entries
        self.retention = float(retention)
        # message_id -> (owner, expires_at); owner None means done.
        self._entries: OrderedDict[str, tuple[str | None, float]] = OrderedDict()
        self._closed = False

    def __len__(self) -> int:
        """Ids held now, expired ones included until they are touched or evicted."""
        return len(self._entries)

    async def claim(self, message_id: str, *, owner: str, lease: float) -> ClaimResult:
        """Claim ``message_id`` (see `DedupStore.claim()`)."""
        return self.claim_nowait(message_id, owner=owner, lease=lease)

    async def complete(self, message_id: str, *, owner: str) -> None:
        """Mark ``message_id`` done (see `DedupStore.complete()`)."""
        self.complete_nowait(message_id, owner=owner)

    async def release(self, message_id: str, *, owner: str) -> None:
        """Drop ``owner``'s claim (see `DedupStore.release()`)."""
        self.release_nowait(message_id, owner=owner)

    def claim_nowait(self, message_id: str, *, owner: str, lease: float) -> ClaimResult:
        """`claim()` without a coroutine (the consumer's hot path uses it)."""
        if self._closed:
            raise DedupStoreUnavailable("the dedup store is closed")
        if lease <= 0:
            raise ValueError("lease must be positive")
        entries = self._entries
        now = time.monotonic()
        entry = entries.get(message_id)
        if entry is not None and entry[1] > now:
            entries.move_to_end(message_id)
            return _BUSY if entry[0] is not None else _DONE
        entries[message_id] = (owner, now + lease)
        if entry is not None:
            entries.move_to_end(message_id)
        elif len(entries) > self.max_entries:
            entries.popitem(last=False)
        return _CLAIMED

    def complete_nowait(self, message_id: str, *, owner: str) -> None:
        """`complete()` without a coroutine."""
        if self._closed:
            raise DedupStoreUnavailable("the dedup store is closed")
        entries = self._entries
        present = message_id in entries
        entries[message_id] = (None, time.monotonic() + self.retention)
        if present:
            entries.move_to_end(message_id)
        elif len(entries) > self.max_entries:
            entries.popitem(last=False)

    def release_nowait(self, message_id: str, *, owner: str) -> None:
        """`release()` without a coroutine."""
        if self._closed:
            raise DedupStoreUnavailable("the dedup store is closed")
        entry = self._entries.get(message_id)
        if entry is not None and entry[0] == owner:
            del self._entries[message_id]

    async def close(self) -> None:
        """Forget everything; later calls raise ``DedupStoreUnavailable``."""
        self._closed = True
        self._entries.clear()
