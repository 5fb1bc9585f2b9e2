"""Finding the one message the broker refused when its reply does not name it.

A ``channel.close`` (or a 50x connection close) refusing a publish says why,
not which publish. Every message unconfirmed on that channel is a suspect.
`Isolation` re-sends them in halves, one half at a time: a half that is
confirmed is innocent; a half that is refused again holds the culprit and is
halved again, until the refused message is alone and fails with its reply.
Other messages wait in the backlog meanwhile; for N suspects this costs about
2 log2(N) channel reopens.
"""

from __future__ import annotations

from collections import deque

from .._amqp.faults import Fault
from .outgoing import Outgoing, by_seq

__all__ = ("MAX_REFUSALS", "Isolation", "judge")

MAX_REFUSALS = 64
"""A message on this many refused channels fails, whatever isolation concluded."""


class Isolation:
    """Suspects of a refusal whose culprit the broker did not name, tested half by half."""

    __slots__ = ("chunk", "fault", "size", "suspects")

    def __init__(self, suspects: list[Outgoing], fault: Fault) -> None:
        self.suspects: deque[Outgoing] = deque(suspects)
        self.fault = fault
        self.size = max(1, (len(suspects) + 1) // 2)
        self.chunk: list[Outgoing] = []

    def next_chunk(self) -> list[Outgoing]:
        """The next group to send alone (the previous one was confirmed)."""
        chunk: list[Outgoing] = []
        while self.suspects and len(chunk) < self.size:
            out = self.suspects.popleft()
            if not out.finished:
                chunk.append(out)
        self.chunk = chunk
        return chunk

    def chunk_done(self) -> bool:
        return all(out.tag == 0 for out in self.chunk)

    def narrow(self, refused: list[Outgoing]) -> Outgoing | None:
        """The channel was refused while ``refused`` were unconfirmed: the culprit is among
        them. Returns it when it is alone; otherwise they become the next suspects."""
        in_chunk = [out for out in refused if out in self.chunk]
        others = [out for out in refused if out not in self.chunk]
        self.chunk = []
        if len(in_chunk) == 1:
            self.suspects.extendleft(reversed(others))
            return in_chunk[0]
        self.suspects.extendleft(reversed(in_chunk + others))
        self.size = max(1, (len(in_chunk) + 1) // 2)
        return None


def judge(
    live: list[Outgoing], isolation: Isolation | None, fault: Fault
) -> tuple[list[Outgoing], Isolation | None]:
    """A refusal that names no exchange: the messages it fails, and the isolation after it.

    ``live`` were unconfirmed on the refused channel (their ``refusals`` already
    counted); ``isolation`` is the one under way, if any. Fails the messages
    refused `MAX_REFUSALS` times; then a lone suspect, or the culprit the
    isolation under way narrowed down to. Several suspects and no isolation
    start one (a new `Isolation` is returned; the others are re-sent by it).
    """
    failed = [out for out in live if out.refusals >= MAX_REFUSALS]
    live = [out for out in live if out.refusals < MAX_REFUSALS]
    if not live:
        return failed, isolation
    if isolation is None:
        if len(live) == 1:
            return [*failed, live[0]], None
        return failed, Isolation(sorted(live, key=by_seq), fault)
    culprit = isolation.narrow(live)
    if culprit is not None:
        failed.append(culprit)
    return failed, isolation
