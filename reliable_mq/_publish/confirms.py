"""Which publishes a ``basic.ack`` / ``basic.nack`` settles: pure bookkeeping, no I/O.

On a channel in confirm mode the broker numbers publishes 1, 2, 3, ... (the
*delivery tags*; they start at 1 on every channel). It confirms each exactly
once, possibly out of order, and a frame with ``multiple=true`` settles every
outstanding tag up to and including its ``delivery_tag``.

`ConfirmTracker` keeps the outstanding publishes of one channel in tag
order, so a multiple ack resolves a whole range by popping from the front,
without a future or a dictionary entry per message. Tags a single ack settled
out of order are left as holes and skipped when the front reaches them.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

__all__ = ("ConfirmTracker",)

T = TypeVar("T")


class ConfirmTracker(Generic[T]):
    """Outstanding publishes of one channel, by delivery tag."""

    __slots__ = ("_first", "_items", "_live")

    def __init__(self) -> None:
        self._items: deque[T | None] = deque()
        self._first = 1  # the tag of _items[0]
        self._live = 0

    def __len__(self) -> int:
        """Publishes still waiting for their confirm."""
        return self._live

    @property
    def next_tag(self) -> int:
        """The tag the next `add()` assigns."""
        return self._first + len(self._items)

    def add(self, item: T) -> int:
        """Record a publish written to the channel; return its delivery tag."""
        self._items.append(item)
        self._live += 1
        return self._first + len(self._items) - 1

    def settle(self, tag: int, multiple: bool) -> list[T]:
        """Remove and return what an ack or nack for ``tag`` settles, in tag order.

        A tag that is unknown or already settled settles nothing (the broker
        never does that; a stale frame must not resolve a newer publish).
        """
        items = self._items
        if multiple:
            settled: list[T] = []
            count = min(tag - self._first + 1, len(items))
            for _ in range(max(count, 0)):
                item = items.popleft()
                if item is not None:
                    settled.append(item)
            if count > 0:
                self._first += count
            self._live -= len(settled)
            return settled
        index = tag - self._first
        if not 0 <= index < len(items):
            return []
        item = items[index]
        if item is None:
            return []
        if index == 0:
            items.popleft()
            self._first += 1
            while items and items[0] is None:  # holes left by earlier single acks
                items.popleft()
                self._first += 1
        else:
            items[index] = None
        self._live -= 1
        return [item]

    def oldest(self) -> T | None:
        """The outstanding publish with the lowest tag, if any."""
        for item in self._items:
            if item is not None:
                return item
        return None

    def drain(self) -> list[T]:
        """Remove and return every outstanding publish, in tag order (the channel is gone)."""
        items = [item for item in self._items if item is not None]
        self._first += len(self._items)
        self._items.clear()
        self._live = 0
        return items

    def outstanding(self) -> list[T]:
        """Every outstanding publish, in tag order, without removing them."""
        return [item for item in self._items if item is not None]
