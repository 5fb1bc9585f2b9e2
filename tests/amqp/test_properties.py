"""Every property a publisher sends, as another client (pika) reads it (issue 19, defects 3, 4).

Through every way a property is handed over: ``publish()``, ``enqueue()``,
``publish_many()`` with `Message`, and the `BlockingPublisher` (``publish``,
``submit``, ``publish_many``). The outbox's ``add()`` is tested with the relay
(tests/outbox/test_relay.py).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from reliable_mq import Message, PublishRefused, ReliablePublisher
from reliable_mq.sync import BlockingPublisher
from tests.support import pika_client

pytestmark = pytest.mark.rabbitmq

URL = os.environ.get("RELIABLE_MQ_TEST_URL", "amqp://guest:guest@127.0.0.1:5672/")

OPTIONS: dict[str, Any] = {
    "content_type": "",  # empty stays empty: not the inferred application/octet-stream
    "content_encoding": "gzip",
    "correlation_id": "",
    "reply_to": "replies",
    "expiration": 64.002,
    "priority": 9,
    "message_type": "order.created",
    "user_id": "guest",
    "app_id": "",
    "timestamp": dt.datetime(2200, 1, 1),
    "headers": {"h": ""},
    "persistent": False,
}
"""Every option a message takes, empty strings among them."""

READ = {
    "content_type": "",
    "content_encoding": "gzip",
    "correlation_id": "",
    "reply_to": "replies",
    "expiration": "64002",
    "priority": 9,
    "message_type": "order.created",
    "user_id": "guest",
    "app_id": "",
    "timestamp": 7_258_118_400,
    "headers": {"h": ""},
    "delivery_mode": 1,
    "cluster_id": None,
}
"""What pika reads of `OPTIONS`: each property as given (``message_id`` aside)."""


def _check(received: list[pika_client.Received], ids: list[str]) -> None:
    assert [m.properties["message_id"] for m in received] == ids
    for message in received:
        got = {name: message.properties[name] for name in READ}
        assert got == READ, message.body


class TestEveryOption:
    async def test_async_publisher(self, broker_url: str, queue: str) -> None:
        """Defect 4: content_encoding and user_id are options (they were "unknown message
        option(s)"); an empty content type stays empty; publish, enqueue, publish_many."""
        async with ReliablePublisher(URL, registry=CollectorRegistry()) as publisher:
            await publisher.publish(b"1", routing_key=queue, message_id="a", **OPTIONS)
            await (await publisher.enqueue(b"2", routing_key=queue, message_id="b", **OPTIONS))
            await publisher.publish_many(
                [Message(b"3", routing_key=queue, message_id="c", **OPTIONS)]
            )
        received = await asyncio.to_thread(pika_client.get_all, URL, queue)
        _check(received, ["a", "b", "c"])

    async def test_blocking_publisher(self, broker_url: str, queue: str) -> None:
        """The same options through the BlockingPublisher's publish, submit and publish_many."""

        def publish() -> None:
            with BlockingPublisher(URL, registry=CollectorRegistry()) as publisher:
                publisher.publish(b"1", routing_key=queue, message_id="a", **OPTIONS)
                publisher.submit(b"2", routing_key=queue, message_id="b", **OPTIONS).result(30)
                publisher.publish_many(
                    [Message(b"3", routing_key=queue, message_id="c", **OPTIONS)]
                )

        await asyncio.to_thread(publish)
        received = await asyncio.to_thread(pika_client.get_all, URL, queue)
        _check(received, ["a", "b", "c"])

    async def test_a_foreign_user_id_is_refused_by_name(self, broker_url: str, queue: str) -> None:
        """RabbitMQ refuses a user_id other than the connection's user (406): a typed
        PublishRefused naming it, and the publisher goes on with the next message."""
        async with ReliablePublisher(URL, registry=CollectorRegistry()) as publisher:
            assert publisher.user == "guest"
            with pytest.raises(PublishRefused, match="user_id property set to 'bob'"):
                await publisher.publish(b"x", routing_key=queue, user_id="bob")
            await publisher.publish(b"y", routing_key=queue, user_id="guest", message_id="ok")
        received = await asyncio.to_thread(pika_client.get_all, URL, queue)
        assert [(m.body, m.properties["user_id"]) for m in received] == [(b"y", "guest")]


class TestExpiration:
    async def test_milliseconds_are_rounded_not_truncated(
        self, broker_url: str, queue: str
    ) -> None:
        """Defect 3: every value of 10 to 99.999 s that truncation got wrong (64.002 went
        out as "64001") arrives as its own milliseconds."""
        wrong = [ms for ms in range(10_000, 100_000) if int(ms / 1000 * 1000) != ms]
        assert 600 < len(wrong) < 741  # the 741 of 0-99,999 ms, but those under 10 s
        async with ReliablePublisher(URL, registry=CollectorRegistry()) as publisher:
            await publisher.publish_many(
                Message(b"x", routing_key=queue, message_id=str(ms), expiration=ms / 1000)
                for ms in wrong
            )
        received = await asyncio.to_thread(pika_client.get_all, URL, queue)
        got = {m.properties["message_id"]: m.properties["expiration"] for m in received}
        assert got == {str(ms): str(ms) for ms in wrong}
