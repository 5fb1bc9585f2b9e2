"""Hostile input on the publisher (issue 10): refused locally, refused alone, never a loop.

Each class reproduces one defect of the issue against the real broker. The
shared broker is only published to; tests that change broker settings use the
private node.
"""

from __future__ import annotations

import asyncio
import datetime
import math
import re
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import aio_pika
import pytest
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, field_serializer

from reliable_mq import (
    ExchangeNotFound,
    InvalidBody,
    InvalidMessage,
    Message,
    PublishBatchError,
    PublishError,
    PublisherSettings,
    PublishOutcomeUnknown,
    PublishRefused,
    PublishResult,
    PublishUnavailable,
    PublishUnroutable,
    ReliablePublisher,
)
from reliable_mq._publish import exchanges as _exchanges
from tests.publish.test_publisher import conn, fast_settings
from tests.support.amqp import drain_queue
from tests.support.waiting import wait_until

pytestmark = pytest.mark.rabbitmq


class _ExplodingModel(BaseModel):
    n: int

    @field_serializer("n")
    def _n(self, value: int) -> int:
        raise RuntimeError("serializer exploded")


class _BadList(list[int]):
    def __iter__(self) -> Any:
        raise LookupError("no iteration")


class _BadHeaders(Mapping[str, Any]):
    def __getitem__(self, key: str) -> Any:
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        raise RuntimeError("headers exploded")

    def __len__(self) -> int:
        return 1


class _BadTime(datetime.datetime):
    """A datetime whose own code raises when its seconds are computed."""

    def timestamp(self) -> float:
        return 1 / 0

    def __sub__(self, other: Any) -> Any:  # the encoder subtracts the epoch: exact seconds
        return 1 / 0


def _generations(publisher: ReliablePublisher) -> tuple[int, int]:
    """(connections opened, channels opened) by this publisher so far."""
    return publisher._supervisor.generation, publisher.stats().channel_generation


class TestRefusedBeforeSending:
    """Issue 10 items 2 and 5: what the client can check is checked, and nothing is sent."""

    @pytest.mark.parametrize(
        ("kwargs", "match"),
        [
            ({"headers": {"x": math.nan}}, "finite"),
            ({"headers": {"big": "x" * 200_000}}, "frame_max"),
            ({"expiration": -1}, "expiration"),
            ({"timeout": math.nan}, "timeout"),
            ({"timeout": 0}, "timeout"),
            ({"message_id": 42}, "message_id must be a non-empty str, not int"),
            ({"routing_key": 7}, "routing_key must be a str, not int"),
            ({"headers": {3: "x"}}, "names must be str"),
            ({"headers": {"k" * 200: 1}}, "limit is 128"),
            ({"priority": 300}, "priority"),
            ({"persistent": "yes"}, "persistent must be a bool"),
            ({"nonsense": 1}, "unknown message option"),
            ({"routing_key": "q\ud800"}, "routing_key is not encodable as UTF-8"),
            ({"message_id": "m\udfff"}, "message_id is not encodable as UTF-8"),
            ({"correlation_id": "\ud800"}, "correlation_id is not encodable"),
            ({"headers": {"k\ud800": 1}}, "headers name .* not encodable"),
            ({"headers": {"k": ["ok", "v\udc00"]}}, r"headers\['k'\]\[1\] is not encodable"),
        ],
    )
    async def test_invalid_options_raise_and_send_nothing(
        self, broker_url: str, queue: str, kwargs: dict[str, Any], match: str
    ) -> None:
        """InvalidMessage names the field; no frame reaches the broker; no reconnect."""
        args: dict[str, Any] = {"routing_key": queue, **kwargs}
        async with ReliablePublisher(conn(broker_url), registry=CollectorRegistry()) as publisher:
            with pytest.raises(InvalidMessage, match=match):
                await publisher.publish(b"x", **args)
            assert _generations(publisher) == (1, 1)
            assert publisher.in_flight == 0
            await publisher.publish(b"after", routing_key=queue)
            assert _generations(publisher) == (1, 1)
        # Settled: the one publisher is closed, and a frame of the refused message would
        # have gone out on its channel before "after", confirmed before it.
        drained = await drain_queue(broker_url, queue, settled=True)
        assert [m.body for m in drained] == [b"after"]

    async def test_deeply_nested_body_is_invalid_not_a_crash(
        self, broker_url: str, queue: str
    ) -> None:
        """A body nested past the recursion limit is InvalidBody, raised before sending."""
        nested: list[Any] = []
        for _ in range(100_000):
            nested = [nested]
        async with ReliablePublisher(conn(broker_url), registry=CollectorRegistry()) as publisher:
            with pytest.raises(InvalidMessage, match="nested too deeply"):
                await publisher.publish(nested, routing_key=queue)


class TestRefusedByTheBroker:
    """Issue 10 item 2: a message the broker refuses after it was written fails alone."""

    async def test_internal_exchange_refusal_fails_alone_and_is_cached(
        self, broker_url: str, amqp: aio_pika.abc.AbstractChannel, queue: str
    ) -> None:
        """A 403 names the exchange: its messages fail with PublishRefused, the rest confirm,
        and later publishes to it fail locally instead of closing the channel again."""
        internal = f"internal-{uuid.uuid4().hex[:8]}"
        await amqp.declare_exchange(internal, aio_pika.ExchangeType.FANOUT, internal=True)
        try:
            async with ReliablePublisher(
                conn(broker_url), settings=fast_settings(), registry=CollectorRegistry()
            ) as publisher:
                good = [publisher.publish(b"g", routing_key=queue) for _ in range(300)]
                bad = publisher.publish(b"b", routing_key="", exchange=internal)
                outcomes = await asyncio.gather(*good, bad, return_exceptions=True)
                refused = outcomes[-1]
                assert isinstance(refused, PublishRefused), refused
                assert refused.reply_code == 403
                assert "internal exchange" in refused.reply_text
                assert all(isinstance(o, PublishResult) for o in outcomes[:-1])
                channels = publisher.stats().channel_generation
                started = time.monotonic()
                for _ in range(20):
                    with pytest.raises(PublishRefused):
                        await publisher.publish(b"b", routing_key="", exchange=internal)
                assert time.monotonic() - started < 2
                assert publisher.stats().channel_generation == channels
                assert publisher._supervisor.generation == 1
        finally:
            await amqp.exchange_delete(internal)


class TestMissingExchange:
    """Issue 10 items 3 and 4: a missing exchange fails only the publishes to it."""

    async def test_collateral_of_a_bad_publish_every_50ms(
        self, broker_url: str, amqp: aio_pika.abc.AbstractChannel, queue: str
    ) -> None:
        """10,000 good messages next to a publish to a missing exchange every 50 ms: one
        connection, one channel, no duplicates, and not much slower than alone."""
        missing = f"missing-{uuid.uuid4().hex[:8]}"
        messages = [Message(b"x" * 256, routing_key=queue) for _ in range(10_000)]

        async def stream(publisher: ReliablePublisher) -> float:
            started = time.perf_counter()
            result = await publisher.publish_many(messages)
            assert result.confirmed == len(messages)
            return time.perf_counter() - started

        async with ReliablePublisher(conn(broker_url), registry=CollectorRegistry()) as publisher:
            alone = await stream(publisher)
        await (await amqp.get_queue(queue)).purge()  # all 10,000 confirmed: empty it at once

        refusals = 0
        async with ReliablePublisher(conn(broker_url), registry=CollectorRegistry()) as publisher:
            done = asyncio.Event()

            async def bad_loop() -> None:
                nonlocal refusals
                while not done.is_set():
                    with pytest.raises(ExchangeNotFound):
                        await publisher.publish(b"b", routing_key="k", exchange=missing)
                    refusals += 1
                    await asyncio.sleep(0.05)

            bad = asyncio.ensure_future(bad_loop())
            await asyncio.sleep(0.1)
            together = await stream(publisher)
            done.set()
            await bad
            connections, channels = _generations(publisher)
        delivered = await drain_queue(broker_url, queue)
        ids = [m.message_id for m in delivered]
        figure = (
            f"alone {alone:.2f}s, with a bad publish every 50 ms {together:.2f}s "
            f"(ratio {together / alone:.2f}), {refusals} refusals, {connections} connection(s), "
            f"{channels} channel(s), {len(ids) - len(set(ids))} duplicate copies"
        )
        assert refusals >= 2, figure
        assert (connections, channels) == (1, 1), figure
        assert len(ids) == len(set(ids)) == len(messages), figure
        assert together <= 2.5 * alone + 1.0, figure  # target 1.5x: bench/collateral.py

    async def test_missing_exchange_is_probed_once_per_ttl(
        self,
        broker_url: str,
        amqp: aio_pika.abc.AbstractChannel,
        queue: str,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """Concurrent publishes to a missing exchange share one probe; later ones within
        MISSING_TTL fail locally (no probe channel each); an exchange declared meanwhile
        is found once the TTL has passed."""
        monkeypatch.setattr(_exchanges, "MISSING_TTL", 0.5)
        missing = f"missing-{uuid.uuid4().hex[:8]}"
        async with ReliablePublisher(conn(broker_url), registry=CollectorRegistry()) as publisher:
            probes = publisher._engine._exchanges
            outcomes = await asyncio.gather(
                *(publisher.publish(b"b", routing_key="", exchange=missing) for _ in range(50)),
                return_exceptions=True,
            )
            assert all(isinstance(o, ExchangeNotFound) for o in outcomes), outcomes
            assert probes.channels_opened == 1  # one probe for all 50
            started = time.monotonic()
            for _ in range(20):
                with pytest.raises(ExchangeNotFound):
                    await publisher.publish(b"b", routing_key="", exchange=missing)
            assert probes.channels_opened == 1, "a publish within the TTL probed again"
            assert time.monotonic() - started < 0.5
            declared = await amqp.declare_exchange(missing, aio_pika.ExchangeType.FANOUT)
            try:
                await (await amqp.get_queue(queue)).bind(declared)
                await asyncio.sleep(0.6)  # the cached 404 has expired
                result = await publisher.publish(b"now", routing_key="", exchange=missing)
                assert result.attempts == 1
                assert probes.channels_opened == 2
                assert _generations(publisher) == (1, 1)
            finally:
                await amqp.exchange_delete(missing)
        assert [m.body for m in await drain_queue(broker_url, queue, settled=True)] == [b"now"]

    @pytest.mark.fast_path
    async def test_exchange_deleted_mid_stream(
        self, broker_url: str, amqp: aio_pika.abc.AbstractChannel, queue: str
    ) -> None:
        """Messages that reached the queue are never reported as ExchangeNotFound."""
        exchange = f"deleted-{uuid.uuid4().hex[:8]}"
        declared = await amqp.declare_exchange(exchange, aio_pika.ExchangeType.FANOUT)
        bound = await amqp.get_queue(queue)
        await bound.bind(declared)
        settings = fast_settings(max_in_flight=200)
        outcomes: dict[str, PublishResult | BaseException] = {}
        async with ReliablePublisher(
            conn(broker_url), settings=settings, registry=CollectorRegistry()
        ) as publisher:

            async def one(index: int) -> None:
                message_id = f"m{index}"
                try:
                    outcomes[message_id] = await publisher.publish(
                        b"x", routing_key="", exchange=exchange, message_id=message_id
                    )
                except PublishError as exc:
                    outcomes[message_id] = exc

            tasks = [asyncio.ensure_future(one(i)) for i in range(4000)]
            await wait_until(lambda: publisher.stats().confirmed >= 500, timeout=30)
            await amqp.exchange_delete(exchange)
            await asyncio.gather(*tasks)
            assert publisher._supervisor.generation == 1
        delivered = {m.message_id for m in await drain_queue(broker_url, queue, settled=True)}
        kinds = {type(o).__name__ for o in outcomes.values()}
        # PublishUnroutable is the truth for a message the broker routed while the
        # deletion had removed the exchange's bindings but not yet the exchange
        # (seen once in CI, 3.10.8): it came back in a basic.return, so it is in no queue.
        allowed = {
            "PublishResult",
            "ExchangeNotFound",
            "PublishOutcomeUnknown",
            "PublishUnroutable",
        }
        assert kinds <= allowed, kinds
        not_found = {k for k, o in outcomes.items() if isinstance(o, ExchangeNotFound)}
        assert not_found, "the deletion came too late to test anything"
        assert not (not_found & delivered), "a delivered message was reported ExchangeNotFound"
        returned = {k for k, o in outcomes.items() if isinstance(o, PublishUnroutable)}
        assert not (returned & delivered), "a delivered message was reported PublishUnroutable"
        confirmed = {k for k, o in outcomes.items() if isinstance(o, PublishResult)}
        assert confirmed <= delivered

    @pytest.mark.fast_path
    async def test_deleting_one_exchange_spares_the_other(
        self, broker_url: str, amqp: aio_pika.abc.AbstractChannel, queue: str
    ) -> None:
        """Two exchanges streamed to at once; A is deleted mid-stream. The 404 closes the
        channel both share: every B message is still confirmed (re-sent, never reported
        ExchangeNotFound or outcome unknown) and in B's queue; A's end confirmed,
        ExchangeNotFound or PublishOutcomeUnknown; the connection is never closed."""
        tag = uuid.uuid4().hex[:8]
        exchange_a, exchange_b = f"gone-{tag}", f"kept-{tag}"
        queue_a = (await amqp.declare_queue(f"test-gone-{tag}", durable=True)).name
        try:
            for exchange, target in ((exchange_a, queue_a), (exchange_b, queue)):
                declared = await amqp.declare_exchange(exchange, aio_pika.ExchangeType.FANOUT)
                await (await amqp.get_queue(target)).bind(declared)
            registry = CollectorRegistry()
            outcomes: dict[str, dict[str, PublishResult | BaseException]] = {
                exchange_a: {},
                exchange_b: {},
            }
            async with ReliablePublisher(
                conn(broker_url), settings=fast_settings(max_in_flight=400), registry=registry
            ) as publisher:

                async def one(exchange: str, index: int) -> None:
                    message_id = f"{exchange}-{index}"
                    try:
                        outcome: PublishResult | BaseException = await publisher.publish(
                            b"x", routing_key="", exchange=exchange, message_id=message_id
                        )
                    except PublishError as exc:
                        outcome = exc
                    outcomes[exchange][message_id] = outcome

                # Both exchanges probed first: then the stream interleaves them on the channel.
                await asyncio.gather(one(exchange_a, -1), one(exchange_b, -1))
                tasks = [
                    asyncio.ensure_future(one(exchange, index))
                    for index in range(3000)
                    for exchange in (exchange_a, exchange_b)
                ]
                await wait_until(lambda: publisher.stats().confirmed >= 600, timeout=30)
                await amqp.exchange_delete(exchange_a)
                await asyncio.gather(*tasks)
                connections, channels = _generations(publisher)
            nearby = registry.get_sample_value(
                "reliable_mq_republished_messages_total",
                {"exchange": exchange_b, "reason": "refused_nearby"},
            )
            in_b = [m.message_id for m in await drain_queue(broker_url, queue)]
            in_a = {m.message_id for m in await drain_queue(broker_url, queue_a)}
        finally:
            await amqp.exchange_delete(exchange_b)
            await amqp.exchange_delete(exchange_a)
            await amqp.queue_delete(queue_a)
        kinds_b = {type(o).__name__ for o in outcomes[exchange_b].values()}
        assert kinds_b == {"PublishResult"}, kinds_b
        assert set(in_b) == set(outcomes[exchange_b])
        kinds_a = {type(o).__name__ for o in outcomes[exchange_a].values()}
        # PublishUnroutable for A, as in test_exchange_deleted_mid_stream: routed while the
        # deletion had removed A's binding but not yet A (seen in CI, 3.10.8).
        allowed_a = {
            "PublishResult",
            "ExchangeNotFound",
            "PublishOutcomeUnknown",
            "PublishUnroutable",
        }
        assert kinds_a <= allowed_a, kinds_a
        not_found = {k for k, o in outcomes[exchange_a].items() if isinstance(o, ExchangeNotFound)}
        assert not_found, "the deletion came too late to test anything"
        assert not (not_found & in_a), "a delivered message was reported ExchangeNotFound"
        returned_a = {
            k for k, o in outcomes[exchange_a].items() if isinstance(o, PublishUnroutable)
        }
        assert not (returned_a & in_a), "a delivered message was reported PublishUnroutable"
        confirmed_a = {k for k, o in outcomes[exchange_a].items() if isinstance(o, PublishResult)}
        assert confirmed_a <= in_a
        assert connections == 1, "the 404 must close the channel only, never the connection"
        assert channels >= 2  # the 404 closed the shared channel: B's were re-sent on a new one
        assert nearby, "no B message was in flight when A's 404 closed the channel"


class TestBatches:
    async def test_publish_many_reports_each_failure_by_index(
        self, broker_url: str, queue: str
    ) -> None:
        """Bad messages in a batch fail alone, by index; the others are confirmed."""
        missing = f"missing-{uuid.uuid4().hex[:8]}"
        messages: list[Any] = [Message(b"ok", routing_key=queue) for _ in range(1000)]
        messages[10] = Message(b"x", routing_key=queue, headers={"n": math.nan})
        messages[20] = Message(b"x", routing_key=f"nowhere-{uuid.uuid4().hex}")
        messages[30] = Message(b"x", routing_key="k", exchange=missing)
        messages[40] = "not a message"
        async with ReliablePublisher(conn(broker_url), registry=CollectorRegistry()) as publisher:
            with pytest.raises(PublishBatchError) as caught:
                await publisher.publish_many(messages)
            result = caught.value.result
            assert result.taken == 1000 and result.confirmed == 996
            kinds = [(f.index, type(f.error).__name__) for f in result.failures]
            assert kinds == [
                (10, "InvalidMessage"),
                (20, "PublishUnroutable"),
                (30, "ExchangeNotFound"),
                (40, "InvalidMessage"),
            ]
            quiet = await publisher.publish_many(messages[:5], raise_on_error=False)
            assert quiet.ok and quiet.confirmed == 5
        assert len(await drain_queue(broker_url, queue)) == 1001

    async def test_lone_surrogates_fail_alone(self, broker_url: str, queue: str) -> None:
        """Messages with a lone surrogate anywhere fail alone with InvalidMessage naming the
        field (InvalidBody for the body); the good ones around them are confirmed."""
        bad: dict[int, tuple[dict[str, Any], str]] = {
            3: ({"routing_key": "q\ud800"}, "routing_key"),
            7: ({"message_id": "id-\udfff"}, "message_id"),
            11: ({"headers": {"\ud800": 1}}, "headers name"),
            13: ({"headers": {"k": "v\ud800"}}, r"headers\['k'\]"),
            17: ({"app_id": "\udc80"}, "app_id"),
            19: ({"body": "text \ud800"}, "body text"),
        }
        messages = []
        for index in range(500):
            options, _ = bad.get(index, ({}, ""))
            fields: dict[str, Any] = {"body": f"ok {index}", "routing_key": queue, **options}
            messages.append(Message(**fields))
        async with ReliablePublisher(conn(broker_url), registry=CollectorRegistry()) as publisher:
            result = await publisher.publish_many(messages, raise_on_error=False)
            assert (result.taken, result.confirmed) == (500, 500 - len(bad))
            assert [f.index for f in result.failures] == sorted(bad)
            for failure in result.failures:
                assert isinstance(failure.error, InvalidMessage), failure.error
                assert re.match(bad[failure.index][1], str(failure.error)), failure.error
            for options, field in bad.values():
                fields = {"body": b"x", "routing_key": queue, **options}
                body = fields.pop("body")
                with pytest.raises(InvalidMessage, match=field):
                    await publisher.publish(body, **fields)
            assert _generations(publisher) == (1, 1)
            await publisher.publish(b"after", routing_key=queue)
        bodies = [m.body for m in await drain_queue(broker_url, queue, settled=True)]
        expected = [f"ok {i}".encode() for i in range(500) if i not in bad]
        assert bodies == [*expected, b"after"]

    async def test_values_whose_own_code_raises_fail_alone(
        self, broker_url: str, queue: str
    ) -> None:
        """A body, header table, timestamp or routing key whose own code raises anything
        (not a ReliableMQError) is that message's InvalidBody or InvalidMessage naming the
        cause, in publish() and in publish_many(); it never aborts the batch."""
        bad: dict[int, tuple[dict[str, Any], type[InvalidMessage], str]] = {
            2: ({"body": _ExplodingModel(n=1)}, InvalidBody, "RuntimeError: serializer"),
            4: ({"body": _BadList([1])}, InvalidBody, "BadList body: LookupError: no iter"),
            6: ({"headers": _BadHeaders()}, InvalidMessage, "RuntimeError: headers exploded"),
            8: ({"timestamp": _BadTime(2020, 1, 1)}, InvalidMessage, "ZeroDivisionError"),
            9: ({"routing_key": ["q"]}, InvalidMessage, "routing_key must be a str, not list"),
        }
        messages = []
        for index in range(12):
            options, _, _ = bad.get(index, ({}, InvalidMessage, ""))
            fields: dict[str, Any] = {"body": f"ok {index}", "routing_key": queue, **options}
            messages.append(Message(**fields))
        async with ReliablePublisher(conn(broker_url), registry=CollectorRegistry()) as publisher:
            result = await publisher.publish_many(messages, raise_on_error=False)
            assert (result.taken, result.confirmed) == (12, 12 - len(bad))
            assert [f.index for f in result.failures] == sorted(bad)
            for failure in result.failures:
                _, kind, text = bad[failure.index]
                assert type(failure.error) is kind and text in str(failure.error), failure.error
            for options, kind, text in bad.values():
                fields = {"body": b"x", "routing_key": queue, **options}
                body = fields.pop("body")
                with pytest.raises(kind, match=re.escape(text)):
                    await publisher.publish(body, **fields)
                with pytest.raises(kind, match=re.escape(text)):
                    await publisher.enqueue(body, **fields)
            assert _generations(publisher) == (1, 1) and publisher.in_flight == 0
            await publisher.publish(b"after", routing_key=queue)
        bodies = [m.body for m in await drain_queue(broker_url, queue, settled=True)]
        assert bodies == [*(f"ok {i}".encode() for i in range(12) if i not in bad), b"after"]

    async def test_max_failures_stops_reading(self, broker_url: str, queue: str) -> None:
        """max_failures stops taking messages from the input; what was taken finishes."""
        taken: list[int] = []

        def source() -> Any:
            for index in range(10_000):
                taken.append(index)
                yield Message(b"x", routing_key=queue, expiration=-1 if index % 2 else None)

        async with ReliablePublisher(conn(broker_url), registry=CollectorRegistry()) as publisher:
            result = await publisher.publish_many(source(), max_failures=3, raise_on_error=False)
        assert result.stopped_early and len(result.failures) == 3
        assert len(taken) == result.taken == 6

    async def test_async_iterable_input(self, broker_url: str, queue: str) -> None:
        """An async generator feeds the stream too."""

        async def source() -> Any:
            for index in range(500):
                yield Message({"i": index}, routing_key=queue)

        async with ReliablePublisher(conn(broker_url), registry=CollectorRegistry()) as publisher:
            result = await publisher.publish_many(source())
        assert (result.taken, result.confirmed) == (500, 500)
        bodies = [m.body for m in await drain_queue(broker_url, queue, settled=True)]
        assert bodies[:2] == [b'{"i":0}', b'{"i":1}']


class TestPrivateBroker:
    """Faults that need a broker of our own: settings changed, or the node stopped."""

    @pytest.mark.fast_path
    async def test_unnamed_refusal_is_isolated(self, private_broker: Any) -> None:
        """A 406 that names no exchange (message over the broker's max_message_size):
        the culprit is found by halves and fails alone; every other message confirms."""
        node = private_broker
        queue = f"iso-{uuid.uuid4().hex[:8]}"
        await asyncio.to_thread(
            node.rabbitmqctl, "eval", "application:set_env(rabbit, max_message_size, 1048576)."
        )
        try:
            connection = await aio_pika.connect(node.url)
            async with connection:
                channel = await connection.channel()
                await channel.declare_queue(queue, durable=True)
            async with ReliablePublisher(
                conn(node.url), settings=fast_settings(), registry=CollectorRegistry()
            ) as publisher:
                small = [publisher.publish(b"s" * 100, routing_key=queue) for _ in range(400)]
                big = publisher.publish(b"B" * 2_000_000, routing_key=queue)
                more = [publisher.publish(b"s" * 100, routing_key=queue) for _ in range(400)]
                outcomes = await asyncio.gather(*small, big, *more, return_exceptions=True)
                refused = outcomes[400]
                assert isinstance(refused, PublishRefused), refused
                assert refused.reply_code == 406
                assert "max size" in refused.reply_text or "larger" in refused.reply_text
                others = outcomes[:400] + outcomes[401:]
                assert all(isinstance(o, PublishResult) for o in others), {
                    type(o).__name__ for o in others
                }
                assert publisher._supervisor.generation == 1
            delivered = await drain_queue(node.url, queue)
            assert all(len(m.body) == 100 for m in delivered)
            assert {m.message_id for m in delivered} == {
                o.message_id for o in others if isinstance(o, PublishResult)
            }
        finally:
            await asyncio.to_thread(
                node.rabbitmqctl,
                "eval",
                "application:set_env(rabbit, max_message_size, 134217728).",
            )

    async def test_dead_broker_fails_waiting_messages_together(self, private_broker: Any) -> None:
        """With the broker down, every waiting message fails with PublishUnavailable once
        unavailable_timeout passes (not one deadline after another), new publishes fail at
        once, and publishing works again when the broker is back."""
        node = private_broker
        queue = f"down-{uuid.uuid4().hex[:8]}"
        connection = await aio_pika.connect(node.url)
        async with connection:
            channel = await connection.channel()
            await channel.declare_queue(queue, durable=True)
        settings = PublisherSettings(
            max_in_flight=50, publish_timeout=120, unavailable_timeout=2.0, backoff_initial=0.01
        )
        async with ReliablePublisher(
            conn(node.url, heartbeat=2), settings=settings, registry=CollectorRegistry()
        ) as publisher:
            await publisher.publish(b"before", routing_key=queue)
            await asyncio.sleep(2)  # 3.10: a definition younger than ~1 s may not survive kill -9
            await asyncio.to_thread(node.kill)
            started = time.monotonic()
            outcomes = await asyncio.gather(
                *(publisher.publish(b"x", routing_key=queue) for _ in range(500)),
                return_exceptions=True,
            )
            elapsed = time.monotonic() - started
            assert all(isinstance(o, PublishUnavailable) for o in outcomes), {
                type(o).__name__ for o in outcomes
            }
            assert elapsed < 2.0 + 5.0, elapsed  # one bound for all 500, not 500 deadlines
            fast = time.monotonic()
            with pytest.raises(PublishUnavailable):
                await publisher.publish(b"y", routing_key=queue)
            assert time.monotonic() - fast < 0.5
            await asyncio.to_thread(node.start)
            await wait_until(lambda: not publisher._engine.unavailable, timeout=60)
            result = await publisher.publish(b"after", routing_key=queue)
            assert result.attempts == 1
        bodies = [m.body for m in await drain_queue(node.url, queue)]
        assert b"after" in bodies and b"before" in bodies


class TestErrorTree:
    def test_outcome_unknown_is_the_base_of_timeouts(self) -> None:
        """PublishTimeout and PublishAborted are both 'outcome unknown'."""
        from reliable_mq import PublishAborted, PublishTimeout

        assert issubclass(PublishTimeout, PublishOutcomeUnknown)
        assert issubclass(PublishAborted, PublishOutcomeUnknown)


class TestNoReconnectStorm:
    async def test_broker_closes_back_off_network_cuts_do_not(
        self, broker_url: str, queue: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Young connections the broker keeps closing delay the next reconnect more and
        more; an old one resets that, and a network cut does not count."""
        import reliable_mq.connection as connection_module
        from reliable_mq.testing import TCPProxy
        from tests.conftest import proxied_url
        from tests.publish.test_publisher import _close_connection_named

        async with TCPProxy("127.0.0.1", 5672) as proxy:
            settings = conn(proxied_url(proxy), reconnect_initial_delay=0.2, reconnect_max_delay=5)
            name = f"{settings.connection_name}.publisher"
            async with ReliablePublisher(
                settings, settings=fast_settings(), registry=CollectorRegistry()
            ) as publisher:
                supervisor = publisher._supervisor

                async def broker_close() -> None:
                    generation = supervisor.generation
                    await asyncio.to_thread(_close_connection_named, name)
                    await wait_until(lambda: supervisor.generation > generation, timeout=30)

                # The test sets which closes are young, rather than racing the 2 s
                # line: finding and closing a connection with rabbitmqctl takes about
                # 1 s on an idle machine and over 2 s on a loaded one, and near 2 s
                # the library's clock and the test's disagreed about which side it was.
                monkeypatch.setattr(connection_module, "_SHORT_LIFE", 3600.0)
                for young in (1, 2, 3):
                    await broker_close()
                    assert supervisor._short_lives == young
                    assert supervisor.first_reconnect_delay() == pytest.approx(
                        0.2 * 2 ** (young - 1)
                    )
                monkeypatch.setattr(connection_module, "_SHORT_LIFE", 0.0)  # all old now
                await broker_close()
                assert supervisor._short_lives == 0
                assert supervisor.first_reconnect_delay() == 0
                monkeypatch.setattr(connection_module, "_SHORT_LIFE", 3600.0)
                await broker_close()
                assert supervisor._short_lives == 1
                generation = supervisor.generation
                await proxy.cut()  # as young as the others, but not the broker's doing
                await wait_until(lambda: supervisor.generation > generation, timeout=30)
                assert supervisor._short_lives == 0
                assert supervisor.first_reconnect_delay() == 0
                assert (await publisher.publish(b"x", routing_key=queue)).attempts == 1
