"""OpenTelemetry tracing of ``publish_many()`` (issue 21): the batch span, the create
spans and their links, against the real broker.

As in ``tests/test_tracing.py``, every test passes its own SDK ``TracerProvider``
(an ``InMemorySpanExporter``) as ``tracer_provider``; the global one is never set.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry

from reliable_mq import PublisherSettings, ReliablePublisher
from reliable_mq._publish import batch as batch_module
from reliable_mq._publish.traced import MAX_LINKS
from reliable_mq.errors import PublishBatchError
from reliable_mq.message import Message
from reliable_mq.testing import TCPProxy
from tests.conftest import proxied_url
from tests.support.amqp import drain_queue
from tests.test_tracing import Spans, _BrokenProvider, connection, fast, traceparent

GIVEN = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
"""A ``traceparent`` set by the caller (an outbox row, another service)."""


@pytest.fixture(name="spans")
def _spans() -> Spans:
    return Spans()


def publisher(url: str, spans: Spans | None, **settings: Any) -> ReliablePublisher:
    return ReliablePublisher(
        connection(url),
        settings=PublisherSettings(publish_timeout=30, **settings),
        registry=CollectorRegistry(),
        tracer_provider=None if spans is None else spans.provider,
    )


def the_batch(spans: Spans) -> ReadableSpan:
    [span] = [s for s in spans.exporter.get_finished_spans() if s.name.startswith("publish")]
    return span


def ids(span: Any) -> tuple[int, int]:
    context = span.get_span_context()
    assert context is not None
    return context.trace_id, context.span_id


@pytest.mark.rabbitmq
class TestBatchSpan:
    async def test_one_producer_span_counted_and_ended_after_the_last_confirm(
        self, broker_url: str, queue: str, spans: Spans, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """``publish {queue}``, CLIENT (create spans on), child of the caller's span, with the message
        count; it ends once every message is confirmed, before ``publish_many`` returns."""
        confirmed: list[int] = []
        succeeded = batch_module.Batch.succeeded

        def spy(self: batch_module.Batch) -> None:
            confirmed.append(time.time_ns())
            succeeded(self)

        monkeypatch.setattr(batch_module.Batch, "succeeded", spy)
        tracer = spans.provider.get_tracer("test")
        async with publisher(broker_url, spans) as mq:
            with tracer.start_as_current_span("request") as request:
                result = await mq.publish_many(
                    Message(b"x", routing_key=queue, message_id=f"m-{n}") for n in range(5)
                )
                returned = time.time_ns()
        assert result.confirmed == 5 and len(confirmed) == 5
        span = the_batch(spans)
        assert span.name == f"publish {queue}"
        assert span.kind is SpanKind.CLIENT, "each message has its own creation context"
        assert span.parent is not None
        assert (span.parent.trace_id, span.parent.span_id) == ids(request)
        assert span.status.status_code is StatusCode.UNSET
        assert dict(span.attributes or {}) == {
            "messaging.system": "rabbitmq",
            "messaging.operation.type": "send",
            "messaging.operation.name": "publish",
            "messaging.destination.name": queue,
            "messaging.rabbitmq.destination.routing_key": queue,
            "server.address": "127.0.0.1",
            "server.port": 5672,
            "messaging.batch.message_count": 5,
            "reliable_mq.batch.failed": 0,
            "reliable_mq.batch.republished": 0,
        }
        assert span.start_time is not None and span.end_time is not None
        assert max(confirmed) <= span.end_time <= returned

    async def test_each_message_gets_a_create_span_injected_and_linked(
        self, broker_url: str, queue: str, spans: Spans
    ) -> None:
        """Per message: ``create {queue}`` (PRODUCER, a sibling of the batch span), ended
        once encoded; its context is the message's ``traceparent`` as a plain aio-pika
        consumer reads it, and the batch span links to it with the message id."""
        tracer = spans.provider.get_tracer("test")
        async with publisher(broker_url, spans) as mq:
            with tracer.start_as_current_span("request") as request:
                await mq.publish_many(
                    [
                        Message(b"x", routing_key=queue, message_id=f"m-{n}", correlation_id="c")
                        for n in range(3)
                    ]
                )
        batch = the_batch(spans)
        creates = {
            (span.attributes or {})["messaging.message.id"]: span for span in spans.named("create ")
        }
        assert set(creates) == {"m-0", "m-1", "m-2"}
        for message_id, span in creates.items():
            assert span.name == f"create {queue}"
            assert span.kind is SpanKind.PRODUCER
            assert span.parent is not None and batch.parent is not None
            assert (span.parent.trace_id, span.parent.span_id) == ids(request)
            assert span.end_time is not None and batch.end_time is not None
            assert span.end_time <= batch.end_time
            assert dict(span.attributes or {}) == {
                "messaging.system": "rabbitmq",
                "messaging.operation.type": "create",
                "messaging.operation.name": "create",
                "messaging.destination.name": queue,
                "messaging.rabbitmq.destination.routing_key": queue,
                "messaging.message.conversation_id": "c",
                "messaging.message.id": message_id,
                "server.address": "127.0.0.1",
                "server.port": 5672,
            }
        links = {
            (link.attributes or {})["messaging.message.id"]: link.context.span_id
            for link in batch.links
        }
        assert links == {message_id: ids(span)[1] for message_id, span in creates.items()}
        received = await drain_queue(broker_url, queue, settled=True)
        assert {m.message_id: m.headers["traceparent"] for m in received} == {
            message_id: traceparent(span) for message_id, span in creates.items()
        }

    async def test_a_message_carrying_a_traceparent_keeps_it_and_is_linked(
        self, broker_url: str, queue: str, spans: Spans
    ) -> None:
        """A ``traceparent`` the message carries is its creation context: no create span,
        headers untouched, and the batch span links to that context."""
        async with publisher(broker_url, spans) as mq:
            await mq.publish_many(
                [
                    Message(
                        b"x", routing_key=queue, message_id="own", headers={"traceparent": GIVEN}
                    ),
                    Message(b"x", routing_key=queue, message_id="new", headers={"tenant": "t"}),
                ]
            )
        batch = the_batch(spans)
        [create] = spans.named("create ")
        assert (create.attributes or {})["messaging.message.id"] == "new"
        links = {
            (link.attributes or {})["messaging.message.id"]: link.context for link in batch.links
        }
        assert set(links) == {"own", "new"}
        assert f"{links['own'].trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"
        assert f"{links['own'].span_id:016x}" == "b7ad6b7169203331"
        assert links["new"].span_id == ids(create)[1]
        received = {
            m.message_id: m.headers for m in await drain_queue(broker_url, queue, settled=True)
        }
        assert received["own"] == {"traceparent": GIVEN}
        assert received["new"] == {"tenant": "t", "traceparent": traceparent(create)}

    async def test_create_spans_off_the_batch_context_is_injected(
        self, broker_url: str, queue: str, spans: Spans
    ) -> None:
        """``trace_create_spans=False``: no create span; a message without a
        ``traceparent`` gets the batch span's, and is not linked (it is the span's own)."""
        async with publisher(broker_url, spans, trace_create_spans=False) as mq:
            await mq.publish_many(
                [
                    Message(b"x", routing_key=queue, message_id="a"),
                    Message(b"x", routing_key=queue, message_id="b"),
                    Message(
                        b"x", routing_key=queue, message_id="own", headers={"traceparent": GIVEN}
                    ),
                ]
            )
        batch = the_batch(spans)
        assert batch.kind is SpanKind.PRODUCER, "its context is the messages' creation context"
        assert spans.named("create ") == []
        assert [(link.attributes or {})["messaging.message.id"] for link in batch.links] == ["own"]
        received = {
            m.message_id: m.headers["traceparent"]
            for m in await drain_queue(broker_url, queue, settled=True)
        }
        assert received == {"a": traceparent(batch), "b": traceparent(batch), "own": GIVEN}

    async def test_several_destinations_name_it_publish_only(
        self, broker_url: str, queue: str, spans: Spans
    ) -> None:
        """Messages to different destinations: the span is ``publish``, with no destination."""
        async with publisher(broker_url, spans) as mq:
            await mq.publish_many(
                [
                    Message(b"x", routing_key=queue),
                    Message(b"x", exchange="amq.fanout", routing_key="", mandatory=False),
                ]
            )
        batch = the_batch(spans)
        assert batch.name == "publish"
        attributes = dict(batch.attributes or {})
        assert "messaging.destination.name" not in attributes
        assert "messaging.rabbitmq.destination.routing_key" not in attributes
        assert attributes["messaging.batch.message_count"] == 2
        assert {span.name for span in spans.named("create ")} == {
            f"create {queue}",
            "create amq.fanout",
        }

    async def test_an_unroutable_message_sets_error_type(
        self, broker_url: str, queue: str, spans: Spans
    ) -> None:
        """One mandatory message no queue takes: the batch raises, and its span has
        ``error.type`` (the first failure's class), status ERROR and the failure count."""
        nowhere = f"test-nowhere-{uuid.uuid4().hex[:10]}"
        async with publisher(broker_url, spans) as mq:
            with pytest.raises(PublishBatchError) as raised:
                await mq.publish_many(
                    [
                        Message(b"x", routing_key=queue),
                        Message(b"x", routing_key=nowhere, mandatory=True),
                        Message(b"x", routing_key=queue),
                    ]
                )
        assert raised.value.result.confirmed == 2
        batch = the_batch(spans)
        attributes = dict(batch.attributes or {})
        assert attributes["error.type"] == "PublishUnroutable"
        assert attributes["reliable_mq.batch.failed"] == 1
        assert attributes["messaging.batch.message_count"] == 3
        assert batch.status.status_code is StatusCode.ERROR
        assert batch.name == "publish"

    async def test_an_invalid_message_fails_its_create_span(
        self, broker_url: str, queue: str, spans: Spans
    ) -> None:
        """A message the encoder refuses: its create span ends with the error, the batch
        span counts it and is not linked to it; ``raise_on_error=False`` still sets error.type."""
        async with publisher(broker_url, spans) as mq:
            result = await mq.publish_many(
                [
                    Message(b"x", routing_key=queue),
                    Message(b"x", routing_key=queue, headers={"bad": object()}),
                ],
                raise_on_error=False,
            )
        assert result.confirmed == 1 and len(result.failures) == 1
        refused = [
            span for span in spans.named("create ") if span.status.status_code is StatusCode.ERROR
        ]
        assert len(refused) == 1
        assert (refused[0].attributes or {})["error.type"] == "InvalidMessage"
        batch = the_batch(spans)
        assert (batch.attributes or {})["error.type"] == "InvalidMessage"
        assert len(batch.links) == 1

    async def test_links_stop_at_max_links(self, broker_url: str, queue: str, spans: Spans) -> None:
        """The batch span links to the first ``MAX_LINKS`` messages' contexts only."""
        count = MAX_LINKS + 5
        async with publisher(broker_url, spans) as mq:
            await mq.publish_many(
                Message(b"x", routing_key=queue, message_id=f"m-{n}") for n in range(count)
            )
        batch = the_batch(spans)
        assert (batch.attributes or {})["messaging.batch.message_count"] == count
        assert len(spans.named("create ")) == count
        assert [(link.attributes or {})["messaging.message.id"] for link in batch.links] == [
            f"m-{n}" for n in range(MAX_LINKS)
        ]

    async def test_tracing_off_no_spans_no_header(self, broker_url: str, queue: str) -> None:
        """No provider (none set globally): messages go out with their headers untouched."""
        if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
            pytest.skip("a global tracer provider was set in this process")
        async with publisher(broker_url, None) as mq:
            assert mq._tracing.tracer() is None
            await mq.publish_many(
                [
                    Message(b"x", routing_key=queue),
                    Message(b"x", routing_key=queue, headers={"t": 1}),
                ]
            )
        assert [m.headers for m in await drain_queue(broker_url, queue, settled=True)] == [
            {},
            {"t": 1},
        ]

    async def test_republishes_are_counted_on_the_one_batch_span(
        self, broker_url: str, queue: str, spans: Spans
    ) -> None:
        """Messages lost with their connection and sent again: one batch span, ended after
        their confirms, with the republish count; the create spans stay one per message."""
        async with TCPProxy("127.0.0.1", 5672) as proxy:
            async with ReliablePublisher(
                connection(proxied_url(proxy)),
                settings=fast(),
                registry=CollectorRegistry(),
                tracer_provider=spans.provider,
            ) as mq:
                proxy.set_blackhole(True)  # the first attempts go nowhere: never confirmed
                messages = [Message(b"x", routing_key=queue) for _ in range(3)]
                sending = asyncio.ensure_future(mq.publish_many(messages))
                done, _ = await asyncio.wait({sending}, timeout=0.2)
                assert not done
                proxy.set_blackhole(False)
                await proxy.cut()
                result = await asyncio.wait_for(sending, 30)
        assert result.confirmed == 3 and result.republished >= 3
        batch = the_batch(spans)
        assert (batch.attributes or {})["reliable_mq.batch.republished"] == result.republished
        assert batch.status.status_code is StatusCode.UNSET
        assert len(spans.named("create ")) == 3
        received = await drain_queue(broker_url, queue)
        creates = {traceparent(span) for span in spans.named("create ")}
        assert {m.headers["traceparent"] for m in received} == creates

    async def test_a_raising_tracer_never_breaks_a_batch(self, broker_url: str, queue: str) -> None:
        """A tracer that raises: logged once (``tracing_failed``), the batch is published
        as without tracing, headers untouched."""
        import structlog

        with structlog.testing.capture_logs() as logs:
            async with ReliablePublisher(
                connection(broker_url),
                registry=CollectorRegistry(),
                tracer_provider=_BrokenProvider(),
            ) as mq:
                for _ in range(2):
                    result = await mq.publish_many(
                        [Message(b"x", routing_key=queue, headers={"t": n}) for n in range(2)]
                    )
                    assert result.confirmed == 2
        assert [m.headers for m in await drain_queue(broker_url, queue, settled=True)] == [
            {"t": 0},
            {"t": 1},
        ] * 2
        assert [e["call"] for e in logs if e["event"] == "tracing_failed"] == ["start_batch"]


@pytest.mark.rabbitmq
class TestBlockingPublishMany:
    def test_the_calling_threads_span_is_the_parent(self, broker_url: str, spans: Spans) -> None:
        """``BlockingPublisher.publish_many`` runs the batch on the loop thread in a copy
        of the caller's context: its batch span (and the create spans) are children of
        the span current in the calling thread."""
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
                connection(broker_url), registry=CollectorRegistry(), tracer_provider=spans.provider
            ) as mq:

                def call(name: str) -> None:
                    try:
                        with tracer.start_as_current_span(name) as parent:
                            parents[name] = ids(parent)
                            mq.publish_many(
                                [
                                    Message(b"x", routing_key=queue, message_id=f"{name}-{n}")
                                    for n in range(2)
                                ]
                            )
                    except BaseException as exc:
                        errors.append(exc)

                threads = [threading.Thread(target=call, args=(f"t{n}",)) for n in range(2)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join(30)
        finally:
            admin.channel().queue_delete(queue)
            admin.close()
        assert errors == []
        batches = [s for s in spans.exporter.get_finished_spans() if s.name.startswith("publish")]
        assert len(batches) == 2
        by_parent = {
            (s.parent.trace_id, s.parent.span_id): s for s in batches if s.parent is not None
        }
        assert set(by_parent) == set(parents.values())
        for name, parent in parents.items():
            batch = by_parent[parent]
            assert batch.kind is SpanKind.CLIENT
            assert (batch.attributes or {})["messaging.batch.message_count"] == 2
            creates = [
                s
                for s in spans.named("create ")
                if str((s.attributes or {})["messaging.message.id"]).startswith(name)
            ]
            assert len(creates) == 2
            assert all(
                s.parent is not None and (s.parent.trace_id, s.parent.span_id) == parent
                for s in creates
            )
