"""The consumer's fast path: `reliable_mq._amqp.inbound`, the dispatcher's intake, batched metrics.

`decode_frame` must give what pamqp gives for every frame, well-formed or not
(it takes the three frames of a delivery itself and hands the rest to pamqp),
but for timestamps: AMQP's 64-bit seconds, where pamqp reads a value above
2**32 - 1 as milliseconds. The oracle is pamqp with its timestamp decoder
replaced by the specification's (`unmarshal`).
The intake closes the channel rather than wedge a delivery it could not
record. Counts kept in plain Python reach Prometheus exactly as direct
``inc()``/``observe()`` calls would have. Against the real broker: the
consumer's connection really decodes with `decode_frame` (an aiormq upgrade
that moves the receiver fails here, not silently), bodies of every size and the
properties arrive intact, a channel that dies under a running handler cancels
it (the delivery is counted stale and handled again), and the handler gauge
follows running handlers while the consumer runs.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import struct
import uuid
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any
from unittest import mock

import aio_pika
import pamqp.frame
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pamqp import commands, decode, heartbeat
from pamqp.body import ContentBody
from pamqp.exceptions import PAMQPException
from pamqp.header import ContentHeader
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from reliable_mq import ConnectionSettings
from reliable_mq._amqp.hooks import find_receiver
from reliable_mq._amqp.inbound import (
    UndecodableDeliver,
    UndecodableHeader,
    _decode_escaped,
    _deliver,
    _plain_delivery,
    content_header,
    decode_frame,
)
from reliable_mq.consumer import ReliableConsumer
from reliable_mq.delivery import Delivery
from reliable_mq.handlers import AckPolicy
from reliable_mq.metrics import Metrics
from reliable_mq.testing import TCPProxy
from reliable_mq.topology import QueueTopology, delete_topology
from tests.support.waiting import wait_until

URL = os.environ.get("RELIABLE_MQ_TEST_URL", "amqp://guest:guest@127.0.0.1:5672/")
Basic = commands.Basic


def _attributes(frame: Any) -> Any:
    """A frame as comparable data (pamqp frames compare by identity)."""
    if isinstance(frame, ContentHeader):
        props = frame.properties
        return (
            "header",
            frame.class_id,
            frame.weight,
            frame.body_size,
            type(props),
            {name: getattr(props, name) for name in props.__slots__},
        )
    if isinstance(frame, ContentBody):
        return ("body", frame.value)
    slots = getattr(frame, "__slots__", ())
    return (type(frame), {name: getattr(frame, name) for name in slots})


def _outcome(decoder: Any, data: bytes) -> Any:
    """What ``decoder`` makes of ``data``, comparable: by ``repr`` (a damaged double can
    decode as NaN, which equals nothing; and ``True`` is not ``1`` there)."""
    try:
        used, channel, frame = decoder(data)
    except PAMQPException as exc:
        return ("error", type(exc))
    return (used, channel, repr(_attributes(frame)))


def _ours(data: bytes) -> Any:
    return decode_frame(data[:7], data[7:])


def _timestamp_as_specified(value: bytes) -> tuple[int, datetime.datetime]:
    """pamqp's ``decode.timestamp`` without its guess that a value above 2**32 - 1 is
    milliseconds: 64-bit POSIX seconds, as AMQP 0-9-1 defines them."""
    try:
        (seconds,) = struct.unpack(">Q", value[0:8])
        return 8, datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)
    except (struct.error, OverflowError, OSError) as err:  # OSError: past what time_t holds
        raise ValueError("Could not unpack timestamp value") from err


def unmarshal(data: bytes) -> Any:
    """``pamqp.frame.unmarshal``, reading timestamps as the specification says."""
    with (
        mock.patch.dict(decode.METHODS, {"timestamp": _timestamp_as_specified}),
        mock.patch.dict(decode.TABLE_MAPPING, {b"T": _timestamp_as_specified}),
    ):
        return pamqp.frame.unmarshal(data)


def assert_same(data: bytes) -> None:
    """``decode_frame`` decodes ``data`` exactly as `unmarshal` (pamqp, timestamps fixed)."""
    assert _outcome(_ours, data) == _outcome(unmarshal, data)


def _root_error(data: bytes) -> BaseException | None:
    """What pamqp's error on ``data`` came from (None: pamqp decodes it)."""
    try:
        unmarshal(data)
    except PAMQPException as exc:
        error: BaseException = exc
        while error.__cause__ is not None:
            error = error.__cause__
        return error
    return None


def _refused_by_ours(data: bytes) -> bool:
    """Neither of our readers takes this delivery frame: it is damaged (pamqp decides)."""
    payload = data[7:-1]
    try:
        decoded = _deliver(payload) if data[0] == 1 else content_header(payload)
    except Exception:
        return _decode_escaped(data[0], data[7:]) is None
    return decoded is None


def assert_same_or_undecodable(data: bytes) -> None:
    """As pamqp; or, where pamqp fails only on a string that is not UTF-8 or a date it
    cannot hold, an undecodable frame naming what did not decode; or, for a frame so
    damaged that our readers refuse it and pamqp takes it (pamqp reads a table that
    overruns its length, say), pamqp's own decoding, as before (timestamps included)."""
    ours = _outcome(_ours, data)
    if ours == _outcome(unmarshal, data):
        return
    frame = _ours(data)[2]
    if type(frame) in (Basic.Deliver, ContentHeader) and _refused_by_ours(data):
        assert ours == _outcome(pamqp.frame.unmarshal, data)
        return
    assert isinstance(frame, (UndecodableDeliver, UndecodableHeader)), ours
    error = _root_error(data)
    fields = frame.undecodable.fields
    assert isinstance(error, UnicodeDecodeError) or isinstance(
        frame.undecodable.error, (ValueError, OverflowError, OSError)
    ), (error, fields)


_short = st.text(max_size=40)
_names = st.from_regex(r"[a-zA-Z0-9_.:-]{0,60}", fullmatch=True)
_timestamps = st.one_of(
    st.integers(0, 2**32 - 1),
    st.integers(2**32, 253_402_300_799),  # after 2106: pamqp reads these as milliseconds
).map(lambda s: datetime.datetime.fromtimestamp(s, tz=datetime.UTC))
_values = st.recursive(
    st.one_of(
        st.integers(-(2**63), 2**63 - 1),
        st.text(max_size=30),
        st.booleans(),
        st.none(),
        st.floats(allow_nan=False, width=32),  # pamqp sends floats as 32-bit "f"
        st.decimals(places=3, min_value=-(10**6), max_value=10**6),
        st.binary(max_size=10).map(bytearray),
        _timestamps,
    ),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(min_size=1, max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
_tables = st.dictionaries(st.text(min_size=1, max_size=12), _values, max_size=6)


@st.composite
def _properties(draw: st.DrawFn) -> Basic.Properties:
    def maybe(strategy: st.SearchStrategy[Any]) -> Any:
        return draw(st.one_of(st.none(), strategy))

    return Basic.Properties(
        content_type=maybe(_short),
        content_encoding=maybe(_short),
        headers=maybe(_tables),
        delivery_mode=maybe(st.sampled_from([1, 2])),
        priority=maybe(st.integers(0, 255)),
        correlation_id=maybe(_short),
        reply_to=maybe(_short),
        expiration=maybe(st.from_regex(r"[0-9]{1,9}", fullmatch=True)),
        message_id=maybe(_short),
        timestamp=maybe(_timestamps),
        message_type=maybe(_short),
        user_id=maybe(_short),
        app_id=maybe(_short),
    )


_delivers = st.builds(
    Basic.Deliver,
    consumer_tag=_short,
    delivery_tag=st.integers(0, 2**63 - 1),
    redelivered=st.booleans(),
    exchange=_names,
    routing_key=_short,
)
_channels = st.integers(0, 65535)


class TestDecodeFrame:
    @settings(max_examples=300, deadline=None)
    @given(frame=_delivers, channel=_channels)
    def test_deliver_as_pamqp(self, frame: Basic.Deliver, channel: int) -> None:
        """basic.deliver: every field as pamqp decodes it (tags up to 2**63 - 1, any text)."""
        assert_same(pamqp.frame.marshal(frame, channel))

    @settings(max_examples=300, deadline=None)
    @given(props=_properties(), size=st.integers(0, 2**40), channel=_channels)
    def test_content_header_as_pamqp(
        self, props: Basic.Properties, size: int, channel: int
    ) -> None:
        """A content header with any mix of properties, tables and timestamps included."""
        assert_same(pamqp.frame.marshal(ContentHeader(0, size, props), channel))

    @settings(max_examples=100, deadline=None)
    @given(body=st.binary(min_size=1, max_size=3000), channel=_channels)
    def test_body_as_pamqp(self, body: bytes, channel: int) -> None:
        """A body frame's bytes, as they came."""
        assert_same(pamqp.frame.marshal(ContentBody(body), channel))

    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        frame=st.one_of(
            _delivers,
            _properties().map(lambda p: ContentHeader(0, 10, p)),
            st.binary(min_size=1, max_size=50).map(ContentBody),
        ),
        data=st.data(),
    )
    def test_damaged_frames_as_pamqp(self, frame: Any, data: st.DataObject) -> None:
        """A frame with a byte changed or cut short: the same frame, or the same error
        (or, when it only made a string not UTF-8, an undecodable frame)."""
        raw = bytearray(pamqp.frame.marshal(frame, 1))
        if data.draw(st.booleans(), label="cut"):
            length = data.draw(st.integers(7, len(raw) - 1), label="length")
            head = bytes(raw[:7])
            assert _outcome(lambda _: decode_frame(head, bytes(raw[7:length])), b"") == (
                _outcome(unmarshal, bytes(raw[:length]))
            )
            return
        index = data.draw(st.integers(7, len(raw) - 1), label="index")
        raw[index] = data.draw(st.integers(0, 255), label="byte")
        assert_same_or_undecodable(bytes(raw))

    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        frame=_delivers,
        props=_properties(),
        body=st.binary(max_size=20),
        data=st.data(),
    )
    def test_a_whole_delivery_as_frame_by_frame(
        self, frame: Basic.Deliver, props: Basic.Properties, body: bytes, data: st.DataObject
    ) -> None:
        """The direct path's decoder (`_plain_delivery`, the method frame and the
        properties straight from a delivery's frames, the next frame following) takes a
        delivery exactly when `decode_frame`'s strict readers take both frames, and gives
        what they give; a payload byte changed (but the class and method ids, which the
        caller checks) included: a string not UTF-8, a length past the frame."""
        method = pamqp.frame.marshal(frame, 1)
        header = pamqp.frame.marshal(ContentHeader(0, len(body), props), 1)
        raw = bytearray(method + header + pamqp.frame.marshal(ContentBody(body or b"x"), 1))
        header_at, body_at = len(method), len(method) + len(header)
        if data.draw(st.booleans(), label="damaged"):
            payloads = [*range(11, header_at - 1), *range(header_at + 7, body_at - 1)]
            raw[data.draw(st.sampled_from(payloads), label="index")] = data.draw(
                st.integers(0, 255), label="byte"
            )
        wire = bytes(raw)
        got = _plain_delivery(wire, header_at, body_at)
        try:
            strict = (
                _deliver(wire[7 : header_at - 1]),
                content_header(wire[header_at + 7 : body_at - 1]),
            )
        except Exception:
            strict = None
        if strict is None or strict[1] is None:
            assert got is None  # decode_frame escapes these frames, or lets pamqp decode them
            return
        assert got is not None
        assert repr(_attributes(got[0])) == repr(_attributes(strict[0]))
        assert type(got[1]) is Basic.Properties
        assert repr(_attributes(got[1])) == repr(_attributes(strict[1].properties))

    @pytest.mark.parametrize("flag", [0x1000, 0x0040, 0x0004])
    def test_a_whole_delivery_whose_properties_read_the_frame_end(self, flag: int) -> None:
        """A header whose flags claim a property its frame lacks (an octet, a timestamp,
        a string: read from the frame-end byte on): refused, as its header frame is."""
        method = pamqp.frame.marshal(Basic.Deliver("ctag", 1, False, "", "q"), 1)
        header = bytearray(pamqp.frame.marshal(ContentHeader(0, 1, Basic.Properties()), 1))
        header[19:21] = flag.to_bytes(2, "big")
        wire = method + bytes(header) + pamqp.frame.marshal(ContentBody(b"\x00" * 9), 1)
        header_at = len(method)
        with pytest.raises((IndexError, struct.error, ValueError)):
            content_header(bytes(header[7:-1]))
        assert _plain_delivery(wire, header_at, header_at + len(header)) is None

    def test_long_string_overrunning_its_table(self) -> None:
        """Found by hypothesis: a long string whose length runs past its table and the
        payload reads nothing of the frame-end byte (pamqp gives an empty string)."""
        raw = bytes.fromhex(
            "02000100000020003c0000000000000000000a600001300000000c013062000230305301000000ce"
        )
        assert_same(raw)

    def test_two_flag_words_go_to_pamqp(self) -> None:
        """A header whose flags continue into a second word is left to pamqp."""
        raw = bytearray(pamqp.frame.marshal(ContentHeader(0, 5, Basic.Properties()), 3))
        raw[19:21] = b"\x00\x01"  # continuation bit set; an empty second word follows
        raw[3:7] = (int.from_bytes(raw[3:7], "big") + 2).to_bytes(4, "big")
        raw[21:21] = b"\x00\x00"
        assert_same(bytes(raw))

    @pytest.mark.parametrize(
        "frame",
        [
            Basic.Ack(delivery_tag=7, multiple=True),
            Basic.Nack(delivery_tag=9, requeue=False),
            Basic.CancelOk(consumer_tag="ctag"),
            Basic.Cancel(consumer_tag="ctag", nowait=True),
            Basic.ConsumeOk(consumer_tag="ctag"),
            Basic.QosOk(),
            Basic.Return(reply_code=312, reply_text="NO_ROUTE", exchange="x", routing_key="k"),
            Basic.GetOk(delivery_tag=1, exchange="", routing_key="q", message_count=3),
            commands.Channel.Close(406, "PRECONDITION_FAILED", class_id=60, method_id=80),
            commands.Connection.Close(320, "CONNECTION_FORCED", class_id=0, method_id=0),
            heartbeat.Heartbeat(),
        ],
        ids=lambda f: type(f).__qualname__,
    )
    def test_other_frames_as_pamqp(self, frame: Any) -> None:
        """Every other frame is pamqp's own decoding."""
        assert_same(pamqp.frame.marshal(frame, 0 if isinstance(frame, heartbeat.Heartbeat) else 5))

    def test_empty_payload_is_pamqps_error(self) -> None:
        """A body frame of size 0 is refused, as pamqp refuses it."""
        raw = b"\x03\x00\x01\x00\x00\x00\x00\xce"
        assert _outcome(_ours, raw) == ("error", pamqp.exceptions.UnmarshalingException)
        assert_same(raw)


_MARK = "QqBADqQ"
_NOT_UTF8 = b"\xff\xfeb\xc3(d\x80"  # as long as _MARK
_ESCAPED = "\\xff\\xfeb\\xc3(d\\x80"
_STRING_PROPERTIES = (
    "content_type",
    "content_encoding",
    "correlation_id",
    "reply_to",
    "expiration",
    "message_id",
    "message_type",
    "user_id",
    "app_id",
)


def _swapped(frame: Any) -> bytes:
    return pamqp.frame.marshal(frame, 1).replace(_MARK.encode(), _NOT_UTF8)


class TestUndecodable:
    """Well-formed frames pamqp cannot decode: strings not UTF-8, dates out of range."""

    @settings(max_examples=200, deadline=None)
    @given(props=_properties(), name=st.sampled_from(_STRING_PROPERTIES))
    def test_a_property_not_utf8_is_escaped_and_named(
        self, props: Basic.Properties, name: str
    ) -> None:
        """That property escaped, every other one as pamqp decodes it, the field named."""
        setattr(props, name, _MARK)
        frame = _ours(_swapped(ContentHeader(0, 3, props)))[2]
        assert isinstance(frame, UndecodableHeader)
        setattr(props, name, _ESCAPED)
        expected = unmarshal(pamqp.frame.marshal(ContentHeader(0, 3, props), 1))[2]
        assert _attributes(frame)[1:] == _attributes(expected)[1:]
        assert frame.undecodable.fields == (name,)
        assert isinstance(frame.undecodable.error, UnicodeDecodeError)

    @settings(max_examples=100, deadline=None)
    @given(table=_tables, path=st.lists(st.text(min_size=1, max_size=5), max_size=2))
    def test_a_header_name_not_utf8_anywhere_in_the_table(
        self, table: dict[str, Any], path: list[str]
    ) -> None:
        """A header name at any depth (nested tables) escaped; its path named."""
        nested: dict[str, Any] = {_MARK: 1}
        for key in reversed(path):
            nested = {key: nested}
        headers = {**table, **nested}
        frame = _ours(_swapped(ContentHeader(0, 3, Basic.Properties(headers=headers))))[2]
        assert isinstance(frame, UndecodableHeader)
        where = "header" + "".join(f"[{key!r}]" for key in path)
        assert frame.undecodable.fields == (f"{where} name '{_ESCAPED}'",)
        value: Any = frame.properties.headers
        for key in path:
            value = value[key]
        assert value[_ESCAPED] == 1

    def test_a_header_value_not_utf8_is_bytes_as_in_pamqp(self) -> None:
        """A long-string value need not be text: pamqp gives bytes, and so does ours."""
        data = _swapped(ContentHeader(0, 3, Basic.Properties(headers={"k": [_MARK]})))
        assert_same(data)
        assert _ours(data)[2].properties.headers == {"k": [_NOT_UTF8]}

    @pytest.mark.parametrize("field", ["exchange", "routing_key"])
    def test_deliver_with_a_string_not_utf8(self, field: str) -> None:
        """basic.deliver: the exchange or routing key escaped, the rest as pamqp."""
        deliver = Basic.Deliver("ctag", 7, True, "ex", "rk")
        setattr(deliver, field, _MARK)
        frame = _ours(_swapped(deliver))[2]
        assert isinstance(frame, UndecodableDeliver)
        assert frame.undecodable.fields == (field,)
        assert (frame.consumer_tag, frame.delivery_tag, frame.redelivered) == ("ctag", 7, True)
        assert getattr(frame, field) == _ESCAPED

    @pytest.mark.parametrize("seconds", [2**64 - 1, 1_700_000_000_000_000])
    def test_a_timestamp_out_of_range_is_none(self, seconds: int) -> None:
        """A timestamp past the year 9999 (a producer writing microseconds): None, named."""
        placeholder = 1_234_567_890
        stamp = datetime.datetime.fromtimestamp(placeholder, tz=datetime.UTC)
        props = Basic.Properties(message_id="m", timestamp=stamp, headers={"t": stamp})
        data = pamqp.frame.marshal(ContentHeader(0, 3, props), 1)
        data = data.replace(placeholder.to_bytes(8, "big"), seconds.to_bytes(8, "big"))
        frame = _ours(data)[2]
        assert isinstance(frame, UndecodableHeader)
        assert frame.undecodable.fields == ("header['t']", "timestamp")
        assert frame.properties.timestamp is None and frame.properties.headers == {"t": None}
        assert frame.properties.message_id == "m"

    def test_a_long_escaped_string_still_fits_a_short_string(self) -> None:
        """255 bytes not UTF-8 escape to 1,020 characters: cut to 255 bytes, marked."""
        props = Basic.Properties(message_id="\x01" * 255)
        data = pamqp.frame.marshal(ContentHeader(0, 3, props), 1).replace(
            b"\x01" * 255, b"\xff" * 255
        )
        frame = _ours(data)[2]
        assert isinstance(frame, UndecodableHeader)
        message_id = frame.properties.message_id
        assert len(message_id.encode()) == 255 and message_id.endswith("...")

    def test_a_damaged_frame_is_still_pamqps_error(self) -> None:
        """Not UTF-8 and a string past the end of the frame: pamqp's error."""
        data = bytearray(_swapped(ContentHeader(0, 3, Basic.Properties(message_id=_MARK))))
        data[data.index(_NOT_UTF8) - 1] = 8  # one byte more: the frame-end byte
        assert _outcome(_ours, bytes(data)) == ("error", pamqp.exceptions.UnmarshalingException)


def _resized(data: bytearray, at: int, delta: int) -> bytes:
    """``data`` with the 4-byte length at ``at`` changed by ``delta`` (the frame is not)."""
    data[at : at + 4] = (int.from_bytes(data[at : at + 4], "big") + delta).to_bytes(4, "big")
    return bytes(data)


def _undecodable_table(headers: dict[str, Any]) -> bytearray:
    """A content header of ``headers`` only, its first name made not UTF-8 (`_swapped`)."""
    return bytearray(_swapped(ContentHeader(0, 3, Basic.Properties(headers=headers))))


_TABLE_LENGTH = 21  # the frame's offset of the headers table's length (the first property)


def _array_resized(headers: dict[str, Any], delta: int) -> bytes:
    """`_undecodable_table` of ``headers``, the length of its first array changed by ``delta``."""
    data = _undecodable_table(headers)
    return _resized(data, data.index(b"A", _TABLE_LENGTH + 4 + 1 + len(_MARK)) + 1, delta)


@pytest.mark.unit
class TestHeaderEdges:
    """Content headers at the edges of what our decoder takes itself."""

    @pytest.mark.parametrize(
        "props",
        [
            Basic.Properties(content_type="ab", content_encoding="cd"),
            Basic.Properties(message_id="m1", headers={"k": [1, "v"]}, priority=3),
            Basic.Properties(
                content_type="text/plain",
                delivery_mode=2,
                timestamp=datetime.datetime(2026, 1, 2, tzinfo=datetime.UTC),
                app_id="a",
            ),
        ],
        ids=["strings", "table", "mixed"],
    )
    def test_two_flag_words_with_properties(self, props: Basic.Properties) -> None:
        """Properties in the first flag word, the continuation bit set and an empty second
        word after it: pamqp decodes it; ours must not read the properties from the
        second flag word's offset (an empty content type, the rest shifted)."""
        raw = bytearray(pamqp.frame.marshal(ContentHeader(0, 5, props), 3))
        flags = int.from_bytes(raw[19:21], "big")
        assert flags
        raw[19:21] = (flags | 1).to_bytes(2, "big")
        raw[21:21] = b"\x00\x00"
        raw[3:7] = (int.from_bytes(raw[3:7], "big") + 2).to_bytes(4, "big")
        assert content_header(bytes(raw[7:-1])) is None  # not ours: pamqp's
        assert_same(bytes(raw))
        frame = _ours(bytes(raw))[2]
        assert _attributes(frame)[5] == _attributes(ContentHeader(0, 5, props))[5]

    @pytest.mark.parametrize(
        "damaged",
        [
            pytest.param(
                lambda: _resized(_undecodable_table({_MARK: "\x00" * 4}), _TABLE_LENGTH, -4),
                id="table-ends-inside-a-value",
            ),
            pytest.param(
                lambda: _resized(_undecodable_table({_MARK: "\x00" * 4}), _TABLE_LENGTH, -1),
                id="table-one-byte-short",
            ),
            pytest.param(
                lambda: _resized(_undecodable_table({_MARK: "v"}), _TABLE_LENGTH, 1),
                id="table-past-the-frame",
            ),
            pytest.param(
                lambda: _resized(_undecodable_table({_MARK: "v"}), _TABLE_LENGTH, 2**31),
                id="table-far-past-the-frame",
            ),
            pytest.param(
                lambda: _array_resized({_MARK: [1, 2]}, -1),
                id="array-one-byte-short",
            ),
            pytest.param(
                lambda: _array_resized({_MARK: [1, "\x01zb\x05"]}, -4),
                id="array-ends-inside-a-value",  # what follows reads as a header "z": 5
            ),
            pytest.param(
                lambda: _array_resized({_MARK: [1, 2], "z": 1}, -2),
                id="array-ends-between-items",
            ),
            pytest.param(
                lambda: _array_resized({_MARK: [1, 2]}, 1),
                id="array-past-its-table",
            ),
        ],
    )
    def test_a_damaged_undecodable_header_is_still_pamqps_error(self, damaged: Any) -> None:
        """A header name not UTF-8 *and* a table or array whose length is wrong: damaged,
        not undecodable. Ours raises pamqp's error (the channel closes, the broker
        requeues); it never makes a delivery of what it read past the damage (it would be
        dead-lettered with garbage for properties)."""
        data = damaged()
        assert _decode_escaped(data[0], data[7:]) is None
        assert _outcome(_ours, data) == _outcome(pamqp.frame.unmarshal, data)
        assert _outcome(_ours, data)[0] == "error"


class TestIntake:
    async def test_a_delivery_it_cannot_record_closes_the_channel(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A tag out of order (or any bug while recording) aborts the channel: the
        broker requeues its deliveries; nothing is left admitted and unsettled."""
        from reliable_mq._consume.dispatch import Dispatcher
        from reliable_mq._consume.session import Shared
        from reliable_mq.settings import ConsumerSettings

        aborted: list[bool] = []

        class _Session:
            def admit(self, tag: int, task: Any) -> Any:
                raise ValueError(f"delivery tag {tag} out of order (expected 1)")

            def abort(self) -> None:
                aborted.append(True)

        route = SimpleNamespace(
            queue="q",
            spec=SimpleNamespace(ack_policy=AckPolicy.RETRY_ON_ERROR, queue_only=False, batch=None),
            metrics=Metrics.on(CollectorRegistry()).for_queue("q"),
            batcher=None,
            dedup=None,
        )
        dispatcher = Dispatcher(Shared(ConsumerSettings()))
        on_delivery = dispatcher.intake(route, _Session())  # type: ignore[arg-type]
        frame = Basic.Deliver("ctag", 5, False, "", "q")
        with caplog.at_level("ERROR"):
            on_delivery(frame, Basic.Properties(), b"x", None)
        assert aborted == [True]
        assert "consumer_intake_failed" in caplog.text
        assert route.metrics.delivered == 0

    async def test_channel_dead_before_the_task_starts(self) -> None:
        """Deliveries whose channel dies before their task runs: each settled once,
        as stale, without running the handler; a running one is cancelled."""
        from reliable_mq._consume.acks import LostAcks
        from reliable_mq._consume.dispatch import Dispatcher
        from reliable_mq._consume.session import Session, Shared
        from reliable_mq.settings import ConsumerSettings

        calls: list[str] = []

        async def handler(delivery: Delivery) -> None:
            calls.append(delivery.message_id)
            await asyncio.sleep(60)

        shared = Shared(ConsumerSettings())
        channel = _ClosableChannel()
        route = SimpleNamespace(
            queue="q",
            quorum=False,
            spec=SimpleNamespace(
                ack_policy=AckPolicy.RETRY_ON_ERROR, decode=None, queue_only=False, batch=None
            ),
            batcher=None,
            handler=handler,
            threads=None,
            running={},
            has_overran=False,
            lost_acks=LostAcks(),
            metrics=Metrics.on(CollectorRegistry()).for_queue("q"),
            dedup=None,
            semaphore=None,
        )
        route.ack_lost = lambda message_id, attempt: None
        route.handler_ended = route.running.pop
        session = Session(shared, route, channel)  # type: ignore[arg-type]
        on_delivery = Dispatcher(shared).intake(route, session)  # type: ignore[arg-type]
        on_delivery(
            Basic.Deliver("ctag", 1, False, "", "q"), Basic.Properties(message_id="a"), b"", None
        )
        await asyncio.sleep(0.01)  # the first one's handler is running
        for tag in (2, 3):
            props = Basic.Properties(message_id=f"m{tag}")
            on_delivery(Basic.Deliver("ctag", tag, False, "", "q"), props, b"", None)
        channel.is_closed = True  # dies before 2 and 3 started
        started = [t for t in session.inflight.values() if t.task is not None]
        assert [t.tag for t in started] == [1]  # 2 and 3 wait for their turn, without a task
        session.interrupt()
        await asyncio.wait_for(asyncio.gather(started[0].task, return_exceptions=True), 10)
        await wait_until(lambda: not session.inflight, timeout=10, what="2 and 3 settled")
        assert calls == ["a"]
        assert route.metrics.stale == 3 and route.metrics.acked == 0
        assert session.inflight == {} and shared.active == 0
        assert channel.frames == []


class _ClosableChannel:
    """Records settle frames; ``is_closed`` set by the test."""

    def __init__(self) -> None:
        self.frames: list[tuple[str, int]] = []
        self.is_closed = False

    async def basic_ack(self, tag: int, *, multiple: bool, wait: bool = False) -> None:
        self.frames.append(("ack", tag))

    async def basic_nack(
        self, tag: int, *, multiple: bool, requeue: bool, wait: bool = False
    ) -> None:
        self.frames.append(("nack", tag))


# -- against the broker -----------------------------------------------------------


class Env:
    def __init__(self) -> None:
        self.suffix = uuid.uuid4().hex[:10]
        self.queue = f"test-inbound-{self.suffix}"
        self.consumers: list[ReliableConsumer] = []

    def consumer(self, url: str = URL, **overrides: Any) -> ReliableConsumer:
        settings = ConnectionSettings(
            url=SecretStr(url),
            connection_name=f"test-inbound-{self.suffix}",
            reconnect_initial_delay=0.1,
            reconnect_max_delay=0.5,
        )
        consumer = ReliableConsumer(settings, registry=CollectorRegistry(), **overrides)
        self.consumers.append(consumer)
        return consumer


@pytest.fixture(name="env")
async def _env() -> AsyncIterator[Env]:
    env = Env()
    yield env
    connection = await aio_pika.connect(URL)
    try:
        channel = await connection.channel()
        await delete_topology(channel, QueueTopology(env.queue))
    finally:
        await connection.close()


@pytest.mark.rabbitmq
class TestOnTheBroker:
    async def test_the_consumer_connection_decodes_with_ours(self, env: Env) -> None:
        """With the aiormq we support, the consumer's frames go through `decode_frame`."""
        consumer = env.consumer()

        @consumer.handler(env.queue)
        async def handle(body: bytes) -> None:
            return None

        async with consumer:
            link = consumer._supervisor.connection
            assert link is not None and link.fast
            receiver, failure = find_receiver(link._connection)
            assert failure is None, failure
            assert "get_frame" in vars(receiver), "the receiver still decodes with aiormq's code"

    async def test_bodies_and_properties_arrive_intact(self, env: Env) -> None:
        """Empty, one-frame, frame-boundary and multi-frame bodies; every property kept."""
        frame_body = 131_072 - 8  # the most one body frame holds at the default frame_max
        bodies = {
            "empty": b"",
            "one": b"x",
            "boundary": os.urandom(frame_body),
            "boundary+1": os.urandom(frame_body + 1),
            "large": os.urandom(3 * frame_body + 17),
        }
        seen: dict[str, tuple[bytes, Delivery]] = {}
        consumer = env.consumer()

        @consumer.handler(env.queue)
        async def handle(body: bytes, delivery: Delivery) -> None:
            seen[delivery.message_id] = (body, delivery)

        async with consumer:
            connection = await aio_pika.connect(URL)
            try:
                channel = await connection.channel(publisher_confirms=True)
                for name, body in bodies.items():
                    await channel.default_exchange.publish(
                        aio_pika.Message(
                            body,
                            message_id=name,
                            content_type="application/x-test",
                            correlation_id="corr-é",
                            reply_to="replies",
                            headers={"tenant": "ü", "n": 3},
                        ),
                        routing_key=env.queue,
                    )
            finally:
                await connection.close()
            await wait_until(lambda: len(seen) == len(bodies), timeout=20, what="every body")
        for name, body in bodies.items():
            got, delivery = seen[name]
            assert got == body, name
            assert delivery.content_type == "application/x-test"
            assert delivery.correlation_id == "corr-é"
            assert delivery.reply_to == "replies"
            assert dict(delivery.headers) == {"tenant": "ü", "n": 3}
            assert delivery.routing_key == env.queue and delivery.exchange == ""
        assert consumer.stats().acked == len(bodies)

    async def test_a_dead_channel_cancels_its_running_handler(self, env: Env) -> None:
        """A cut connection cancels the handler; the delivery is stale, then handled again."""
        runs: list[str] = []
        release = asyncio.Event()
        async with TCPProxy("127.0.0.1", 5672) as proxy:
            consumer = env.consumer(f"amqp://guest:guest@127.0.0.1:{proxy.port}/")

            @consumer.handler(env.queue)
            async def handle(delivery: Delivery) -> None:
                if not runs:
                    runs.append("first")
                    try:
                        await asyncio.wait_for(release.wait(), 60)
                    except asyncio.CancelledError:
                        runs.append("cancelled")
                        raise
                    return
                runs.append("again")

            async with consumer:
                connection = await aio_pika.connect(URL)
                try:
                    channel = await connection.channel(publisher_confirms=True)
                    await channel.default_exchange.publish(
                        aio_pika.Message(b"x", message_id="m1"), routing_key=env.queue
                    )
                finally:
                    await connection.close()
                await wait_until(lambda: runs == ["first"], timeout=20, what="the first run")
                assert await proxy.cut() >= 1
                await wait_until(lambda: "again" in runs, timeout=30, what="the redelivery")
                stats = consumer.stats()
        assert runs == ["first", "cancelled", "again"]
        assert stats.stale == 1
        assert stats.acked == 1
        assert stats.in_progress == 0

    async def test_the_handler_gauge_follows_running_handlers(self, env: Env) -> None:
        """While a handler runs, handlers_in_progress reads 1 (within the flush interval);
        once it returned, 0, and its duration is in the histogram."""
        release = asyncio.Event()
        consumer = env.consumer()

        @consumer.handler(env.queue)
        async def handle(body: bytes) -> None:
            await asyncio.wait_for(release.wait(), 60)

        def value(name: str) -> float:
            registry = consumer._registry
            assert registry is not None
            return registry.get_sample_value(name, {"queue": env.queue}) or 0.0

        async with consumer:
            connection = await aio_pika.connect(URL)
            try:
                channel = await connection.channel(publisher_confirms=True)
                await channel.default_exchange.publish(
                    aio_pika.Message(b"x", message_id="m1"), routing_key=env.queue
                )
            finally:
                await connection.close()
            await wait_until(
                lambda: value("reliable_mq_handlers_in_progress") == 1,
                timeout=20,
                what="the gauge at 1",
            )
            release.set()
            await wait_until(
                lambda: value("reliable_mq_handlers_in_progress") == 0,
                timeout=20,
                what="the gauge at 0",
            )
            await wait_until(
                lambda: value("reliable_mq_handler_duration_seconds_count") == 1,
                timeout=20,
                what="a duration",
            )
