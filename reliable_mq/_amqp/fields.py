"""AMQP field tables and values, decoded as pamqp decodes them but for timestamps.

AMQP 0-9-1 timestamps (the ``timestamp`` property, ``T`` field values) are
64-bit POSIX seconds. pamqp reads a value above 2**32 - 1 as milliseconds
("anything above the year 2106 is likely milliseconds"), so that
``datetime(2200, 1, 1)`` comes out as 1970-03-26 00:08:38.4, with no error.
The consumer's decoder (`reliable_mq._amqp.inbound`) reads field tables with
`read_table` instead: every other value as pamqp gives it (``x`` as a
``bytearray``, a long string that is not UTF-8 as ``bytes``, ``f`` as a float,
``D`` as a ``Decimal``...), a timestamp as `timestamp_of` its seconds, which
raises past the year 9999 (a timestamp in milliseconds is year 55,000 or so).

Stricter than pamqp on damaged input (a value that overruns its table raises):
the caller then lets pamqp decode the frame, and say what is wrong.
"""

from __future__ import annotations

import datetime as dt
import struct
from decimal import Decimal
from typing import Any

__all__ = ("A_ARRAY", "F_TABLE", "T_TIMESTAMP", "read_scalar", "read_table", "timestamp_of")

_LONG = struct.Struct(">I")
_TIMESTAMP = struct.Struct(">Q")
_DECIMAL = struct.Struct(">Bi")
_NUMBERS = {  # field value types of fixed size, read as pamqp reads them
    ord(kind): struct.Struct(layout)
    for kind, layout in (
        ("b", ">b"),
        ("B", ">B"),
        ("s", ">h"),
        ("u", ">H"),
        ("I", ">i"),
        ("i", ">I"),
        ("l", ">q"),
        ("L", ">q"),
        ("f", ">f"),
        ("d", ">d"),
    )
}
F_TABLE, A_ARRAY, T_TIMESTAMP = b"FAT"
"""The type octets of the field values `_inbound` reads with notes of its own."""
_S, _X, _D, _BOOL, _VOID, _NUL = b"SxDtV\0"
_TEN = Decimal(10)


def timestamp_of(seconds: int) -> dt.datetime:
    """An AMQP timestamp (64-bit POSIX seconds) as an aware UTC datetime.

    Raises:
        ValueError, OverflowError, OSError: past the year 9999 (no datetime holds it).
    """
    return dt.datetime.fromtimestamp(seconds, dt.UTC)


def read_table(data: bytes, offset: int, where: str = "") -> tuple[dict[str, Any], int]:
    """A field table at ``offset`` (its length first), values as pamqp decodes them but
    timestamps; raises on anything pamqp would not decode the same way (pamqp then says)."""
    (length,) = _LONG.unpack_from(data, offset)
    offset += 4
    end = offset + length
    if end > len(data):
        raise ValueError("field table past the end of the frame")
    table: dict[str, Any] = {}
    while offset < end:
        key_end = offset + 1 + data[offset]
        if key_end > end:
            raise ValueError("field name past the end of its table")
        key = data[offset + 1 : key_end].decode("utf-8")
        table[key], offset = _value(data, key_end)
    if offset != end:
        raise ValueError("field table overruns its length")
    return table, end


def _value(data: bytes, offset: int) -> tuple[Any, int]:
    """A field value at ``offset`` (its type octet first)."""
    kind = data[offset]
    offset += 1
    if kind == F_TABLE:
        return read_table(data, offset)
    if kind == A_ARRAY:
        (length,) = _LONG.unpack_from(data, offset)
        offset += 4
        end = offset + length
        if end > len(data):
            raise ValueError("field array past the end of the frame")
        items: list[Any] = []
        while offset < end:
            item, offset = _value(data, offset)
            items.append(item)
        if offset != end:
            raise ValueError("field array overruns its length")
        return items, end
    if kind == T_TIMESTAMP:
        return timestamp_of(_TIMESTAMP.unpack_from(data, offset)[0]), offset + 8
    return read_scalar(kind, data, offset)


def read_scalar(kind: int, data: bytes, offset: int) -> tuple[Any, int]:  # noqa: PLR0911 (a codec: one return per AMQP field type)
    """A field value of type ``kind`` that is no table, array or timestamp, at
    ``offset`` (past its type octet), as pamqp decodes it."""
    if kind in (_S, _X):
        (length,) = _LONG.unpack_from(data, offset)
        start = offset + 4
        end = start + length
        if end > len(data):
            raise ValueError("long string past the end of the frame")
        raw = data[start:end]
        if kind == _X:
            return bytearray(raw), end
        try:
            return raw.decode("utf-8"), end
        except UnicodeDecodeError:  # as pamqp: a long string need not be text
            return raw, end
    number = _NUMBERS.get(kind)
    if number is not None:
        return number.unpack_from(data, offset)[0], offset + number.size
    if kind == _BOOL:
        return bool(data[offset]), offset + 1
    if kind == _D:
        places, mantissa = _DECIMAL.unpack_from(data, offset)
        return Decimal(mantissa) * _TEN**-places, offset + 5
    if kind in (_VOID, _NUL):  # pamqp: "\0" is seen in the wild
        return None, offset
    raise ValueError(f"unknown field value type {bytes((kind,))!r}")
