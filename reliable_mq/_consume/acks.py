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
from collections import deque

__all__ = ("AckTracker", "TagState")


class TagState(enum.IntEnum):
    """Where one outstanding delivery tag stands."""

    IN_PROGRESS = 0
    """In a handler (or waiting for one)."""
    ACK_PENDING = 1
    """Finished; waiting for a batched ack frame."""
    SETTLED = 2
    """Settled by its own frame; must never be named again."""


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
        self._states.append(TagState.IN_PROGRESS)

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
        if not 0 <= index < len(self._states) or self._states[index] is not TagState.IN_PROGRESS:
            return False
        self._states[index] = TagState.ACK_PENDING
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
        if not 0 <= index < len(self._states) or self._states[index] is not TagState.IN_PROGRESS:
            return False
        self._states[index] = TagState.SETTLED
        return True

    def blocked(self) -> bool:
        """True if the head of the window is still in progress."""
        return bool(self._states) and self._states[0] is TagState.IN_PROGRESS

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
            if head is TagState.IN_PROGRESS:
                break
            states.popleft()
            if head is TagState.ACK_PENDING:
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
            if state is TagState.ACK_PENDING:
                states[index] = TagState.SETTLED
                tags.append(self._first + index)
        self._pending -= len(tags)
        return tags

    def in_progress(self) -> list[int]:
        """Tags still in progress, in order."""
        first = self._first
        return [first + i for i, s in enumerate(self._states) if s is TagState.IN_PROGRESS]
