"""Fuzz tier, the wire: pika and reliable_mq publish, the other one reads, against the broker.

Both directions, with generated properties and header tables at their edges
(`tests.fuzz.wire_inputs`: empty and 255-byte short strings, 128-byte header
names, every integer width's boundaries, bools beside ints, nested tables and
arrays, decimals, timestamps after 2106 and to the year 9999):

* **pika publishes, our consumer decodes**: every property of every message,
  as the handler's ``delivery.properties``, equals what pika sent: same
  values of the same kinds (a bool is no int, a str no bytes), timestamps as
  sent (pamqp alone reads one after 2106 as milliseconds);
* **we publish, pika reads**: every option of ``publish_many()``'s `Message`
  arrives as pika decodes it: strings as given (empty ones empty), the
  content type inferred only when none was given, ``expiration`` rounded to
  the millisecond, timestamps as whole seconds (floor), header values as
  given. Floats are compared as pika reads them: pika 1.4.4 decodes every
  ``d`` as an int (truncated; its own defect); ours are doubles, checked
  exactly by `tests.amqp.test_wire`.

``FUZZ_RANDOM=1`` draws new examples (``FUZZ_WIRE_EXAMPLES`` per direction).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import os
import uuid
from collections.abc import Callable
from decimal import ROUND_HALF_UP, Decimal
from fractions import Fraction
from typing import Any

import aio_pika
import pytest
from hypothesis import HealthCheck, Phase, example, given, seed, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from reliable_mq import ConnectionSettings, Message, ReliablePublisher
from reliable_mq.consumer import ReliableConsumer
from reliable_mq.delivery import Delivery
from reliable_mq.topology import delete_topology
from tests.fuzz.wire_inputs import fit, our_options, pika_properties
from tests.support import pika_client
from tests.support.pika_client import PROPERTIES, same, seconds_of

pytestmark = pytest.mark.rabbitmq

URL = "amqp://guest:guest@127.0.0.1:5672/"
RANDOM = bool(os.environ.get("FUZZ_RANDOM"))
EXAMPLES = int(os.environ.get("FUZZ_WIRE_EXAMPLES", "40"))

Test = Callable[..., None]


def _fuzz(fixed_seed: int) -> Callable[[Test], Test]:
    """This tier's settings: a fixed seed (unless FUZZ_RANDOM), no shrinking."""
    configured = settings(
        max_examples=EXAMPLES,
        deadline=None,
        phases=[Phase.explicit, Phase.reuse, Phase.generate],  # a broker round per example
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=True,
        derandomize=False,  # the CI profile's derandomize would override the seed
        **({} if RANDOM else {"database": None}),
    )

    def apply(test: Test) -> Test:
        return configured(test if RANDOM else seed(fixed_seed)(test))

    return apply


# -- pika publishes, our consumer decodes ------------------------------------------


async def _consume(messages: list[dict[str, Any]]) -> dict[bytes, dict[str, Any]]:
    """Publish with pika; the consumer's decoding of each message's properties, by body."""
    queue = f"fuzz-wire-{uuid.uuid4().hex[:10]}"
    consumer = ReliableConsumer(
        ConnectionSettings(url=URL, connection_name=queue), registry=CollectorRegistry(), dedup=None
    )
    seen: dict[bytes, dict[str, Any]] = {}

    @consumer.handler(queue)
    async def handler(body: bytes, delivery: Delivery) -> None:
        seen[body] = {name: getattr(delivery.properties, name) for name in PROPERTIES}

    bodies = [f"{queue}-{index}".encode() for index in range(len(messages))]
    try:
        async with asyncio.timeout(60), consumer:
            await asyncio.to_thread(
                pika_client.publish, URL, queue, zip(bodies, messages, strict=True)
            )
            while len(seen) < len(messages):
                await asyncio.sleep(0.01)
    finally:
        connection = await aio_pika.connect(URL)
        async with connection:
            await delete_topology(await connection.channel(), consumer.topology(queue))
    return {body: seen[body] for body in bodies}


def _assert_decoded(sent: dict[str, Any], got: dict[str, Any]) -> None:
    for name in PROPERTIES:
        want, have = sent.get(name), got[name]
        if name == "headers":
            assert same(want or {}, have or {}), (name, want, have)
        elif name == "cluster_id":
            assert have == (want or ""), (name, want, have)  # pamqp: "" when absent
        else:
            have = seconds_of(have)
            assert type(have) is type(want) and have == want, (name, want, have)


class TestPikaToUs:
    @_fuzz(fixed_seed=11)
    @example(
        batch=[
            {"timestamp": 7_258_118_400, "headers": {"t": dt.datetime(2200, 1, 1, tzinfo=dt.UTC)}},
            {name: "" for name in ("content_type", "message_id", "reply_to", "cluster_id")},
            {"headers": {"b": True, "i": 1, "z": 0, "f": False, "n": None, "l": [True, 1]}},
        ]
    )
    @given(batch=st.lists(pika_properties(), min_size=4, max_size=24))
    def test_our_consumer_decodes_what_pika_sent(
        self, broker_url: str, batch: list[dict[str, Any]]
    ) -> None:
        """Every property pika sent, as the handler sees it: same values, same kinds."""
        decoded = asyncio.run(_consume(batch))
        for sent, got in zip(batch, decoded.values(), strict=True):
            _assert_decoded(sent, got)


# -- we publish, pika reads ------------------------------------------------------------


def _as_pika_reads(value: Any) -> Any:
    """What pika decodes of a header value we sent."""
    if isinstance(value, float):
        return int(value)  # pika 1.4.4: ``long(struct.unpack_from('>d', ...))``
    if isinstance(value, dt.datetime):
        aware = value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)
        return aware.replace(microsecond=0)
    if isinstance(value, dict):
        return {key: _as_pika_reads(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_pika_reads(item) for item in value]
    return value


def _millis(seconds: float | Decimal) -> str:
    """Milliseconds, half up, from the decimal as written (exact fractions: not ``_wire``)."""
    exact = Fraction(str(seconds)) if isinstance(seconds, Decimal) else Fraction(repr(seconds))
    return str(math.floor(exact * 1000 + Fraction(1, 2)))


def _expected(options: dict[str, Any], message_id: str) -> dict[str, Any]:
    """Every property as pika should read it."""
    stamp = options.get("timestamp")
    expiration = options.get("expiration")
    headers = options.get("headers")
    content_type = options.get("content_type")
    return {
        "content_type": "application/octet-stream" if content_type is None else content_type,
        "content_encoding": options.get("content_encoding"),
        "headers": _as_pika_reads(headers) if headers else None,
        "delivery_mode": 1 if options.get("persistent") is False else 2,
        "priority": options.get("priority"),
        "correlation_id": options.get("correlation_id"),
        "reply_to": options.get("reply_to"),
        "expiration": None if expiration is None else _millis(expiration),
        "message_id": message_id,
        "timestamp": None if stamp is None else seconds_of(stamp.replace(microsecond=0)),
        "message_type": options.get("message_type"),
        "user_id": options.get("user_id"),
        "app_id": options.get("app_id"),
        "cluster_id": None,
    }


async def _publish(batch: list[dict[str, Any]]) -> tuple[list[str], list[pika_client.Received]]:
    queue = f"fuzz-wire-{uuid.uuid4().hex[:10]}"
    ids = [
        fit(f"{index}:{queue}:{options.get('app_id') or ''}") for index, options in enumerate(batch)
    ]
    connection = await aio_pika.connect(URL)
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(queue, durable=True)
        try:
            async with ReliablePublisher(URL, registry=CollectorRegistry()) as publisher:
                await publisher.publish_many(
                    Message(b"x", routing_key=queue, message_id=message_id, **options)
                    for message_id, options in zip(ids, batch, strict=True)
                )
            received = await asyncio.to_thread(pika_client.get_all, URL, queue)
        finally:
            await channel.queue_delete(queue)
    return ids, received


class TestUsToPika:
    @_fuzz(fixed_seed=12)
    @example(
        batch=[
            {
                "timestamp": dt.datetime(2200, 1, 1),
                "expiration": 64.002,
                "content_type": "",
                "headers": {"t": dt.datetime(2200, 1, 1, 0, 0, 0, 999_999), "b": True, "i": 1},
            },
            {"headers": {"d": Decimal("-1.50"), "x": b"\xff", "e": [], "m": {}}},
        ]
    )
    @given(batch=st.lists(our_options(), min_size=4, max_size=24))
    def test_pika_reads_what_we_sent(self, broker_url: str, batch: list[dict[str, Any]]) -> None:
        """Every option we publish, as pika decodes it (floats aside: see the module)."""
        ids, received = asyncio.run(_publish(batch))
        assert [m.properties["message_id"] for m in received] == ids
        for options, message_id, got in zip(batch, ids, received, strict=True):
            want = _expected(options, message_id)
            for name in PROPERTIES:
                if name == "headers":
                    assert same(want[name] or {}, got.properties[name] or {}), (
                        want[name],
                        got.properties[name],
                    )
                else:
                    assert got.properties[name] == want[name], (name, want[name], got.properties)


def test_half_up_is_what_rounding_means() -> None:
    """The oracle's rounding against Decimal's own half-up, on the cases that differ."""
    for text in ("0.0005", "0.0015", "1.4375", "64.002", "4294967.2945"):
        value = Decimal(text)
        assert _millis(value) == str(int((value * 1000).to_integral_value(ROUND_HALF_UP)))
