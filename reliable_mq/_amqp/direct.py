"""Deliveries handed over by the connection's frame reader itself (the direct path).

With our frame decoder (`reliable_mq._amqp.inbound.take_frames`) a delivery
still took aiormq's route: each of its three frames went once round aiormq's
connection reader loop, into the channel's frame queue, and out again in the
channel's reader task, which ran our delivery handler
(`reliable_mq._amqp.inbound.take_deliveries`). On a consumer that was about a
third of the client's CPU per delivery: three loop turns, three queue puts and
gets, three task wake-ups.

On the direct path the frame decoder, having read a ``basic.deliver`` for a
channel registered here (`DirectChannels.register`), reads the delivery's
content header and body frame at once (from the stream's buffer, where they
nearly always are already) and hands the delivery to the same function the
channel's reader would have called (``hand``), synchronously, without leaving
the connection's reader task. When all three frames are in the buffer
(`whole_deliveries`), the method frame and the properties are decoded straight
from one copy of them (`reliable_mq._amqp.plain`), without a content header
object, and handed to ``hand_plain``. It does so only while the channel's reader is
idle: nothing queued for it, its reader task waiting for a frame, not half-way
through a delivery of its own (`DirectChannel.idle`); so every channel's
frames are still handled in the order they came. Anything else goes the usual
way, in order:

* a delivery whose body spans several frames, or whose next frame is another
  channel's or not of the kind expected: the frames read so far are put in the
  channel's queue as aiormq's reader would have put them, and the last one is
  returned to aiormq's reader loop;
* the frames of a channel not registered (channel 0, the publisher's, tools'),
  and every other frame of a registered one (``basic.cancel``, RPC replies,
  ``channel.close``).

aiormq notes the time of every frame it reads (``__last_frame_time``), and its
heartbeat task ends a connection that received nothing for too long: the
direct path notes it too, for each delivery it hands over. The hooks into
asyncio's and aiormq's private attributes are checked when a channel or a
connection registers (`DirectChannels.of`, `DirectChannel.of`); where one is
missing, its deliveries go the usual way.
"""

from __future__ import annotations

import asyncio
import collections
import struct
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from pamqp.body import ContentBody
from pamqp.header import ContentHeader

from . import hooks

__all__ = (
    "DirectChannel",
    "DirectChannels",
    "Hand",
    "HandPlain",
    "Received",
    "buffered",
    "whole_deliveries",
)

Received = tuple[int, int, Any]
"""A decoded frame as the frame receiver returns it: ``(bytes used, channel, frame)``."""

Hand = Callable[[Any, Any, bytes], None]
"""``hand(deliver frame, content header, body)``: the channel's delivery handler's
synchronous end. It must not raise."""

HandPlain = Callable[[Any, Any, bytes], None]
"""``hand_plain(deliver frame, properties, body)``: the same for a delivery whose
frames decoded plainly (nothing undecodable in them), without its content header."""

_FRAME_HEADER = struct.Struct(">BHI")
_METHOD_START = struct.Struct(">BHIHH")  # frame type, channel, size, class id, method id
_BODY_SIZE = struct.Struct(">Q")
_FRAME_END = 0xCE

_of: weakref.WeakKeyDictionary[Any, DirectChannels] = weakref.WeakKeyDictionary()


class DirectChannel:
    """One registered channel: its frame queue, and whether its reader is idle.

    Attributes:
        mid_content: the channel's own delivery handler waits for a content
            frame (set by it): its reader is not idle.
    """

    __slots__ = ("_getters", "_items", "frames", "hand", "hand_plain", "mid_content")

    def __init__(
        self,
        frames: asyncio.Queue[Any],
        deques: tuple[collections.deque[Any], collections.deque[Any]],
        hand: Hand,
        hand_plain: HandPlain,
    ) -> None:
        self.frames = frames
        self._items, self._getters = deques
        self.hand = hand
        self.hand_plain = hand_plain
        self.mid_content = False

    @classmethod
    def of(
        cls, frames: asyncio.Queue[Any], hand: Hand, hand_plain: HandPlain
    ) -> DirectChannel | None:
        """A registration for a channel with the frame queue ``frames`` (None: the
        queue lacks the private deques this relies on)."""
        deques = hooks.queue_deques(frames)
        return None if deques is None else cls(frames, deques, hand, hand_plain)

    def idle(self) -> bool:
        """Nothing queued for the channel, and its reader waits for a frame."""
        return not self._items and bool(self._getters) and not self.mid_content

    async def take(
        self,
        first: Received,
        read_now: Callable[[], Received | None],
        read: Callable[[], Awaitable[Received]],
        stamp: Callable[[], None],
    ) -> Received | None:
        """Read the rest of the delivery ``first`` starts and hand it over (None).

        Or, where that cannot be done (see the module doc), queue the frames
        read so far for the channel and return the last one, for aiormq's
        reader loop to handle. ``read_now`` decodes a frame already in the
        stream's buffer (None: not all there), ``read`` waits for one.
        """
        number, got = first[1], [first]
        second = read_now() or await read()
        got.append(second)
        header = second[2]
        if second[1] != number or not isinstance(header, ContentHeader):
            return self._queue_all(got)
        body = b""
        size = header.body_size or 0
        if size:
            third = read_now() or await read()
            got.append(third)
            content = third[2]
            if third[1] != number or type(content) is not ContentBody:
                return self._queue_all(got)
            body = content.value
            if len(body) != size:  # more body frames follow: the channel reads them
                return self._queue_all(got)
        if not self.idle():  # the channel changed while we read (closed, say)
            return self._queue_all(got)
        stamp()
        self.hand(first[2], header, body)
        return None

    def _queue_all(self, got: list[Received]) -> Received:
        put = self.frames.put_nowait
        for used, _, frame in got[:-1]:
            put((used, frame))
        return got[-1]


class DirectChannels:
    """The registered channels of one connection, by number."""

    __slots__ = ("channels", "stamp")

    def __init__(self, stamp: Callable[[], None]) -> None:
        self.channels: dict[int, DirectChannel] = {}
        self.stamp = stamp

    @classmethod
    def of(cls, connection: Any) -> DirectChannels | None:
        """The registry of ``connection`` (made on the first call; None: it lacks
        aiormq's last-frame time this relies on)."""
        stamp = hooks.frame_clock(connection)
        if stamp is None:
            return None
        found = _of.get(connection)
        if found is None:
            found = _of[connection] = cls(stamp)
        return found

    @staticmethod
    def registered(connection: Any) -> DirectChannels | None:
        """The registry of ``connection`` if its frame decoder takes deliveries directly."""
        return _of.get(connection)

    def register(self, number: int, channel: DirectChannel, closing: asyncio.Future[Any]) -> None:
        """Hand channel ``number``'s deliveries over directly until ``closing`` is done."""
        self.channels[number] = channel

        def closed(_: asyncio.Future[Any]) -> None:
            if self.channels.get(number) is channel:
                del self.channels[number]

        if closing.done():
            closed(closing)
        else:
            closing.add_done_callback(closed)


def buffered(
    reader: asyncio.StreamReader, decode: Callable[[bytes, bytes], Received]
) -> Callable[[], Received | None]:
    """A function decoding the next frame when it is whole in ``reader``'s buffer.

    It returns None when the frame is not all there yet (the caller awaits
    ``readexactly`` then); it takes the frame out of the buffer as
    ``readexactly`` does (and resumes a transport paused for a full buffer), in
    one step instead of two awaited calls. A reader without asyncio's buffer
    (another implementation) gets a function that always returns None.
    """
    found = hooks.stream_buffer(reader)
    if found is None:
        return lambda: None
    buffer, resume = found
    unpack = _FRAME_HEADER.unpack_from

    def read_now() -> Received | None:
        if len(buffer) < 7:
            return None
        end = unpack(buffer)[2] + 8
        if len(buffer) < end:
            return None
        head, rest = bytes(buffer[:7]), bytes(buffer[7:end])
        del buffer[:end]
        resume()
        return decode(head, rest)

    return read_now


DecodeDelivery = Callable[[bytes, int, int], tuple[Any, Any] | None]
"""``decode(frames, header at, body at)``: the ``basic.deliver`` frame and the
properties of a delivery's frames (the method frame at 0, the content header
frame at ``header at``, the body frame, if any, at ``body at``), or None for
anything but a plain one (it then goes frame by frame)."""


def whole_deliveries(
    reader: asyncio.StreamReader,
    channels: dict[int, DirectChannel],
    stamp: Callable[[], None],
    decode: DecodeDelivery,
) -> Callable[[], int]:
    """A function handing over the deliveries at the head of ``reader``'s buffer, if it can.

    It hands over one delivery after another while the next one's three frames
    (method, header, at most one body frame) are whole in the buffer, on a
    registered channel that is idle, and decode plainly (``decode``); each is
    taken out of the buffer in one step, without a frame object or an awaited
    read each. It returns how many it handed over, and takes nothing more: the
    frames of the next delivery go through `buffered` and `DirectChannel.take`
    (or aiormq's loop) one by one. A transport paused for a full buffer is
    resumed, and the connection's last-frame time noted, once per call (the
    deliveries of one socket read are handed over in one call).
    """
    found = hooks.stream_buffer(reader)
    if found is None:
        return lambda: 0
    buffer, resume = found
    method_start, frame_header, body_size_of = (
        _METHOD_START.unpack_from,
        _FRAME_HEADER.unpack_from,
        _BODY_SIZE.unpack_from,
    )

    def take_one() -> bool:  # noqa: PLR0911 (one return per way a delivery is not whole)
        have = len(buffer)
        if have < 11:
            return False
        kind, number, size, class_id, method_id = method_start(buffer)
        if kind != 1 or class_id != 60 or method_id != 60:  # not a basic.deliver
            return False
        taker = channels.get(number)
        if taker is None or not taker.idle():
            return False
        header_at = size + 8
        if have < header_at + 21:  # frame header and the header's fixed 14 bytes
            return False
        kind, channel, header_size = frame_header(buffer, header_at)
        body_at = header_at + header_size + 8
        if kind != 2 or channel != number or header_size < 14 or have < body_at:
            return False
        (body_size,) = body_size_of(buffer, header_at + 11)
        end = body_at + body_size + 8 if body_size else body_at
        if have < end or buffer[header_at - 1] != _FRAME_END or buffer[body_at - 1] != _FRAME_END:
            return False
        if body_size:
            kind, channel, frame_size = frame_header(buffer, body_at)
            if kind != 3 or channel != number or frame_size != body_size:
                return False
            if buffer[end - 1] != _FRAME_END:
                return False
        data = bytes(buffer[:end])  # one copy: the frames decode from it, the body is cut from it
        decoded = decode(data, header_at, body_at)
        if decoded is None:
            return False
        del buffer[:end]
        taker.hand_plain(decoded[0], decoded[1], data[body_at + 7 : end - 1] if body_size else b"")
        return True

    def take_whole() -> int:
        taken = 0
        while take_one():
            taken += 1
        if taken:
            resume()
            stamp()
        return taken

    return take_whole
