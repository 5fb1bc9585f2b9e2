"""Issue 10, consumer side, against the real broker: no delivery can wedge, no copy can loop.

Every wedge test runs with prefetch 1: a delivery left unsettled would hold the
only slot and stop the queue. After each one the queue must keep flowing (a
good message behind the bad one is handled), ``stats().in_progress`` must be 0,
and the bad message must be retried or dead-lettered with the reason in its
headers.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import aio_pika
import pytest
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, field_validator

from reliable_mq import PublisherSettings, ReliablePublisher
from reliable_mq._amqp import wire as _wire
from reliable_mq._consume.settle import UNPUBLISHABLE_COPY
from reliable_mq.consumer import ReliableConsumer
from reliable_mq.dedup import ClaimResult, MemoryDedupStore
from reliable_mq.delivery import Delivery
from reliable_mq.handlers import AckPolicy, Reject
from reliable_mq.headers import (
    ATTEMPT_HEADER,
    DROPPED_HEADERS_HEADER,
    ERROR_MESSAGE_HEADER,
    ERROR_TYPE_HEADER,
    LAST_ERROR_HEADER,
    REASON_HEADER,
)
from tests.consume.test_consumer_broker import URL, Env, _env, drain  # noqa: F401 (_env: fixture)
from tests.support.amqp import ESCAPED, MARK, NOT_UTF8, PLACEHOLDER_TIME, hostile_frames
from tests.support.waiting import wait_until

pytestmark = pytest.mark.rabbitmq

FAST = {"prefetch": 1, "retry_delays": (0.2,), "max_attempts": 2, "handler_timeout": 30.0}


class Picky(BaseModel):
    n: int

    @field_validator("n")
    @classmethod
    def _check(cls, value: int) -> int:
        if value == 13:
            raise KeyError("unlucky")  # not a ValueError: pydantic lets it through
        return value


class Opaque:
    """An annotation pydantic cannot build a validator for: bodies fall back to json.loads."""


def _recurse(depth: int) -> int:
    return _recurse(depth + 1) + 1


async def _publish_raw(queue: str, body: bytes, message_id: str, **kw: Any) -> None:
    connection = await aio_pika.connect(URL)
    async with connection:
        channel = await connection.channel()
        message = aio_pika.Message(body, message_id=message_id, **kw)
        await channel.default_exchange.publish(message, routing_key=queue)


async def _settled(consumer: ReliableConsumer) -> None:
    """Wait until nothing is in a handler, then check it stays so."""
    await wait_until(lambda: consumer.stats().in_progress == 0, timeout=10, what="in_progress 0")


def _dead(messages: list[Any]) -> dict[str, dict[str, Any]]:
    return {m.message_id: dict(m.headers) for m in messages}


class TestWedges:
    """The three triggers of issue 10 item 1, and their cousins: each ends settled."""

    async def test_validator_raising_key_error_is_dead_lettered(self, env: Env) -> None:
        """A pydantic validator raising KeyError: the DLQ (invalid_body), not a wedge."""
        consumer = env.consumer(**FAST)
        handled: list[int] = []

        @consumer.handler(env.queue)
        async def handler(body: Picky) -> None:
            handled.append(body.n)

        env.track(consumer)
        async with consumer:
            await env.publish([{"n": 13}, {"n": 1}], ids=["bad", "good"])
            await wait_until(
                lambda: handled == [1], timeout=10, what="the good message behind the bad one"
            )
            await _settled(consumer)
            assert consumer.stats().dead_lettered == 1
        dead = _dead(await drain(consumer.topology(env.queue).dead_letter_queue))
        assert dead["bad"][REASON_HEADER] == "invalid_body"
        assert dead["bad"][ERROR_TYPE_HEADER] == "KeyError"
        assert "unlucky" in str(dead["bad"][ERROR_MESSAGE_HEADER])
        assert await drain(env.queue) == []

    async def test_handler_raising_cancelled_error_is_retried(self, env: Env) -> None:
        """A handler raising CancelledError itself (not our timeout, shutdown or dead
        channel) is an error: retried, then dead-lettered; the consumer goes on."""
        consumer = env.consumer(**FAST)
        attempts: list[int] = []
        handled: list[str] = []

        @consumer.handler(env.queue)
        async def handler(delivery: Delivery) -> None:
            if delivery.message_id == "bad":
                attempts.append(delivery.attempt)
                raise asyncio.CancelledError("from the handler")
            handled.append(delivery.message_id)

        env.track(consumer)
        async with consumer:
            await env.publish([b"x", b"y"], ids=["bad", "good"])
            await wait_until(
                lambda: consumer.stats().dead_lettered == 1, timeout=10, what="dead-lettered"
            )
            await wait_until(lambda: handled == ["good"], timeout=10, what="the good message")
            await _settled(consumer)
            stats = consumer.stats()
        assert attempts == [1, 2]
        assert (stats.retried, stats.acked, stats.channel_reopens) == (1, 1, 0)
        dead = _dead(await drain(consumer.topology(env.queue).dead_letter_queue))
        assert dead["bad"][REASON_HEADER] == "max_attempts"
        assert dead["bad"][ERROR_TYPE_HEADER] == "CancelledError"

    async def test_deeply_nested_json_is_dead_lettered(self, env: Env) -> None:
        """A 100,000-deep JSON array for an annotation that falls back to json.loads."""
        consumer = env.consumer(**FAST)
        handled: list[Any] = []

        @consumer.handler(env.queue)
        async def handler(body: Opaque) -> None:
            handled.append(body)

        env.track(consumer)
        deep = b"[" * 100_000 + b"]" * 100_000
        async with consumer:
            await env.publish(
                [deep, b'{"ok": 1}'], ids=["deep", "good"], content_type="application/json"
            )
            await wait_until(lambda: handled == [{"ok": 1}], timeout=10, what="the good message")
            await _settled(consumer)
        dead = _dead(await drain(consumer.topology(env.queue).dead_letter_queue))
        assert dead["deep"][REASON_HEADER] == "invalid_body"
        assert "nested too deeply" in str(dead["deep"][ERROR_MESSAGE_HEADER])

    async def test_recursion_and_memory_errors_in_the_handler(self, env: Env) -> None:
        """RecursionError and MemoryError are handler errors like any other."""
        consumer = env.consumer(**FAST)
        handled: list[str] = []

        @consumer.handler(env.queue, ack_policy=AckPolicy.DEAD_LETTER_ON_ERROR)
        async def handler(delivery: Delivery) -> None:
            if delivery.message_id == "recursion":
                _recurse(0)
            if delivery.message_id == "memory":
                raise MemoryError("no room")
            handled.append(delivery.message_id)

        env.track(consumer)
        async with consumer:
            await env.publish([b"1", b"2", b"3"], ids=["recursion", "memory", "good"])
            await wait_until(lambda: handled == ["good"], timeout=10, what="the good message")
            await _settled(consumer)
        dead = _dead(await drain(consumer.topology(env.queue).dead_letter_queue))
        assert dead["recursion"][ERROR_TYPE_HEADER] == "RecursionError"
        assert dead["memory"][ERROR_TYPE_HEADER] == "MemoryError"
        assert {h[REASON_HEADER] for h in dead.values()} == {"handler_error"}

    async def test_dedup_store_raising_anything_defers(self, env: Env) -> None:
        """A store raising an unexpected error (not DedupStoreUnavailable) defers the
        delivery instead of wedging it; it runs once the store answers."""

        class Flaky(MemoryDedupStore):
            failures = 2

            async def claim(self, message_id: str, *, owner: str, lease: float) -> ClaimResult:
                if self.failures:
                    self.failures -= 1
                    raise RuntimeError("store bug")
                return await super().claim(message_id, owner=owner, lease=lease)

        store = Flaky()
        consumer = env.consumer(dedup=store, **FAST)
        handled: list[str] = []

        @consumer.handler(env.queue)
        async def handler(delivery: Delivery) -> None:
            handled.append(delivery.message_id)

        env.track(consumer)
        async with consumer:
            await env.publish([b"x"], ids=["m"])
            await wait_until(
                lambda: handled == ["m"], timeout=10, what="handled after the store answers"
            )
            await _settled(consumer)
            stats = consumer.stats()
        assert (stats.deferred, stats.acked) == (2, 1)
        await store.close()


async def _ctl(*args: str) -> str:
    """Run rabbitmqctl; its stderr ("" on success)."""
    process = await asyncio.create_subprocess_exec(
        "rabbitmqctl",
        "-q",
        *args,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(process.communicate(), 60)
    return err.decode(errors="replace") or ("" if process.returncode == 0 else "failed")


class Policy:
    """A broker policy on our own uuid-named queues only, removed afterwards."""

    def __init__(self, pattern: str, definition: str) -> None:
        self.name = f"test-hardening-{uuid.uuid4().hex[:10]}"
        self.pattern = pattern
        self.definition = definition

    async def __aenter__(self) -> Policy:
        args = ("set_policy", "--apply-to", "queues", self.name, self.pattern, self.definition)
        error = await _ctl(*args)
        assert not error, error
        return self

    async def clear(self) -> None:
        await _ctl("clear_policy", self.name)

    async def __aexit__(self, *exc_info: object) -> None:
        await self.clear()


REFUSE_ALL = '{"max-length": 0, "overflow": "reject-publish"}'


def _fallbacks(env: Env, rung: str) -> float:
    labels = {"queue": env.queue, "rung": rung}
    return env.registry.get_sample_value("reliable_mq_settle_fallbacks_total", labels) or 0.0


class TestUnpublishableCopies:
    """Issue 10 item 2, consumer side: a copy that cannot be published never loops."""

    async def test_retry_copy_over_frame_max_is_trimmed(self, env: Env) -> None:
        """Headers that fit on delivery but not once ours are added: a trimmed copy
        (the large header dropped and named) carries the retry; the rest is unchanged."""
        consumer = env.consumer(**FAST)
        seen: list[tuple[int, dict[str, Any]]] = []

        @consumer.handler(env.queue)
        async def handler(delivery: Delivery) -> None:
            seen.append((delivery.attempt, dict(delivery.headers)))
            if delivery.attempt == 1:
                raise ValueError("e" * 2000)  # ~1,000 more bytes of last-error header

        env.track(consumer)
        async with consumer:
            big = "x" * 130_500  # frame_max is 131,072: the original fits
            await _publish_raw(env.queue, b"body", "big", headers={"big": big, "keep": 1})
            await wait_until(lambda: len(seen) == 2, timeout=15, what="the retried attempt")
            await _settled(consumer)
            stats = consumer.stats()
        assert seen[0][1]["big"] == big
        attempt, headers = seen[1]
        assert attempt == 2 and headers[ATTEMPT_HEADER] == 2
        assert "big" not in headers and "keep" not in headers
        assert headers[DROPPED_HEADERS_HEADER] == "big,keep"
        assert (stats.retried, stats.acked, stats.fallbacks, stats.requeued) == (1, 1, 1, 0)
        assert _fallbacks(env, "trimmed_copy") == 1
        assert await drain(env.queue) == []

    async def test_refused_retry_copy_is_dead_lettered_by_the_broker(self, env: Env) -> None:
        """The retry queue refuses every copy (nacks): the broker dead-letters the
        original onto the work queue's DLX; the queue keeps flowing."""
        consumer = env.consumer(publisher_settings=PublisherSettings(max_attempts=2), **FAST)
        handled: list[str] = []

        @consumer.handler(env.queue)
        async def handler(delivery: Delivery) -> None:
            if delivery.message_id == "bad":
                raise ValueError("fails")
            handled.append(delivery.message_id)

        env.track(consumer)
        async with Policy(rf"^{env.queue}\.retry\.", REFUSE_ALL):
            async with consumer:
                await env.publish([b"x", b"y"], ids=["bad", "good"])
                await wait_until(lambda: handled == ["good"], timeout=15, what="the good message")
                await wait_until(
                    lambda: consumer.stats().dead_lettered == 1, timeout=10, what="dead-lettered"
                )
                await _settled(consumer)
                stats = consumer.stats()
        assert (stats.retried, stats.fallbacks) == (0, 1)
        assert _fallbacks(env, "broker_dead_letter") == 1
        labels = {"queue": env.queue, "reason": UNPUBLISHABLE_COPY}
        assert env.registry.get_sample_value("reliable_mq_dead_lettered_messages_total", labels)
        dead = await drain(consumer.topology(env.queue).dead_letter_queue)
        assert [m.message_id for m in dead] == ["bad"]
        death = dead[0].headers["x-death"][0]
        assert (death["reason"], death["queue"]) == ("rejected", env.queue)
        assert await drain(env.queue) == []

    async def test_refused_dlq_copy_is_held_and_requeued_never_lost(self, env: Env) -> None:
        """The DLQ itself refuses: dead-lettering into it would drop the message, so it
        is requeued after a growing hold (no spin); once the DLQ takes it, it ends there."""
        consumer = env.consumer(
            publisher_settings=PublisherSettings(max_attempts=2),
            fallback_delay=0.3,
            **FAST,
        )
        calls = 0

        @consumer.handler(env.queue)
        async def handler(body: bytes) -> None:
            nonlocal calls
            calls += 1
            raise Reject("poison")

        env.track(consumer)
        dlq = consumer.topology(env.queue).dead_letter_queue
        async with Policy(f"^{dlq}$", REFUSE_ALL) as refusing, consumer:
            await env.publish([b"x"], ids=["poison"])
            await wait_until(lambda: consumer.stats().requeued >= 2, timeout=15, what="two holds")
            # Holds of 0.3 s then 0.6 s: a spinning consumer would have run it hundreds of times.
            assert calls <= 4
            await refusing.clear()
            await wait_until(
                lambda: consumer.stats().dead_lettered == 1, timeout=20, what="in the DLQ"
            )
            await _settled(consumer)
            stats = consumer.stats()
        assert stats.fallbacks >= 2
        assert _fallbacks(env, "requeue_later") >= 2
        dead = _dead(await drain(dlq))
        assert dead["poison"][REASON_HEADER] == "rejected"
        assert await drain(env.queue) == []

    async def test_lone_surrogates_in_our_text_headers_are_escaped(self, env: Env) -> None:
        """A handler's error text or Reject reason with a lone surrogate goes into our
        headers escaped: the retry and the DLQ copy are published as usual, no fallback."""
        consumer = env.consumer(**FAST)
        seen: list[dict[str, Any]] = []

        @consumer.handler(env.queue)
        async def handler(delivery: Delivery) -> None:
            seen.append(dict(delivery.headers))
            if delivery.attempt == 1:
                raise ValueError("bad \ud800 input")
            raise Reject("reason \udfff")

        env.track(consumer)
        async with consumer:
            await env.publish([b"x"], ids=["odd"])
            await wait_until(
                lambda: consumer.stats().dead_lettered == 1, timeout=15, what="dead-lettered"
            )
            await _settled(consumer)
            stats = consumer.stats()
        assert len(seen) == 2
        assert seen[1][LAST_ERROR_HEADER] == "ValueError: bad \\ud800 input"
        assert (stats.retried, stats.dead_lettered, stats.fallbacks) == (1, 1, 0)
        dead = _dead(await drain(consumer.topology(env.queue).dead_letter_queue))
        assert dead["odd"][REASON_HEADER] == "rejected"
        assert dead["odd"][ERROR_MESSAGE_HEADER] == "reason \\udfff"
        assert await drain(env.queue) == []

    async def test_header_name_we_would_not_write_is_trimmed(
        self, env: Env, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A header name of 200 bytes is valid AMQP (a short string) but over the 128 bytes
        our encoder writes: the full retry copy is refused locally, the trimmed one goes."""
        long_name = "n" * 200
        consumer = env.consumer(**FAST)
        seen: list[dict[str, Any]] = []
        published = asyncio.Event()

        @consumer.handler(env.queue)
        async def handler(delivery: Delivery) -> None:
            seen.append(dict(delivery.headers))
            if delivery.attempt == 1:
                await published.wait()  # the copy is made with our own encoder's limit
                raise ValueError("once")

        env.track(consumer)
        async with consumer:
            with monkeypatch.context() as patch:  # another client's encoder, for this publish
                patch.setattr(_wire, "_MAX_KEY", 255)
                async with ReliablePublisher(URL, registry=CollectorRegistry()) as publisher:
                    await publisher.publish(
                        b"x", routing_key=env.queue, message_id="long", headers={long_name: 1}
                    )
            published.set()
            await wait_until(lambda: len(seen) == 2, timeout=15, what="the retried attempt")
            await _settled(consumer)
            stats = consumer.stats()
        assert seen[0][long_name] == 1
        assert long_name not in seen[1] and seen[1][DROPPED_HEADERS_HEADER] == long_name
        assert (stats.retried, stats.acked, stats.fallbacks) == (1, 1, 1)
        assert _fallbacks(env, "trimmed_copy") == 1
        assert await drain(env.queue) == []

    async def test_hopeless_message_backs_off_while_other_copies_go_through(self, env: Env) -> None:
        """One message no copy of which can be published (the DLQ refuses it), next to a
        steady stream whose retry copies are published: its holds still double (its own
        count, not reset by the others' copies), so its handler runs a few times, not
        every fallback_delay. On a classic queue its attempt number stays 1."""
        consumer = env.consumer(
            prefetch=20,
            retry_delays=(0.05,),
            max_attempts=3,
            fallback_delay=0.2,
            fallback_max_delay=5.0,
            publisher_settings=PublisherSettings(max_attempts=2),
        )
        poison: list[tuple[int, bool]] = []
        good: list[str] = []

        @consumer.handler(env.queue)
        async def handler(delivery: Delivery) -> None:
            if delivery.message_id == "poison":
                poison.append((delivery.attempt, delivery.redelivered))
                raise Reject("poison")
            good.append(delivery.message_id)
            if delivery.attempt == 1:
                raise ValueError("once")  # its retry copy is published

        env.track(consumer)
        dlq = consumer.topology(env.queue).dead_letter_queue
        async with Policy(f"^{dlq}$", REFUSE_ALL) as refusing, consumer:
            await env.publish([b"p"], ids=["poison"])
            async with ReliablePublisher(URL, registry=CollectorRegistry()) as publisher:
                for index in range(70):  # 3.5 s of traffic whose copies go through
                    await publisher.publish(b"g", routing_key=env.queue, message_id=f"g{index}")
                    await asyncio.sleep(0.05)
            runs = len(poison)
            await refusing.clear()
            await wait_until(
                lambda: consumer.stats().dead_lettered == 1, timeout=20, what="in the DLQ"
            )
            await wait_until(
                lambda: consumer.stats().retried >= 70, timeout=10, what="the good retries"
            )
            await _settled(consumer)
        # Holds of 0.2, 0.4, 0.8, 1.6 s: about 5 runs in 3.5 s. A hold reset by every
        # other copy published would have run it every ~0.2 s (about 15 times).
        assert 3 <= runs <= 7, poison
        assert {attempt for attempt, _ in poison} == {1}
        assert all(redelivered for _, redelivered in poison[1:])
        assert len(set(good)) == 70
        dead = _dead(await drain(dlq))
        assert dead["poison"][REASON_HEADER] == "rejected"


async def _publish_hostile(
    env: Env,
    exchange: str = "",
    routing_key: str | None = None,
    **options: Any,
) -> None:
    """One hostile message, then good ones ``good0``..``good2``, in this order."""
    connection = await aio_pika.connect(URL)
    async with connection:
        channel = await connection.channel()
        target = await channel.get_exchange(exchange) if exchange else channel.default_exchange
        message = aio_pika.Message(b'{"n": 1}', **options)
        with hostile_frames():
            await target.publish(message, routing_key=routing_key or env.queue)
        for index in range(3):
            good = aio_pika.Message(b'{"n": 2}', message_id=f"good{index}")
            await target.publish(good, routing_key=env.queue)


_UNDECODABLE = {
    "message_id": ({"message_id": MARK}, "message_id"),
    "correlation_id": ({"correlation_id": MARK}, "correlation_id"),
    "content_type": ({"content_type": MARK}, "content_type"),
    "header_name": ({"headers": {MARK: 1, "ok": "kept"}}, f"header name '{ESCAPED}'"),
    "nested_header_name": ({"headers": {"t": {MARK: [1]}}}, f"header['t'] name '{ESCAPED}'"),
    "timestamp_in_microseconds": (
        {"timestamp": PLACEHOLDER_TIME},
        "timestamp",
    ),
}


class TestUndecodableDeliveries:
    """Strings AMQP requires to be UTF-8 that are not, and dates Python cannot hold.

    pamqp cannot decode such a delivery, and aiormq's reader used to close the
    whole connection on it: the broker redelivered it and the consumer
    reconnected some 80 times a second, every queue of the connection stopped.
    Now it is dead-lettered (``invalid_properties``) and nothing else is touched.
    """

    @pytest.mark.parametrize("case", list(_UNDECODABLE))
    async def test_dead_lettered_and_the_queue_flows(self, env: Env, case: str) -> None:
        """The DLQ with the field named and its text escaped; the handler never runs;
        no channel reopened; the good messages behind it are handled."""
        options, field = _UNDECODABLE[case]
        consumer = env.consumer(**FAST)
        handled: list[str] = []

        @consumer.handler(env.queue)
        async def handler(body: Picky, delivery: Delivery) -> None:
            handled.append(delivery.message_id)

        env.track(consumer)
        async with consumer:
            options = {"message_id": "bad", **options}
            await _publish_hostile(env, **options)
            await wait_until(
                lambda: len(handled) == 3, timeout=10, what="the good messages behind it"
            )
            await _settled(consumer)
            stats = consumer.stats()
        assert handled == ["good0", "good1", "good2"]
        assert (stats.delivered, stats.acked, stats.dead_lettered) == (4, 3, 1)
        assert (stats.channel_reopens, stats.requeued, stats.fallbacks) == (0, 0, 0)
        labels = {"queue": env.queue, "reason": "invalid_properties"}
        sample = env.registry.get_sample_value("reliable_mq_dead_lettered_messages_total", labels)
        assert sample == 1
        [dead] = await drain(consumer.topology(env.queue).dead_letter_queue)
        headers = dict(dead.headers)
        assert headers[REASON_HEADER] == "invalid_properties"
        error_type = "ValueError" if case.startswith("timestamp") else "UnicodeDecodeError"
        assert headers[ERROR_TYPE_HEADER] == error_type
        assert str(headers[ERROR_MESSAGE_HEADER]).startswith(f"not decodable: {field}: ")
        assert dead.body == b'{"n": 1}'
        if case == "message_id":
            assert dead.message_id == ESCAPED
        if case == "header_name":
            assert headers[ESCAPED] == 1 and headers["ok"] == "kept"
        if case == "content_type":
            assert dead.content_type == ESCAPED
        assert await drain(env.queue) == []

    async def test_routing_key_not_utf8(self, env: Env) -> None:
        """A routing key that is not UTF-8 (through a fanout exchange, which takes any)."""
        consumer = env.consumer(**FAST)
        handled: list[str] = []

        @consumer.handler(env.queue)
        async def handler(delivery: Delivery) -> None:
            handled.append(delivery.message_id)

        env.track(consumer)
        exchange = f"{env.queue}.fanout"
        connection = await aio_pika.connect(URL)
        async with connection:
            channel = await connection.channel()
            fanout = await channel.declare_exchange(exchange, "fanout", auto_delete=True)
            async with consumer:
                await (await channel.get_queue(env.queue)).bind(fanout)
                await _publish_hostile(env, exchange=exchange, routing_key=MARK, message_id="bad")
                await wait_until(
                    lambda: len(handled) == 3, timeout=10, what="the good messages behind it"
                )
                await _settled(consumer)
                stats = consumer.stats()
        assert (stats.dead_lettered, stats.channel_reopens) == (1, 0)
        [dead] = await drain(consumer.topology(env.queue).dead_letter_queue)
        assert dead.headers[REASON_HEADER] == "invalid_properties"
        assert str(dead.headers[ERROR_MESSAGE_HEADER]).startswith("not decodable: routing_key: ")
        assert dead.headers["x-reliable-mq-original-routing-key"] == ESCAPED

    async def test_header_value_not_utf8_reaches_the_handler_as_bytes(self, env: Env) -> None:
        """A long-string header value is not required to be UTF-8 (pamqp gives bytes): the
        handler runs; its retry and DLQ copies carry the value as bytes."""
        consumer = env.consumer(**FAST)
        seen: list[Any] = []

        @consumer.handler(env.queue)
        async def handler(delivery: Delivery) -> None:
            if delivery.message_id == "bad":
                seen.append(delivery.headers["k"])
                raise ValueError("fails")

        env.track(consumer)
        async with consumer:
            await _publish_hostile(env, message_id="bad", headers={"k": MARK})
            await wait_until(
                lambda: consumer.stats().dead_lettered == 1, timeout=10, what="dead-lettered"
            )
            await _settled(consumer)
            stats = consumer.stats()
        assert seen == [NOT_UTF8, NOT_UTF8]
        assert (stats.retried, stats.acked, stats.channel_reopens) == (1, 3, 0)
        [dead] = await drain(consumer.topology(env.queue).dead_letter_queue)
        assert dead.headers["k"] == NOT_UTF8
        assert dead.headers[REASON_HEADER] == "max_attempts"

    async def test_deliveries_in_flight_are_not_touched(self, env: Env) -> None:
        """Handlers running when the bad delivery arrives finish and are acked on the
        same channel: it is not closed, nothing is redelivered or stale."""
        consumer = env.consumer(prefetch=10, retry_delays=(0.2,), max_attempts=2)
        release = asyncio.Event()
        handled: list[tuple[str, bool]] = []

        @consumer.handler(env.queue)
        async def handler(delivery: Delivery) -> None:
            if delivery.message_id == "slow":
                await release.wait()
            handled.append((delivery.message_id, delivery.redelivered))

        env.track(consumer)
        async with consumer:
            await env.publish([b"s"], ids=["slow"])
            await wait_until(
                lambda: consumer.stats().in_progress == 1, timeout=10, what="the slow handler"
            )
            await _publish_hostile(env, message_id=MARK)
            await wait_until(
                lambda: consumer.stats().dead_lettered == 1, timeout=10, what="dead-lettered"
            )
            await wait_until(lambda: len(handled) == 3, timeout=10, what="the good messages")
            release.set()
            await wait_until(lambda: len(handled) == 4, timeout=10, what="the slow one")
            await _settled(consumer)
            stats = consumer.stats()
        assert not any(redelivered for _, redelivered in handled)
        assert (stats.acked, stats.channel_reopens, stats.stale) == (4, 0, 0)
        assert [
            m.message_id for m in await drain(consumer.topology(env.queue).dead_letter_queue)
        ] == [ESCAPED]
