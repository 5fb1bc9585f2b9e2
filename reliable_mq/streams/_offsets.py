"""Offsets of a stream, as values: starting points, ranges and their splits (no I/O).

A stream numbers its messages 0, 1, 2, ... for ever; retention removes whole
segments from the head, so the first offset still held grows over time. A
range is ``[start, end)``: ``start`` included, ``end`` excluded, as Python's.
"""

from __future__ import annotations

import datetime as dt
import enum
from dataclasses import dataclass

from ..errors import InvalidSettings

__all__ = (
    "OffsetRange",
    "StartingPoint",
    "StartingOffset",
    "parse_starting_offset",
    "split_range",
)


class StartingPoint(enum.StrEnum):
    """A starting point named by a word."""

    EARLIEST = "earliest"
    """The first offset the stream still holds (retention may have removed older ones)."""
    LATEST = "latest"
    """The tail: the offset the next message published will get (nothing yet to read)."""


StartingOffset = StartingPoint | int | dt.datetime
"""Where a read starts: a named point, an offset (>= 0), or a time (aware datetime):
the first message stored at or after it, to the precision of the stream's chunks."""


def parse_starting_offset(text: str | int | dt.datetime) -> StartingOffset:
    """``"earliest"``, ``"latest"``, ``"123"`` or an ISO 8601 time with a zone → a `StartingOffset`.

    Raises:
        InvalidSettings: anything else (a negative offset, a time without a zone).
    """
    if isinstance(text, dt.datetime):
        return _aware(text, str(text))
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise _invalid(str(text), "an offset is >= 0")
        return text
    value = str(text).strip()
    lowered = value.lower()
    if lowered in ("earliest", "first"):
        return StartingPoint.EARLIEST
    if lowered in ("latest", "last", "next"):
        return StartingPoint.LATEST
    if value.isdigit():
        return int(value)
    try:
        moment = dt.datetime.fromisoformat(value)
    except ValueError:
        raise _invalid(
            value, "expected 'earliest', 'latest', an offset (>= 0) or an ISO 8601 time"
        ) from None
    return _aware(moment, value)


def _aware(moment: dt.datetime, text: str) -> dt.datetime:
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise _invalid(text, "a time needs a zone (e.g. '2024-05-01T12:00:00+00:00')")
    return moment


def _invalid(value: str, why: str) -> InvalidSettings:
    return InvalidSettings("stream offsets", [("startingOffsets", f"{value!r}: {why}")])


@dataclass(frozen=True, slots=True)
class OffsetRange:
    """The offsets ``[start, end)`` of one stream.

    Attributes:
        stream: the stream's name.
        start: the first offset to read.
        end: the first offset not to read (``start == end``: nothing to read).
    """

    stream: str
    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise ValueError(f"an offset range needs 0 <= start <= end, not {self}")

    def __len__(self) -> int:
        return self.end - self.start


def split_range(whole: OffsetRange, parts: int) -> list[OffsetRange]:
    """``whole`` cut into at most ``parts`` contiguous, non-empty ranges of near-equal size.

    Their union is ``whole`` and they do not overlap; an empty ``whole`` gives no range.
    """
    if parts < 1:
        raise ValueError("parts must be >= 1")
    count = min(parts, len(whole))
    if count == 0:
        return []
    size, extra = divmod(len(whole), count)
    ranges: list[OffsetRange] = []
    start = whole.start
    for index in range(count):
        end = start + size + (1 if index < extra else 0)
        ranges.append(OffsetRange(whole.stream, start, end))
        start = end
    return ranges
