"""Inputs of the wire fuzz tier: every basic property and header value, at its edges.

Two families, one per publisher: `pika_properties` (what pika can send: every
property, empty strings, 255-byte short strings, header names of 128 bytes,
ints at every width's boundary, bools, nested tables and arrays, decimals,
timestamps to the year 9999) and `our_options` (the same through
``publish()``'s options, plus what pika cannot send: floats, tuples, naive
datetimes, datetimes with microseconds, ``expiration`` in fractional seconds).
"""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from typing import Any

from hypothesis import strategies as st

__all__ = (
    "STRING_PROPERTIES",
    "fit",
    "our_options",
    "our_values",
    "pika_properties",
    "pika_values",
)

STRING_PROPERTIES = (
    "content_type",
    "content_encoding",
    "correlation_id",
    "reply_to",
    "message_id",
    "message_type",
    "app_id",
)


def fit(text: str, limit: int = 255) -> str:
    """``text`` cut to at most ``limit`` bytes of UTF-8, on a character boundary."""
    return text.encode()[:limit].decode("utf-8", "ignore")


short_strings = st.one_of(
    st.text(max_size=20),
    st.just(""),
    st.text(min_size=200, max_size=255).map(fit),
    st.just("é" * 127 + "x"),  # 255 bytes exactly
)
"""AMQP short strings: empty, short, long, and exactly 255 bytes of UTF-8."""

names = st.one_of(
    st.text(min_size=1, max_size=30).filter(lambda n: not n.startswith("x-")),
    st.just("n" * 128),  # the longest header name AMQP allows
    st.just("é" * 64),  # 128 bytes of UTF-8
)
"""Header names (never ``x-``: the broker and reliable_mq own some of those)."""

int_edges = st.sampled_from(
    [
        *(0, 1, -1, 127, 128, -128, -129, 255, 256, 32767, 32768, -32768, -32769),
        *(2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**32, 2**63 - 1, -(2**63)),
    ]
)
"""Each side of every signed width (8, 16, 32, 64 bits)."""

seconds = st.one_of(
    st.integers(0, 2**32 - 1),
    st.integers(2**32, 253_402_300_799),  # after 2106-02-07, to the end of 9999
    st.sampled_from([0, 2**32 - 1, 2**32, 7_258_118_400, 253_402_300_799]),
)
"""AMQP timestamps: 64-bit POSIX seconds a datetime can hold."""

instants = seconds.map(lambda s: dt.datetime.fromtimestamp(s, dt.UTC))

decimals = st.builds(
    lambda mantissa, places: Decimal(mantissa).scaleb(-places),
    st.integers(-(2**31), 2**31 - 1),
    st.integers(0, 12),
)
"""AMQP decimals: a 32-bit mantissa and a scale."""

_pika_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    int_edges,
    st.text(max_size=30),
    st.binary(max_size=30),
    decimals,
    instants,
)
pika_values = st.recursive(
    _pika_leaves,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(names, inner, max_size=4),
    max_leaves=10,
)
"""Header values pika can encode."""


@st.composite
def pika_properties(draw: st.DrawFn) -> dict[str, Any]:
    """Every property pika can send (None: left out), as another client's would be."""

    def maybe(strategy: st.SearchStrategy[Any]) -> Any:
        return draw(st.none() | strategy)

    properties = {name: maybe(short_strings) for name in (*STRING_PROPERTIES, "cluster_id")}
    properties["headers"] = maybe(st.dictionaries(names, pika_values, max_size=6))
    properties["delivery_mode"] = maybe(st.sampled_from([1, 2]))
    properties["priority"] = maybe(st.integers(0, 255))
    # Long enough not to expire while a test runs; up to the broker's limit.
    properties["expiration"] = maybe(st.integers(60_000, 2**32 - 1).map(str))
    properties["timestamp"] = maybe(seconds)
    properties["user_id"] = maybe(st.just("guest"))  # the broker refuses any other name
    return properties


_our_leaves = st.one_of(
    _pika_leaves,
    st.floats(allow_nan=False, allow_infinity=False),
    st.datetimes(min_value=dt.datetime(1970, 1, 1), max_value=dt.datetime(9999, 12, 31)),
)
our_values = st.recursive(
    _our_leaves,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(names, inner, max_size=4)
    ),
    max_leaves=10,
)
"""Header values ``publish()`` takes: pika's, and floats, tuples, naive datetimes."""


@st.composite
def our_options(draw: st.DrawFn) -> dict[str, Any]:
    """``publish()`` options for every property (``message_id`` is the caller's)."""

    def maybe(strategy: st.SearchStrategy[Any]) -> Any:
        return draw(st.none() | strategy)

    options = {name: maybe(short_strings) for name in STRING_PROPERTIES if name != "message_id"}
    options["headers"] = maybe(st.dictionaries(names, our_values, max_size=6))
    options["persistent"] = maybe(st.booleans())
    options["priority"] = maybe(st.integers(0, 255))
    options["expiration"] = maybe(
        st.one_of(
            st.integers(60, 4_294_967),
            st.integers(60_000, 2**32 - 1).map(lambda ms: ms / 1000),
            st.floats(60, 4_294_967.295),
            st.integers(60_000, 2**32 - 1).map(lambda ms: Decimal(ms) / 1000),
        )
    )
    options["timestamp"] = maybe(
        st.datetimes(min_value=dt.datetime(1970, 1, 1), max_value=dt.datetime(9999, 12, 31))
        | instants
    )
    options["user_id"] = maybe(st.just("guest"))
    return options
