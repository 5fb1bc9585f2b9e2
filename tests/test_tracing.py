"""OpenTelemetry tracing (issue 21): publish and process spans, against the real broker.

Every test passes its own SDK ``TracerProvider`` (a ``SimpleSpanProcessor`` into an
``InMemorySpanExporter``) as ``tracer_provider``: the global provider is never set,
so the tests of the "off" path see the API's default proxy.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from reliable_mq import ConnectionSettings, PublisherSettings, ReliablePublisher
from reliable_mq._tracing import Tracing, consume_destination, publish_destination
from reliable_mq.consumer import ReliableConsumer
from reliable_mq.delivery import Delivery
from reliable_mq.errors import PublishGaveUp, PublishUnroutable
from reliable_mq.testing import TCPProxy
from reliable_mq.topology import delete_topology
from tests.conftest import proxied_url
from tests.support.amqp import drain_queue
from tests.support.waiting import wait_until


class Spans:
    """A tracer provider of its own and what it recorded."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def named(self, prefix: str) -> list[ReadableSpan]:
        return [span for span in self.exporter.get_finished_spans() if span.name.startswith(prefix)]


@pytest.fixture(name="spans")
def _spans() -> Spans:
    return Spans()


def traceparent(span: ReadableSpan) -> str:
    context = span.get_span_context()
    assert context is not None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def fast(**overrides: Any) -> PublisherSettings:
    return PublisherSettings(
        **{"publish_timeout": 30, "backoff_initial": 0.01, "backoff_max": 0.2, **overrides}
    )


def connection(url: str) -> ConnectionSettings:
    return ConnectionSettings(
        url=SecretStr(url),
        connection_name=f"test-tracing-{uuid.uuid4().hex[:8]}",
        reconnect_initial_delay=0.05,
        reconnect_max_delay=0.5,
        connect_timeout=5,
    )


@pytest.mark.unit
class TestDestinations:
    def test_publish_destination_follows_the_rabbitmq_convention(self) -> None:
        """``{exchange}:{routing key}``, an empty part left out, ``amq.default`` for neither."""
        assert publish_destination("orders", "created") == "orders:created"
        assert publish_destination("", "jobs") == "jobs"
        assert publish_destination("fanout", "") == "fanout"
        assert publish_destination("", "") == "amq.default"

    def test_consume_destination_names_the_queue_once(self) -> None:
        """``{exchange}:{routing key}:{queue}``; the queue once when it is the routing key."""
        assert consume_destination("orders", "created", "billing") == "orders:created:billing"
        assert consume_destination("", "jobs", "jobs") == "jobs"
        assert consume_destination("", "retry-1", "jobs") == "retry-1:jobs"
        assert consume_destination("", "", "jobs") == "jobs"

    def test_off_without_a_configured_provider(self) -> None:
        """No SDK set globally (the API's proxy provider): no tracer, so no span work."""
        if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
            pytest.skip("a global tracer provider was set in this process")
        assert Tracing().tracer() is None
        assert Tracing(trace.NoOpTracerProvider()).tracer() is None
        assert Tracing(TracerProvider()).tracer() is not None

    def test_the_library_works_without_opentelemetry(self) -> None:
        """With opentelemetry not importable, the package imports and tracing is off."""
        code = (
            "import sys; sys.modules['opentelemetry'] = None\n"
            "import reliable_mq\n"
            "from reliable_mq._tracing import Tracing\n"
            "from reliable_mq import ReliablePublisher\n"
            "from reliable_mq.consumer import ReliableConsumer\n"
            "assert Tracing().tracer() is None\n"
            "ReliablePublisher('amqp://127.0.0.1/'); ReliableConsumer('amqp://127.0.0.1/')\n"
            "try:\n"
            "    Tracing(object())\n"
            "except ImportError as exc:\n"
            "    assert \"'otel' extra\" in str(exc), exc\n"
            "else:\n"
            "    raise AssertionError('a provider without the API must be refused')\n"
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.rabbitmq
class TestPublishSpan:
    async def test_one_producer_span_ended_by_the_confirm(
        self, broker_url: str, queue: str, spans: Spans
    ) -> None:
        """``publish {queue}``, PRODUCER, the convention's attributes; open until the confirm."""
        async with ReliablePublisher(
            connection(broker_url), registry=CollectorRegistry(), tracer_provider=spans.provider
        ) as publisher:
            pending = await publisher.enqueue(
                b"x", routing_key=queue, message_id="m-1", correlation_id="conv-9"
            )
            assert spans.exporter.get_finished_spans() == (), "ended before the confirm"
            result = await pending
            returned = time.time_ns()
        [span] = spans.exporter.get_finished_spans()
        assert result.attempts == 1
        assert span.name == f"publish {queue}"
        assert span.kind is SpanKind.PRODUCER
        assert span.end_time is not None and span.start_time is not None
        assert span.start_time <= span.end_time <= returned
        assert span.status.status_code is StatusCode.UNSET
        assert dict(span.attributes or {}) == {
            "messaging.system": "rabbitmq",
            "messaging.operation.type": "send",
            "messaging.operation.name": "publish",
            "messaging.destination.name": queue,
            "messaging.rabbitmq.destination.routing_key": queue,
            "messaging.message.conversation_id": "conv-9",
            "messaging.message.id": "m-1",
            "server.address": "127.0.0.1",
            "server.port": 5672,
            "reliable_mq.publish.attempts": 1,
        }
        [message] = await drain_queue(broker_url, queue, settled=True)
        assert message.headers["traceparent"] == traceparent(span)

    async def test_a_message_keeps_its_own_traceparent(
        self, broker_url: str, queue: str, spans: Spans
    ) -> None:
        """A ``traceparent`` the caller set is kept; other headers are kept as given."""
        given = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        async with ReliablePublisher(
            connection(broker_url), registry=CollectorRegistry(), tracer_provider=spans.provider
        ) as publisher:
            await publisher.publish(
                b"x", routing_key=queue, headers={"traceparent": given, "tenant": "t1"}
            )
        assert len(spans.named("publish ")) == 1
        [message] = await drain_queue(broker_url, queue, settled=True)
        assert message.headers == {"traceparent": given, "tenant": "t1"}

    async def test_a_publish_in_a_span_is_its_child(
        self, broker_url: str, queue: str, spans: Spans
    ) -> None:
        """The publish span starts in the caller's context."""
        tracer = spans.provider.get_tracer("test")
        async with ReliablePublisher(
            connection(broker_url), registry=CollectorRegistry(), tracer_provider=spans.provider
        ) as publisher:
            with tracer.start_as_current_span("request") as request:
                await publisher.publish(b"x", routing_key=queue)
        [span] = spans.named("publish ")
        assert span.parent is not None
        assert span.parent.span_id == request.get_span_context().span_id
        assert span.context is not None
        assert span.context.trace_id == request.get_span_context().trace_id

    async def test_publish_with_callback_ends_its_span_with_the_outcome(
        self, broker_url: str, queue: str, spans: Spans
    ) -> None:
        """The callback form gets its span too, ended when the callback is called."""
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        async with ReliablePublisher(
            connection(broker_url), registry=CollectorRegistry(), tracer_provider=spans.provider
        ) as publisher:
            publisher.publish_with_callback(
                lambda result, error: done.set_result((result, error)), b"x", routing_key=queue
            )
            result, error = await asyncio.wait_for(done, 10)
            assert error is None
            [span] = spans.exporter.get_finished_spans()
        assert span.attributes is not None
        assert span.attributes["messaging.message.id"] == result.message_id

    async def test_unroutable_sets_error_type(self, broker_url: str, spans: Spans) -> None:
        """A mandatory message no queue takes: ``error.type=PublishUnroutable``, status ERROR."""
        nowhere = f"test-nowhere-{uuid.uuid4().hex[:10]}"
        async with ReliablePublisher(
            connection(broker_url), registry=CollectorRegistry(), tracer_provider=spans.provider
        ) as publisher:
            with pytest.raises(PublishUnroutable):
                await publisher.publish(b"x", routing_key=nowhere, mandatory=True)
        [span] = spans.exporter.get_finished_spans()
        assert span.name == f"publish {nowhere}"
        assert span.attributes is not None
        assert span.attributes["error.type"] == "PublishUnroutable"
        assert span.status.status_code is StatusCode.ERROR

    async def test_a_nacked_message_sets_error_type(self, broker_url: str, spans: Spans) -> None:
        """The broker nacks every attempt (a full ``reject-publish`` queue): one span,
        a ``republish`` event per resend with reason ``nack``, ``error.type`` the
        error ``publish()`` raised (``PublishGaveUp``), status ERROR."""
        name = f"test-tracing-nack-{uuid.uuid4().hex[:8]}"
        connection_ = await aio_pika.connect(broker_url)
        try:
            channel = await connection_.channel()
            full = await channel.declare_queue(
                name, arguments={"x-max-length": 1, "x-overflow": "reject-publish"}
            )
            await channel.default_exchange.publish(aio_pika.Message(b"first"), routing_key=name)
            async with ReliablePublisher(
                connection(broker_url),
                settings=fast(max_attempts=2),
                registry=CollectorRegistry(),
                tracer_provider=spans.provider,
            ) as publisher:
                with pytest.raises(PublishGaveUp) as raised:
                    await publisher.publish(b"x", routing_key=name, message_id="nacked-1")
            await full.delete(if_unused=False, if_empty=False)
        finally:
            await connection_.close()
        [span] = spans.exporter.get_finished_spans()
        assert span.name == f"publish {name}"
        assert span.attributes is not None
        assert span.attributes["error.type"] == type(raised.value).__name__ == "PublishGaveUp"
        assert span.attributes["reliable_mq.publish.attempts"] == 2
        assert span.attributes["messaging.message.id"] == "nacked-1"
        assert span.status.status_code is StatusCode.ERROR
        republishes = [event for event in span.events if event.name == "republish"]
        assert [(e.attributes or {}).get("reason") for e in republishes] == ["nack"]

    async def test_a_republish_is_an_event_on_the_one_span(
        self, broker_url: str, queue: str, spans: Spans
    ) -> None:
        """Lost with its connection, sent again: still one span, ``attempts`` 2, an event."""
        async with TCPProxy("127.0.0.1", 5672) as proxy:
            async with ReliablePublisher(
                connection(proxied_url(proxy)),
                settings=fast(),
                registry=CollectorRegistry(),
                tracer_provider=spans.provider,
            ) as publisher:
                proxy.set_blackhole(True)  # the first attempt goes nowhere: never confirmed
                pending = await publisher.enqueue(b"x", routing_key=queue, message_id="cut-1")
                await asyncio.sleep(0.2)
                proxy.set_blackhole(False)
                await proxy.cut()
                result = await asyncio.wait_for(pending, 30)
        assert result.attempts >= 2
        [span] = spans.exporter.get_finished_spans()
        assert span.attributes is not None
        assert span.attributes["reliable_mq.publish.attempts"] == result.attempts
        assert span.status.status_code is StatusCode.UNSET
        republishes = [event for event in span.events if event.name == "republish"]
        assert len(republishes) == result.attempts - 1
        assert republishes[0].attributes is not None
        assert republishes[0].attributes["reason"] == "connection_lost"
        assert republishes[0].attributes["attempt"] == 2
        messages = await drain_queue(broker_url, queue)
        assert {m.headers["traceparent"] for m in messages} == {traceparent(span)}


class ConsumerEnv:
    def __init__(self, url: str, spans: Spans | None) -> None:
        self.url = url
        self.queue = f"test-tracing-{uuid.uuid4().hex[:10]}"
        self.consumers: list[ReliableConsumer] = []
        self.spans = spans

    def consumer(self, **overrides: Any) -> ReliableConsumer:
        consumer = ReliableConsumer(
            connection(self.url),
            registry=CollectorRegistry(),
            tracer_provider=None if self.spans is None else self.spans.provider,
            **overrides,
        )
        self.consumers.append(consumer)
        return consumer


@pytest.fixture(name="consumers")
async def _consumers(broker_url: str, spans: Spans) -> AsyncIterator[ConsumerEnv]:
    env = ConsumerEnv(broker_url, spans)
    yield env
    link = await aio_pika.connect(broker_url)
    async with link:
        for consumer in env.consumers:
            for spec in consumer.handlers:
                channel = await link.channel()
                await delete_topology(channel, consumer.topology(spec.queue))
                await channel.close()


def link_of(span: ReadableSpan) -> tuple[int, int]:
    [link] = span.links
    return link.context.trace_id, link.context.span_id


def ids_of(span: ReadableSpan) -> tuple[int, int]:
    context = span.get_span_context()
    assert context is not None
    return context.trace_id, context.span_id


@pytest.mark.rabbitmq
class TestProcessSpan:
    async def test_process_span_links_to_the_publish_span(
        self, consumers: ConsumerEnv, spans: Spans
    ) -> None:
        """CONSUMER ``process {queue}``, linked (not parented) to the producer's span."""
        consumer = consumers.consumer()
        current: list[Any] = []

        @consumer.handler(consumers.queue)
        async def handle(body: bytes, delivery: Delivery) -> None:
            current.append(trace.get_current_span().get_span_context())

        async with consumer:
            async with ReliablePublisher(
                connection(consumers.url),
                registry=CollectorRegistry(),
                tracer_provider=spans.provider,
            ) as publisher:
                await publisher.publish(
                    b"x", routing_key=consumers.queue, message_id="p-1", correlation_id="c-1"
                )
            await wait_until(lambda: len(spans.named("process ")) == 1, timeout=10)
        [publish] = spans.named("publish ")
        [process] = spans.named("process ")
        assert process.name == f"process {consumers.queue}"
        assert process.kind is SpanKind.CONSUMER
        assert link_of(process) == ids_of(publish)
        assert process.parent is None, "a link, not a parent"
        assert process.get_span_context().trace_id != ids_of(publish)[0]  # type: ignore[union-attr]
        assert current == [process.get_span_context()], "the handler runs in the process span"
        attributes = dict(process.attributes or {})
        assert isinstance(attributes.pop("messaging.rabbitmq.message.delivery_tag"), int)
        assert attributes == {
            "messaging.system": "rabbitmq",
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": consumers.queue,
            "messaging.rabbitmq.destination.routing_key": consumers.queue,
            "messaging.message.id": "p-1",
            "messaging.message.conversation_id": "c-1",
            "server.address": "127.0.0.1",
            "server.port": 5672,
            "reliable_mq.attempt": 1,
            "reliable_mq.settle": "ack",
            "reliable_mq.outcome": "returned",
        }
        assert process.status.status_code is StatusCode.UNSET

    async def test_a_retry_copy_links_to_the_original_creation_context(
        self, consumers: ConsumerEnv, spans: Spans
    ) -> None:
        """The handler fails once: both process spans link to the original publish span;
        the copy's own publish span is a child of the first process span."""
        consumer = consumers.consumer(retry_delays=(0.1,))
        attempts: list[int] = []

        @consumer.handler(consumers.queue)
        async def flaky(body: bytes, delivery: Delivery) -> None:
            attempts.append(delivery.attempt)
            if delivery.attempt == 1:
                raise ValueError("not yet")

        async with consumer:
            async with ReliablePublisher(
                connection(consumers.url),
                registry=CollectorRegistry(),
                tracer_provider=spans.provider,
            ) as publisher:
                await publisher.publish(b"x", routing_key=consumers.queue, message_id="r-1")
            await wait_until(lambda: len(spans.named("process ")) == 2, timeout=15)
        assert attempts == [1, 2]
        original = next(s for s in spans.named("publish ") if s.parent is None)
        first, second = sorted(
            spans.named("process "),
            key=lambda s: (s.attributes or {})["reliable_mq.attempt"],
        )
        assert link_of(first) == link_of(second) == ids_of(original)
        assert first.attributes is not None and second.attributes is not None
        assert first.attributes["reliable_mq.settle"] == "retry"
        assert first.attributes["error.type"] == "ValueError"
        assert first.status.status_code is StatusCode.ERROR
        assert second.attributes["reliable_mq.settle"] == "ack"
        assert second.attributes["reliable_mq.attempt"] == 2
        [copy] = [s for s in spans.named("publish ") if s is not original]
        assert copy.parent is not None and copy.parent.span_id == ids_of(first)[1]
        assert copy.attributes is not None
        assert copy.attributes["reliable_mq.publish.attempts"] == 1

    async def test_a_duplicate_is_an_event_on_its_process_span(
        self, consumers: ConsumerEnv, spans: Spans
    ) -> None:
        """A message id done already: settled ``duplicate`` without a handler, an event."""
        consumer = consumers.consumer()
        calls: list[str] = []

        @consumer.handler(consumers.queue)
        async def handle(body: bytes, delivery: Delivery) -> None:
            calls.append(delivery.message_id)

        async with consumer:
            async with ReliablePublisher(
                connection(consumers.url), registry=CollectorRegistry()
            ) as publisher:
                await publisher.publish(b"x", routing_key=consumers.queue, message_id="d-1")
                await wait_until(lambda: len(spans.named("process ")) == 1, timeout=10)
                await publisher.publish(b"x", routing_key=consumers.queue, message_id="d-1")
            await wait_until(lambda: len(spans.named("process ")) == 2, timeout=10)
        assert calls == ["d-1"]
        first, second = spans.named("process ")
        assert first.attributes is not None and second.attributes is not None
        assert first.attributes["reliable_mq.settle"] == "ack"
        assert not first.events
        assert second.attributes["reliable_mq.settle"] == "duplicate"
        assert [event.name for event in second.events] == ["duplicate"]

    async def test_a_plain_aio_pika_message_with_a_traceparent_is_linked(
        self, consumers: ConsumerEnv, spans: Spans
    ) -> None:
        """Any producer's W3C ``traceparent`` header becomes the process span's link."""
        consumer = consumers.consumer()
        seen: list[str] = []

        @consumer.handler(consumers.queue)
        async def handle(body: bytes, delivery: Delivery) -> None:
            seen.append(delivery.message_id)

        trace_id, span_id = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
        async with consumer:
            link = await aio_pika.connect(consumers.url)
            async with link:
                channel = await link.channel()
                await channel.default_exchange.publish(
                    aio_pika.Message(
                        b"x",
                        message_id="plain-1",
                        headers={"traceparent": f"00-{trace_id:032x}-{span_id:016x}-01"},
                    ),
                    routing_key=consumers.queue,
                )
            await wait_until(lambda: len(spans.named("process ")) == 1, timeout=10)
        [process] = spans.named("process ")
        assert link_of(process) == (trace_id, span_id)
        assert seen == ["plain-1"]


@pytest.mark.rabbitmq
class TestTracingOff:
    async def test_no_provider_no_spans_no_header(self, broker_url: str) -> None:
        """Without a provider (none set globally) publish and consume work, untouched."""
        if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
            pytest.skip("a global tracer provider was set in this process")
        env = ConsumerEnv(broker_url, None)
        consumer = env.consumer()
        received: list[dict[str, Any]] = []

        @consumer.handler(env.queue)
        async def handle(body: bytes, delivery: Delivery) -> None:
            received.append(dict(delivery.headers))

        try:
            async with consumer:
                async with ReliablePublisher(
                    connection(broker_url), registry=CollectorRegistry()
                ) as publisher:
                    assert publisher._tracing.tracer() is None
                    pending = await publisher.enqueue(
                        b"x", routing_key=env.queue, headers={"tenant": "t1"}
                    )
                    out = publisher._engine.holder(pending.message_id)
                    assert out is not None and out.span is None
                    await pending
                await wait_until(lambda: len(received) == 1, timeout=10)
        finally:
            link = await aio_pika.connect(broker_url)
            async with link:
                await delete_topology(await link.channel(), consumer.topology(env.queue))
        assert received == [{"tenant": "t1"}]


class _BrokenTracer:
    def start_span(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("exporter misconfigured")


class _BrokenProvider:
    """A tracer provider whose tracer raises on every span (a misconfigured SDK)."""

    def get_tracer(self, *args: Any, **kwargs: Any) -> _BrokenTracer:
        return _BrokenTracer()


@pytest.mark.rabbitmq
class TestBrokenTracer:
    async def test_a_raising_tracer_never_breaks_publish_or_consume(self, broker_url: str) -> None:
        """Every span call that raises is logged once (``tracing_failed``) and the message
        is published, delivered and acked as without tracing, with no header added."""
        import structlog

        env = ConsumerEnv(broker_url, None)
        consumer = ReliableConsumer(
            connection(broker_url), registry=CollectorRegistry(), tracer_provider=_BrokenProvider()
        )
        received: list[dict[str, Any]] = []

        @consumer.handler(env.queue)
        async def handle(body: bytes, delivery: Delivery) -> None:
            received.append(dict(delivery.headers))

        try:
            with structlog.testing.capture_logs() as logs:
                async with consumer:
                    async with ReliablePublisher(
                        connection(broker_url),
                        registry=CollectorRegistry(),
                        tracer_provider=_BrokenProvider(),
                    ) as publisher:
                        for _ in range(3):
                            await publisher.publish(b"x", routing_key=env.queue)
                    await wait_until(lambda: len(received) == 3, timeout=10, what="3 handled")
                    await wait_until(lambda: consumer.stats().acked == 3, timeout=10, what="acks")
        finally:
            link = await aio_pika.connect(broker_url)
            async with link:
                await delete_topology(await link.channel(), consumer.topology(env.queue))
        assert received == [{}, {}, {}]
        failed = [e["call"] for e in logs if e["event"] == "tracing_failed"]
        assert sorted(failed) == ["start_process", "start_publish"]  # once each


@pytest.mark.rabbitmq
class TestBlockingPublisher:
    def test_each_calling_threads_span_is_the_parent(self, broker_url: str, spans: Spans) -> None:
        """``publish()`` and ``submit()`` run on the publisher's loop thread, in a copy of
        the caller's context: each publish span is a child of the span current in the
        thread that called, and is ended by the confirm."""
        import threading

        import pika

        from reliable_mq import BlockingPublisher

        queue = f"test-tracing-sync-{uuid.uuid4().hex[:8]}"
        admin = pika.BlockingConnection(pika.URLParameters(broker_url))
        admin.channel().queue_declare(queue, durable=True)
        tracer = spans.provider.get_tracer("test")
        parents: dict[str, tuple[int, int]] = {}
        errors: list[BaseException] = []
        try:
            with BlockingPublisher(
                connection(broker_url),
                registry=CollectorRegistry(),
                tracer_provider=spans.provider,
            ) as publisher:

                def call(name: str) -> None:
                    try:
                        with tracer.start_as_current_span(name) as parent:
                            context = parent.get_span_context()
                            parents[name] = (context.trace_id, context.span_id)
                            if name == "request-submit":
                                publisher.submit(b"x", routing_key=queue, message_id=name).result(
                                    30
                                )
                            else:
                                publisher.publish(b"x", routing_key=queue, message_id=name)
                    except BaseException as exc:
                        errors.append(exc)

                threads = [
                    threading.Thread(target=call, args=(name,))
                    for name in ("request-publish", "request-submit")
                ]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join(30)
        finally:
            admin.channel().queue_delete(queue)
            admin.close()
        assert errors == []
        published = {
            span.attributes["messaging.message.id"]: span
            for span in spans.named("publish ")
            if span.attributes is not None
        }
        assert set(published) == set(parents) == {"request-publish", "request-submit"}
        for name, span in published.items():
            assert span.kind is SpanKind.PRODUCER
            assert span.status.status_code is not StatusCode.ERROR
            assert span.parent is not None
            assert (span.parent.trace_id, span.parent.span_id) == parents[name]
