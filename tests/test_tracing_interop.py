"""Tracing interop (issue 21), against the real broker: other producers, the contrib
``opentelemetry-instrumentation-aio-pika`` consumer, and that instrumentation enabled
alongside ours.

Every in-process test passes its own SDK ``TracerProvider`` (never the global one)
and uninstruments the contrib instrumentation after itself (`contrib` fixture). The
case with the global provider runs in a subprocess, so no global state leaks.
Every test runs on the fast path and on the plain path, chosen by ``fast_path`` in
the connection settings (so whatever ``RELIABLE_MQ_FAST_PATH`` says: this module
need not be in scripts/test-plain.sh).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aio_pika
import pytest
from opentelemetry import trace
from opentelemetry.instrumentation.aio_pika import AioPikaInstrumentor
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from reliable_mq import ConnectionSettings, ReliablePublisher
from reliable_mq.consumer import ReliableConsumer
from reliable_mq.delivery import Delivery
from reliable_mq.settings import FastPath
from reliable_mq.topology import delete_topology
from tests.support import pika_client
from tests.support.waiting import wait_until

CONTRIB = "opentelemetry.instrumentation.aio_pika"
"""The instrumentation scope of the contrib instrumentation's spans."""
OURS = "reliable_mq"
PATHS = [pytest.param(FastPath.ON, id="fast"), pytest.param(FastPath.OFF, id="plain")]
TRACE_ID, SPAN_ID = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
FOREIGN = f"00-{TRACE_ID:032x}-{SPAN_ID:016x}-01"
"""A ``traceparent`` of another producer's span."""


class OpenSpans(SpanProcessor):
    """Spans started and not ended yet (the exporter sees only ended ones)."""

    def __init__(self) -> None:
        self.open: dict[int, str] = {}

    def on_start(self, span: Span, parent_context: Any = None) -> None:
        self.open[span.context.span_id] = f"{span.instrumentation_scope.name}: {span.name}"

    def on_end(self, span: ReadableSpan) -> None:
        assert span.context is not None
        self.open.pop(span.context.span_id, None)


class Spans:
    """A tracer provider of its own, what it recorded, and what is still open."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.unended = OpenSpans()
        self.provider = TracerProvider()
        self.provider.add_span_processor(self.unended)
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def of(self, scope: str, prefix: str = "") -> list[ReadableSpan]:
        return [
            span
            for span in self.exporter.get_finished_spans()
            if span.instrumentation_scope is not None
            and span.instrumentation_scope.name == scope
            and span.name.startswith(prefix)
        ]


@pytest.fixture(name="spans")
def _spans() -> Spans:
    return Spans()


@pytest.fixture(name="contrib")
def _contrib() -> Iterator[AioPikaInstrumentor]:
    """The contrib instrumentor, uninstrumented after the test whatever happened."""
    instrumentor = AioPikaInstrumentor()
    yield instrumentor
    if instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.uninstrument()
    assert not hasattr(aio_pika.Exchange.publish, "__wrapped__"), "left instrumented"
    assert not hasattr(aio_pika.Queue.consume, "__wrapped__"), "left instrumented"


def connection(url: str, fast_path: FastPath) -> ConnectionSettings:
    return ConnectionSettings(
        url=SecretStr(url),
        connection_name=f"test-interop-{uuid.uuid4().hex[:8]}",
        connect_timeout=5,
        fast_path=fast_path,
    )


def traceparent(span: ReadableSpan) -> str:
    context = span.get_span_context()
    assert context is not None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def ids_of(span: ReadableSpan) -> tuple[int, int]:
    context = span.get_span_context()
    assert context is not None
    return context.trace_id, context.span_id


def link_of(span: ReadableSpan) -> tuple[int, int]:
    [link] = span.links
    return link.context.trace_id, link.context.span_id


class Consumers:
    """Our consumers on fresh queues; their topology is deleted after the test."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.made: list[ReliableConsumer] = []

    def consumer(self, provider: Any | None, fast_path: FastPath) -> ReliableConsumer:
        consumer = ReliableConsumer(
            connection(self.url, fast_path), registry=CollectorRegistry(), tracer_provider=provider
        )
        self.made.append(consumer)
        return consumer

    async def delete(self) -> None:
        link = await aio_pika.connect(self.url)
        async with link:
            for consumer in self.made:
                for spec in consumer.handlers:
                    channel = await link.channel()
                    await delete_topology(channel, consumer.topology(spec.queue))
                    await channel.close()


@pytest.fixture(name="consumers")
async def _consumers(broker_url: str) -> AsyncIterator[Consumers]:
    made = Consumers(broker_url)
    yield made
    await made.delete()


async def publish_with_pika(url: str, queue: str, message_id: str, headers: Any) -> None:
    await asyncio.to_thread(
        pika_client.publish, url, queue, [(b"x", {"message_id": message_id, "headers": headers})]
    )


async def publish_with_aio_pika(url: str, queue: str, message_id: str, headers: Any) -> None:
    link = await aio_pika.connect(url)
    async with link:
        channel = await link.channel()
        await channel.default_exchange.publish(
            aio_pika.Message(b"x", message_id=message_id, headers=headers), routing_key=queue
        )


@pytest.mark.rabbitmq
class TestOtherProducers:
    @pytest.mark.parametrize("fast_path", PATHS)
    @pytest.mark.parametrize(
        ("publish", "headers"),
        [
            pytest.param(publish_with_pika, {"traceparent": FOREIGN}, id="pika-str"),
            pytest.param(publish_with_pika, {"traceparent": FOREIGN.encode()}, id="pika-bytes"),
            pytest.param(
                publish_with_aio_pika,
                {"traceparent": FOREIGN, "tracestate": "vendor=1"},
                id="aio-pika-str",
            ),
            pytest.param(
                publish_with_aio_pika,
                {"traceparent": bytearray(FOREIGN.encode())},
                id="aio-pika-bytearray",
            ),
        ],
    )
    async def test_their_traceparent_is_the_process_span_link(
        self,
        consumers: Consumers,
        spans: Spans,
        publish: Any,
        headers: dict[str, Any],
        fast_path: FastPath,
    ) -> None:
        """A ``traceparent`` header from pika or aio-pika, a string or bytes (both clients
        send bytes as a byte array), becomes the link of our ``process`` span; no parent."""
        queue = f"test-interop-{uuid.uuid4().hex[:10]}"
        consumer = consumers.consumer(spans.provider, fast_path)
        seen: list[str] = []

        @consumer.handler(queue)
        async def handle(body: bytes, delivery: Delivery) -> None:
            seen.append(delivery.message_id)

        async with consumer:
            await publish(consumers.url, queue, "foreign-1", headers)
            await wait_until(lambda: len(spans.of(OURS, "process ")) == 1, what="the process span")
        [process] = spans.of(OURS, "process ")
        assert seen == ["foreign-1"]
        assert link_of(process) == (TRACE_ID, SPAN_ID)
        assert process.parent is None
        if "tracestate" in headers:
            assert process.links[0].context.trace_state.get("vendor") == "1"


@pytest.mark.rabbitmq
class TestContribConsumer:
    @pytest.mark.parametrize("fast_path", PATHS)
    async def test_its_receive_span_is_a_child_of_our_publish_span(
        self,
        broker_url: str,
        queue: str,
        spans: Spans,
        contrib: AioPikaInstrumentor,
        fast_path: FastPath,
    ) -> None:
        """An aio-pika consumer under the contrib instrumentation reads our ``traceparent``:
        its CONSUMER span is a child of our publish span (the contrib parents, not links)."""
        contrib.instrument(tracer_provider=spans.provider)
        assert contrib.is_instrumented_by_opentelemetry, "refused: see its logged conflict"
        async with ReliablePublisher(
            connection(broker_url, fast_path),
            registry=CollectorRegistry(),
            tracer_provider=spans.provider,
        ) as publisher:
            await publisher.publish(
                b"x", routing_key=queue, message_id="ours-1", correlation_id="conv-1"
            )
        [publish] = spans.of(OURS, "publish ")
        received: list[tuple[dict[str, Any], Any]] = []

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            async with message.process():
                current = trace.get_current_span().get_span_context()
                received.append((dict(message.headers), current))

        link = await aio_pika.connect(broker_url)
        async with link:
            channel = await link.channel()
            declared = await channel.declare_queue(queue, passive=True)
            tag = await declared.consume(on_message)
            await wait_until(lambda: len(received) == 1, what="the aio-pika consumer")
            await declared.cancel(tag)
        [theirs] = spans.of(CONTRIB)
        [(headers, current)] = received
        assert headers["traceparent"] == traceparent(publish)
        assert theirs.kind is SpanKind.CONSUMER
        assert theirs.name == f"{queue} receive"
        assert theirs.parent is not None
        assert (theirs.parent.trace_id, theirs.parent.span_id) == ids_of(publish)
        assert current == theirs.get_span_context(), "the callback runs in its span"
        assert theirs.attributes is not None
        assert theirs.attributes["messaging.message.id"] == "ours-1"
        assert theirs.attributes["messaging.conversation_id"] == "conv-1"
        assert spans.unended.open == {}


async def alongside(url: str, spans: Spans, fast_path: FastPath, provider: Any | None) -> None:
    """With the contrib instrumentation on: we publish three messages and aio-pika one,
    our consumer takes all four. Raises AssertionError if our spans are duplicated,
    re-parented, left open, or our ``traceparent`` is replaced.

    ``provider`` None: ours and the contrib's use the global provider (``spans``'s).
    """
    queue = f"test-interop-{uuid.uuid4().hex[:10]}"
    consumers = Consumers(url)
    consumer = consumers.consumer(provider, fast_path)
    wire: dict[str, str] = {}

    @consumer.handler(queue)
    async def handle(body: bytes, delivery: Delivery) -> None:
        wire[delivery.message_id] = str(delivery.headers.get("traceparent"))

    ours = [f"ours-{n}" for n in range(3)]
    try:
        async with consumer:
            async with ReliablePublisher(
                connection(url, fast_path), registry=CollectorRegistry(), tracer_provider=provider
            ) as publisher:
                await asyncio.gather(
                    *(publisher.publish(b"x", routing_key=queue, message_id=m) for m in ours)
                )
                await publish_with_aio_pika(url, queue, "plain-1", None)  # the control
            await wait_until(lambda: len(wire) == 4, what="four deliveries")
            await wait_until(lambda: len(spans.of(OURS, "process ")) == 4, what="process spans")
    finally:
        await consumers.delete()

    # The contrib instrumentation is live: aio-pika's publish made its span and header ...
    [send] = spans.of(CONTRIB)
    assert send.kind is SpanKind.PRODUCER and send.name == f",{queue} send"
    assert wire["plain-1"] == traceparent(send)
    # ... and it made no span of its own on our paths: no second producer, no receive.
    publishes = {
        (span.attributes or {})["messaging.message.id"]: span for span in spans.of(OURS, "publish ")
    }
    assert sorted(publishes) == sorted(ours), "one publish span per message"
    processes = {
        (span.attributes or {})["messaging.message.id"]: span for span in spans.of(OURS, "process ")
    }
    assert sorted(processes) == sorted([*ours, "plain-1"]), "one process span per message"
    for message_id in ours:
        assert wire[message_id] == traceparent(publishes[message_id]), "our traceparent"
        assert link_of(processes[message_id]) == ids_of(publishes[message_id])
    assert link_of(processes["plain-1"]) == ids_of(send)
    assert all(span.parent is None for span in processes.values()), "links, not parents"
    assert spans.unended.open == {}, "a span left open"


@pytest.mark.rabbitmq
class TestContribAlongside:
    @pytest.mark.parametrize("fast_path", PATHS)
    async def test_no_duplicate_or_broken_spans_on_our_paths(
        self, broker_url: str, spans: Spans, contrib: AioPikaInstrumentor, fast_path: FastPath
    ) -> None:
        """The contrib instrumentation on (the same provider): on both paths, exactly one
        publish and one process span per message, our ``traceparent`` on the wire."""
        contrib.instrument(tracer_provider=spans.provider)
        assert contrib.is_instrumented_by_opentelemetry, "refused: see its logged conflict"
        await alongside(broker_url, spans, fast_path, spans.provider)

    def test_with_the_global_provider(self, broker_url: str) -> None:
        """The same with the global provider for both (set in a subprocess of its own)."""
        code = (
            "import asyncio, sys\n"
            "from opentelemetry import trace\n"
            "from opentelemetry.instrumentation.aio_pika import AioPikaInstrumentor\n"
            "from reliable_mq.settings import FastPath\n"
            "from tests.test_tracing_interop import Spans, alongside\n"
            "spans = Spans()\n"
            "trace.set_tracer_provider(spans.provider)\n"
            "contrib = AioPikaInstrumentor()\n"
            "contrib.instrument()\n"
            "assert contrib.is_instrumented_by_opentelemetry\n"
            "for path in (FastPath.ON, FastPath.OFF):\n"
            "    spans.exporter.clear()\n"
            "    asyncio.run(alongside(sys.argv[1], spans, path, None))\n"
            "print('alongside: ok')\n"
        )
        root = Path(__file__).resolve().parent.parent
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
        }
        done = subprocess.run(
            [sys.executable, "-W", "error", "-c", code, broker_url],
            check=False,
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip().endswith("alongside: ok")
