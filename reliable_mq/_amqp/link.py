"""One AMQP connection (`Link`): opened, checked, watched and closed.

aiormq keeps the socket, the handshake, heartbeats, RPCs and the close
handshakes. `open_link` opens one connection as ``aio_pika.connect`` does
(same URL, TLS context and client properties), then decides which path its
channels take: the fast paths when every hook verifies (`reliable_mq._amqp.hooks`),
else the plain path (or a refusal, with ``fast_path="on"``).
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from typing import Any

import aiormq
from yarl import URL

from ..settings import FastPath, redact_credentials
from . import hooks
from .channels import Channel
from .confirm import ConfirmChannel, ConfirmEvents, FastConfirmChannel, PlainConfirmChannel
from .consume import ConsumeChannel
from .faults import Fault, classify
from .inbound import decode_frame, take_frames

__all__ = ("Link", "LinkEnd", "open_link")

_DEFAULT_FRAME_MAX = 131_072


@dataclass(frozen=True)
class LinkEnd:
    """How a link ended.

    Attributes:
        reason: a one-line description (never a password).
        fault: the classified close (None for a plain close or a cut).
        aborted: aiormq dropped it for missed heartbeats (a silent, stuck link).
    """

    reason: str
    fault: Fault | None = None
    aborted: bool = False


class Link:
    """One open AMQP connection and the channels reliable_mq opens on it.

    Attributes:
        fast: its channels take the fast paths (every hook verified).
    """

    def __init__(
        self,
        connection: aiormq.Connection,
        *,
        fast: bool,
        receiver: Any = None,
        mode: FastPath = FastPath.AUTO,
    ) -> None:
        self._connection = connection
        self.fast = fast
        self._receiver = receiver
        self._mode = mode

    def _fast_channel(self, channel: aiormq.Channel) -> bool:
        """Whether ``channel`` takes the fast path: its own shapes checked too (a failed
        check warns, or refuses under ``on``, as the link's checks do)."""
        if not self.fast:
            return False
        failure = hooks.check_channel(channel)
        if failure is None:
            return True
        self.fast = False
        hooks.resolve(self._mode, [failure])
        return False

    def decode_frames(self) -> None:
        """Decode this connection's frames with ours from now on (on the fast path).

        For connections that receive deliveries: one pamqp cannot decode is then
        dead-lettered by the consumer instead of closing the connection.
        """
        if self.fast:
            take_frames(self._receiver, self._connection)

    @property
    def is_closed(self) -> bool:
        return bool(self._connection.is_closed)

    @property
    def frame_max(self) -> int:
        """The negotiated largest frame, in bytes."""
        tune = getattr(self._connection, "connection_tune", None)
        return int(getattr(tune, "frame_max", 0) or _DEFAULT_FRAME_MAX)

    async def wait_closed(self) -> LinkEnd:
        """Wait until the connection is gone, and say how it went.

        Waits without awaiting aiormq's future itself: aiormq *cancels* it when it
        drops a connection for missed heartbeats, and awaiting it would raise
        ``CancelledError`` here as if the caller had been cancelled.
        """
        if self._connection.is_closed:
            return LinkEnd("closed")
        closing = self._connection.closing
        try:
            await asyncio.wait((closing,))
        finally:
            if not closing.done():
                closing.cancel()  # we were cancelled: detach the observer
        if closing.cancelled():
            return LinkEnd(
                "aborted (no frames within the heartbeat grace: link stuck)", aborted=True
            )
        exc = closing.exception()
        if exc is None:
            return LinkEnd("closed")
        return LinkEnd(_describe(exc), classify(exc))

    async def close(self) -> None:
        await self._connection.close()

    async def channel(self, *, timeout: float | None = None) -> Channel:
        """A channel for declarations, deletes and ``basic.get`` (no confirms)."""
        opened = await self._connection.channel(publisher_confirms=False, timeout=timeout)
        assert isinstance(opened, aiormq.Channel)
        return Channel(opened)

    async def confirm_channel(self, events: ConfirmEvents, *, timeout: float) -> ConfirmChannel:
        """A confirm-mode channel for the publisher, reporting to ``events``."""
        async with asyncio.timeout(timeout):
            opened = await self._connection.channel(publisher_confirms=True, on_return_raises=False)
        assert isinstance(opened, aiormq.Channel)
        try:
            fast = self._fast_channel(opened)
        except BaseException:
            await opened.close()
            raise
        if fast:
            return FastConfirmChannel(opened, events, self.frame_max)
        return PlainConfirmChannel(opened, events, self.frame_max)

    async def consume_channel(self, *, timeout: float | None = None) -> ConsumeChannel:
        """A channel for the consumer (no confirms); `ConsumeChannel.consume` starts it."""
        self.decode_frames()
        opened = await self._connection.channel(publisher_confirms=False, timeout=timeout)
        assert isinstance(opened, aiormq.Channel)
        try:
            fast = self._fast_channel(opened)
        except BaseException:
            await opened.close()
            raise
        return ConsumeChannel(opened, fast=fast)


async def open_link(
    url: URL,
    *,
    name: str,
    heartbeat: int,
    ssl_context: ssl.SSLContext | None,
    timeout: float,
    fast_path: FastPath,
    decode_frames: bool,
) -> Link:
    """Open one connection to ``url`` and decide its path.

    Args:
        url: the broker address.
        name: the connection name the broker shows.
        heartbeat: seconds (0 disables).
        ssl_context: for ``amqps://`` URLs.
        timeout: seconds for the whole handshake.
        fast_path: `FastPath` (checked here: the hooks, then the frame receiver).
        decode_frames: decode this connection's frames with ours at once (tools
            that fetch messages; a consumer channel turns it on too).

    Raises:
        UnsupportedDependency: ``fast_path`` is ``on`` and a hook failed its check.
        TimeoutError: the handshake took longer than ``timeout``.
    """
    target = url.update_query(heartbeat=str(heartbeat), name=name)
    options: dict[str, Any] = {}
    for option, parse in (("interleave", int), ("happy_eyeballs_delay", float)):
        if option in url.query:  # as aio_pika.connect passes them on
            options[option] = parse(url.query[option])
    async with asyncio.timeout(timeout):
        connection = await aiormq.connect(
            target,
            context=ssl_context,
            client_properties={"connection_name": name},
            **options,
        )
        try:
            await connection.ready()
        except BaseException:
            await _close_quietly(connection)
            raise
    try:
        fast, receiver = _decide(connection, fast_path)
    except BaseException:
        await _close_quietly(connection)
        raise
    link = Link(connection, fast=fast, receiver=receiver, mode=fast_path)
    if decode_frames:
        link.decode_frames()
    return link


def _decide(connection: aiormq.Connection, mode: FastPath) -> tuple[bool, Any]:
    """Whether ``connection`` takes the fast paths, and its verified frame receiver."""
    if hooks.resolve(mode, hooks.verify(decode_frame) if mode is not FastPath.OFF else []):
        receiver, failure = hooks.find_receiver(connection)
        if failure is None:
            return True, receiver
        hooks.resolve(mode, [failure])
    hooks.check_plain()
    return False, None


async def _close_quietly(connection: aiormq.Connection) -> None:
    try:
        async with asyncio.timeout(2):
            await connection.close()
    except Exception:  # closing a half-open connection may fail in many ways
        return


def _describe(exc: BaseException) -> str:
    """A one-line, password-free description of why a connection ended."""
    text = redact_credentials(str(exc) or type(exc).__name__)
    return f"{type(exc).__name__}: {text}"[:300]
