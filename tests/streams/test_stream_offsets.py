"""Offsets as values: starting points parsed, ranges split (no broker)."""

from __future__ import annotations

import datetime as dt

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reliable_mq.errors import InvalidSettings
from reliable_mq.streams import (
    OffsetRange,
    StartingPoint,
    StreamSpec,
    parse_starting_offset,
    split_range,
)

pytestmark = pytest.mark.unit


class TestParseStartingOffset:
    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            ("earliest", StartingPoint.EARLIEST),
            ("first", StartingPoint.EARLIEST),
            ("LATEST", StartingPoint.LATEST),
            (" latest ", StartingPoint.LATEST),
            ("0", 0),
            ("12345", 12345),
            (7, 7),
        ],
    )
    def test_words_and_offsets(self, text: str | int, expected: object) -> None:
        """Named points and offsets (text or int) parse to themselves."""
        assert parse_starting_offset(text) == expected

    def test_an_iso_time_with_a_zone(self) -> None:
        """An ISO 8601 time with a zone is a time."""
        parsed = parse_starting_offset("2024-05-01T12:00:00+00:00")
        assert parsed == dt.datetime(2024, 5, 1, 12, tzinfo=dt.UTC)

    @pytest.mark.parametrize(
        "text", ["-1", -1, "2024-05-01T12:00:00", "soon", "", "1.5", dt.datetime(2024, 1, 1)]
    )
    def test_refuses_the_rest(self, text: object) -> None:
        """A negative offset, a time without a zone or a stray word is refused, named."""
        with pytest.raises(InvalidSettings, match="startingOffsets"):
            parse_starting_offset(text)  # type: ignore[arg-type]


class TestSplitRange:
    @given(
        start=st.integers(0, 10**12),
        size=st.integers(0, 10_000),
        parts=st.integers(1, 64),
    )
    def test_parts_cover_the_range_once(self, start: int, size: int, parts: int) -> None:
        """The parts are contiguous, non-empty, at most ``parts``, near-equal, and cover it."""
        whole = OffsetRange("s", start, start + size)
        pieces = split_range(whole, parts)
        assert len(pieces) == min(parts, size)
        position = start
        for piece in pieces:
            assert piece.start == position and len(piece) > 0
            position = piece.end
        assert position == whole.end
        if pieces:
            sizes = [len(p) for p in pieces]
            assert max(sizes) - min(sizes) <= 1

    def test_bad_ranges_are_refused(self) -> None:
        """start > end, a negative start and zero parts are errors."""
        with pytest.raises(ValueError, match="start <= end"):
            OffsetRange("s", 5, 4)
        with pytest.raises(ValueError, match="start <= end"):
            OffsetRange("s", -1, 4)
        with pytest.raises(ValueError, match="parts"):
            split_range(OffsetRange("s", 0, 4), 0)


class TestStreamSpec:
    def test_arguments(self) -> None:
        """Retention becomes the stream's x- arguments; unset ones are absent."""
        spec = StreamSpec("s", max_length_bytes=10, max_age="7D", max_segment_size_bytes=5)
        assert spec.queue_arguments() == {
            "x-queue-type": "stream",
            "x-max-length-bytes": 10,
            "x-max-age": "7D",
            "x-stream-max-segment-size-bytes": 5,
        }
        assert StreamSpec("s").queue_arguments() == {"x-queue-type": "stream"}

    @pytest.mark.parametrize(
        "kwargs",
        [
            {"max_length_bytes": 0},
            {"max_segment_size_bytes": -1},
            {"max_age": "7 days"},
            {"max_age": "0D"},
            {"max_age": "12"},
        ],
    )
    def test_bad_retention_is_refused(self, kwargs: dict[str, object]) -> None:
        """A retention RabbitMQ would refuse (or read otherwise) fails before any I/O."""
        with pytest.raises(ValueError):
            StreamSpec("s", **kwargs)  # type: ignore[arg-type]
