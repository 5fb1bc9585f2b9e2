"""Our publish frames: what pamqp and the consumer's decoder read back, and what we refuse."""

from __future__ import annotations

import datetime as dt
import math
import struct
from decimal import Decimal
from fractions import Fraction
from typing import Any

import pamqp.decode
import pamqp.frame
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pamqp.body import ContentBody
from pamqp.commands import Basic
from pamqp.header import ContentHeader
from pydantic import BaseModel

from reliable_mq._amqp.inbound import decode_frame
from reliable_mq._amqp.wire import (
    MAX_EXPIRATION_MS,
    Encoded,
    check_timeout,
    encode_headers,
    encode_properties,
    encode_publish,
    expiration_ms,
    publish_frames,
)
from reliable_mq._codec import encode_body
from reliable_mq._publish.confirms import ConfirmTracker
from reliable_mq.errors import InvalidBody, InvalidMessage


class _Text(str):
    """A str subclass: header values take the slower isinstance path."""


class _Model(BaseModel):
    s: str


names = st.text(min_size=1, max_size=30).filter(lambda s: len(s.encode()) <= 128)
leaves = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=50)
    | st.binary(max_size=50)
    | st.decimals(
        allow_nan=False, allow_infinity=False, places=2, min_value=-(10**6), max_value=10**6
    )
)
values = st.recursive(
    leaves,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(names, children, max_size=4),
    max_leaves=12,
)
tables = st.dictionaries(names, values, max_size=6)


def _normalise(value: Any) -> Any:
    """pamqp decodes byte arrays to bytearray and lists stay lists."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, dict):
        return {k: _normalise(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_normalise(v) for v in value]
    return value


def _decode(data: bytes) -> list[Any]:
    frames = []
    while data:
        consumed, _, frame = pamqp.frame.unmarshal(data)
        frames.append(frame)
        data = data[consumed:]
    return frames


_short = st.text(max_size=30).filter(lambda s: len(s.encode()) <= 255)
_datetimes = st.datetimes(
    min_value=dt.datetime(1970, 1, 1), max_value=dt.datetime(9999, 12, 31, 23, 59, 59)
)


class TestFrames:
    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        exchange=st.text(max_size=20),
        routing_key=st.text(max_size=40),
        mandatory=st.booleans(),
        body=st.binary(max_size=3000),
        headers=tables,
        strings=st.fixed_dictionaries(
            {},
            optional={
                name: _short
                for name in (
                    "content_type",
                    "content_encoding",
                    "correlation_id",
                    "reply_to",
                    "message_id",
                    "message_type",
                    "user_id",
                    "app_id",
                    "cluster_id",
                )
            },
        ),
        delivery_mode=st.none() | st.sampled_from([1, 2]),
        priority=st.none() | st.integers(min_value=0, max_value=255),
        expiration=st.none() | st.floats(min_value=0, max_value=1000),
        timestamp=st.none() | _datetimes,
        frame_max=st.sampled_from([4096, 131072]),
        channel=st.integers(min_value=1, max_value=2047),
    )
    def test_what_we_encode_decodes_as_sent(
        self,
        exchange: str,
        routing_key: str,
        mandatory: bool,
        body: bytes,
        headers: dict[str, Any],
        strings: dict[str, str],
        delivery_mode: int | None,
        priority: int | None,
        expiration: float | None,
        timestamp: dt.datetime | None,
        frame_max: int,
        channel: int,
    ) -> None:
        """Method, content header and body frames round-trip: every property (none,
        empty and full strings), timestamps to the year 9999, expiration rounded."""
        encoded = Encoded(
            encode_publish(exchange, routing_key, mandatory),
            encode_properties(
                len(body),
                headers=headers,
                delivery_mode=delivery_mode,
                priority=priority,
                expiration=expiration,
                timestamp=timestamp,
                **strings,
            ),
            body,
        )
        data = publish_frames(channel, encoded, frame_max)
        method, _, *bodies = _decode(data)
        assert isinstance(method, Basic.Publish)
        assert (method.exchange, method.routing_key, method.mandatory) == (
            exchange,
            routing_key,
            mandatory,
        )
        # The content header as the consumer decodes it (pamqp would read a
        # timestamp after 2106 as milliseconds).
        header = frames_of(data)[1]
        _, _, ours = decode_frame(header[:7], header[7:])
        assert type(ours) is ContentHeader
        assert ours.body_size == len(body)
        props = ours.properties
        for name, value in strings.items():
            assert getattr(props, name) == value, name
        for name in set(_STRINGS) - set(strings):
            assert getattr(props, name) == ("" if name == "cluster_id" else None), name
        assert (props.delivery_mode, props.priority) == (delivery_mode, priority)
        assert props.expiration == (None if expiration is None else str(_half_up_ms(expiration)))
        assert props.timestamp == (
            None if timestamp is None else timestamp.replace(microsecond=0, tzinfo=dt.UTC)
        )
        assert _normalise(props.headers or {}) == _normalise(headers)
        assert all(isinstance(b, ContentBody) for b in bodies)
        assert b"".join(b.value for b in bodies) == body
        assert all(len(b.value) <= frame_max - 8 for b in bodies)


_STRINGS = (
    "content_type",
    "content_encoding",
    "correlation_id",
    "reply_to",
    "message_id",
    "message_type",
    "user_id",
    "app_id",
    "cluster_id",
)


def frames_of(data: bytes) -> list[bytes]:
    """The raw frames of ``data`` (header, payload and end octet each)."""
    frames = []
    while data:
        size = int.from_bytes(data[3:7], "big")
        frames.append(data[: size + 8])
        data = data[size + 8 :]
    return frames


def _half_up_ms(seconds: float) -> int:
    """Milliseconds, rounded half up from the decimal the float prints as (independently
    of `expiration_ms`: exact fractions)."""
    return math.floor(Fraction(repr(seconds)) * 1000 + Fraction(1, 2))


class TestExpiration:
    def test_every_millisecond_below_100_seconds(self) -> None:
        """``ms / 1000`` seconds is ``ms`` for all 100,000 values (truncation lost one
        millisecond on 741 of them: ``64.002`` went out as ``64001``)."""
        truncated = sum(int(ms / 1000 * 1000) != ms for ms in range(100_000))
        assert truncated == 741  # the defect this guards against is real
        assert [ms for ms in range(100_000) if expiration_ms(ms / 1000) != ms] == []
        assert [ms for ms in range(100_000) if expiration_ms(Decimal(ms) / 1000) != ms] == []
        assert expiration_ms(64.002) == 64002

    @pytest.mark.parametrize(
        ("seconds", "ms"),
        [(0, 0), (0.0004, 0), (0.0005, 1), (0.0015, 2), (1.4375, 1438), (4_294_967.295, 2**32 - 1)],
    )
    def test_rounded_half_up(self, seconds: float, ms: int) -> None:
        """Half a millisecond rounds up, as written (not as its binary neighbour)."""
        assert expiration_ms(seconds) == ms


class TestTimestamps:
    @pytest.mark.parametrize(
        ("value", "seconds"),
        [
            (dt.datetime(2200, 1, 1), 7_258_118_400),
            (dt.datetime(2106, 2, 7, 6, 28, 16, tzinfo=dt.UTC), 2**32),
            (dt.datetime(9999, 12, 31, 23, 59, 59, 999_999), 253_402_300_799),
            (dt.datetime(1970, 1, 1, 0, 0, 0, 999_999), 0),
            (dt.datetime(2000, 1, 1, 1, tzinfo=dt.timezone(dt.timedelta(hours=1))), 946_684_800),
        ],
    )
    def test_64_bit_seconds_both_ways(self, value: dt.datetime, seconds: int) -> None:
        """The property and a ``T`` header value are whole 64-bit seconds (floor, exact:
        the last microsecond of 9999 is not rounded into the year 10000), and the
        consumer's decoder reads them back as the same instant."""
        header = encode_properties(0, timestamp=value, headers={"t": value, "a": [value]})
        assert struct.pack(">Q", seconds) in header
        frame = struct.pack(">BHI", 2, 1, len(header)) + header + b"\xce"
        _, _, decoded = decode_frame(frame[:7], frame[7:])
        assert type(decoded) is ContentHeader
        want = dt.datetime.fromtimestamp(seconds, dt.UTC)
        props = decoded.properties
        assert (props.timestamp, props.headers) == (want, {"t": want, "a": [want]})

    def test_before_1970_is_refused(self) -> None:
        """A timestamp before the epoch cannot be sent: InvalidMessage names the field."""
        with pytest.raises(InvalidMessage, match="timestamp 1969"):
            encode_properties(0, timestamp=dt.datetime(1969, 12, 31, 23, 59, 59))
        with pytest.raises(InvalidMessage, match=r"headers\['t'\]\[0\] 1969"):
            encode_headers({"t": [dt.datetime(1969, 12, 31, tzinfo=dt.UTC)]})


class TestRefusedBeforeSending:
    @pytest.mark.parametrize(
        ("headers", "match"),
        [
            ({"n": math.nan}, "finite"),
            ({"n": math.inf}, "finite"),
            ({"n": Decimal("NaN")}, "finite"),
            ({"nested": {"x": [1, math.nan]}}, r"nested.*\[1\]"),
            ({1: "x"}, "names must be str"),
            ({"k" * 129: 1}, "limit is 128"),
            ({"big": 2**64}, "64-bit"),
            ({"set": {1, 2}}, "set is not an AMQP header value"),
            ({"obj": object()}, "object is not an AMQP header value"),
            ({"dec": Decimal("1e999999")}, "AMQP decimal"),
            ({"old": dt.datetime(1969, 1, 1)}, "before 1970"),
            ({"k\ud800": 1}, r"headers name 'k\\ud800' .*lone surrogate \\ud800 at index 1"),
            ({"v": "ok\udfff"}, r"headers\['v'\] .*lone surrogate \\udfff at index 2"),
            ({"n": {"l": ["x", "\udc80"]}}, r"headers\['n'\]\['l'\]\[1\] .*lone surrogate"),
            ({"sub": _Text("\ud800")}, r"headers\['sub'\] .*lone surrogate"),
        ],
    )
    def test_headers(self, headers: dict[Any, Any], match: str) -> None:
        """Unencodable header names and values are named, and nothing is truncated."""
        with pytest.raises(InvalidMessage, match=match):
            encode_headers(headers)

    @pytest.mark.parametrize(
        "field",
        ["message_id", "content_type", "correlation_id", "reply_to", "message_type", "app_id"],
    )
    def test_lone_surrogates_in_short_strings(self, field: str) -> None:
        """A lone surrogate cannot be UTF-8: InvalidMessage names the field (the culprit
        escaped, so the error prints), never a bare UnicodeEncodeError."""
        props: dict[str, Any] = {"content_type": None, "message_id": "m", field: "ab\ud800"}
        with pytest.raises(InvalidMessage, match=rf"^{field} is not encodable") as caught:
            encode_properties(0, delivery_mode=2, **props)
        assert "\\ud800 at index 2" in str(caught.value)
        str(caught.value).encode()  # the message itself is valid UTF-8
        with pytest.raises(InvalidMessage, match=r"^routing_key is not encodable"):
            encode_publish("", "rk\ud800", True)
        with pytest.raises(InvalidMessage, match=r"^exchange is not encodable"):
            encode_publish("\udfff", "rk", True)

    @pytest.mark.parametrize(
        "body", ["text\ud800", {"k": ["x", "\ud800"]}, _Model(s="\ud800"), "\udfff" * 3]
    )
    def test_lone_surrogates_in_bodies(self, body: Any) -> None:
        """A str, JSON or pydantic body with a lone surrogate is InvalidBody."""
        with pytest.raises(InvalidBody, match="body") as caught:
            encode_body(body)
        str(caught.value).encode()

    def test_deep_nesting_is_refused_not_a_recursion_error(self) -> None:
        """A table nested 10,000 deep fails with InvalidMessage, not RecursionError."""
        deep: dict[str, Any] = {}
        cursor = deep
        for _ in range(10_000):
            cursor["x"] = {}
            cursor = cursor["x"]
        with pytest.raises(InvalidMessage, match="deeper than 32"):
            encode_headers(deep)
        nested: list[Any] = []
        for _ in range(10_000):
            nested = [nested]
        with pytest.raises(InvalidMessage, match="deeper than 32"):
            encode_headers({"l": nested})

    @pytest.mark.parametrize(
        ("field", "value", "match"),
        [
            ("expiration", -1, "finite and >= 0"),
            ("expiration", math.nan, "finite and >= 0"),
            ("expiration", math.inf, "finite and >= 0"),
            ("expiration", (MAX_EXPIRATION_MS + 1000) / 1000, "limit"),
            ("expiration", "10", "number of seconds"),
            ("priority", 256, "0 to 255"),
            ("priority", -1, "0 to 255"),
            ("priority", True, "0 to 255"),
            ("correlation_id", 5, "must be a str"),
            ("reply_to", "r" * 256, "limit is 255"),
            ("timestamp", "2026-01-01", "must be a datetime"),
        ],
    )
    def test_properties(self, field: str, value: Any, match: str) -> None:
        """Property types and ranges are checked, naming the field."""
        with pytest.raises(InvalidMessage, match=match):
            encode_properties(
                0, content_type=None, delivery_mode=2, message_id="m", **{field: value}
            )

    @pytest.mark.parametrize("value", [math.nan, math.inf, -1, 0, "5", True, None])
    def test_timeouts(self, value: Any) -> None:
        """A timeout is finite and positive seconds."""
        with pytest.raises(InvalidMessage, match="timeout"):
            check_timeout(value)

    def test_routing_key_and_exchange(self) -> None:
        """Short strings are typed and measured in bytes of UTF-8."""
        with pytest.raises(InvalidMessage, match="routing_key must be a str, not int"):
            encode_publish("", 5, True)  # type: ignore[arg-type]
        with pytest.raises(InvalidMessage, match="exchange is 256 bytes"):
            encode_publish("é" * 128, "k", True)


class TestConfirmTracker:
    def test_multiple_ack_settles_the_prefix(self) -> None:
        """A multiple ack settles every outstanding tag up to its own, in order."""
        tracker: ConfirmTracker[str] = ConfirmTracker()
        assert [tracker.add(x) for x in "abcde"] == [1, 2, 3, 4, 5]
        assert tracker.settle(3, multiple=True) == ["a", "b", "c"]
        assert len(tracker) == 2
        assert tracker.settle(5, multiple=True) == ["d", "e"]
        assert len(tracker) == 0

    def test_out_of_order_single_acks_leave_holes(self) -> None:
        """Single acks out of order settle one each; a later multiple skips the holes."""
        tracker: ConfirmTracker[str] = ConfirmTracker()
        for x in "abcd":
            tracker.add(x)
        assert tracker.settle(3, multiple=False) == ["c"]
        assert tracker.settle(3, multiple=False) == []  # never twice
        assert tracker.oldest() == "a"
        assert tracker.settle(1, multiple=False) == ["a"]
        assert tracker.settle(4, multiple=True) == ["b", "d"]
        assert tracker.next_tag == 5

    def test_unknown_tags_settle_nothing(self) -> None:
        """A stale or future tag never resolves a publish."""
        tracker: ConfirmTracker[str] = ConfirmTracker()
        tracker.add("a")
        assert tracker.settle(0, multiple=True) == []
        assert tracker.settle(7, multiple=False) == []
        assert tracker.settle(1, multiple=False) == ["a"]
        assert tracker.settle(1, multiple=True) == []

    @pytest.mark.unit
    def test_oldest_skips_a_hole_left_at_the_front(self) -> None:
        """A multiple ack can stop just before a tag a single ack settled: that hole is
        now the front, and the oldest outstanding publish is the one after it."""
        tracker: ConfirmTracker[str] = ConfirmTracker()
        for x in "abc":
            tracker.add(x)
        assert tracker.settle(2, multiple=False) == ["b"]
        assert tracker.settle(1, multiple=True) == ["a"]
        assert tracker.oldest() == "c"
        assert tracker.outstanding() == ["c"] and len(tracker) == 1

    def test_drain_hands_back_the_rest_in_order(self) -> None:
        """A lost channel returns every outstanding publish, in tag order."""
        tracker: ConfirmTracker[str] = ConfirmTracker()
        for x in "abc":
            tracker.add(x)
        tracker.settle(2, multiple=False)
        assert tracker.outstanding() == ["a", "c"]
        assert tracker.drain() == ["a", "c"]
        assert len(tracker) == 0 and tracker.oldest() is None


_ops = st.lists(
    st.one_of(
        st.just(("add", 0, False)),
        st.tuples(st.just("settle"), st.integers(min_value=-2, max_value=60), st.booleans()),
    ),
    max_size=120,
)


class TestConfirmTrackerModel:
    @settings(max_examples=300, deadline=None)
    @given(ops=_ops)
    def test_matches_a_dictionary_of_outstanding_tags(
        self, ops: list[tuple[str, int, bool]]
    ) -> None:
        """Any mix of publishes and (multiple) acks settles what a plain tag -> item map would."""
        tracker: ConfirmTracker[int] = ConfirmTracker()
        model: dict[int, int] = {}
        next_tag = 1
        for op, tag, multiple in ops:
            if op == "add":
                assert tracker.add(next_tag * 10) == next_tag
                model[next_tag] = next_tag * 10
                next_tag += 1
                continue
            if multiple:
                expected = [model.pop(t) for t in sorted(model) if t <= tag]
            else:
                expected = [model.pop(tag)] if tag in model else []
            assert tracker.settle(tag, multiple) == expected
            assert len(tracker) == len(model)
            assert tracker.next_tag == next_tag
            assert tracker.outstanding() == [model[t] for t in sorted(model)]
            assert tracker.oldest() == (model[min(model)] if model else None)
        assert tracker.drain() == [model[t] for t in sorted(model)]
        assert len(tracker) == 0 and tracker.next_tag == next_tag

    def test_one_multiple_ack_settles_a_whole_window(self) -> None:
        """10,000 publishes, one ack with multiple=true: all settled, in order, nothing kept."""
        tracker: ConfirmTracker[int] = ConfirmTracker()
        for n in range(10_000):
            tracker.add(n)
        assert tracker.settle(10_000, multiple=True) == list(range(10_000))
        assert len(tracker) == 0 and tracker.oldest() is None
        assert not tracker._items  # no per-tag residue
        assert tracker.add(-1) == 10_001

    def test_single_acks_in_any_order_leave_nothing_behind(self) -> None:
        """Single acks in reverse order leave holes until the front is acked, then none."""
        tracker: ConfirmTracker[int] = ConfirmTracker()
        for n in range(1, 101):
            tracker.add(n)
        for tag in range(100, 1, -1):
            assert tracker.settle(tag, multiple=False) == [tag]
        assert tracker.oldest() == 1 and len(tracker) == 1
        assert tracker.settle(1, multiple=False) == [1]
        assert not tracker._items
        assert tracker.next_tag == 101

    def test_a_multiple_ack_below_the_front_settles_nothing(self) -> None:
        """A stale multiple ack (tag already passed) resolves no newer publish."""
        tracker: ConfirmTracker[str] = ConfirmTracker()
        for x in "abcd":
            tracker.add(x)
        assert tracker.settle(2, multiple=True) == ["a", "b"]
        assert tracker.settle(2, multiple=True) == []
        assert tracker.settle(1, multiple=True) == []
        assert tracker.outstanding() == ["c", "d"]


def _body_frames(data: bytes) -> list[bytes]:
    """The raw body frames (type 3) of ``data``, headers and end octets included."""
    return [frame for frame in frames_of(data) if frame[0] == 3]


@pytest.mark.unit
class TestBoundaries:
    """Each limit of the codec exactly at its edge, where an off-by-one would show."""

    @pytest.mark.parametrize("frame_max", [4096, 131072])
    @pytest.mark.parametrize(
        ("chunks", "extra"), [(0, 0), (0, 1), (1, -1), (1, 0), (1, 1), (2, 0), (3, 1), (2, 7)]
    )
    def test_a_body_split_across_frames(self, frame_max: int, chunks: int, extra: int) -> None:
        """A body of ``chunks`` full frames plus ``extra`` bytes: every byte arrives, in
        order; no frame is longer than ``frame_max`` (header and end octet included),
        every frame but the last is full, and an empty body sends no body frame."""
        chunk = frame_max - 8
        size = chunks * chunk + extra
        body = bytes(i % 251 for i in range(size))
        encoded = Encoded(encode_publish("", "k", False), encode_properties(size), body)
        data = publish_frames(5, encoded, frame_max)
        frames = _body_frames(data)
        assert len(frames) == -(-size // chunk)  # ceiling: no empty frame, none missing
        assert all(len(frame) <= frame_max for frame in frames)
        assert all(len(frame) == frame_max for frame in frames[:-1])
        assert b"".join(frame[7:-1] for frame in frames) == body
        decoded = _decode(data)[2:]
        assert b"".join(b.value for b in decoded) == body

    @pytest.mark.parametrize(
        "field",
        ["content_type", "correlation_id", "reply_to", "message_id", "message_type", "app_id"],
    )
    def test_short_strings_up_to_255_bytes(self, field: str) -> None:
        """255 bytes of UTF-8 is a short string (sent whole); 256 is refused, by name."""
        value = "é" * 127 + "x"  # 255 bytes, 128 characters
        props: dict[str, Any] = {field: value}
        header = encode_properties(0, **props)
        frame = struct.pack(">BHI", 2, 1, len(header)) + header + b"\xce"
        _, _, decoded = decode_frame(frame[:7], frame[7:])
        assert getattr(decoded.properties, field) == value
        assert encode_publish("x" * 255, value, False)[-257:] == b"\xff" + value.encode() + b"\x00"
        with pytest.raises(InvalidMessage, match=f"{field} is 256 bytes"):
            encode_properties(0, **{**props, field: value + "y"})

    def test_header_names_up_to_128_bytes(self) -> None:
        """A header name of 128 bytes is sent whole; 129 is refused (pamqp would cut it)."""
        name = "é" * 63 + "xx"  # 128 bytes
        assert encode_headers({name: 1}) == struct.pack(">I", 1 + 128 + 2) + (
            b"\x80" + name.encode() + b"b\x01"
        )
        with pytest.raises(InvalidMessage, match="129 bytes of UTF-8; the limit is 128"):
            encode_headers({name + "y": 1})

    @pytest.mark.parametrize(
        ("value", "encoded"),
        [
            (True, b"t\x01"),
            (False, b"t\x00"),
            (0, b"b\x00"),
            (1, b"b\x01"),
            (127, b"b\x7f"),
            (128, b"s\x00\x80"),
            (-128, b"b\x80"),
            (-129, b"s\xff\x7f"),
            (32767, b"s\x7f\xff"),
            (32768, b"I\x00\x00\x80\x00"),
            (-32768, b"s\x80\x00"),
            (-32769, b"I\xff\xff\x7f\xff"),
            (2**31 - 1, b"I\x7f\xff\xff\xff"),
            (2**31, b"l" + struct.pack(">q", 2**31)),
            (-(2**31), b"I\x80\x00\x00\x00"),
            (-(2**31) - 1, b"l" + struct.pack(">q", -(2**31) - 1)),
            (2**63 - 1, b"l" + struct.pack(">q", 2**63 - 1)),
            (-(2**63), b"l" + struct.pack(">q", -(2**63))),
            (1.5, b"d" + struct.pack(">d", 1.5)),
        ],
    )
    def test_header_values_by_type(self, value: Any, encoded: bytes) -> None:
        """Each value as its exact field type and bytes: a bool is ``t`` (never an int,
        though ``True == 1``), an int the narrowest signed type that holds it, a float a
        double; pamqp decodes it back to the same value and type."""
        table = encode_headers({"v": value})
        assert table == struct.pack(">I", 2 + len(encoded)) + b"\x01v" + encoded
        _, decoded = pamqp.decode.field_table(table)
        assert decoded == {"v": value}
        assert type(decoded["v"]) is type(value)

    @pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 2**64])
    def test_integers_beyond_64_bits_are_refused(self, value: int) -> None:
        """An int no signed 64-bit field holds is InvalidMessage, never struct.error."""
        with pytest.raises(InvalidMessage, match="does not fit in a signed 64-bit integer"):
            encode_headers({"big": value})

    def test_nesting_up_to_32_levels(self) -> None:
        """Tables nested 32 levels below the headers are sent; 33 are refused."""

        def nested(levels: int) -> dict[str, Any]:
            table: dict[str, Any] = {"x": 1}
            for _ in range(levels):
                table = {"x": table}
            return table

        _, decoded = pamqp.decode.field_table(encode_headers(nested(32)))
        assert decoded == nested(32)
        with pytest.raises(InvalidMessage, match="deeper than 32"):
            encode_headers(nested(33))
