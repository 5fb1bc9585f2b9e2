"""The publisher's confirm-mode channel: writes publishes, reports confirms, returns and closes.

Two implementations of one interface (`ConfirmChannel`), chosen by the `Link`:

* `FastConfirmChannel` publishes below aiormq's ``basic_publish``: the frames
  of every message written in one event-loop iteration are joined into one
  buffer and put on the connection's write queue as one item (one socket
  write), and three of aiormq's frame handlers are replaced on this channel
  only (`reliable_mq._amqp.hooks.install_confirm_handlers`): a ``basic.ack`` or
  ``basic.nack`` settles a range of delivery tags; a ``basic.return`` (which
  comes before its ack) is reported by message id; a broker ``channel.close``
  stops the writes at once (a frame sent after ``channel.close-ok`` would close
  the whole connection with 504). The caller's tags are the broker's: every
  publish on the channel is ours, written in tag order.
* `PlainConfirmChannel` publishes each message through aiormq's public
  ``basic_publish`` (in order: one task per message, each taking the channel's
  lock in turn) and reports what its confirmation future says.

Both report to the same `ConfirmEvents`, in the caller's tags.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Protocol

import aiormq
from aiormq.abc import DeliveredMessage
from pamqp.commands import Basic

from . import hooks
from .faults import AMQP_ERRORS, Fault, classify, classify_close, is_delivery_nack
from .wire import Encoded, publish_frames

__all__ = (
    "ConfirmChannel",
    "ConfirmEvents",
    "FastConfirmChannel",
    "PlainConfirmChannel",
    "Publish",
)

_HEADER_START = 12
"""Bytes of a content header payload before its property flags (class, weight, body size)."""


class Publish(Protocol):
    """One message to publish, encoded once (`reliable_mq._amqp.wire`)."""

    message_id: str
    encoded: Encoded
    exchange: str
    routing_key: str
    mandatory: bool


class ConfirmEvents(Protocol):
    """What a confirm channel reports, in the caller's delivery tags."""

    def confirmed(self, tag: int, multiple: bool, ack: bool) -> None:
        """A ``basic.ack`` (``ack``) or ``basic.nack`` of ``tag`` (and below, ``multiple``)."""

    def returned(self, message_id: str, code: int, text: str) -> None:
        """A ``basic.return`` of ``message_id``: its confirm follows."""

    def channel_closed(self, fault: Fault | None) -> None:
        """The broker closed the channel: nothing more is written on it."""


class ConfirmChannel:
    """A confirm-mode channel: `send` publishes, `ConfirmEvents` hears back."""

    fast = False

    def __init__(self, channel: aiormq.Channel, events: ConfirmEvents, frame_max: int) -> None:
        self._channel = channel
        self._events = events
        self.frame_max = frame_max
        self.number = int(channel.number)
        self.stopped = False
        """No more writes (the broker closed the channel, or it is being replaced)."""

    def send(self, tag: int, message: Publish) -> None:
        """Publish ``message`` as delivery ``tag`` (the caller numbers them 1, 2, 3...)."""
        raise NotImplementedError

    def stop(self) -> None:
        """Write nothing more (what is buffered is dropped: its tags are reported lost)."""
        self.stopped = True

    @property
    def is_closed(self) -> bool:
        return bool(self._channel.is_closed)

    async def wait_closed(self, until: asyncio.Future[Any]) -> Fault | None:
        """Wait until the channel closes or ``until`` is done; why it closed (None: not, or
        closed without a reason)."""
        closing = self._channel.closing
        try:
            await asyncio.wait((closing, until), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not closing.done():
                closing.cancel()  # detach the observer
        if closing.done() and not closing.cancelled():
            exc = closing.exception()
            if exc is not None:
                return classify(exc)
        return None

    async def close(self) -> None:
        """Close the channel, which may already be dead, without raising."""
        self.stop()
        try:
            async with asyncio.timeout(5):
                await self._channel.close()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
        except Exception:  # closing a dead channel may fail in many ways, none of them ours
            return


class FastConfirmChannel(ConfirmChannel):
    """Publishes below ``basic_publish``: one write per loop iteration (see the module doc)."""

    fast = True

    def __init__(self, channel: aiormq.Channel, events: ConfirmEvents, frame_max: int) -> None:
        super().__init__(channel, events, frame_max)
        self._buffer: list[bytes] = []
        self._wake = asyncio.Event()
        hooks.install_confirm_handlers(
            channel, on_confirm=self._on_confirm, on_return=self._on_return, on_close=self._on_close
        )
        self._writer = asyncio.get_running_loop().create_task(self._write())

    def send(self, tag: int, message: Publish) -> None:
        self._buffer.append(publish_frames(self.number, message.encoded, self.frame_max))
        if len(self._buffer) == 1:
            self._wake.set()

    def stop(self) -> None:
        self.stopped = True
        self._writer.cancel()

    async def _write(self) -> None:
        """Put the buffered frames on the connection's write queue, one item per batch."""
        write = hooks.write_frames(self._channel)
        wake = self._wake
        spins = 0
        while True:
            await wake.wait()
            wake.clear()
            while self._buffer and not self.stopped:
                data = b"".join(self._buffer)
                if not write(data):  # aiormq's writer empties it within a loop iteration
                    spins += 1
                    await asyncio.sleep(0 if spins < 20 else 0.005)
                    continue
                spins = 0
                self._buffer.clear()

    async def _on_confirm(self, frame: Basic.Ack | Basic.Nack | Basic.Reject) -> None:
        multiple = bool(getattr(frame, "multiple", False))
        self._events.confirmed(frame.delivery_tag or 0, multiple, isinstance(frame, Basic.Ack))

    async def _on_return(self, frame: Basic.Return) -> None:
        properties = await hooks.read_returned(self._channel, frame)
        if properties.message_id:
            self._events.returned(
                properties.message_id, frame.reply_code or 0, frame.reply_text or ""
            )

    def _on_close(self, frame: Any) -> None:
        self.stop()  # before close-ok is queued: nothing may follow it
        self._events.channel_closed(
            classify_close(frame.reply_code, frame.reply_text, connection_level=False)
        )


class PlainConfirmChannel(ConfirmChannel):
    """Publishes through aiormq's public ``basic_publish``, one task per message, in order."""

    def __init__(self, channel: aiormq.Channel, events: ConfirmEvents, frame_max: int) -> None:
        super().__init__(channel, events, frame_max)
        self._tasks: set[asyncio.Task[None]] = set()

    def send(self, tag: int, message: Publish) -> None:
        if self.stopped:
            return
        encoded = message.encoded
        properties = hooks.PreEncodedProperties(encoded.header[_HEADER_START:], message.message_id)
        task = asyncio.get_running_loop().create_task(
            self._publish(
                tag,
                encoded.body,
                message.exchange,
                message.routing_key,
                message.mandatory,
                properties,
            )
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def stop(self) -> None:
        self.stopped = True
        for task in list(self._tasks):
            task.cancel()

    async def _publish(
        self,
        tag: int,
        body: bytes,
        exchange: str,
        routing_key: str,
        mandatory: bool,
        properties: Basic.Properties,
    ) -> None:
        result: Any
        try:
            result = await self._channel.basic_publish(
                body,
                exchange=exchange,
                routing_key=routing_key,
                properties=properties,
                mandatory=mandatory,
                wait=False,
            )
        except asyncio.CancelledError:
            return  # stopped: the channel's outstanding tags are reported lost
        except AMQP_ERRORS as exc:
            if is_delivery_nack(exc):
                self._events.confirmed(tag, False, False)
            return  # the channel is gone: reported lost with the others
        if isinstance(result, DeliveredMessage):  # returned, then acked
            delivery = result.delivery
            if properties.message_id and isinstance(delivery, Basic.Return):
                self._events.returned(
                    properties.message_id, delivery.reply_code or 0, delivery.reply_text or ""
                )
        self._events.confirmed(tag, False, True)

    async def close(self) -> None:
        await super().close()
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._tasks, return_exceptions=True)
