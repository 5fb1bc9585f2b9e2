"""A copy is the message: every property on every hop, against the real broker (issue 19).

pika, another client with its own encoder and decoder, publishes; the
consumer's handler fails every attempt, so each message goes: first delivery
-> retry copy -> DLQ copy -> ``reliable-mq dlq move`` -> moved copy, which the
handler accepts. Two decoders read the hops: ours (the handler's
``delivery.properties``: first, retry, moved) and pika's (the DLQ copy, fetched
and put back before the move).

What a copy keeps, field by field (docs/concepts/retries-and-dlq.md): every
property as sent, empty strings and absent properties included, but

* ``expiration``: only on the first delivery; each copy carries it in
  ``x-reliable-mq-original-expiration`` (RabbitMQ's dead-lettering drops it too);
* ``message_id``: as sent when not empty; else one generated on the retry copy,
  kept on every later copy;
* ``cluster_id`` (reserved in AMQP 0-9-1): empty and absent are one;
* ``user_id``: kept when it is the publishing user, else moved to
  ``x-reliable-mq-original-user-id`` (`TestForeignUserId`, on a private node
  with a second user);
* headers: as sent, plus ``x-reliable-mq-*`` and the broker's ``x-death`` group.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import sys
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aio_pika
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from reliable_mq import ConnectionSettings, ReliablePublisher
from reliable_mq.consumer import ReliableConsumer
from reliable_mq.delivery import Delivery
from reliable_mq.headers import BROKER_DEATH_HEADERS, MOVED_FROM_HEADER, PREFIX
from reliable_mq.topology import QueueTopology, declare_topology, delete_topology
from tests.fuzz.wire_inputs import pika_properties
from tests.support import pika_client
from tests.support.pika_client import PROPERTIES, same, seconds_of
from tests.support.waiting import wait_until

pytestmark = pytest.mark.rabbitmq

URL = os.environ.get("RELIABLE_MQ_TEST_URL", "amqp://guest:guest@127.0.0.1:5672/")
ROOT = Path(__file__).resolve().parents[2]
HOPS = ("first", "retry", "dlq", "moved")
_ALLOWED_EXTRA = frozenset(BROKER_DEATH_HEADERS)
ORIGINAL_EXPIRATION_HEADER = "x-reliable-mq-original-expiration"  # the wire contract, pinned
ORIGINAL_USER_ID_HEADER = "x-reliable-mq-original-user-id"


ISSUE_EXAMPLE = {
    "content_type": "application/json",
    "content_encoding": "gzip",
    "headers": {"tenant": "t1", "n": 7, "at": dt.datetime(2030, 5, 1, tzinfo=dt.UTC)},
    "delivery_mode": 2,
    "priority": 9,
    "correlation_id": "corr-1",
    "reply_to": "replies",
    "expiration": "3600000",
    "message_id": "order-1",
    "timestamp": 1_767_225_600,
    "message_type": "order.created",
    "user_id": "guest",
    "app_id": "billing",
    "cluster_id": None,
}
"""The message of issue 19, defect 1 (pika with gzip, priority 9, a timestamp...)."""


# -- the hops -------------------------------------------------------------------------


def _ours(delivery: Delivery) -> dict[str, Any]:
    props = delivery.properties
    return {name: getattr(props, name) for name in PROPERTIES}


async def _cli(*args: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "reliable_mq.cli",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        cwd=ROOT,
    )
    out, _ = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode is not None
    return process.returncode, out.decode()


async def run_hops(
    messages: list[dict[str, Any]],
    *,
    url: str = URL,
    consumer_url: str | None = None,
    publish_urls: list[str] | None = None,
) -> dict[bytes, dict[str, dict[str, Any]]]:
    """Publish ``messages`` with pika; return each one's properties on every hop, by body.

    Args:
        messages: pika's properties of each message.
        url: the broker, for everything but what the two others name.
        consumer_url: where the consumer connects (its user publishes the copies).
        publish_urls: where each message is published from (its user may set user_id).
    """
    queue = f"test-copies-{uuid.uuid4().hex[:10]}"
    consumer = ReliableConsumer(
        ConnectionSettings(url=consumer_url or url, connection_name=f"{queue}-consumer"),
        registry=CollectorRegistry(),
        dedup=None,
        retry_delays=(0.05,),
        max_attempts=2,
        prefetch=50,
    )
    hops: dict[bytes, dict[str, dict[str, Any]]] = defaultdict(dict)

    @consumer.handler(queue)
    async def handler(body: bytes, delivery: Delivery) -> None:
        if MOVED_FROM_HEADER in delivery.headers:
            hops[body]["moved"] = _ours(delivery)
            return
        hops[body]["first" if delivery.attempt == 1 else "retry"] = _ours(delivery)
        raise RuntimeError("this attempt fails")

    topology = consumer.topology(queue)
    bodies = [f"{queue}-{index}".encode() for index in range(len(messages))]
    try:
        async with consumer:
            for body, message, source in zip(
                bodies, messages, publish_urls or [url] * len(messages), strict=True
            ):
                await asyncio.to_thread(pika_client.publish, source, queue, [(body, message)])
            await wait_until(
                lambda: consumer.stats().dead_lettered == len(messages),
                what="every DLQ copy",
                timeout=30,
            )
            for received in await asyncio.to_thread(
                pika_client.get_all, url, topology.dead_letter_queue, requeue=True
            ):
                hops[received.body]["dlq"] = received.properties
            code, output = await _cli("dlq", "move", queue, "--all", "--url", url)
            assert code == 0, output
            await wait_until(
                lambda: all("moved" in hops[b] for b in bodies), what="every moved copy", timeout=30
            )
    finally:
        connection = await aio_pika.connect(url)
        async with connection:
            await delete_topology(await connection.channel(), topology)
    return {body: hops[body] for body in bodies}


# -- the comparison ---------------------------------------------------------------------


def assert_kept(sent: dict[str, Any], hops: dict[str, dict[str, Any]]) -> None:
    """Every hop has every property ``sent`` had, but the documented exceptions."""
    assert set(hops) == set(HOPS), hops.keys()
    generated = hops["retry"]["message_id"]
    for hop in HOPS:
        got = hops[hop]
        copy = hop != "first"
        for name in PROPERTIES:
            want, have = sent.get(name), got[name]
            where = f"{hop}: {name}"
            if name == "headers":
                _assert_headers(want or {}, have or {}, copy=copy, where=where)
                continue
            if name == "expiration" and copy:
                assert have is None, where
                recorded = (have_headers := got["headers"] or {}).get(ORIGINAL_EXPIRATION_HEADER)
                assert recorded == want, (where, have_headers)
                continue
            if name == "message_id" and not want and copy:
                assert generated and have == generated, (where, have, generated)
                continue
            if name == "cluster_id":
                want, have = want or None, have or None  # "" and absent are one
            assert type(seconds_of(have)) is type(seconds_of(want)), (where, have, want)
            assert seconds_of(have) == seconds_of(want), (where, have, want)
        assert ORIGINAL_USER_ID_HEADER not in (got["headers"] or {}), hop


def _assert_headers(sent: dict[str, Any], got: dict[str, Any], *, copy: bool, where: str) -> None:
    for key, value in sent.items():
        assert key in got, (where, key)
        assert same(value, got[key]), (where, key, value, got[key])
    extra = set(got) - set(sent)
    if not copy:
        assert not extra, (where, extra)
    else:
        assert all(k.startswith(PREFIX) or k in _ALLOWED_EXTRA for k in extra), (where, extra)


_hypothesis = settings(
    max_examples=int(os.environ.get("COPIES_EXAMPLES", "20")),
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],  # a broker round per example
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class TestEveryHop:
    @pytest.mark.fast_path
    @_hypothesis
    @given(batch=st.lists(pika_properties(), min_size=2, max_size=8))
    @example(batch=[ISSUE_EXAMPLE, dict.fromkeys(PROPERTIES)])
    def test_pika_properties_on_every_copy(
        self, broker_url: str, batch: list[dict[str, Any]]
    ) -> None:
        """Generated pika properties, compared field by field on the first delivery, the
        retry copy, the DLQ copy and the ``dlq move`` copy."""
        hops = asyncio.run(run_hops(batch))
        for sent, seen in zip(batch, hops.values(), strict=True):
            assert_kept(sent, seen)

    async def test_the_issues_message_keeps_its_properties(self, broker_url: str) -> None:
        """Defect 1: gzip, priority 9, timestamp, type, user id and app id on every copy
        (they came back with only message id, content type, correlation id, reply-to)."""
        (hops,) = (await run_hops([ISSUE_EXAMPLE])).values()
        for hop in ("retry", "dlq", "moved"):
            got = hops[hop]
            assert got["content_encoding"] == "gzip", hop
            assert (got["priority"], got["message_type"], got["app_id"]) == (
                9,
                "order.created",
                "billing",
            ), hop
            assert seconds_of(got["timestamp"]) == 1_767_225_600, hop
            assert got["user_id"] == "guest", hop
            assert got["delivery_mode"] == 2, hop
        assert_kept(ISSUE_EXAMPLE, hops)


@contextlib.asynccontextmanager
async def work_queue() -> AsyncIterator[str]:
    """A declared queue set (work, retry, DLQ), deleted afterwards."""
    topology = QueueTopology(f"test-copies-{uuid.uuid4().hex[:10]}")
    await declare_topology(URL, topology)
    try:
        yield topology.queue
    finally:
        connection = await aio_pika.connect(URL)
        async with connection:
            await delete_topology(await connection.channel(), topology)


async def consume(queue: str, count: int) -> dict[bytes, dict[str, Any]]:
    """What the consumer's decoder reads of ``count`` messages (each acked), by body."""
    seen: dict[bytes, dict[str, Any]] = {}
    consumer = ReliableConsumer(URL, registry=CollectorRegistry())

    @consumer.handler(queue)
    async def handler(body: bytes, delivery: Delivery) -> None:
        seen[body] = _ours(delivery)

    async with consumer:
        await wait_until(lambda: len(seen) == count, what=f"{count} messages", timeout=30)
    return seen


class TestTimestamps:
    @pytest.mark.fast_path
    async def test_after_2106_both_ways(self, broker_url: str) -> None:
        """Defect 2: datetime(2200, 1, 1), sent by pika or by us, as the property and as a
        ``T`` header value, reads as 2200 (it read as 1970-03-26 00:08:38.4)."""
        when = dt.datetime(2200, 1, 1, tzinfo=dt.UTC)
        seconds = 7_258_118_400
        headers = {"t": when, "a": [when], "f": {"t": when}}
        async with work_queue() as queue:
            await asyncio.to_thread(
                pika_client.publish,
                URL,
                queue,
                [(b"pika", {"timestamp": seconds, "headers": headers})],
            )
            async with ReliablePublisher(URL, registry=CollectorRegistry()) as publisher:
                await publisher.publish(b"ours", routing_key=queue, timestamp=when, headers=headers)
            by_pika = await asyncio.to_thread(pika_client.get_all, URL, queue, requeue=True)
            assert [(m.properties["timestamp"], m.properties["headers"]) for m in by_pika] == [
                (seconds, headers)
            ] * 2
            seen = await consume(queue, 2)
        for body in (b"pika", b"ours"):
            assert seen[body]["timestamp"] == when, body
            assert seen[body]["headers"] == headers, body

    @pytest.mark.fast_path
    async def test_a_timestamp_past_9999_is_an_invalid_properties_dead_letter(
        self, broker_url: str
    ) -> None:
        """A timestamp in milliseconds (year 57,000) is no silent wrong date: the handler
        does not run, the message is dead-lettered as ``invalid_properties`` naming the
        field (pamqp read it as milliseconds: a 2026 date, handled)."""
        millis = 1_767_225_600_000
        queue_topology = QueueTopology(f"test-copies-{uuid.uuid4().hex[:10]}")
        consumer = ReliableConsumer(URL, registry=CollectorRegistry(), dedup=None)
        ran: list[bytes] = []

        @consumer.handler(queue_topology.queue)
        async def handler(body: bytes) -> None:
            ran.append(body)

        try:
            async with consumer:
                await asyncio.to_thread(
                    pika_client.publish,
                    URL,
                    queue_topology.queue,
                    [
                        (b"property", {"timestamp": millis, "message_id": "p"}),
                        (b"header", {"headers": {"t": _raw_seconds(millis)}, "message_id": "h"}),
                    ],
                )
                await wait_until(
                    lambda: consumer.stats().dead_lettered == 2, what="two dead letters", timeout=30
                )
            dead = await asyncio.to_thread(
                pika_client.get_all, URL, queue_topology.dead_letter_queue
            )
        finally:
            connection = await aio_pika.connect(URL)
            async with connection:
                await delete_topology(await connection.channel(), queue_topology)
        assert ran == []
        reasons = {
            m.body: (
                m.properties["headers"]["x-reliable-mq-reason"],
                m.properties["headers"]["x-reliable-mq-error-message"],
            )
            for m in dead
        }
        assert reasons == {
            b"property": (
                "invalid_properties",
                "not decodable: timestamp: year 57971 is out of range",
            ),
            b"header": (
                "invalid_properties",
                "not decodable: header['t']: year 57971 is out of range",
            ),
        }


class _RawSeconds(dt.datetime):
    """A datetime pika writes as any 64-bit count of seconds: pika encodes a ``T`` value
    as ``calendar.timegm(value.utctimetuple())``, which only adds up the fields."""

    seconds = 0

    def utctimetuple(self) -> Any:
        return (1970, 1, 1, 0, 0, self.seconds, 0, 1, 0)


def _raw_seconds(seconds: int) -> dt.datetime:
    value = _RawSeconds(1970, 1, 1, tzinfo=dt.UTC)
    value.seconds = seconds
    return value


@pytest.mark.private_broker
class TestForeignUserId:
    async def test_moved_to_a_header_never_refused(self, private_broker: Any) -> None:
        """A copy published as another user than its user_id names would be refused (406):
        the user_id moves to x-reliable-mq-original-user-id; one naming the publishing
        user is kept. On a private node with a second user, ``bob``, who consumes."""
        node = private_broker
        await asyncio.to_thread(node.rabbitmqctl, "add_user", "bob", "bob-secret")
        await asyncio.to_thread(
            node.rabbitmqctl, "set_permissions", "-p", "/", "bob", ".*", ".*", ".*"
        )
        bob = node.url.replace("guest:guest@", "bob:bob-secret@")
        sent = [{"user_id": "guest", "app_id": "a"}, {"user_id": "bob", "app_id": "b"}]
        hops = await run_hops(sent, url=node.url, consumer_url=bob, publish_urls=[node.url, bob])
        by_guest, by_bob = hops.values()

        def user(hop: dict[str, Any]) -> tuple[Any, Any]:
            return hop["user_id"], (hop["headers"] or {}).get(ORIGINAL_USER_ID_HEADER)

        # bob's consumer copies (retry, DLQ); the DLQ move runs as guest.
        assert [user(by_guest[hop]) for hop in HOPS] == [
            ("guest", None),
            (None, "guest"),
            (None, "guest"),
            (None, "guest"),
        ]
        assert [user(by_bob[hop]) for hop in HOPS] == [
            ("bob", None),
            ("bob", None),
            ("bob", None),
            (None, "bob"),
        ]
        for hops_of, app in ((by_guest, "a"), (by_bob, "b")):
            assert all(hops_of[hop]["app_id"] == app for hop in HOPS)
