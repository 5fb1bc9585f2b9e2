"""The consumer's inbound path below aiormq: frame decoding and deliveries.

What we own and why. aiormq keeps the socket; its connection's reader task
reads frames, decodes them with pamqp, and queues each channel's frames for
that channel's reader task, which calls ``Channel._on_deliver_frame`` for every
``basic.deliver``. A delivery is three frames (method, content header, body),
and most of a consumer's CPU went into aiormq's generic handling of them. On
the consumer's own connection and channels, and only there, we replace two
pieces, the way `reliable_mq._stream` replaces the publisher's confirm, return
and close handlers on its own channel:

* **Frame decoding** (`take_frames`): the connection's ``FrameReceiver`` reads
  each frame with three socket reads into a ``BytesIO`` under a lock, then
  pamqp decodes it field by field through a type table. Ours reads the 7-byte
  frame header and the payload (two reads from the stream's buffer) and
  decodes the three frames of a delivery (``basic.deliver``, a content header
  with one flag word, a body) directly into the same pamqp objects; every
  other frame (and anything our decoder does not take) goes through pamqp as
  before, and read and decode errors are raised as aiormq raises them. Frames
  are still handed to aiormq's reader loop one by one, so channel 0, RPC
  replies, closes and the frames of other channels are handled by aiormq,
  unchanged. aiormq exposes no hook for its receiver: we find it among the
  locals of the connection's reader coroutine. Where that fails (another
  aiormq, another Python), nothing is replaced and aiormq decodes as before.
* **Deliveries** (`take_deliveries`): aiormq's ``_on_deliver_frame`` reads the
  content into a ``BytesIO``, wraps it in a ``DeliveredMessage`` and starts a
  Task per delivery through its future store (a wrapper object, two sets and
  two done-callbacks each). Ours takes the header and body frames straight off
  the channel's frame queue (waiting only when they have not arrived yet),
  uses a single-frame body as is, and hands the delivery *synchronously*, in
  tag order, to a plain function (the consumer's dispatcher), which records it
  and starts the one Task that processes it. A delivery for a consumer tag
  that is not registered is dropped, as aiormq does; a header or body frame of
  the wrong kind raises from the channel's reader, as in aiormq (the channel
  closes and the broker requeues what it had delivered on it).

Everything else stays aiormq's: the socket, heartbeats, RPCs, ``basic.qos``,
``basic.consume``/``basic.cancel``, settle frames, the close handshakes. Since
our delivery tasks are not in aiormq's future store, aiormq no longer cancels
them when the channel closes: the consumer does (see
`reliable_mq._route.ChannelKeeper`).
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import weakref
from collections.abc import Callable
from typing import Any

import aiormq
import pamqp.frame
from aiormq.abc import AbstractConnection
from pamqp import decode
from pamqp.body import ContentBody
from pamqp.commands import Basic
from pamqp.header import ContentHeader

from ._amqp_faults import reader_error

__all__ = ("OnDelivery", "decode_frame", "take_deliveries", "take_frames")

OnDelivery = Callable[[Basic.Deliver, Basic.Properties, bytes], None]
"""Called once per delivery, in tag order, from the channel's reader task:
``(deliver frame, properties, body)``. It must not raise (an exception closes
the channel)."""


def take_deliveries(channel: aiormq.Channel, on_delivery: OnDelivery) -> None:
    """Replace ``channel``'s delivery handler: each delivery goes to ``on_delivery``."""
    frames = channel.frames
    get_frame = channel._get_frame
    consumers = channel.consumers

    async def next_frame() -> Any:
        if frames.empty():
            return await get_frame()
        frame = frames.get_nowait()[1]
        frames.task_done()
        return frame

    async def on_deliver(frame: Basic.Deliver) -> None:
        # The header and the body have usually arrived with the method frame:
        # take them without a coroutine each.
        if frames.empty():
            header = await get_frame()
        else:
            header = frames.get_nowait()[1]
            frames.task_done()
        if not isinstance(header, ContentHeader):
            raise ValueError(f"Unexpected frame {header!r} instead of ContentHeader", header)
        size = header.body_size or 0
        body = b""
        if size:
            if frames.empty():
                content = await get_frame()
            else:
                content = frames.get_nowait()[1]
                frames.task_done()
            if not isinstance(content, ContentBody):
                raise ValueError(f"Unexpected frame {content!r}", content)
            body = content.value
            if len(body) < size:
                body = await _rest(body, size, next_frame)
        if frame.consumer_tag in consumers:
            on_delivery(frame, header.properties, body)

    channel._on_deliver_frame = on_deliver  # type: ignore[method-assign]


async def _rest(first: bytes, size: int, next_frame: Callable[[], Any]) -> bytes:
    """The rest of a body split over several frames."""
    parts = [first]
    received = len(first)
    while received < size:
        content = await next_frame()
        if not isinstance(content, ContentBody):
            raise ValueError(f"Unexpected frame {content!r}", content)
        parts.append(content.value)
        received += len(content.value)
    return b"".join(parts)


# -- frame decoding -------------------------------------------------------------

_FRAME_HEADER = struct.Struct(">BHI")
_HEADER_START = struct.Struct(">HHQH")  # class id, weight, body size, first flag word
_LONGLONG = struct.Struct(">q")  # signed, as pamqp decodes it
_METHOD, _HEADER, _BODY = 1, 2, 3
_FRAME_END = 0xCE
_DELIVER = struct.pack(">HH", 60, 60)
_PROPERTIES = tuple(
    (name, Basic.Properties.flags[name], Basic.Properties.amqp_type(name))
    for name in Basic.Properties.__slots__
)
_taken: weakref.WeakSet[Any] = weakref.WeakSet()  # receivers whose get_frame is ours


def take_frames(connection: AbstractConnection) -> bool:
    """Decode ``connection``'s frames with `decode_frame` from now on (once per connection).

    Returns:
        True if ours decodes them; False if aiormq's receiver could not be
        found (it then goes on decoding, as before).
    """
    receiver = _receiver(connection)
    if receiver is None:
        return False
    if receiver in _taken:
        return True
    reader = receiver.reader

    async def get_frame() -> tuple[int, int, Any]:
        if reader.at_eof():
            raise StopAsyncIteration
        try:
            head = await reader.readexactly(7)
            rest = await reader.readexactly(_FRAME_HEADER.unpack(head)[2] + 1)
            return decode_frame(head, rest)
        except Exception as exc:
            mapped = reader_error(exc)
            if mapped is None:
                raise
            raise mapped from exc

    receiver.get_frame = get_frame
    _taken.add(receiver)
    return True


def _receiver(connection: AbstractConnection) -> Any:
    """aiormq's ``FrameReceiver`` of ``connection``: a local of its reader coroutine."""
    with contextlib.suppress(Exception):
        task = getattr(connection, "_reader_task", None)
        task = getattr(task, "task", task)  # aiormq wraps it in a TaskWrapper
        if isinstance(task, asyncio.Task) and not task.done():
            frame = task.get_coro().cr_frame  # type: ignore[union-attr]
            receiver = frame.f_locals.get("frame_receiver") if frame is not None else None
            if isinstance(receiver, aiormq.connection.FrameReceiver) and isinstance(
                getattr(receiver, "reader", None), asyncio.StreamReader
            ):
                return receiver
    return None


def decode_frame(head: bytes, rest: bytes) -> tuple[int, int, Any]:
    """Decode one frame as ``pamqp.frame.unmarshal(head + rest)`` does.

    Args:
        head: the 7-byte frame header (type, channel, payload size).
        rest: the payload and the frame-end byte.

    Returns:
        ``(bytes used, channel, frame)``.

    Raises:
        PAMQPException: as pamqp, for a frame it cannot decode.
    """
    kind, channel, size = _FRAME_HEADER.unpack(head)
    if size and len(rest) == size + 1 and rest[size] == _FRAME_END:
        used = size + 8
        if kind == _BODY:
            return used, channel, ContentBody(rest[:size])
        try:
            if kind == _METHOD and rest.startswith(_DELIVER):
                return used, channel, _deliver(rest)
            if kind == _HEADER:
                header = _content_header(rest)
                if header is not None:
                    return used, channel, header
        except Exception:  # pamqp decodes it again, and says what is wrong
            pass
    return pamqp.frame.unmarshal(head + rest)


def _short_str(data: bytes, offset: int) -> tuple[str, int]:
    end = offset + 1 + data[offset]
    if end > len(data):
        raise ValueError("short string past the end of the frame")
    return data[offset + 1 : end].decode("utf-8"), end


def _deliver(data: bytes) -> Basic.Deliver:
    consumer_tag, offset = _short_str(data, 4)
    delivery_tag = _LONGLONG.unpack_from(data, offset)[0]
    redelivered = bool(data[offset + 8] & 1)
    exchange, offset = _short_str(data, offset + 9)
    routing_key, offset = _short_str(data, offset)
    frame = Basic.Deliver.__new__(Basic.Deliver)  # as pamqp: no validation of what came in
    frame.consumer_tag = consumer_tag
    frame.delivery_tag = delivery_tag
    frame.redelivered = redelivered
    frame.exchange = exchange
    frame.routing_key = routing_key
    return frame


def _content_header(data: bytes) -> ContentHeader | None:
    """A content header with one flag word (None: more, pamqp decodes it)."""
    class_id, weight, body_size, flags = _HEADER_START.unpack_from(data)
    if flags & 1:
        return None
    properties = Basic.Properties.__new__(Basic.Properties)
    offset = 14
    value: Any
    for name, flag, kind in _PROPERTIES:
        if not flags & flag:
            value = "" if name == "cluster_id" else None
        elif kind == "shortstr":
            value, offset = _short_str(data, offset)
        elif kind == "octet":
            value = data[offset]
            offset += 1
        elif kind == "table":
            used, value = decode.field_table(data[offset:])
            offset += used
        elif kind == "timestamp":
            used, value = decode.timestamp(data[offset : offset + 8])
            offset += used
        else:
            return None
        setattr(properties, name, value)
    if offset > len(data):
        raise ValueError("content header past the end of the frame")
    header = ContentHeader.__new__(ContentHeader)
    header.class_id = class_id
    header.weight = weight
    header.body_size = body_size
    header.properties = properties
    return header
