"""AMQP 0-9-1 publish frames, validated and encoded by us: pure functions, no I/O.

reliable_mq owns the publish path below aiormq's ``Channel.basic_publish``:
a message is checked and encoded *once*, when it is accepted, into the
payloads of its ``basic.publish`` method frame and its content header; each
attempt then only wraps those payloads (and the body) in frame headers for the
channel it goes out on. Everything the broker would refuse after the fact and
that the client can check is refused here, before anything is sent, with an
[`InvalidMessage`][reliable_mq.errors.InvalidMessage] naming the field:

* short strings (exchange, routing key, message id, content type...) at most
  255 bytes of UTF-8; header names at most 128 bytes (the AMQP limit pamqp
  silently truncates to);
* every string (those, header names, string header values) encodable as
  UTF-8: a lone surrogate such as ``"\\ud800"`` is refused;
* header values of AMQP field types only, numbers finite and in range, nesting
  at most 32 levels;
* ``expiration`` a finite number of seconds from 0 to 2**32 - 1 ms, the
  broker's own limit, rounded to the nearest millisecond (``64.002`` is
  ``"64002"``, never truncated to ``"64001"``); ``priority`` 0 to 255;
* a timestamp (the property, and ``T`` header values) from 1970 on, as 64-bit
  POSIX seconds (the fraction of a second dropped): ``datetime(2200, 1, 1)``
  is ``7258118400``, beyond the 32 bits some decoders assume;
* the content header (properties and headers) within one frame of the
  negotiated ``frame_max``.

Floats in headers are sent as doubles (``d``), never narrowed to 32 bits.
"""

from __future__ import annotations

import datetime as dt
import math
import struct
from collections.abc import Mapping
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from ..errors import InvalidMessage

__all__ = (
    "FRAME_OVERHEAD",
    "MAX_EXPIRATION_MS",
    "Encoded",
    "check_timeout",
    "encode_headers",
    "encode_properties",
    "encode_publish",
    "expiration_ms",
    "publish_frames",
)

FRAME_OVERHEAD = 8
"""Bytes a frame adds around its payload: type, channel, size and the end octet."""
MAX_EXPIRATION_MS = 4_294_967_295
"""RabbitMQ refuses a per-message TTL above this (``rabbit_misc:check_expiry``)."""
_MAX_DEPTH = 32
_MAX_KEY = 128
_FRAME_END = b"\xce"
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_SECOND = dt.timedelta(seconds=1)

_pack_frame_head = struct.Struct(">BHI").pack
_pack_content_head = struct.Struct(">HHQ").pack
_pack_publish_head = struct.Struct(">HHH").pack(60, 40, 0)
_BOOL = struct.Struct(">?").pack
_I8 = struct.Struct(">b").pack
_I16 = struct.Struct(">h").pack
_I32 = struct.Struct(">i").pack
_I64 = struct.Struct(">q").pack
_U16 = struct.Struct(">H").pack
_U32 = struct.Struct(">I").pack
_U64 = struct.Struct(">Q").pack
_F64 = struct.Struct(">d").pack
_DECIMAL = struct.Struct(">Bi").pack

# Basic.Properties flag bits, in wire order.
_CONTENT_TYPE = 1 << 15
_CONTENT_ENCODING = 1 << 14
_HEADERS = 1 << 13
_DELIVERY_MODE = 1 << 12
_PRIORITY = 1 << 11
_CORRELATION_ID = 1 << 10
_REPLY_TO = 1 << 9
_EXPIRATION = 1 << 8
_MESSAGE_ID = 1 << 7
_TIMESTAMP = 1 << 6
_TYPE = 1 << 5
_USER_ID = 1 << 4
_APP_ID = 1 << 3
_CLUSTER_ID = 1 << 2


class Encoded:
    """The payloads of one message's frames, ready to be wrapped for any channel."""

    __slots__ = ("body", "header", "method")

    def __init__(self, method: bytes, header: bytes, body: bytes) -> None:
        self.method = method
        self.header = header
        self.body = body


def shortstr(value: Any, field: str, *, limit: int = 255) -> bytes:
    """``value`` as an AMQP short string (length octet + UTF-8).

    Raises:
        InvalidMessage: not a str, or longer than ``limit`` bytes.
    """
    if not isinstance(value, str):
        raise InvalidMessage(f"{field} must be a str, not {type(value).__name__}")
    try:
        data = value.encode()
    except UnicodeEncodeError as exc:  # free on the good path: no check before
        raise InvalidMessage(f"{field} {_not_utf8(exc)}") from None
    if len(data) > limit:
        raise InvalidMessage(f"{field} is {len(data)} bytes of UTF-8; the limit is {limit}")
    return bytes((len(data),)) + data


def _not_utf8(exc: UnicodeEncodeError) -> str:
    """Why a str is not UTF-8 text, printable as is (the culprit escaped)."""
    culprit = exc.object[exc.start : exc.end].encode("unicode_escape").decode("ascii")
    return f"is not encodable as UTF-8: a lone surrogate {culprit} at index {exc.start}"


def check_timeout(value: Any, field: str = "timeout") -> float:
    """A finite, positive number of seconds.

    Raises:
        InvalidMessage: NaN, infinite, zero, negative, or not a number.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidMessage(f"{field} must be a number of seconds, not {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise InvalidMessage(f"{field} must be finite and positive, not {value!r}")
    return float(value)


def encode_publish(exchange: str, routing_key: str, mandatory: bool) -> bytes:
    """The ``basic.publish`` method payload.

    Raises:
        InvalidMessage: exchange or routing key not a str, or over 255 bytes.
    """
    return b"".join(
        (
            _pack_publish_head,
            shortstr(exchange, "exchange"),
            shortstr(routing_key, "routing_key"),
            b"\x01" if mandatory else b"\x00",
        )
    )


def encode_properties(  # noqa: PLR0912 (one branch per basic property, in wire order; the publish hot path)
    body_size: int,
    *,
    content_type: str | None = None,
    content_encoding: str | None = None,
    headers: Mapping[str, Any] | None = None,
    delivery_mode: int | None = None,
    priority: int | None = None,
    correlation_id: str | None = None,
    reply_to: str | None = None,
    expiration: float | None = None,
    message_id: str | None = None,
    timestamp: dt.datetime | None = None,
    message_type: str | None = None,
    user_id: str | None = None,
    app_id: str | None = None,
    cluster_id: str | None = None,
) -> bytes:
    """The content header payload (class, weight, body size, flags, properties).

    Every basic property, in wire order; None leaves it out, and an empty
    string is sent as an empty string. ``publish()`` always gives
    ``delivery_mode`` and ``message_id``; a copy of a received message gives
    what the original had.

    Raises:
        InvalidMessage: a property of the wrong type or out of range (named).
    """
    flags = 0
    parts: list[bytes] = []
    if content_type is not None:
        flags |= _CONTENT_TYPE
        parts.append(shortstr(content_type, "content_type"))
    if content_encoding is not None:
        flags |= _CONTENT_ENCODING
        parts.append(shortstr(content_encoding, "content_encoding"))
    if headers:
        flags |= _HEADERS
        parts.append(encode_headers(headers))
    if delivery_mode is not None:
        flags |= _DELIVERY_MODE
        parts.append(bytes((delivery_mode,)))
    if priority is not None:
        if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 255:
            raise InvalidMessage(f"priority must be an int from 0 to 255, not {priority!r}")
        flags |= _PRIORITY
        parts.append(bytes((priority,)))
    if correlation_id is not None:
        flags |= _CORRELATION_ID
        parts.append(shortstr(correlation_id, "correlation_id"))
    if reply_to is not None:
        flags |= _REPLY_TO
        parts.append(shortstr(reply_to, "reply_to"))
    if expiration is not None:
        flags |= _EXPIRATION
        parts.append(shortstr(str(expiration_ms(expiration)), "expiration"))
    if message_id is not None:
        flags |= _MESSAGE_ID
        parts.append(shortstr(message_id, "message_id"))
    if timestamp is not None:
        flags |= _TIMESTAMP
        parts.append(_U64(_timestamp(timestamp, "timestamp")))
    if message_type is not None:
        flags |= _TYPE
        parts.append(shortstr(message_type, "message_type"))
    if user_id is not None:
        flags |= _USER_ID
        parts.append(shortstr(user_id, "user_id"))
    if app_id is not None:
        flags |= _APP_ID
        parts.append(shortstr(app_id, "app_id"))
    if cluster_id is not None:
        flags |= _CLUSTER_ID
        parts.append(shortstr(cluster_id, "cluster_id"))
    return b"".join((_pack_content_head(60, 0, body_size), _U16(flags), *parts))


def expiration_ms(value: Any) -> int:
    """``expiration`` seconds as the whole milliseconds the property carries, rounded
    half up from the number as written (``64.002`` is 64002, ``0.0005`` is 1).

    Raises:
        InvalidMessage: not a number, negative, not finite, or over the broker's limit.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, Decimal)):
        raise InvalidMessage(f"expiration must be a number of seconds, not {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise InvalidMessage(f"expiration must be finite and >= 0 seconds, not {value!r}")
    if isinstance(value, int):
        ms = value * 1000
    else:  # a float by its shortest repr: the decimal the caller wrote, not its binary neighbour
        exact = value if isinstance(value, Decimal) else Decimal(repr(value))
        if exact > MAX_EXPIRATION_MS:  # before scaling: Decimal("1e999999") must not grow
            ms = MAX_EXPIRATION_MS + 1
        else:
            ms = int((exact * 1000).to_integral_value(ROUND_HALF_UP))
    if ms > MAX_EXPIRATION_MS:
        raise InvalidMessage(
            f"expiration {value!r}s is over the broker's limit of {MAX_EXPIRATION_MS} ms"
        )
    return ms


def _timestamp(value: Any, field: str) -> int:
    """Whole POSIX seconds (64-bit, floor), computed exactly: no float on the way."""
    if not isinstance(value, dt.datetime):
        raise InvalidMessage(f"{field} must be a datetime, not {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        value = value.replace(tzinfo=dt.UTC)
    seconds: int = (value - _EPOCH) // _SECOND
    if seconds < 0:
        raise InvalidMessage(f"{field} {value.isoformat()} is before 1970, not encodable")
    return seconds


def encode_headers(headers: Mapping[str, Any]) -> bytes:
    """An AMQP field table, validated while it is encoded.

    Raises:
        InvalidMessage: a key or value that AMQP cannot carry, named by its path.
    """
    if not isinstance(headers, Mapping):
        raise InvalidMessage(f"headers must be a mapping, not {type(headers).__name__}")
    return _table(headers, "headers", 0)


def _table(table: Mapping[Any, Any], path: str, depth: int) -> bytes:
    if depth > _MAX_DEPTH:
        raise InvalidMessage(f"{path}: nested deeper than {_MAX_DEPTH} levels")
    parts: list[bytes] = []
    for key, value in table.items():
        if not isinstance(key, str):
            raise InvalidMessage(f"{path}: header names must be str, not {type(key).__name__}")
        parts.append(shortstr(key, f"{path} name {key[:40]!r}", limit=_MAX_KEY))
        parts.append(_value(value, f"{path}[{key[:40]!r}]", depth))
    data = b"".join(parts)
    return _U32(len(data)) + data


def _value(value: Any, path: str, depth: int) -> bytes:  # noqa: PLR0911, PLR0912 (a codec: one branch per AMQP field type; the publish hot path)
    kind = type(value)
    if kind is str:
        try:
            data: bytes = value.encode()
        except UnicodeEncodeError as exc:
            raise InvalidMessage(f"{path} {_not_utf8(exc)}") from None
        return b"S" + _U32(len(data)) + data
    if value is None:
        return b"V"
    if kind is bool:
        return b"t" + _BOOL(value)
    if isinstance(value, int):
        return _integer(int(value), path)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidMessage(f"{path}: {value!r} is not a finite number")
        return b"d" + _F64(value)
    if isinstance(value, str):
        try:
            data = value.encode()
        except UnicodeEncodeError as exc:
            raise InvalidMessage(f"{path} {_not_utf8(exc)}") from None
        return b"S" + _U32(len(data)) + data
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        return b"x" + _U32(len(data)) + data
    if isinstance(value, Decimal):
        return b"D" + _decimal(value, path)
    if isinstance(value, dt.datetime):
        return b"T" + _U64(_timestamp(value, path))
    if isinstance(value, Mapping):
        return b"F" + _table(value, path, depth + 1)
    if isinstance(value, (list, tuple)):
        if depth >= _MAX_DEPTH:
            raise InvalidMessage(f"{path}: nested deeper than {_MAX_DEPTH} levels")
        items = b"".join(_value(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))
        return b"A" + _U32(len(items)) + items
    raise InvalidMessage(f"{path}: a {type(value).__name__} is not an AMQP header value")


def _integer(value: int, path: str) -> bytes:
    if -128 <= value <= 127:
        return b"b" + _I8(value)
    if -32768 <= value <= 32767:
        return b"s" + _I16(value)
    if -2_147_483_648 <= value <= 2_147_483_647:
        return b"I" + _I32(value)
    if -(2**63) <= value < 2**63:
        return b"l" + _I64(value)
    raise InvalidMessage(f"{path}: {value} does not fit in a signed 64-bit integer")


def _decimal(value: Decimal, path: str) -> bytes:
    if not value.is_finite():
        raise InvalidMessage(f"{path}: {value} is not a finite decimal")
    exponent = value.as_tuple().exponent
    assert isinstance(exponent, int)
    problem = f"{path}: {value} does not fit an AMQP decimal (32-bit mantissa, scale 0-255)"
    if (value and value.adjusted() > 9) or -exponent > 255:
        raise InvalidMessage(problem)  # checked before int(): 1e999999 must not allocate
    if exponent > 0:
        scale, mantissa = 0, int(value)
    else:
        scale, mantissa = -exponent, int(value.scaleb(-exponent))
    if not -2_147_483_648 <= mantissa <= 2_147_483_647:
        raise InvalidMessage(problem)
    return _DECIMAL(scale, mantissa)


def publish_frames(channel: int, encoded: Encoded, frame_max: int) -> bytes:
    """The method, content header and body frames of one publish on ``channel``."""
    method = encoded.method
    header = encoded.header
    body = encoded.body
    chunk = frame_max - FRAME_OVERHEAD
    parts: list[bytes | memoryview] = [
        _pack_frame_head(1, channel, len(method)),
        method,
        _FRAME_END,
        _pack_frame_head(2, channel, len(header)),
        header,
        _FRAME_END,
    ]
    size = len(body)
    if size <= chunk:
        if size:
            parts += (_pack_frame_head(3, channel, size), body, _FRAME_END)
    else:
        view = memoryview(body)
        for start in range(0, size, chunk):
            piece = view[start : start + chunk]
            parts += (_pack_frame_head(3, channel, len(piece)), piece, _FRAME_END)
    return b"".join(parts)
