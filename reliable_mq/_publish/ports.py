"""What the publisher's engine needs from the world around it, as protocols.

The engine (`reliable_mq._publish.engine`) decides; these do the I/O. In the
library they are the confirm channel's keeper (`reliable_mq._publish.stream`),
the exchange probes (`reliable_mq._publish.exchanges`) and the connection's
supervisor (`reliable_mq.connection`); in the engine's unit tests, fakes that
record what was sent and replay the broker's answers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from .._amqp.faults import Fault
from .confirms import ConfirmTracker
from .outgoing import Outgoing

__all__ = ("Exchanges", "Link", "SendChannel", "Stream", "StreamEvents", "StreamFactory")


class SendChannel(Protocol):
    """One confirm channel's life (a *generation*), as the engine sees it."""

    number: int
    """Its generation number (1, 2, ... per publisher)."""
    frame_max: int
    """The connection's negotiated frame size."""
    closing: bool
    """No more writes: the broker closed it, or it is being replaced."""
    last_ack: float
    """Loop time of the last ``basic.ack`` on it."""
    nacks_since_ack: int
    """``basic.nack`` frames since that ack."""
    tracker: ConfirmTracker[Outgoing]
    """Its attempts in flight, by delivery tag."""

    def write(self, out: Outgoing) -> int:
        """Queue one attempt of ``out`` for writing; return its delivery tag."""
        ...


class StreamEvents(Protocol):
    """What a stream reports about its channels (the engine implements it)."""

    def opened(self, generation: SendChannel) -> None: ...

    def confirmed(self, generation: SendChannel, items: list[Outgoing], ack: bool) -> None: ...

    def returned(self, generation: SendChannel, message_id: str, code: int, text: str) -> None: ...

    def lost(self, generation: SendChannel, items: list[Outgoing], fault: Fault | None) -> None: ...


ChannelT = TypeVar("ChannelT", bound=SendChannel)


class Stream(Protocol[ChannelT]):
    """Keeps one confirm channel open, generation after generation."""

    @property
    def current(self) -> ChannelT | None:
        """The live channel, or None between channels."""
        ...

    @property
    def generation(self) -> int:
        """The number of the latest channel opened (0 before the first)."""
        ...

    def replace(self, generation: ChannelT) -> None:
        """Give up on ``generation``: its messages are reported lost, a new one opens."""
        ...

    async def start(self) -> None:
        """Open the first channel."""
        ...

    async def close(self) -> None:
        """Stop for good (no event is reported after)."""
        ...


StreamFactory = Callable[[StreamEvents, Callable[[], bool]], "Stream[Any]"]
"""Makes the engine's stream: ``(events, needed)``; ``needed()`` says whether a
channel is still wanted."""


class Exchanges(Protocol):
    """Which exchanges exist (checked once each by a passive declare)."""

    known: set[str]
    """Exchanges known to exist (the default exchange always does)."""

    async def check(self, exchange: str) -> Fault | None:
        """Probe ``exchange``: None when it exists, else why not."""
        ...

    def forget(self, exchange: str) -> None:
        """A channel was closed with 404 for ``exchange``: probe it again next time."""
        ...

    def refuse(self, exchange: str, fault: Fault) -> None:
        """The broker refused a publish to ``exchange``: fail the next ones locally a while."""
        ...

    async def close(self) -> None: ...


class Link(Protocol):
    """The connection, as far as the engine's policy asks about it."""

    @property
    def generation(self) -> int:
        """Connections opened so far (1 after the first, +1 per reconnect)."""
        ...

    @property
    def connected_at(self) -> float:
        """Loop time the current connection opened."""
        ...
