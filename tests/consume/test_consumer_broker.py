"""ReliableConsumer against the real broker on 127.0.0.1:5672.

Each test uses uuid-suffixed queues and deletes the whole topology (work,
retry and dead-letter queues) afterwards.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import os
import random
import signal
import sys
import textwrap
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aio_pika
import pytest
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, SecretStr

from reliable_mq import ConnectionSettings, ReliablePublisher
from reliable_mq.consumer import ReliableConsumer
from reliable_mq.dedup import ClaimResult, MemoryDedupStore
from reliable_mq.delivery import Delivery, Settle
from reliable_mq.errors import ClosedError
from reliable_mq.handlers import AckPolicy, Reject, Retry
from reliable_mq.topology import QueueTopology, QueueType, declare_topology, delete_topology
from tests.support.waiting import wait_until

pytestmark = pytest.mark.rabbitmq

URL = os.environ.get("RELIABLE_MQ_TEST_URL", "amqp://guest:guest@127.0.0.1:5672/")


class Order(BaseModel):
    id: int


class Env:
    """Names and helpers of one test."""

    def __init__(self) -> None:
        self.suffix = uuid.uuid4().hex[:10]
        self.queue = f"test-consumer-{self.suffix}"
        self.topologies: list[QueueTopology] = []
        self.registry = CollectorRegistry()

    def connection(self) -> ConnectionSettings:
        return ConnectionSettings(
            url=SecretStr(URL),
            connection_name=f"test-consumer-{self.suffix}",
            reconnect_initial_delay=0.1,
            reconnect_max_delay=0.5,
        )

    def consumer(self, **overrides: Any) -> ReliableConsumer:
        consumer = ReliableConsumer(self.connection(), registry=self.registry, **overrides)
        return consumer

    def track(self, consumer: ReliableConsumer) -> None:
        for spec in consumer.handlers:
            self.topologies.append(consumer.topology(spec.queue))

    async def publish(
        self,
        bodies: list[Any],
        *,
        queue: str | None = None,
        ids: list[str] | None = None,
        content_type: str | None = None,
    ) -> list[str]:
        ids = ids or [f"m{i}" for i in range(len(bodies))]
        async with ReliablePublisher(URL, registry=CollectorRegistry()) as publisher:
            pending = [
                await publisher.enqueue(
                    body, routing_key=queue or self.queue, message_id=mid, content_type=content_type
                )
                for body, mid in zip(bodies, ids, strict=True)
            ]
            for item in pending:
                await item
        return ids


async def drain(queue: str) -> list[aio_pika.abc.AbstractIncomingMessage]:
    """Take everything out of ``queue`` with basic.get (acking each)."""
    connection = await aio_pika.connect(URL)
    try:
        channel = await connection.channel()
        amqp_queue = await channel.get_queue(queue, ensure=True)
        out: list[aio_pika.abc.AbstractIncomingMessage] = []
        while True:
            message = await amqp_queue.get(no_ack=False, fail=False)
            if message is None:
                return out
            await message.ack()
            out.append(message)
    finally:
        await connection.close()


@pytest.fixture(name="env")
async def _env() -> AsyncIterator[Env]:
    env = Env()
    yield env
    connection = await aio_pika.connect(URL)
    try:
        for topology in env.topologies:
            channel = await connection.channel()
            await delete_topology(channel, topology)
            await channel.close()
    finally:
        await connection.close()


Handler = Callable[..., Awaitable[None]]


class TestPrefetch:
    async def test_prefetch_bounds_concurrent_handlers(self, env: Env) -> None:
        """With a slow handler and 2,000 queued, never more than prefetch run at once."""
        consumer = env.consumer(prefetch=25)
        running = 0
        peak = 0
        done: set[str] = set()

        @consumer.handler(env.queue)
        async def slow(body: bytes, delivery: Delivery) -> None:
            nonlocal running, peak
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0.01)
            running -= 1
            done.add(delivery.message_id)

        env.track(consumer)
        async with consumer:
            ids = await env.publish([b"x"] * 2000)
            await wait_until(lambda: len(done) == 2000, timeout=30, what="all processed")
        assert peak <= 25
        assert peak >= 20  # the bound was actually reached
        assert consumer.stats().max_in_progress <= 25
        assert done == set(ids)
        assert await drain(env.queue) == []

    async def test_concurrency_below_prefetch(self, env: Env) -> None:
        """concurrency caps running handlers below the prefetch window."""
        consumer = env.consumer(prefetch=50, concurrency=5)
        running = 0
        peak = 0
        count = 0

        @consumer.handler(env.queue)
        async def slow(body: bytes) -> None:
            nonlocal running, peak, count
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0.01)
            running -= 1
            count += 1

        env.track(consumer)
        async with consumer:
            await env.publish([b"x"] * 200)
            await wait_until(lambda: count == 200, timeout=30)
        assert peak == 5


class TestBatchedAcks:
    @pytest.mark.parametrize("batch_ack", [True, False])
    async def test_out_of_order_completion_loses_and_doubles_nothing(
        self, env: Env, batch_ack: bool
    ) -> None:
        """Random handler times: each message handled once, queue empty, channel never lost."""
        consumer = env.consumer(prefetch=100, batch_ack=batch_ack, ack_batch_size=20)
        seen: collections.Counter[str] = collections.Counter()
        rng = random.Random(7)

        @consumer.handler(env.queue)
        async def handler(body: bytes, delivery: Delivery) -> None:
            await asyncio.sleep(rng.random() * 0.004)
            seen[delivery.message_id] += 1

        env.track(consumer)
        async with consumer:
            ids = await env.publish([b"x"] * 3000)
            await wait_until(lambda: len(seen) == 3000, timeout=60, what="all seen")
            await asyncio.sleep(0.2)  # let the last batch flush
        stats = consumer.stats()
        assert set(seen) == set(ids)
        assert max(seen.values()) == 1  # no redelivery: no ack was lost or refused
        assert stats.channel_reopens == 0  # no PRECONDITION_FAILED closed the channel
        assert stats.stale == 0
        assert stats.acked == 3000
        if batch_ack:
            assert stats.ack_frames < 3000 / 4
        else:
            assert stats.ack_frames == 3000
        assert await drain(env.queue) == []

    async def test_batched_acks_mixed_with_own_frame_settles(self, env: Env) -> None:
        """Batched acks interleaved with retries (acked in their own frame after the
        republish) and stragglers: no frame ever names a settled tag.

        A multiple ack overtaking a single ack of a tag it covers makes the broker
        close the channel with PRECONDITION_FAILED - unknown delivery tag.
        """
        consumer = env.consumer(
            prefetch=100, ack_batch_size=3, ack_flush_interval=0.001, retry_delays=(0.1,)
        )
        done: collections.Counter[str] = collections.Counter()
        rng = random.Random(11)

        @consumer.handler(env.queue)
        async def handler(body: bytes, delivery: Delivery) -> None:
            await asyncio.sleep(rng.random() * 0.003)
            if delivery.attempt == 1 and rng.random() < 0.3:
                raise Retry("again")
            done[delivery.message_id] += 1

        env.track(consumer)
        async with consumer:
            ids = await env.publish([b"x"] * 3000)
            await wait_until(lambda: len(done) == 3000, timeout=60, what="all done")
            await asyncio.sleep(0.2)
        stats = consumer.stats()
        assert stats.channel_reopens == 0  # no PRECONDITION_FAILED closed the channel
        assert stats.stale == 0
        assert stats.retried > 500
        assert set(done) == set(ids)
        assert max(done.values()) == 1
        assert stats.acked == 3000
        for queue in [env.queue, *env.topologies[0].retry_queues]:
            assert await drain(queue) == []

    async def test_user_double_settle_is_harmless(self, env: Env) -> None:
        """A handler acking twice gets False the second time and no channel error."""
        consumer = env.consumer(prefetch=10)
        results: list[tuple[bool, bool]] = []

        @consumer.handler(env.queue)
        async def handler(delivery: Delivery) -> None:
            first = await delivery.ack()
            second = await delivery.ack()
            results.append((first, second))
            await delivery.reject("too late")  # also a no-op

        env.track(consumer)
        async with consumer:
            await env.publish([b"x"] * 30)
            await wait_until(lambda: len(results) == 30, timeout=10)
            await asyncio.sleep(0.2)
        assert set(results) == {(True, False)}
        assert consumer.stats().channel_reopens == 0
        assert consumer.stats().dead_lettered == 0
        assert await drain(env.queue) == []
        assert await drain(consumer.topology(env.queue).dead_letter_queue) == []

    async def test_handled_deliveries_free_their_tickets(self, env: Env) -> None:
        """A delivery kept after its handler keeps its outcome but not its ticket, and
        nothing of the consumer's is left for the cyclic garbage collector: with it
        off, no ticket outlives its delivery's processing."""
        from reliable_mq._consume.session import Ticket

        consumer = env.consumer(prefetch=50)
        kept: list[Delivery] = []

        @consumer.handler(env.queue)
        async def handler(delivery: Delivery) -> None:
            kept.append(delivery)

        env.track(consumer)
        gc.collect()
        gc.disable()
        try:
            async with consumer:
                await env.publish([b"x"] * 300)
                await wait_until(lambda: consumer.stats().acked == 300, timeout=20)
                live = sum(1 for o in gc.get_objects() if type(o) is Ticket)
                assert [await d.ack() for d in kept[:3]] == [False, False, False]
        finally:
            gc.enable()
        assert len(kept) == 300 and {d.outcome for d in kept} == {Settle.ACK}
        assert live == 0
        assert await drain(env.queue) == []


class TestRetryAndDeadLetter:
    async def test_retry_delays_attempts_and_dlq(self, env: Env) -> None:
        """Delays between attempts follow retry_delays; after max_attempts the DLQ gets reasons."""
        consumer = env.consumer(retry_delays=(0.3, 0.8), max_attempts=3)
        attempts: list[tuple[int, float]] = []

        @consumer.handler(env.queue)
        async def poison(order: Order, delivery: Delivery) -> None:
            attempts.append((delivery.attempt, time.monotonic()))
            raise ValueError(f"cannot handle order {order.id}")

        env.track(consumer)
        async with consumer:
            await env.publish([{"id": 7}], ids=["poison-1"])
            await wait_until(
                lambda: consumer.stats().dead_lettered == 1, timeout=10, what="dead-lettered"
            )
        assert [a for a, _ in attempts] == [1, 2, 3]
        gap1 = attempts[1][1] - attempts[0][1]
        gap2 = attempts[2][1] - attempts[1][1]
        assert 0.3 <= gap1 < 0.3 + 0.7, gap1
        assert 0.8 <= gap2 < 0.8 + 0.7, gap2
        stats = consumer.stats()
        assert stats.retried == 2
        dead = await drain(consumer.topology(env.queue).dead_letter_queue)
        assert len(dead) == 1
        message = dead[0]
        headers = message.headers
        assert message.message_id == "poison-1"
        assert message.body == b'{"id":7}'
        assert headers["x-reliable-mq-reason"] == "max_attempts"
        assert headers["x-reliable-mq-error-type"] == "ValueError"
        assert headers["x-reliable-mq-error-message"] == "cannot handle order 7"
        assert headers["x-reliable-mq-attempts"] == 3
        assert headers["x-reliable-mq-queue"] == env.queue
        assert headers["x-reliable-mq-original-routing-key"] == env.queue
        assert "x-reliable-mq-dead-lettered-at" in headers
        assert await drain(env.queue) == []

    async def test_retry_signal_then_success(self, env: Env) -> None:
        """Raising Retry once retries with attempt 2, which then acks."""
        consumer = env.consumer(retry_delays=(0.2,))
        attempts: list[int] = []

        @consumer.handler(env.queue)
        async def flaky(body: str, delivery: Delivery) -> None:
            attempts.append(delivery.attempt)
            if delivery.attempt == 1:
                raise Retry("not yet")

        env.track(consumer)
        async with consumer:
            await env.publish(["hello"])
            await wait_until(lambda: len(attempts) == 2, timeout=10)
            await asyncio.sleep(0.1)
        assert attempts == [1, 2]
        stats = consumer.stats()
        assert (stats.retried, stats.acked, stats.dead_lettered) == (1, 1, 0)
        topology = consumer.topology(env.queue)
        for name in (env.queue, *topology.retry_queues, topology.dead_letter_queue):
            assert await drain(name) == []

    async def test_reject_dead_letters_at_once(self, env: Env) -> None:
        """Reject skips retries."""
        consumer = env.consumer(retry_delays=(0.2,), max_attempts=5)
        calls = 0

        @consumer.handler(env.queue)
        async def handler(body: bytes) -> None:
            nonlocal calls
            calls += 1
            raise Reject("not for us")

        env.track(consumer)
        async with consumer:
            await env.publish([b"x"])
            await wait_until(lambda: consumer.stats().dead_lettered == 1, timeout=10)
        assert calls == 1
        dead = await drain(consumer.topology(env.queue).dead_letter_queue)
        assert dead[0].headers["x-reliable-mq-reason"] == "rejected"
        assert dead[0].headers["x-reliable-mq-error-message"] == "not for us"

    async def test_dead_letter_on_error_policy(self, env: Env) -> None:
        """DEAD_LETTER_ON_ERROR sends a plain exception to the DLQ without retrying."""
        consumer = env.consumer(retry_delays=(0.2,))
        calls = 0

        @consumer.handler(env.queue, ack_policy=AckPolicy.DEAD_LETTER_ON_ERROR)
        async def handler(body: bytes) -> None:
            nonlocal calls
            calls += 1
            raise KeyError("boom")

        env.track(consumer)
        async with consumer:
            await env.publish([b"x"])
            await wait_until(lambda: consumer.stats().dead_lettered == 1, timeout=10)
        assert calls == 1
        dead = await drain(consumer.topology(env.queue).dead_letter_queue)
        assert dead[0].headers["x-reliable-mq-reason"] == "handler_error"
        assert dead[0].headers["x-reliable-mq-error-type"] == "KeyError"

    async def test_invalid_bodies_go_to_dlq_at_once(self, env: Env) -> None:
        """Bad JSON, a wrong schema and a wrong content type never reach the handler."""
        consumer = env.consumer(retry_delays=(0.2,))
        handled: list[int] = []

        @consumer.handler(env.queue)
        async def handler(order: Order) -> None:
            handled.append(order.id)

        env.track(consumer)
        async with consumer:
            await env.publish(
                [b"{not json", b'{"id": "abc"}'], ids=["bad-json", "bad-schema"],
                content_type="application/json",
            )  # fmt: skip
            await env.publish([b'{"id": 1}'], ids=["bad-type"], content_type="text/plain")
            await env.publish([{"id": 2}], ids=["good"])
            await wait_until(lambda: consumer.stats().dead_lettered == 3, timeout=10)
            await wait_until(lambda: handled == [2], timeout=5)
        dead = await drain(consumer.topology(env.queue).dead_letter_queue)
        by_id = {m.message_id: m.headers for m in dead}
        assert set(by_id) == {"bad-json", "bad-schema", "bad-type"}
        for headers in by_id.values():
            assert headers["x-reliable-mq-reason"] == "invalid_body"
            assert headers["x-reliable-mq-attempts"] == 1
        assert "not JSON" in str(by_id["bad-type"]["x-reliable-mq-error-message"])
        assert "id" in str(by_id["bad-schema"]["x-reliable-mq-error-message"])

    async def test_handler_timeout_is_retried(self, env: Env) -> None:
        """A handler past handler_timeout is cancelled and retried; the consumer keeps going."""
        consumer = env.consumer(handler_timeout=0.3, retry_delays=(0.2,))
        events: list[str] = []

        @consumer.handler(env.queue)
        async def handler(body: bytes, delivery: Delivery) -> None:
            if delivery.attempt == 1:
                try:
                    await asyncio.sleep(30)
                except asyncio.CancelledError:
                    events.append("cancelled")
                    raise
            events.append(f"done:{delivery.attempt}")

        env.track(consumer)
        async with consumer:
            started = time.monotonic()
            await env.publish([b"x"])
            await wait_until(lambda: "done:2" in events, timeout=10)
            elapsed = time.monotonic() - started
        assert events == ["cancelled", "done:2"]
        assert elapsed < 3
        dead = await drain(consumer.topology(env.queue).dead_letter_queue)
        assert dead == []


class TestQuorum:
    async def test_delivery_count_counts_attempts(self, env: Env) -> None:
        """On a quorum queue a plain requeue raises the attempt via x-delivery-count."""
        consumer = env.consumer(retry_delays=(0.2,), max_attempts=3)
        attempts: list[int] = []

        @consumer.handler(env.queue, queue_type=QueueType.QUORUM)
        async def handler(delivery: Delivery) -> None:
            attempts.append(delivery.attempt)
            await delivery.nack(requeue=True)  # a hot requeue, as a crash would cause

        env.track(consumer)
        async with consumer:
            await env.publish([b"x"], ids=["q1"])
            await wait_until(lambda: consumer.stats().dead_lettered == 1, timeout=15)
        assert attempts == [1, 2, 3]  # the 4th delivery went to the DLQ unhandled
        dead = await drain(consumer.topology(env.queue).dead_letter_queue)
        assert dead[0].message_id == "q1"
        assert dead[0].headers["x-reliable-mq-reason"] == "max_attempts"
        assert dead[0].headers["x-reliable-mq-attempts"] == 4

    async def test_quorum_retry_round_trip(self, env: Env) -> None:
        """Retry through a quorum retry queue comes back with attempt 2."""
        consumer = env.consumer(retry_delays=(0.2,))
        attempts: list[int] = []

        @consumer.handler(env.queue, queue_type="quorum")
        async def handler(body: bytes, delivery: Delivery) -> None:
            attempts.append(delivery.attempt)
            if delivery.attempt == 1:
                raise Retry()

        env.track(consumer)
        async with consumer:
            await env.publish([b"x"])
            await wait_until(lambda: attempts == [1, 2], timeout=10)


async def _rabbitmqctl(*args: str) -> str:
    process = await asyncio.create_subprocess_exec(
        "rabbitmqctl", "-q", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    return out.decode()


async def _connection_pid(name: str) -> str:
    for _ in range(50):
        for line in (
            await _rabbitmqctl("list_connections", "pid", "client_properties")
        ).splitlines():
            if f'{{"connection_name","{name}"}}' in line:
                return line.split("\t", 1)[0]
        await asyncio.sleep(0.2)
    raise AssertionError(f"no connection named {name}")


class _SwallowingStore(MemoryDedupStore):
    """Its first claim waits until cancelled, then answers as if the answer had come
    in the same turn as the cancel (the cancel is swallowed). Awaited: not the memory
    store's own type, so the consumer does not take it for one that answers at once."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = asyncio.Event()
        self.swallowed = 0

    async def claim(self, message_id: str, *, owner: str, lease: float) -> ClaimResult:
        result = self.claim_nowait(message_id, owner=owner, lease=lease)
        if not self.waiting.is_set():
            self.waiting.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.swallowed += 1
        return result


class TestFaults:
    async def test_connection_cut_with_handlers_in_flight(self, env: Env) -> None:
        """Closing the consumer's connection mid-flight loses nothing and trips no stale tag."""
        consumer = env.consumer(prefetch=50, ack_batch_size=10)
        processed: collections.Counter[str] = collections.Counter()
        cut_done = asyncio.Event()

        @consumer.handler(env.queue)
        async def handler(body: bytes, delivery: Delivery) -> None:
            await asyncio.sleep(0.1)
            if len(processed) >= 100:
                await cut_done.wait()  # hold deliveries in flight until the cut (no timing bet)
            processed[delivery.message_id] += 1

        env.track(consumer)
        async with consumer:
            pid = await _connection_pid(consumer.connection_name)
            ids = await env.publish([b"x"] * 600)
            await wait_until(lambda: len(processed) >= 100, timeout=20, what="first hundred")
            await wait_until(
                lambda: consumer.stats().in_progress > 0, timeout=20, what="handlers in flight"
            )
            await _rabbitmqctl("close_connection", pid, "test cut")
            await wait_until(
                lambda: consumer.stats().channel_reopens >= 1, timeout=30, what="the reopen"
            )
            cut_done.set()
            await wait_until(
                lambda: set(ids) <= set(processed), timeout=60, what="every message processed"
            )
            await asyncio.sleep(0.3)
            stats = consumer.stats()
        assert stats.channel_reopens == 1  # the cut only: no PRECONDITION_FAILED afterwards
        assert stats.stale > 0  # in-flight settles of the dead channel were dropped
        assert set(processed) == set(ids)
        assert await drain(env.queue) == []

    async def test_a_cancel_the_store_swallowed_keeps_the_handler_from_running(
        self, env: Env
    ) -> None:
        """The connection dies while the dedup store is awaited, and the store answers
        CLAIMED anyway (as ``asyncio.wait_for`` does when the answer came in the same
        turn as the cancel, redis-py's client uses it): the handler must not run on the
        dead channel. It ran, and its claim was released after the effect, so the
        redelivery ran it again: the duplicate effects of the end-to-end cut test."""
        store = _SwallowingStore()
        consumer = env.consumer(dedup=store)
        runs: collections.Counter[str] = collections.Counter()

        @consumer.handler(env.queue)
        async def handler(delivery: Delivery) -> None:
            runs[delivery.message_id] += 1

        env.track(consumer)
        async with consumer:
            pid = await _connection_pid(consumer.connection_name)
            await env.publish([b"x"], ids=["m1"])
            await asyncio.wait_for(store.waiting.wait(), 10)
            await _rabbitmqctl("close_connection", pid, "test cut")
            await wait_until(lambda: consumer.stats().acked == 1, timeout=30, what="the ack")
            await asyncio.sleep(0.2)
        assert store.swallowed == 1
        assert runs == collections.Counter({"m1": 1})
        assert await drain(env.queue) == []

    async def test_sigterm_drains_and_exits(self, env: Env, tmp_path: Path) -> None:
        """run() in a subprocess: SIGTERM lets in-flight handlers finish; nothing is lost."""
        out = tmp_path / "processed.txt"
        script = tmp_path / "consume.py"
        script.write_text(
            textwrap.dedent(
                """
                import asyncio, sys
                from pydantic import SecretStr
                from reliable_mq import ConnectionSettings
                from reliable_mq.consumer import ReliableConsumer
                from reliable_mq.delivery import Delivery

                url, queue, out, name = sys.argv[1:5]
                consumer = ReliableConsumer(
                    ConnectionSettings(url=SecretStr(url), connection_name=name),
                    prefetch=20,
                    shutdown_grace=10,
                )

                @consumer.handler(queue)
                async def handler(body: bytes, delivery: Delivery) -> None:
                    await asyncio.sleep(0.3)
                    with open(out, "a") as f:
                        f.write(delivery.message_id + "\\n")

                asyncio.run(consumer.run())
                print("exited cleanly")
                """
            )
        )
        probe = env.consumer()  # only for the topology name/cleanup

        @probe.handler(env.queue)
        async def unused(body: bytes) -> None: ...

        env.track(probe)
        connection = await aio_pika.connect(URL)
        await declare_topology(await connection.channel(), probe.topology(env.queue))
        await connection.close()
        ids = await env.publish([b"x"] * 200)
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            str(script),
            URL,
            env.queue,
            str(out),
            f"test-consumer-{env.suffix}-sub",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )

        def lines() -> list[str]:
            return out.read_text().split() if out.exists() else []

        await wait_until(lambda: len(lines()) >= 30, timeout=30, what="subprocess processing")
        process.send_signal(signal.SIGTERM)
        stdout, stderr = await asyncio.wait_for(process.communicate(), 20)
        assert process.returncode == 0, stderr.decode()
        assert b"exited cleanly" in stdout
        processed = lines()
        remaining = [m.message_id or "" for m in await drain(env.queue)]
        assert len(processed) == len(set(processed))
        assert not set(processed) & set(remaining)  # in-flight ones finished and were acked
        assert sorted(processed + remaining) == sorted(ids)
        assert len(remaining) > 0  # it stopped before the end


class TestLifecycle:
    async def test_stop_requeues_handlers_past_grace(self, env: Env) -> None:
        """Handlers still running when the grace period ends are cancelled and requeued."""
        consumer = env.consumer(prefetch=10)
        started: list[str] = []
        cancelled: list[str] = []

        @consumer.handler(env.queue)
        async def stuck(body: bytes, delivery: Delivery) -> None:
            started.append(delivery.message_id)
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.append(delivery.message_id)
                raise

        env.track(consumer)
        await consumer.start()
        ids = await env.publish([b"x"] * 3)
        await wait_until(lambda: len(started) == 3, timeout=10)
        begun = time.monotonic()
        await consumer.stop(grace=0.3)
        assert time.monotonic() - begun < 3
        await consumer.stop()  # idempotent
        assert sorted(cancelled) == sorted(ids)
        assert consumer.stats().requeued == 3
        remaining = await drain(env.queue)
        assert sorted(m.message_id or "" for m in remaining) == sorted(ids)
        assert all(m.redelivered for m in remaining)

    async def test_a_stopped_consumer_refuses_to_start_again(self, env: Env) -> None:
        """start() after stop() raises ClosedError: it used to return at once and
        consume nothing, leaving the caller's ``async with`` waiting on an idle consumer."""
        consumer = env.consumer()

        @consumer.handler(env.queue)
        async def handler(body: bytes) -> None: ...

        env.track(consumer)
        async with consumer:
            pass
        with pytest.raises(ClosedError, match="cannot start again"):
            await consumer.start()
        with pytest.raises(ClosedError):
            async with consumer:
                pass

    async def test_broker_cancel_resumes(self, env: Env) -> None:
        """If the broker cancels the consumer (queue deleted), it redeclares and resumes."""
        consumer = env.consumer()
        seen: list[str] = []

        @consumer.handler(env.queue)
        async def handler(body: bytes, delivery: Delivery) -> None:
            seen.append(delivery.message_id)

        env.track(consumer)
        async with consumer:
            await env.publish([b"x"], ids=["before"])
            await wait_until(lambda: seen == ["before"], timeout=5)
            connection = await aio_pika.connect(URL)
            channel = await connection.channel()
            await channel.queue_delete(env.queue)
            await connection.close()
            await wait_until(
                lambda: consumer.stats().channel_reopens == 1, timeout=10, what="reopened"
            )
            await env.publish([b"x"], ids=["after"])
            await wait_until(lambda: seen == ["before", "after"], timeout=5)

    async def test_run_returns_after_stop(self, env: Env) -> None:
        """run() returns once stop() is called from elsewhere, restoring signal handlers."""
        consumer = env.consumer()
        seen: list[str] = []

        @consumer.handler(env.queue)
        async def handler(body: str) -> None:
            seen.append(body)

        env.track(consumer)
        previous = signal.getsignal(signal.SIGTERM)
        runner = asyncio.create_task(consumer.run())
        await wait_until(lambda: consumer.consuming, timeout=10)
        await env.publish(["hi"])
        await wait_until(lambda: seen == ["hi"], timeout=10)
        await consumer.stop()
        await asyncio.wait_for(runner, 10)
        assert signal.getsignal(signal.SIGTERM) == previous


class TestPoliciesAndMetrics:
    async def test_manual_policy_unsettled_return_is_retried(self, env: Env) -> None:
        """MANUAL: returning without settling retries; an explicit ack ends it."""
        consumer = env.consumer(retry_delays=(0.2,))
        attempts: list[int] = []

        @consumer.handler(env.queue, ack_policy=AckPolicy.MANUAL)
        async def handler(delivery: Delivery) -> None:
            attempts.append(delivery.attempt)
            if delivery.attempt == 2:
                assert await delivery.ack()

        env.track(consumer)
        async with consumer:
            await env.publish([b"x"])
            await wait_until(lambda: attempts == [1, 2], timeout=10)
            await asyncio.sleep(0.1)
        stats = consumer.stats()
        assert (stats.retried, stats.acked) == (1, 1)

    async def test_ack_first_policy_acks_despite_failure(self, env: Env) -> None:
        """ACK_FIRST is at-most-once: a failing handler still leaves the message acked."""
        consumer = env.consumer(retry_delays=(0.2,))
        calls = 0

        @consumer.handler(env.queue, ack_policy=AckPolicy.ACK_FIRST)
        async def handler(body: bytes) -> None:
            nonlocal calls
            calls += 1
            raise RuntimeError("lost on purpose")

        env.track(consumer)
        async with consumer:
            await env.publish([b"x"])
            await wait_until(lambda: calls == 1, timeout=10)
            await asyncio.sleep(0.4)
        assert calls == 1
        assert consumer.stats().retried == 0
        assert await drain(env.queue) == []

    async def test_metrics_are_recorded(self, env: Env) -> None:
        """Outcome counters, ack batches, DLQ reasons and handler durations reach the registry."""
        consumer = env.consumer(retry_delays=(0.2,), max_attempts=1)

        @consumer.handler(env.queue)
        async def handler(body: bytes, delivery: Delivery) -> None:
            if delivery.message_id == "bad":
                raise ValueError("nope")

        env.track(consumer)
        async with consumer:
            await env.publish([b"x"] * 10)
            await env.publish([b"x"], ids=["bad"])
            await wait_until(lambda: consumer.stats().dead_lettered == 1, timeout=10)
            await wait_until(lambda: consumer.stats().acked == 10, timeout=10)
            await asyncio.sleep(0.1)

        def value(name: str, **labels: str) -> float:
            sample = env.registry.get_sample_value(name, labels)
            return sample or 0.0

        q = env.queue
        assert value("reliable_mq_consumed_messages_total", queue=q, outcome="acked") == 10
        assert value("reliable_mq_consumed_messages_total", queue=q, outcome="dead_lettered") == 1
        assert (
            value("reliable_mq_dead_lettered_messages_total", queue=q, reason="max_attempts") == 1
        )
        assert value("reliable_mq_ack_batches_total", queue=q) >= 1
        assert value("reliable_mq_handler_duration_seconds_count", queue=q) == 11
        assert value("reliable_mq_handlers_in_progress", queue=q) == 0


class TestRepublishEdges:
    async def test_retry_keeps_a_missing_content_type_missing(self, env: Env) -> None:
        """A JSON body sent without content type still decodes on attempt 2."""
        consumer = env.consumer(retry_delays=(0.2,))
        seen: list[tuple[int, dict[str, Any]]] = []

        @consumer.handler(env.queue)
        async def handler(body: dict[str, Any], delivery: Delivery) -> None:
            seen.append((delivery.attempt, body))
            if delivery.attempt == 1:
                raise Retry()

        env.track(consumer)
        async with consumer:
            connection = await aio_pika.connect(URL)
            channel = await connection.channel()
            await channel.default_exchange.publish(
                aio_pika.Message(b'{"a": 1}', message_id="no-ct"), routing_key=env.queue
            )
            await connection.close()
            await wait_until(lambda: len(seen) == 2, timeout=10)
        assert seen == [(1, {"a": 1}), (2, {"a": 1})]
        assert consumer.stats().dead_lettered == 0

    async def test_missing_retry_queue_fails_start(self, env: Env) -> None:
        """declare=False and no retry queues: start() fails at once instead of looping later."""
        from reliable_mq import ConsumerError

        consumer = env.consumer(retry_delays=(0.2,))

        @consumer.handler(env.queue, declare=False)
        async def handler(body: bytes) -> None: ...

        env.track(consumer)
        connection = await aio_pika.connect(URL)
        channel = await connection.channel()
        await channel.declare_queue(env.queue, durable=True)  # no retry queues, no DLQ
        await connection.close()
        with pytest.raises(ConsumerError, match="nowhere to go"):
            await consumer.start()
        await consumer.stop()

    async def test_conflicting_queue_type_is_used_as_it_is(self, env: Env) -> None:
        """A queue that exists with other arguments is adopted (see tests/consume/test_own_queue.py)."""
        connection = await aio_pika.connect(URL)
        channel = await connection.channel()
        await channel.declare_queue(env.queue, durable=True)  # classic, no DLX arguments
        await connection.close()
        consumer = env.consumer()

        @consumer.handler(env.queue, queue_type=QueueType.QUORUM)
        async def handler(body: bytes) -> None: ...

        env.track(consumer)
        await consumer.start()
        assert consumer.consuming
        await consumer.stop()
