"""The hot path's decoder: a plain delivery's ``basic.deliver`` and properties.

A consumer decodes two of these per delivery, so they are decoded here field
by field in straight-line code, each property under its own flag test and
stored under its own name, rather than by a loop over a table of fields that
names each through ``setattr`` (the generic readers in
`reliable_mq._amqp.inbound`, which also escape what is not UTF-8): the loop
cost about half of the client's decoding time per delivery.

*Plain* means decodable as pamqp decodes it (strings UTF-8, timestamps dates
Python holds, one property-flag word): anything else raises (or, for more
flag words, gives None), and the caller decodes the frame the slow way, which
escapes what is undecodable or lets pamqp say what is damaged. The readers
take the offset where their fields start and return the offset past the last
one; they may read past the end of their frame, even into the next one, so the
caller must refuse a result whose end is past the frame's (and treat an
exception as "not plain").
"""

from __future__ import annotations

import struct
from typing import Any

from pamqp.commands import Basic

from . import hooks
from .fields import read_table, timestamp_of

__all__ = ("FLAG_WORDS", "read_deliver", "read_properties")

FLAG_WORDS = 1
"""The continuation bit of a property-flag word: more flag words follow (not plain)."""

_TAG = struct.Struct(">qB")  # delivery tag (signed, as pamqp decodes it), redelivered bit
_TIMESTAMP = struct.Struct(">Q")
_new_deliver = hooks.frame_factory(Basic.Deliver)
_new_properties = hooks.frame_factory(Basic.Properties)


def read_deliver(data: bytes, offset: int) -> tuple[Basic.Deliver, int]:
    """The arguments of a ``basic.deliver`` at ``offset`` (past its class and method ids)."""
    frame = _new_deliver()
    end = offset + 1 + data[offset]
    frame.consumer_tag = data[offset + 1 : end].decode()
    frame.delivery_tag, bits = _TAG.unpack_from(data, end)
    frame.redelivered = bool(bits & 1)
    offset = end + 9
    end = offset + 1 + data[offset]
    frame.exchange = data[offset + 1 : end].decode()
    offset = end + 1 + data[end]
    frame.routing_key = data[end + 1 : offset].decode()
    return frame, offset


def read_properties(data: bytes, offset: int, flags: int) -> tuple[Basic.Properties, int]:
    """The basic properties at ``offset`` under the property-flag word ``flags``
    (its continuation bit clear): absent ones as pamqp leaves them (None, and ``""``
    for ``cluster_id``)."""
    properties = _new_properties()
    offset = _first_half(properties, data, offset, flags)
    return properties, _second_half(properties, data, offset, flags)


def _first_half(properties: Any, data: bytes, offset: int, flags: int) -> int:  # noqa: PLR0912 (one branch per property)
    """content_type to reply_to, in wire order."""
    if flags & 0x8000:
        end = offset + 1 + data[offset]
        properties.content_type = data[offset + 1 : end].decode()
        offset = end
    else:
        properties.content_type = None
    if flags & 0x4000:
        properties.content_encoding, offset = _short_str(data, offset)
    else:
        properties.content_encoding = None
    if flags & 0x2000:
        properties.headers, offset = read_table(data, offset)
    else:
        properties.headers = None
    if flags & 0x1000:
        properties.delivery_mode = data[offset]
        offset += 1
    else:
        properties.delivery_mode = None
    if flags & 0x0800:
        properties.priority = data[offset]
        offset += 1
    else:
        properties.priority = None
    if flags & 0x0400:
        properties.correlation_id, offset = _short_str(data, offset)
    else:
        properties.correlation_id = None
    if flags & 0x0200:
        properties.reply_to, offset = _short_str(data, offset)
    else:
        properties.reply_to = None
    return offset


def _second_half(properties: Any, data: bytes, offset: int, flags: int) -> int:  # noqa: PLR0912 (one branch per property)
    """expiration to cluster_id, in wire order."""
    if flags & 0x0100:
        properties.expiration, offset = _short_str(data, offset)
    else:
        properties.expiration = None
    if flags & 0x0080:
        end = offset + 1 + data[offset]
        properties.message_id = data[offset + 1 : end].decode()
        offset = end
    else:
        properties.message_id = None
    if flags & 0x0040:
        properties.timestamp = timestamp_of(_TIMESTAMP.unpack_from(data, offset)[0])
        offset += 8
    else:
        properties.timestamp = None
    if flags & 0x0020:
        properties.message_type, offset = _short_str(data, offset)
    else:
        properties.message_type = None
    if flags & 0x0010:
        properties.user_id, offset = _short_str(data, offset)
    else:
        properties.user_id = None
    if flags & 0x0008:
        properties.app_id, offset = _short_str(data, offset)
    else:
        properties.app_id = None
    if flags & 0x0004:
        properties.cluster_id, offset = _short_str(data, offset)
    else:
        properties.cluster_id = ""
    return offset


def _short_str(data: bytes, offset: int) -> tuple[str, int]:
    end = offset + 1 + data[offset]
    return data[offset + 1 : end].decode(), end
