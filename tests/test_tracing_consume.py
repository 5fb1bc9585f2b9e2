"""OpenTelemetry on the consumer side (issue 21): settle spans, parent mode, copies.

Against the real broker, each test with its own SDK provider and in-memory
exporter (the `Spans` fixture of ``tests/test_tracing.py``, never the global
provider). A settle span is recorded when its frame is written (or known lost),
so a finished span is the proof that it ended.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aio_pika
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry

from reliable_mq import ReliablePublisher
from reliable_mq._consume.copies import build_copy
from reliable_mq._consume.settle import Cause, Decision, Outcome
from reliable_mq._tracing import CHANNEL_CLOSED
from reliable_mq.consumer import ReliableConsumer
from reliable_mq.delivery import Delivery, Settle
from reliable_mq.handlers import BatchFailed, Reject
from reliable_mq.headers import DROPPED_HEADERS_HEADER
from reliable_mq.testing import TCPProxy
from reliable_mq.topology import delete_topology
from tests.conftest import proxied_url
from tests.consume.test_settle import TOPOLOGY, _delivery
from tests.support.waiting import wait_until
from tests.test_tracing import (  # noqa: F401 (_consumers, _spans: fixtures)
    ConsumerEnv,
    Spans,
    _consumers,
    _spans,
    connection,
    ids_of,
    link_of,
    traceparent,
)

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
TRACE_ID, SPAN_ID = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331


def settles(spans: Spans) -> list[ReadableSpan]:
    return [
        s
        for s in spans.exporter.get_finished_spans()
        if (s.attributes or {}).get("messaging.operation.type") == "settle"
    ]


def by_id(found: list[ReadableSpan]) -> dict[str, ReadableSpan]:
    return {str((s.attributes or {})["messaging.message.id"]): s for s in found}


def parent_of(span: ReadableSpan) -> tuple[int, int] | None:
    return None if span.parent is None else (span.parent.trace_id, span.parent.span_id)


async def publish(env: ConsumerEnv, spans: Spans | None, *ids: str) -> None:
    async with ReliablePublisher(
        connection(env.url),
        registry=CollectorRegistry(),
        tracer_provider=None if spans is None else spans.provider,
    ) as publisher:
        for message_id in ids:
            await publisher.publish(b"x", routing_key=env.queue, message_id=message_id)


@pytest.mark.rabbitmq
class TestSettleSpans:
    async def test_a_batched_ack_is_one_span_linked_to_every_delivery(
        self, consumers: ConsumerEnv, spans: Spans
    ) -> None:
        """10 acks in one ``multiple=true`` frame: one CLIENT ``ack {queue}`` span, a root,
        ``messaging.batch.message_count`` 10, a link to each process span, timed from
        the first ack queued to the frame."""
        consumer = consumers.consumer(ack_batch_size=10, ack_flush_interval=5.0)

        @consumer.handler(consumers.queue)
        async def handle(body: bytes, delivery: Delivery) -> None:
            pass

        async with consumer:
            await publish(consumers, None, *(f"b-{n}" for n in range(10)))
            await wait_until(lambda: len(settles(spans)) == 1, timeout=10, what="the ack span")
            assert consumer.stats().ack_frames == 1
        processes = spans.named("process ")
        [ack] = settles(spans)
        assert len(processes) == 10
        assert ack.name == f"ack {consumers.queue}"
        assert ack.kind is SpanKind.CLIENT
        assert ack.parent is None, "a batch belongs to no one delivery's trace"
        assert sorted((link.context.trace_id, link.context.span_id) for link in ack.links) == (
            sorted(ids_of(p) for p in processes)
        )
        attributes = dict(ack.attributes or {})
        assert attributes.pop("messaging.rabbitmq.message.delivery_tag") == max(
            (p.attributes or {})["messaging.rabbitmq.message.delivery_tag"] for p in processes
        )
        assert attributes == {
            "messaging.system": "rabbitmq",
            "messaging.operation.type": "settle",
            "messaging.operation.name": "ack",
            "messaging.destination.name": consumers.queue,
            "messaging.batch.message_count": 10,
            "reliable_mq.settle": "ack",
            "server.address": "127.0.0.1",
            "server.port": 5672,
        }
        assert ack.start_time is not None and ack.end_time is not None
        assert min(p.start_time or 0 for p in processes) <= ack.start_time <= ack.end_time
        assert ack.start_time <= min(p.end_time or 0 for p in processes), "first ack queued"
        assert ack.status.status_code is StatusCode.UNSET

    async def test_an_unbatched_ack_is_a_child_of_its_process_span(
        self, consumers: ConsumerEnv, spans: Spans
    ) -> None:
        """``batch_ack=False``: one ``ack`` span per delivery, a child of its process span,
        inside it in time, with the message's id and no batch count."""
        consumer = consumers.consumer(batch_ack=False)

        @consumer.handler(consumers.queue)
        async def handle(body: bytes, delivery: Delivery) -> None:
            pass

        async with consumer:
            await publish(consumers, None, "u-1", "u-2")
            await wait_until(lambda: len(settles(spans)) == 2, timeout=10, what="2 ack spans")
        processes = by_id(spans.named("process "))
        for message_id, ack in by_id(settles(spans)).items():
            process = processes[message_id]
            assert ack.name == f"ack {consumers.queue}" and ack.kind is SpanKind.CLIENT
            assert parent_of(ack) == ids_of(process)
            assert not ack.links
            assert ack.attributes is not None
            assert "messaging.batch.message_count" not in ack.attributes
            assert ack.attributes["reliable_mq.settle"] == "ack"
            assert (
                ack.attributes["messaging.rabbitmq.message.delivery_tag"]
                == (process.attributes or {})["messaging.rabbitmq.message.delivery_tag"]
            )
            assert process.start_time is not None and process.end_time is not None
            assert ack.start_time is not None and ack.end_time is not None
            assert process.start_time <= ack.start_time <= ack.end_time <= process.end_time

    async def test_nack_reject_retry_and_dead_letter(
        self, consumers: ConsumerEnv, spans: Spans
    ) -> None:
        """Each settle is a child span of its process span: a requeue and a drop are
        ``nack`` (``reliable_mq.settle`` requeue / reject); a retry and a dead letter
        are a copy published and then an ``ack`` (settle retry / dead_letter)."""
        consumer = consumers.consumer(retry_delays=(0.1,), max_attempts=3)

        @consumer.handler(consumers.queue)
        async def handle(body: bytes, delivery: Delivery) -> None:
            match delivery.message_id:
                case "requeue" if not delivery.redelivered:
                    await delivery.nack(requeue=True)
                case "drop":
                    await delivery.nack(requeue=False)
                case "dead":
                    raise Reject("bad order")
                case "retry" if delivery.attempt == 1:
                    raise ValueError("not yet")

        async with consumer:
            await publish(consumers, spans, "requeue", "drop", "dead", "retry")
            await wait_until(lambda: len(spans.named("process ")) == 6, timeout=15)
            await wait_until(lambda: consumer.stats().in_progress == 0, timeout=10)
        processes = spans.named("process ")
        first = {
            str((p.attributes or {})["messaging.message.id"]): p
            for p in processes
            if (p.attributes or {})["reliable_mq.attempt"] == 1
            and (p.attributes or {}).get("reliable_mq.settle") != "ack"
        }
        assert set(first) == {"requeue", "drop", "dead", "retry"}
        found = {parent_of(s): s for s in settles(spans) if s.parent is not None}
        expected = {
            "requeue": ("nack", "requeue"),
            "drop": ("nack", "reject"),
            "dead": ("ack", "dead_letter"),
            "retry": ("ack", "retry"),
        }
        for message_id, (operation, settle) in expected.items():
            span = found[ids_of(first[message_id])]
            assert span.name == f"{operation} {consumers.queue}"
            assert span.kind is SpanKind.CLIENT
            assert span.attributes is not None
            assert span.attributes["messaging.operation.name"] == operation
            assert span.attributes["reliable_mq.settle"] == settle
            assert span.attributes["messaging.message.id"] == message_id
            assert span.status.status_code is StatusCode.UNSET
        # The retry's copy: its publish span is a sibling, the original's link kept.
        [copy] = [s for s in spans.named("publish ") if parent_of(s) == ids_of(first["retry"])]
        retried = [
            p
            for p in processes
            if (p.attributes or {})["messaging.message.id"] == "retry"
            and (p.attributes or {})["reliable_mq.attempt"] == 2
        ]
        assert len(retried) == 1 and link_of(retried[0]) == link_of(first["retry"])
        assert copy.end_time is not None and copy.end_time <= (
            found[ids_of(first["retry"])].end_time or 0
        ), "the copy is confirmed before the original's ack"

    async def test_batched_acks_lost_with_the_channel_end_with_an_error(
        self, broker_url: str, spans: Spans, proxy: TCPProxy
    ) -> None:
        """Acks still batched when the connection is cut: each delivery's settle span
        ends with ``error.type=channel_closed`` (status ERROR), a child of its process
        span; the redeliveries are settled (duplicates) and traced as usual."""
        env = ConsumerEnv(proxied_url(proxy), spans)
        consumer = env.consumer(ack_batch_size=1000, ack_flush_interval=10.0)
        handled: list[str] = []

        @consumer.handler(env.queue)
        async def handle(body: bytes, delivery: Delivery) -> None:
            handled.append(delivery.message_id)

        try:
            async with consumer:
                env.url = broker_url  # publish around the proxy
                await publish(env, None, *(f"l-{n}" for n in range(5)))
                await wait_until(lambda: len(handled) == 5, timeout=10, what="5 handled")
                assert settles(spans) == [], "still batched"
                assert await proxy.cut() > 0
                await wait_until(
                    lambda: consumer.stats().duplicates == 5, timeout=15, what="redeliveries"
                )
        finally:
            await _delete(consumer, env.queue, broker_url)
        processes = spans.named("process ")
        assert len(processes) == 10
        lost = [s for s in settles(spans) if s.status.status_code is StatusCode.ERROR]
        assert len(lost) == 5
        first = {ids_of(p) for p in processes if p.attributes and not p.events}
        for span in lost:
            assert span.attributes is not None
            assert span.attributes["error.type"] == CHANNEL_CLOSED
            assert span.name == f"ack {env.queue}"
            assert parent_of(span) in first
        written = [s for s in settles(spans) if s not in lost]
        assert (
            sum(int((s.attributes or {}).get("messaging.batch.message_count", 1)) for s in written)
            == 5
        )
        assert {(s.attributes or {})["reliable_mq.settle"] for s in written} == {"duplicate"}

    async def test_shutdown_past_grace_requeues_with_a_nack_span(
        self, consumers: ConsumerEnv, spans: Spans
    ) -> None:
        """A handler still running when the grace ends: its delivery is requeued, a
        ``nack`` span (settle requeue), and its process span ends too."""
        consumer = consumers.consumer(shutdown_grace=0.2)
        started = asyncio.Event()

        @consumer.handler(consumers.queue)
        async def handle(body: bytes, delivery: Delivery) -> None:
            started.set()
            await asyncio.sleep(30)

        async with consumer:
            await publish(consumers, None, "slow")
            await asyncio.wait_for(started.wait(), 10)
        [process] = spans.named("process ")
        [nack] = settles(spans)
        assert nack.name == f"nack {consumers.queue}"
        assert parent_of(nack) == ids_of(process)
        assert (nack.attributes or {})["reliable_mq.settle"] == "requeue"
        assert (process.attributes or {})["reliable_mq.settle"] == "requeue"

    async def test_a_handler_cut_by_its_timeout_is_retried_with_an_ack_span(
        self, consumers: ConsumerEnv, spans: Spans
    ) -> None:
        """``handler_timeout`` cuts the first run: its retry copy is published and the
        original acked (an ``ack`` span, settle retry); its process span ends, with
        the timeout's ``error.type``."""
        consumer = consumers.consumer(handler_timeout=0.3, retry_delays=(0.1,))

        @consumer.handler(consumers.queue)
        async def handle(body: bytes, delivery: Delivery) -> None:
            if delivery.attempt == 1:
                await asyncio.sleep(30)

        async with consumer:
            await publish(consumers, None, "slow")
            await wait_until(lambda: len(spans.named("process ")) == 2, timeout=15)
        first = next(
            p for p in spans.named("process ") if (p.attributes or {})["reliable_mq.attempt"] == 1
        )
        assert first.attributes is not None
        assert first.attributes["reliable_mq.outcome"] == "timed_out"
        assert first.status.status_code is StatusCode.ERROR
        [ack] = [s for s in settles(spans) if parent_of(s) == ids_of(first)]
        assert ack.name == f"ack {consumers.queue}"
        assert (ack.attributes or {})["reliable_mq.settle"] == "retry"


@pytest.mark.rabbitmq
class TestParentMode:
    async def test_parent_from_message(self, consumers: ConsumerEnv, spans: Spans) -> None:
        """``trace_parent_from_message=True``: the process span is the publish span's
        child, in its trace, and still links to it."""
        consumer = consumers.consumer(trace_parent_from_message=True)

        @consumer.handler(consumers.queue)
        async def handle(body: bytes, delivery: Delivery) -> None:
            pass

        async with consumer:
            await publish(consumers, spans, "p-1")
            await wait_until(lambda: len(spans.named("process ")) == 1, timeout=10)
        [published] = spans.named("publish ")
        [process] = spans.named("process ")
        assert parent_of(process) == ids_of(published)
        assert link_of(process) == ids_of(published)

    async def test_without_a_traceparent_the_process_span_is_a_root(
        self, consumers: ConsumerEnv, spans: Spans
    ) -> None:
        """Parent mode with a message that has no ``traceparent``: a root, no link."""
        consumer = consumers.consumer(trace_parent_from_message=True)

        @consumer.handler(consumers.queue)
        async def handle(body: bytes, delivery: Delivery) -> None:
            pass

        async with consumer:
            await publish(consumers, None, "plain")
            await wait_until(lambda: len(spans.named("process ")) == 1, timeout=10)
        [process] = spans.named("process ")
        assert process.parent is None and not process.links


@pytest.mark.rabbitmq
class TestTrimmedCopy:
    async def test_a_trimmed_retry_copy_keeps_the_trace_context(
        self, consumers: ConsumerEnv, spans: Spans
    ) -> None:
        """The full copy is over ``frame_max``: the trimmed one drops the large header but
        keeps ``traceparent``/``tracestate``, so the retry's process span links to the
        original creation context."""
        consumer = consumers.consumer(retry_delays=(0.1,), prefetch=1)
        seen: list[dict[str, Any]] = []

        @consumer.handler(consumers.queue)
        async def handle(body: bytes, delivery: Delivery) -> None:
            seen.append(dict(delivery.headers))
            if delivery.attempt == 1:
                raise ValueError("e" * 2000)  # the last-error header tips the copy over

        headers = {"big": "x" * 130_500, "traceparent": TRACEPARENT, "tracestate": "k=v"}
        async with consumer:
            link = await aio_pika.connect(consumers.url)
            async with link:
                channel = await link.channel()
                await channel.default_exchange.publish(
                    aio_pika.Message(b"x", message_id="t-1", headers=headers),
                    routing_key=consumers.queue,
                )
            await wait_until(lambda: len(seen) == 2, timeout=15, what="the retried attempt")
            await wait_until(lambda: len(spans.named("process ")) == 2, timeout=10)
        assert "big" not in seen[1] and seen[1][DROPPED_HEADERS_HEADER] == "big"
        assert seen[1]["traceparent"] == TRACEPARENT and seen[1]["tracestate"] == "k=v"
        for process in spans.named("process "):
            assert link_of(process) == (TRACE_ID, SPAN_ID)


@pytest.mark.unit
def test_build_copy_trimmed_keeps_traceparent_and_tracestate() -> None:
    """The pure rule: a trimmed copy keeps the W3C trace context (if small)."""
    copy = build_copy(
        _delivery({"app": "x" * 5000, "traceparent": TRACEPARENT, "tracestate": "k=v"}),
        TOPOLOGY,
        1.0,
        Decision(Settle.RETRY),
        Cause(Outcome.RAISED, ValueError("x")),
        trimmed=True,
    )
    assert copy.headers["traceparent"] == TRACEPARENT
    assert copy.headers["tracestate"] == "k=v"
    assert copy.headers[DROPPED_HEADERS_HEADER] == "app"


async def _delete(consumer: ReliableConsumer, queue: str, url: str) -> None:
    link = await aio_pika.connect(url)
    async with link:
        channel = await link.channel()
        await delete_topology(channel, consumer.topology(queue))


def batch_spans(spans: Spans) -> list[ReadableSpan]:
    return [
        s
        for s in spans.named("process ")
        if "messaging.batch.message_count" in (s.attributes or {})
    ]


@pytest.mark.rabbitmq
class TestBatchHandlerSpans:
    async def test_a_batch_call_is_one_process_span_linked_to_its_deliveries(
        self, consumers: ConsumerEnv, spans: Spans
    ) -> None:
        """A batch handler's call runs in one CONSUMER ``process {queue}`` span, a root
        with the batch's count and a link to each delivery's process span; the
        handler's own spans are its children, not the leading delivery's."""
        consumer = consumers.consumer(prefetch=20)
        tracer = spans.provider.get_tracer("test")

        @consumer.batch_handler(consumers.queue, max_size=10, max_wait=5.0)
        async def handle(bodies: list[bytes]) -> None:
            with tracer.start_as_current_span("work"):
                pass

        async with consumer:
            await publish(consumers, None, *(f"b-{n}" for n in range(10)))
            await wait_until(lambda: len(spans.named("work")) == 1, timeout=10, what="the call")
            await wait_until(lambda: consumer.stats().in_progress == 0, timeout=10)
        [batch] = batch_spans(spans)
        deliveries = [s for s in spans.named("process ") if s is not batch]
        [work] = spans.named("work")
        assert len(deliveries) == 10
        assert batch.name == f"process {consumers.queue}"
        assert batch.kind is SpanKind.CONSUMER
        assert batch.parent is None
        assert parent_of(work) == ids_of(batch)
        assert sorted((link.context.trace_id, link.context.span_id) for link in batch.links) == (
            sorted(ids_of(p) for p in deliveries)
        )
        attributes = batch.attributes or {}
        assert attributes["messaging.batch.message_count"] == 10
        assert attributes["messaging.operation.type"] == "process"
        assert attributes["reliable_mq.batch.failed"] == 0
        assert batch.status.status_code is StatusCode.UNSET
        assert all(p.end_time is not None and p.end_time >= batch.end_time for p in deliveries)  # type: ignore[operator]

    async def test_failed_messages_are_counted_and_a_failed_call_is_an_error(
        self, consumers: ConsumerEnv, spans: Spans
    ) -> None:
        """`BatchFailed` for 2 of 4: the call's span counts 2 failed and is no error; a
        call that raises fails every message: ``error.type`` is the exception's class."""
        consumer = consumers.consumer(prefetch=20)
        calls = 0

        @consumer.batch_handler(consumers.queue, max_size=4, max_wait=5.0)
        async def handle(bodies: list[bytes], deliveries: list[Delivery]) -> None:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise BatchFailed({0: Reject("bad"), deliveries[1].message_id: Reject("bad")})
            raise Reject("all bad")

        async with consumer:
            await publish(consumers, None, *(f"f-{n}" for n in range(4)))
            await wait_until(lambda: len(batch_spans(spans)) == 1, timeout=10, what="call 1")
            await publish(consumers, None, *(f"g-{n}" for n in range(4)))
            await wait_until(lambda: len(batch_spans(spans)) == 2, timeout=10, what="call 2")
            await wait_until(lambda: consumer.stats().in_progress == 0, timeout=10)
        first, second = sorted(batch_spans(spans), key=lambda s: s.start_time or 0)
        assert (first.attributes or {})["reliable_mq.batch.failed"] == 2
        assert first.status.status_code is StatusCode.UNSET
        assert (second.attributes or {})["reliable_mq.batch.failed"] == 4
        assert (second.attributes or {})["error.type"] == "Reject"
        assert second.status.status_code is StatusCode.ERROR
