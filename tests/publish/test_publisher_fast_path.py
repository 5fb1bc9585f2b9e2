"""The publish fast path (issue 12), measured against the real broker.

What ``publish_many()`` promises beyond its outcomes: no asyncio Task per
message, many messages per socket write, confirms settled by ranges of
delivery tags, and none of that traded for a guarantee (cuts lose nothing).
The path before issue 12 (one Task and one socket write per message, seen at
commit 74b721f) fails the first two classes by three orders of magnitude.
"""

from __future__ import annotations

import asyncio
import collections
from asyncio import selector_events
from collections.abc import Coroutine, Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from reliable_mq import Message, PublishError, ReliablePublisher
from reliable_mq.testing import LossOracle, TCPProxy
from tests.conftest import proxied_url
from tests.publish.test_publisher import conn, fast_settings
from tests.support.amqp import drain_queue
from tests.support.waiting import wait_until

pytestmark = pytest.mark.rabbitmq

MESSAGES = 5000
BODY = b"x" * 256


def _messages(queue: str, count: int, prefix: str = "") -> Iterator[Message]:
    for index in range(count):
        yield Message(BODY, routing_key=queue, message_id=f"{prefix}{index}" if prefix else None)


class _TaskCounter:
    """A loop task factory that counts the Tasks created while it is installed."""

    def __init__(self) -> None:
        self.names: collections.Counter[str] = collections.Counter()

    @property
    def created(self) -> int:
        return sum(self.names.values())

    def __call__(
        self, loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], **kwargs: Any
    ) -> asyncio.Task[Any]:
        self.names[getattr(coro, "__qualname__", type(coro).__name__)] += 1
        return asyncio.Task(coro, loop=loop, **kwargs)


class _WriteCounter:
    """Counts ``transport.write()`` calls (and bytes) of client sockets connected to one port.

    Patched on asyncio's selector socket transport, the class every plain
    asyncio TCP connection uses, so it sees aiormq's writes without reaching
    into aiormq.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, port: int) -> None:
        self.calls = 0
        self.bytes = 0
        original = selector_events._SelectorSocketTransport.write
        counter = self

        def write(transport: Any, data: Any) -> None:
            peer = transport.get_extra_info("peername")
            if peer is not None and peer[1] == port:
                counter.calls += 1
                counter.bytes += len(data)
            original(transport, data)

        monkeypatch.setattr(selector_events._SelectorSocketTransport, "write", write)


@pytest.fixture(name="proxy_url")
def _proxy_url(proxy: TCPProxy) -> str:
    return proxied_url(proxy)


class TestNoTaskPerMessage:
    async def test_publish_many_creates_a_constant_number_of_tasks(
        self, broker_url: str, queue: str
    ) -> None:
        """5,000 messages through publish_many() start at most a handful of Tasks."""
        loop = asyncio.get_running_loop()
        counter = _TaskCounter()
        async with ReliablePublisher(
            conn(broker_url),
            settings=fast_settings(max_in_flight=1000),
            registry=CollectorRegistry(),
        ) as publisher:
            await publisher.publish(b"warm", routing_key=queue)  # exchange probe, channel open
            previous = loop.get_task_factory()
            loop.set_task_factory(counter)
            try:
                result = await publisher.publish_many(_messages(queue, MESSAGES))
            finally:
                loop.set_task_factory(previous)
        assert result.confirmed == MESSAGES
        # A Task per message would be >= 5,000; the fast path needs none at all.
        assert counter.created <= 10, counter.names.most_common(5)


class TestCoalescedWrites:
    async def test_many_messages_per_socket_write(
        self, proxy: TCPProxy, proxy_url: str, queue: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """5,000 messages leave in at most 1,000 socket writes; the proxy sees the same bytes."""
        writes = _WriteCounter(monkeypatch, proxy.port)
        async with ReliablePublisher(
            conn(proxy_url),
            settings=fast_settings(max_in_flight=1000),
            registry=CollectorRegistry(),
        ) as publisher:
            await publisher.publish(b"warm", routing_key=queue)
            await wait_until(lambda: proxy.traffic.to_upstream_bytes == writes.bytes)
            calls, sent, forwarded = writes.calls, writes.bytes, proxy.traffic.to_upstream_bytes
            result = await publisher.publish_many(_messages(queue, MESSAGES))
            calls, sent = writes.calls - calls, writes.bytes - sent
            # every byte written is seen by the proxy: the counter misses no write path
            await wait_until(lambda: proxy.traffic.to_upstream_bytes - forwarded == sent)
        assert result.confirmed == MESSAGES
        assert sent >= MESSAGES * len(BODY)
        assert 1 <= calls <= MESSAGES // 5, f"{calls} writes for {MESSAGES} messages"


class TestConfirmRanges:
    async def test_multiple_acks_settle_many_messages_at_once(
        self, broker_url: str, queue: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The broker's multiple=true acks settle ranges: far fewer settle calls than messages."""
        settled: list[int] = []
        async with ReliablePublisher(
            conn(broker_url),
            settings=fast_settings(max_in_flight=1000),
            registry=CollectorRegistry(),
        ) as publisher:
            engine = publisher._engine
            confirmed = engine.confirmed

            def counting(generation: Any, items: list[Any], ack: bool) -> None:
                settled.append(len(items))
                confirmed(generation, items, ack)

            monkeypatch.setattr(engine, "confirmed", counting)
            result = await publisher.publish_many(_messages(queue, MESSAGES))
        assert result.confirmed == MESSAGES
        assert sum(settled) == MESSAGES
        assert max(settled) > 1
        assert len(settled) <= MESSAGES // 5, f"{len(settled)} settle calls"


class TestCutsLoseNothing:
    async def test_20k_messages_two_cuts(
        self, broker_url: str, proxy: TCPProxy, proxy_url: str, queue: str
    ) -> None:
        """20,000 through publish_many(), the link cut twice: no loss, every outcome typed."""
        total = 20_000
        oracle = LossOracle()
        ids = [f"cut-{index}" for index in range(total)]
        for message_id in ids:
            oracle.attempted(message_id)
        async with ReliablePublisher(
            conn(proxy_url),
            settings=fast_settings(max_in_flight=1000),
            registry=CollectorRegistry(),
        ) as publisher:
            task = asyncio.ensure_future(
                publisher.publish_many(_messages(queue, total, "cut-"), raise_on_error=False)
            )
            for threshold in (total // 5, total // 2):
                await wait_until(
                    lambda t=threshold: publisher.stats().confirmed >= t or task.done(), timeout=60
                )
                assert not task.done(), "finished before the cut"
                generation = publisher.stats().channel_generation
                assert await proxy.cut() == 1
                await wait_until(
                    lambda g=generation: publisher.stats().channel_generation > g, timeout=30
                )
            result = await asyncio.wait_for(task, 120)
        failed = {failure.message_id for failure in result.failures}
        assert all(isinstance(failure.error, PublishError) for failure in result.failures)
        assert result.taken == total
        assert result.confirmed + len(result.failures) == total
        for message_id in ids:
            if message_id in failed:
                oracle.failed(message_id)
            else:
                oracle.confirmed(message_id)
        oracle.delivered_many(m.message_id or "" for m in await drain_queue(broker_url, queue))
        report = oracle.report()
        assert not report.lost and not report.unexpected and not report.unresolved, report.summary()
        assert result.republished > 0, "the cuts caught nothing in flight"
        assert proxy.connections_total >= 3
