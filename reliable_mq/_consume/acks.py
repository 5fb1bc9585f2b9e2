"""Which delivery tags may be acknowledged together: pure bookkeeping, no I/O.

On one channel the broker numbers deliveries 1, 2, 3, ... and
``basic.ack(tag, multiple=true)`` settles *every* outstanding delivery up to
``tag``. So a multiple ack is only safe over the contiguous prefix of tags whose
handlers have finished: one delivery still in its handler blocks the prefix.

`AckTracker` keeps one state per outstanding tag, in tag order:

* ``IN_PROGRESS``: delivered, the handler has not finished. Never acked.
* ``ACK_PENDING``: finished, waiting for the next (batched) ack frame.
* ``SETTLED``: already settled on its own (a nack, a reject, a single ack).
  It no longer exists for the broker, so no frame may name its tag again.

`AckTracker.take_prefix()` pops the finished prefix and returns the highest
``ACK_PENDING`` tag in it (the one to send with ``multiple=true``); it never
names a ``SETTLED`` tag, which the broker would answer with
``PRECONDITION_FAILED - unknown delivery tag``. `AckTracker.take_stragglers()`
returns finished tags stuck behind a slow delivery, to be acked one by one, so a
slow handler does not hold every later delivery's prefetch slot.

The tracker assumes it is the only consumer on its channel (the consumer opens
one channel per queue), so tags arrive consecutively.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque

__all__ = ("AckTracker", "LostAcks", "TagState")


class TagState(enum.IntEnum):
    """Where one outstanding delivery tag stands."""

    IN_PROGRESS = 0
    """In a handler (or waiting for one)."""
    ACK_PENDING = 1
    """Finished; waiting for a batched ack frame."""
    SETTLED = 2
    """Settled by its own frame; must never be named again."""

    @staticmethod
    def unacked(state: TagState | None) -> bool:
        """Unacked on the broker: in progress, or finished with its ack still batched."""
        return state is TagState.IN_PROGRESS or state is TagState.ACK_PENDING


# The states as module globals: the tracker runs for every delivery, and an enum
# member read off its class costs about ten times a global's read on Python 3.11.
_IN_PROGRESS, _ACK_PENDING, _SETTLED = TagState.IN_PROGRESS, TagState.ACK_PENDING, TagState.SETTLED


class AckTracker:
    """Outstanding delivery tags of one channel, in tag order."""

    __slots__ = ("_first", "_pending", "_states")

    def __init__(self) -> None:
        self._states: deque[TagState] = deque()
        self._first = 1  # the tag of _states[0]
        self._pending = 0

    def __len__(self) -> int:
        """Outstanding tags (delivered and not yet handed out for a frame)."""
        return len(self._states)

    @property
    def pending(self) -> int:
        """Tags finished and waiting for an ack frame."""
        return self._pending

    def delivered(self, tag: int) -> None:
        """Record a new delivery; tags must arrive in order.

        Raises:
            ValueError: ``tag`` is not the next tag of this channel.
        """
        expected = self._first + len(self._states)
        if not self._states and tag > expected:
            self._first = tag  # empty: whatever came before is settled
        elif tag != expected:
            raise ValueError(f"delivery tag {tag} out of order (expected {expected})")
        self._states.append(_IN_PROGRESS)

    def state(self, tag: int) -> TagState | None:
        """The state of ``tag``, or None if it was already handed out for a frame."""
        index = tag - self._first
        if 0 <= index < len(self._states):
            return self._states[index]
        return None

    def finish(self, tag: int) -> bool:
        """Mark ``tag`` finished, to be acked with the next batch.

        Returns:
            False if ``tag`` is unknown or not in progress (nothing changed).
        """
        index = tag - self._first
        if not 0 <= index < len(self._states) or self._states[index] is not _IN_PROGRESS:
            return False
        self._states[index] = _ACK_PENDING
        self._pending += 1
        return True

    def settle(self, tag: int) -> bool:
        """Mark ``tag`` settled by its own frame (the caller sends that frame now).

        Use it for a nack, a reject, or a single ack. If the tag is at the head
        it is dropped at once.

        Returns:
            False if ``tag`` is unknown or already finished (send nothing).
        """
        index = tag - self._first
        if not 0 <= index < len(self._states) or self._states[index] is not _IN_PROGRESS:
            return False
        self._states[index] = _SETTLED
        return True

    def blocked(self) -> bool:
        """True if the head of the window is still in progress."""
        return bool(self._states) and self._states[0] is _IN_PROGRESS

    def take_prefix(self) -> tuple[int | None, int]:
        """Pop the finished prefix; return the tag for ``basic.ack(multiple=true)``.

        Returns:
            The highest ``ACK_PENDING`` tag of the prefix (None if the prefix
            holds nothing to ack: empty, or only ``SETTLED`` tags), and how many
            ``ACK_PENDING`` deliveries that one frame settles.
        """
        states = self._states
        ack_tag: int | None = None
        count = 0
        tag = self._first
        while states:
            head = states[0]
            if head is _IN_PROGRESS:
                break
            states.popleft()
            if head is _ACK_PENDING:
                ack_tag = tag
                count += 1
            tag += 1
        self._first = tag
        self._pending -= count
        return ack_tag, count

    def take_stragglers(self) -> list[int]:
        """Finished tags behind an in-progress one, to ack singly (multiple=false).

        Call `take_prefix()` first. The tags become ``SETTLED``.
        """
        if not self._pending:
            return []
        tags: list[int] = []
        states = self._states
        for index, state in enumerate(states):
            if state is _ACK_PENDING:
                states[index] = _SETTLED
                tags.append(self._first + index)
        self._pending -= len(tags)
        return tags

    def in_progress(self) -> list[int]:
        """Tags still in progress, in order."""
        first = self._first
        return [first + i for i, s in enumerate(self._states) if s is _IN_PROGRESS]


class LostAcks:
    """Messages whose work is done but whose ack may never have reached the broker.

    A handler returned (or the message's retry or dead-letter copy was
    published), and then its channel died before the broker took the ack: an
    ack still batched, an ack written after the broker had closed the channel
    (it ignores every frame but ``close-ok`` from then on), a settle that found
    the channel dead, a plain ``def`` handler that finished in its thread after
    the channel died. The broker requeues such a delivery and delivers it
    again; run again, its effect would happen twice, or its copy would be
    published twice.

    Recorded by message id and attempt, in memory, for `ttl` seconds and at
    most `capacity` entries (oldest forgotten first): the redelivery that
    matches (`take`) is acked without running its handler. A restart forgets
    them (across processes, the dedup store is the answer). Messages without
    an id are not recorded: nothing tells two of them apart.
    """

    __slots__ = ("_entries", "capacity", "ttl")

    def __init__(self, *, capacity: int = 16384, ttl: float = 300.0) -> None:
        self._entries: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self.capacity = capacity
        self.ttl = ttl

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, message_id: str, attempt: int, now: float) -> None:
        """``message_id`` at ``attempt`` is done; its ack may be lost."""
        entries = self._entries
        entries[message_id] = (attempt, now + self.ttl)
        entries.move_to_end(message_id)
        while len(entries) > self.capacity:
            entries.popitem(last=False)

    def take(self, message_id: str, attempt: int, now: float, *, counts_returns: bool) -> bool:
        """True (and forgotten) if this delivery is the broker's return of a done message.

        ``counts_returns``: the queue counts every return in the delivery's attempt
        (a quorum queue's ``x-delivery-count``), so the return comes back one higher.
        """
        entry = self._entries.get(message_id)
        if entry is None:
            return False
        done, expires = entry
        if now >= expires:
            del self._entries[message_id]
            return False
        if attempt == done or (counts_returns and attempt == done + 1):
            del self._entries[message_id]
            return True
        return False
