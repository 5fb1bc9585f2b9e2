"""The consumer's inbound path below aiormq: frame decoding and deliveries.

What we own and why. aiormq keeps the socket; its connection's reader task
reads frames, decodes them with pamqp, and queues each channel's frames for
that channel's reader task, which calls ``Channel._on_deliver_frame`` for every
``basic.deliver``. A delivery is three frames (method, content header, body),
and most of a consumer's CPU went into aiormq's generic handling of them. On
the consumer's own connection and channels, and only there, we replace two
pieces, the way `reliable_mq._publish.stream` replaces the publisher's confirm, return
and close handlers on its own channel:

* **Frame decoding** (`take_frames`): the connection's ``FrameReceiver`` reads
  each frame with three socket reads into a ``BytesIO`` under a lock, then
  pamqp decodes it field by field through a type table. Ours reads the 7-byte
  frame header and the payload (two reads from the stream's buffer) and
  decodes the three frames of a delivery (``basic.deliver``, a content header
  with one flag word, a body) directly into the same pamqp objects, with one
  difference: timestamps (the property and ``T`` header values) are 64-bit
  POSIX seconds, as AMQP 0-9-1 defines them, where pamqp reads any value above
  2**32 - 1 as milliseconds (`reliable_mq._amqp.fields`); every
  other frame (and anything our decoder does not take) goes through pamqp as
  before, and read and decode errors are raised as aiormq raises them. Frames
  are still handed to aiormq's reader loop one by one, so channel 0, RPC
  replies, closes and the frames of other channels are handled by aiormq,
  unchanged. aiormq exposes no hook for its receiver: `reliable_mq._amqp.hooks`
  finds it (the argument of the connection's reader coroutine, checked to be
  aiormq's ``Connection.__reader`` over a ``FrameReceiver``) when the link
  opens; where that check fails, the link takes the plain path, with a warning.
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
* **Undecodable deliveries**: the broker checks neither that the strings of a
  delivery (its routing key, the short-string properties, header names) are
  UTF-8 nor that its timestamps are dates Python can hold (a timestamp in
  milliseconds, as some clients send, is past the year 9999), so another client
  can send what pamqp cannot decode. pamqp raises, and aiormq's reader closes
  the whole connection: the broker redelivers the message and the consumer
  reconnects for ever, every queue on the connection stopped. Our decoder
  decodes such a frame again, only when the fast one failed, with those strings
  backslash-escaped (``\\xff``) and such a timestamp None, as an
  `UndecodableDeliver` or `UndecodableHeader` that names what did not decode
  (`Undecodable`); the delivery reaches ``on_delivery`` with it, and the
  consumer dead-letters it without running the handler.

Everything else stays aiormq's: the socket, heartbeats, RPCs, ``basic.qos``,
``basic.consume``/``basic.cancel``, settle frames, the close handshakes. Since
our delivery tasks are not in aiormq's future store, aiormq no longer cancels
them when the channel closes: the consumer does (see
`reliable_mq._consume.route.ChannelKeeper`).
"""

from __future__ import annotations

import struct
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import aiormq
import pamqp.frame
from pamqp.body import ContentBody
from pamqp.commands import Basic
from pamqp.header import ContentHeader

from . import hooks
from .direct import DirectChannel, DirectChannels, buffered, whole_deliveries
from .faults import reader_error
from .fields import A_ARRAY, F_TABLE, T_TIMESTAMP, read_scalar, timestamp_of
from .plain import FLAG_WORDS, read_deliver, read_properties

__all__ = (
    "OnDelivery",
    "Undecodable",
    "UndecodableDeliver",
    "UndecodableHeader",
    "content_header",
    "decode_frame",
    "take_deliveries",
    "take_frames",
)


@dataclass(frozen=True, slots=True)
class Undecodable:
    """What in a delivery's frames did not decode, though the frames are well formed.

    Attributes:
        fields: what did not decode, e.g. ``("message_id", "header name 'a\\xff'")``.
        error: the first error (``UnicodeDecodeError``; ``ValueError``,
            ``OverflowError`` or ``OSError`` for a timestamp past the year 9999).
    """

    fields: tuple[str, ...]
    error: Exception

    def describe(self) -> str:
        """``"not decodable: message_id, routing_key"``."""
        return "not decodable: " + ", ".join(self.fields)

    def __add__(self, other: Undecodable) -> Undecodable:
        return Undecodable(self.fields + other.fields, self.error)


class UndecodableDeliver(Basic.Deliver):
    """A ``basic.deliver`` whose exchange or routing key is not UTF-8 (kept escaped)."""

    undecodable: Undecodable


class UndecodableHeader(ContentHeader):
    """A content header with properties that did not decode (strings kept escaped)."""

    undecodable: Undecodable


OnDelivery = Callable[[Basic.Deliver, Basic.Properties, bytes, Undecodable | None], None]
"""Called once per delivery, in tag order, from the channel's reader task:
``(deliver frame, properties, body, undecodable)``; ``undecodable`` is None
unless a string or timestamp in the deliver frame or the properties did not
decode. It must not raise (an exception closes the channel)."""


def take_deliveries(channel: aiormq.Channel, on_delivery: OnDelivery) -> None:
    """Replace ``channel``'s delivery handler: each delivery goes to ``on_delivery``.

    The caller checked the hooks (`reliable_mq._amqp.hooks.check_channel`).
    """
    frames, get_frame = hooks.channel_frames(channel)
    consumers = channel.consumers
    plain_deliver, plain_header = Basic.Deliver, ContentHeader  # not undecodable ones

    async def next_frame() -> Any:
        if frames.empty():
            return await get_frame()
        frame = frames.get_nowait()[1]
        frames.task_done()
        return frame

    def hand(frame: Basic.Deliver, header: ContentHeader, body: bytes) -> None:
        if frame.consumer_tag in consumers:
            if type(frame) is plain_deliver and type(header) is plain_header:
                on_delivery(frame, header.properties, body, None)
            else:
                on_delivery(frame, header.properties, body, _undecodable(frame, header))

    def hand_plain(frame: Basic.Deliver, properties: Basic.Properties, body: bytes) -> None:
        if frame.consumer_tag in consumers:
            on_delivery(frame, properties, body, None)

    direct = DirectChannels.registered(channel.connection)
    taker = None if direct is None else DirectChannel.of(frames, hand, hand_plain)

    async def on_deliver(frame: Basic.Deliver) -> None:
        # The header and the body have usually arrived with the method frame:
        # take them without a coroutine each.
        if taker is not None:
            taker.mid_content = True  # not idle: the frame reader must not hand over
        try:
            header, body = await _content(frames, get_frame, next_frame)
        finally:
            if taker is not None:
                taker.mid_content = False
        hand(frame, header, body)

    hooks.install_deliver_handler(channel, on_deliver)
    if direct is not None and taker is not None:
        direct.register(int(channel.number), taker, channel.closing)


async def _content(
    frames: Any, get_frame: Callable[[], Any], next_frame: Callable[[], Any]
) -> tuple[ContentHeader, bytes]:
    """A delivery's content header and body, off the channel's frame queue."""
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
    return header, body


def _undecodable(frame: Basic.Deliver, header: ContentHeader) -> Undecodable | None:
    """What did not decode in a delivery's method frame and content header."""
    first = frame.undecodable if isinstance(frame, UndecodableDeliver) else None
    second = header.undecodable if isinstance(header, UndecodableHeader) else None
    if first is None or second is None:
        return first or second
    return first + second


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
_FLAGS = struct.Struct(">H")
_HEADER_START = struct.Struct(">HHQH")  # class id, weight, body size, first flag word
_LONGLONG = struct.Struct(">q")  # signed, as pamqp decodes it
_LONG = struct.Struct(">I")
_TIMESTAMP = struct.Struct(">Q")
_METHOD, _HEADER, _BODY = 1, 2, 3
_FRAME_END = 0xCE
_DELIVER = struct.pack(">HH", 60, 60)
_PROPERTIES = (  # AMQP 0-9-1 basic properties in wire order: pamqp's slot name, flag, type
    ("content_type", 1 << 15, "shortstr"),
    ("content_encoding", 1 << 14, "shortstr"),
    ("headers", 1 << 13, "table"),
    ("delivery_mode", 1 << 12, "octet"),
    ("priority", 1 << 11, "octet"),
    ("correlation_id", 1 << 10, "shortstr"),
    ("reply_to", 1 << 9, "shortstr"),
    ("expiration", 1 << 8, "shortstr"),
    ("message_id", 1 << 7, "shortstr"),
    ("timestamp", 1 << 6, "timestamp"),
    ("message_type", 1 << 5, "shortstr"),
    ("user_id", 1 << 4, "shortstr"),
    ("app_id", 1 << 3, "shortstr"),
    ("cluster_id", 1 << 2, "shortstr"),
)
_taken: weakref.WeakSet[Any] = weakref.WeakSet()  # receivers whose get_frame is ours


def take_frames(receiver: Any, connection: Any = None) -> None:
    """Decode with `decode_frame` from now on the frames ``receiver`` reads (once each).

    ``receiver``: aiormq's frame receiver of a connection, found and checked by
    `reliable_mq._amqp.hooks.find_receiver`. With its ``connection``, the
    deliveries of the channels `take_deliveries` takes on it are handed over
    by the frame reader itself (`reliable_mq._amqp.direct`).
    """
    if receiver in _taken:
        return
    reader = receiver.reader
    direct = None if connection is None else DirectChannels.of(connection)
    channels = {} if direct is None else direct.channels
    stamp = (lambda: None) if direct is None else direct.stamp
    delivers = (Basic.Deliver, UndecodableDeliver)

    read_now = buffered(reader, decode_frame)
    take_whole = whole_deliveries(reader, channels, stamp, _plain_delivery)

    async def read() -> tuple[int, int, Any]:
        head = await reader.readexactly(7)
        return decode_frame(head, await reader.readexactly(_FRAME_HEADER.unpack(head)[2] + 1))

    async def get_frame() -> tuple[int, int, Any]:
        while True:
            if reader.at_eof():
                raise StopAsyncIteration
            try:
                if channels and take_whole():
                    continue  # whole deliveries were in the buffer: handed over
                received = read_now() or await read()
                if channels and type(received[2]) in delivers:
                    taker = channels.get(received[1])
                    if taker is not None and taker.idle():
                        handed = await taker.take(received, read_now, read, stamp)
                        if handed is None:
                            continue  # handed over: the next frame
                        received = handed
                return received
            except Exception as exc:
                mapped = reader_error(exc)
                if mapped is None:
                    raise
                raise mapped from exc

    hooks.install_frame_decoder(receiver, get_frame)
    _taken.add(receiver)


def decode_frame(head: bytes, rest: bytes) -> tuple[int, int, Any]:
    """Decode one frame as ``pamqp.frame.unmarshal(head + rest)`` does.

    Except for a well-formed ``basic.deliver`` or content header that pamqp
    cannot decode only because a string in it is not UTF-8 or a timestamp is
    out of range: that is an `UndecodableDeliver` or `UndecodableHeader`.

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
        payload = rest[:size]  # a field that overruns must not read the frame-end byte
        try:
            if kind == _METHOD and payload.startswith(_DELIVER):
                return used, channel, _deliver(payload)
            if kind == _HEADER:
                header = content_header(payload)
                if header is not None:
                    return used, channel, header
        except Exception:  # a string not UTF-8, a bad timestamp, or a damaged frame
            undecodable = _decode_escaped(kind, rest)
            if undecodable is not None:
                return used, channel, undecodable
            # Damaged: pamqp decodes it again, and says what is wrong.
    return pamqp.frame.unmarshal(head + rest)


def _plain_delivery(
    data: bytes, header_at: int, body_at: int
) -> tuple[Basic.Deliver, Basic.Properties] | None:
    """A delivery's method frame and its content header's properties, decoded from
    ``data`` (the delivery's frames: the method frame at 0, the header frame at
    ``header_at``, what follows at ``body_at``); None if either is not plain (not
    UTF-8, a bad timestamp, two flag words, damaged): `decode_frame` then decodes
    them one by one, and says what is wrong."""
    try:
        frame, end = read_deliver(data, 11)  # past the frame header, class and method ids
        if end > header_at - 1:  # past the method frame's end
            return None
        flags = _FLAGS.unpack_from(data, header_at + 19)[0]
        if flags & FLAG_WORDS:
            return None
        properties, end = read_properties(data, header_at + 21, flags)
    except Exception:
        return None
    return None if end > body_at - 1 else (frame, properties)


def _deliver(data: bytes) -> Basic.Deliver:
    """A ``basic.deliver`` payload, decoded (as pamqp: no validation of what came in)."""
    frame, end = read_deliver(data, 4)
    if end > len(data):
        raise ValueError("short string past the end of the frame")
    return frame


def content_header(data: bytes) -> ContentHeader | None:
    """A content header payload with one flag word, decoded (None: more, pamqp decodes it)."""
    class_id, weight, body_size, flags = _HEADER_START.unpack_from(data)
    if flags & FLAG_WORDS:
        return None
    properties, end = read_properties(data, 14, flags)
    if end > len(data):
        raise ValueError("content header past the end of the frame")
    header = _new_header()
    header.class_id = class_id
    header.weight = weight
    header.body_size = body_size
    header.properties = properties
    return header


class _Reader(Protocol):
    """How `_read_deliver` and `_read_header` decode strings, tables and timestamps
    when the hot path's readers (`reliable_mq._amqp.plain`) could not.

    ``where`` names the field, for a reader that notes what it could not decode.
    """

    def short_str(self, data: bytes, offset: int, where: str) -> tuple[str, int]: ...
    def table(self, data: bytes, offset: int, where: str) -> tuple[dict[str, Any], int]: ...
    def timestamp(self, data: bytes, offset: int, where: str) -> tuple[Any, int]: ...


_D = TypeVar("_D", bound=Basic.Deliver)
_H = TypeVar("_H", bound=ContentHeader)
_new_header = hooks.frame_factory(ContentHeader)


def _read_deliver(frame: _D, data: bytes, reader: _Reader) -> _D:
    """Fill ``frame`` from a ``basic.deliver`` payload."""
    frame.consumer_tag, offset = reader.short_str(data, 4, "consumer_tag")
    frame.delivery_tag = _LONGLONG.unpack_from(data, offset)[0]
    frame.redelivered = bool(data[offset + 8] & 1)
    frame.exchange, offset = reader.short_str(data, offset + 9, "exchange")
    frame.routing_key, offset = reader.short_str(data, offset, "routing_key")
    return frame


def _read_header(header: _H, data: bytes, reader: _Reader) -> _H | None:
    """Fill ``header`` from a content header payload with one flag word (None: more)."""
    class_id, weight, body_size, flags = _HEADER_START.unpack_from(data)
    if flags & 1:
        return None
    properties = hooks.new_frame(Basic.Properties)
    offset = 14
    value: Any
    for name, flag, kind in _PROPERTIES:
        if not flags & flag:
            value = "" if name == "cluster_id" else None
        elif kind == "shortstr":
            value, offset = reader.short_str(data, offset, name)
        elif kind == "octet":
            value = data[offset]
            offset += 1
        elif kind == "table":
            value, offset = reader.table(data, offset, "header")
        elif kind == "timestamp":
            value, offset = reader.timestamp(data, offset, name)
        else:
            return None
        setattr(properties, name, value)
    if offset > len(data):
        raise ValueError("content header past the end of the frame")
    header.class_id = class_id
    header.weight = weight
    header.body_size = body_size
    header.properties = properties
    return header


# -- deliveries that do not decode ------------------------------------------------


def _escape(raw: bytes) -> str:
    """``raw`` as text, what is not UTF-8 as ``\\xNN``, cut to fit a short string again.

    255 bytes escape to as many as 1,020 characters: cut (and marked ``...``) so
    that the consumer's copy of the message can carry it as a property again.
    """
    text = raw.decode("utf-8", "backslashreplace")
    if len(text.encode()) <= 255:
        return text
    return text.encode()[:252].decode("utf-8", "ignore") + "..."


class _Escaping:
    """Decodes what pamqp cannot: strings that are not UTF-8 (escaped), bad timestamps (None).

    The `_Reader` for a frame `_Strict` could not decode (slower): it notes
    what it had to escape or drop.
    """

    __slots__ = ("error", "fields")

    def __init__(self) -> None:
        self.fields: list[str] = []
        self.error: Exception | None = None

    def _note(self, where: str, error: Exception) -> None:
        self.fields.append(where)
        if self.error is None:
            self.error = error

    def short_str(self, data: bytes, offset: int, where: str) -> tuple[str, int]:
        end = offset + 1 + data[offset]
        if end > len(data):
            raise ValueError("short string past the end of the frame")
        raw = data[offset + 1 : end]
        try:
            return raw.decode("utf-8"), end
        except UnicodeDecodeError as exc:
            text = _escape(raw)
            self._note(f"{where} '{text}'" if where.endswith(" name") else where, exc)
            return text, end

    def timestamp(self, data: bytes, offset: int, where: str) -> tuple[Any, int]:
        (seconds,) = _TIMESTAMP.unpack_from(data, offset)  # too short: damaged, not undecodable
        try:
            return timestamp_of(seconds), offset + 8
        except (ValueError, OverflowError, OSError) as exc:  # past the year 9999
            self._note(where, exc)
            return None, offset + 8

    def table(self, data: bytes, offset: int, where: str) -> tuple[dict[str, Any], int]:
        (length,) = _LONG.unpack_from(data, offset)
        offset += 4
        end = offset + length
        if end > len(data):
            raise ValueError("field table past the end of the frame")
        table: dict[str, Any] = {}
        while offset < end:
            key, offset = self.short_str(data, offset, f"{where} name")
            table[key], offset = self.value(data, offset, f"{where}[{key!r}]")
        if offset != end:
            raise ValueError("field table overruns its length")
        return table, end

    def value(self, data: bytes, offset: int, where: str) -> tuple[Any, int]:
        kind = data[offset]
        if kind == F_TABLE:
            return self.table(data, offset + 1, where)
        if kind == T_TIMESTAMP:
            return self.timestamp(data, offset + 1, where)
        if kind == A_ARRAY:
            (length,) = _LONG.unpack_from(data, offset + 1)
            offset += 5
            end = offset + length
            if end > len(data):
                raise ValueError("field array past the end of the frame")
            items: list[Any] = []
            while offset < end:
                item, offset = self.value(data, offset, f"{where}[{len(items)}]")
                items.append(item)
            if offset != end:
                raise ValueError("field array overruns its length")
            return items, end
        return read_scalar(kind, data, offset + 1)

    def undecodable(self) -> Undecodable | None:
        if self.error is None:
            return None
        return Undecodable(tuple(self.fields), self.error)


def _decode_escaped(kind: int, data: bytes) -> UndecodableDeliver | UndecodableHeader | None:
    """``data`` decoded by `_Escaping`: None if it is damaged, or decodes after all.

    ``data`` is the payload and the frame-end byte; nothing may reach into that byte.
    """
    try:
        if kind == _METHOD and data.startswith(_DELIVER):
            return _escaped_deliver(data[:-1])
        if kind == _HEADER:
            return _escaped_header(data[:-1])
    except Exception:
        return None
    return None


def _escaped_deliver(data: bytes) -> UndecodableDeliver | None:
    escaping = _Escaping()
    frame = _read_deliver(hooks.new_frame(UndecodableDeliver), data, escaping)
    undecodable = escaping.undecodable()
    if undecodable is None:
        return None
    frame.undecodable = undecodable
    return frame


def _escaped_header(data: bytes) -> UndecodableHeader | None:
    escaping = _Escaping()
    header = _read_header(hooks.new_frame(UndecodableHeader), data, escaping)
    undecodable = escaping.undecodable()
    if header is None or undecodable is None:
        return None
    header.undecodable = undecodable
    return header
