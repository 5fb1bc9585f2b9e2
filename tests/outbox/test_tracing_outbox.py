"""Tracing across the outbox (issue 21): the request that wrote a row, the relay, the consumer.

A private PostgreSQL (the module's ``pg``), the shared broker, and an SDK
``TracerProvider`` of the test's own (``Spans``): the global provider is never
set. ``outbox.add()`` looks at the global provider for its ``create`` span, so
the tests of that span give the writer a ``Tracing`` of their provider instead.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aio_pika
import psycopg
import pytest
import structlog
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind
from prometheus_client import CollectorRegistry

from reliable_mq import ReliablePublisher
from reliable_mq._tracing import Tracing
from reliable_mq.consumer import ReliableConsumer
from reliable_mq.delivery import Delivery
from reliable_mq.errors import InvalidSettings
from reliable_mq.outbox import OutboxRelay, RelaySettings, add, add_sync
from reliable_mq.outbox import _writer as writer
from reliable_mq.outbox.admin import create_schema
from reliable_mq.topology import delete_topology
from tests.support.private_postgres import PrivatePostgres
from tests.support.waiting import wait_until
from tests.test_tracing import Spans, connection, ids_of, traceparent

OTHER_TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture(name="spans")
def _spans() -> Spans:
    return Spans()


@pytest.fixture
async def table(pg: PrivatePostgres) -> AsyncIterator[str]:
    name = f"outbox_{uuid.uuid4().hex[:8]}"
    await create_schema(pg.dsn, table=name)
    yield name
    async with await psycopg.AsyncConnection.connect(pg.dsn, autocommit=True) as conn:
        await conn.execute(f"DROP TABLE {name}")


@pytest.fixture(name="create_spans")
def _create_spans(spans: Spans, monkeypatch: pytest.MonkeyPatch) -> Iterator[Spans]:
    """``add()``'s tracer is the test's provider (in production: the global one)."""
    monkeypatch.setattr(writer, "_TRACING", Tracing(spans.provider))
    yield spans


async def add_one(dsn: str, table: str, **options: Any) -> dict[str, Any]:
    """``add()`` one row in a committed transaction; the row's stored headers."""
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        message_id = await add(conn, b"x", table=table, **{"routing_key": "q", **options})
        await conn.commit()
        cursor = await conn.execute(
            f"SELECT properties FROM {table} WHERE message_id = %s", (message_id,)
        )
        row = await cursor.fetchone()
    assert row is not None
    headers: dict[str, Any] = row[0].get("headers") or {}
    return headers


def request_span(spans: Spans) -> Any:
    """A server span of the application's, as an HTTP framework would start it."""
    tracer = spans.provider.get_tracer("app")
    return tracer.start_as_current_span("HTTP request", kind=SpanKind.SERVER)


class TestAddStoresTheContext:
    async def test_the_current_span_goes_into_the_row(
        self, pg: PrivatePostgres, table: str, spans: Spans
    ) -> None:
        """No global provider: the caller's span (any provider) is the row's ``traceparent``."""
        with request_span(spans):
            headers = await add_one(pg.dsn, table, headers={"tenant": "t1"})
        [request] = spans.exporter.get_finished_spans()
        assert headers == {"tenant": "t1", "traceparent": traceparent(request)}

    async def test_no_current_span_adds_nothing(self, pg: PrivatePostgres, table: str) -> None:
        """Outside any span the row's headers are the caller's, untouched."""
        assert await add_one(pg.dsn, table, headers={"tenant": "t1"}) == {"tenant": "t1"}
        assert await add_one(pg.dsn, table) == {}

    async def test_a_given_traceparent_is_kept(
        self, pg: PrivatePostgres, table: str, create_spans: Spans
    ) -> None:
        """The caller's own ``traceparent`` wins: no create span, nothing overwritten."""
        with request_span(create_spans):
            headers = await add_one(pg.dsn, table, headers={"traceparent": OTHER_TRACEPARENT})
        assert headers == {"traceparent": OTHER_TRACEPARENT}
        assert [s.name for s in create_spans.exporter.get_finished_spans()] == ["HTTP request"]

    async def test_a_create_span_child_of_the_request(
        self, pg: PrivatePostgres, table: str, create_spans: Spans
    ) -> None:
        """With a tracer: PRODUCER ``create {destination}``, a child of the caller's span,
        ended at once; the row holds its context (in the request's trace)."""
        with request_span(create_spans):
            headers = await add_one(
                pg.dsn, table, routing_key="created", exchange="orders", message_id="o-1"
            )
            [create] = create_spans.named("create ")
        [request] = create_spans.named("HTTP request")
        assert create.name == "create orders:created"
        assert create.kind is SpanKind.PRODUCER
        assert create.parent is not None
        assert create.parent.span_id == ids_of(request)[1]
        assert ids_of(create)[0] == ids_of(request)[0]
        assert dict(create.attributes or {}) == {
            "messaging.system": "rabbitmq",
            "messaging.operation.type": "create",
            "messaging.operation.name": "create",
            "messaging.destination.name": "orders:created",
            "messaging.rabbitmq.destination.routing_key": "created",
            "messaging.message.id": "o-1",
        }
        assert headers == {"traceparent": traceparent(create)}

    async def test_add_sync_too(self, pg: PrivatePostgres, table: str, spans: Spans) -> None:
        """``add_sync()`` stores the context the same way."""
        with request_span(spans), psycopg.connect(pg.dsn) as conn:
            message_id = add_sync(conn, b"x", routing_key="q", table=table)
            conn.commit()
            row = conn.execute(
                f"SELECT properties FROM {table} WHERE message_id = %s", (message_id,)
            ).fetchone()
        [request] = spans.exporter.get_finished_spans()
        assert row is not None
        assert row[0]["headers"] == {"traceparent": traceparent(request)}

    async def test_a_raising_tracer_never_breaks_add(
        self, pg: PrivatePostgres, table: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A broken tracer is logged once (``tracing_failed``); the row is written as given."""
        from tests.test_tracing import _BrokenProvider

        monkeypatch.setattr(writer, "_TRACING", Tracing(_BrokenProvider()))
        with structlog.testing.capture_logs() as logs:
            headers = await add_one(pg.dsn, table, headers={"tenant": "t1"})
            await add_one(pg.dsn, table)
        assert headers == {"tenant": "t1"}
        failed = [entry for entry in logs if entry["event"] == "tracing_failed"]
        assert len(failed) <= 1
        assert all(entry["call"] == "stamp_creation" for entry in failed)


class TestRelayTracerProvider:
    def test_refused_with_a_publisher_of_yours(self, pg: PrivatePostgres) -> None:
        """The relay's ``tracer_provider`` is for its own publisher, never silently dropped."""
        with pytest.raises(InvalidSettings, match="tracer_provider"):
            OutboxRelay(
                pg.dsn,
                ReliablePublisher("amqp://127.0.0.1/"),
                tracer_provider=Spans().provider,
            )


def span_links(span: ReadableSpan) -> list[tuple[int, int]]:
    return [(link.context.trace_id, link.context.span_id) for link in span.links]


@pytest.mark.rabbitmq
class TestOutboxTrace:
    @pytest.mark.parametrize("create_span", [False, True], ids=["request-context", "create-span"])
    async def test_one_trace_from_the_request_to_the_consumer(
        self,
        pg: PrivatePostgres,
        table: str,
        broker_url: str,
        spans: Spans,
        monkeypatch: pytest.MonkeyPatch,
        create_span: bool,
    ) -> None:
        """HTTP request → ``add()`` in its transaction → commit → relay → consumer: the row
        holds the request's context (or, with a global provider, its ``create`` span's);
        the relay's batch span and the consumer's process span link to that context, in
        the request's trace."""
        if create_span:
            monkeypatch.setattr(writer, "_TRACING", Tracing(spans.provider))
        queue = f"test-outbox-trace-{uuid.uuid4().hex[:10]}"
        consumer = ReliableConsumer(
            connection(broker_url), registry=CollectorRegistry(), tracer_provider=spans.provider
        )
        handled: list[str] = []

        @consumer.handler(queue)
        async def handle(body: bytes, delivery: Delivery) -> None:
            handled.append(delivery.headers["traceparent"])

        try:
            async with consumer:
                with request_span(spans):
                    headers = await add_one(pg.dsn, table, routing_key=queue, message_id="e-1")
                relay = OutboxRelay(
                    pg.dsn,
                    connection(broker_url),
                    settings=RelaySettings(poll_interval=0.2),
                    table=table,
                    registry=CollectorRegistry(),
                    tracer_provider=spans.provider,
                )
                async with relay:
                    assert await relay.run_once() == 1
                await wait_until(lambda: len(spans.named("process ")) == 1, timeout=10)
        finally:
            link = await aio_pika.connect(broker_url)
            async with link:
                channel = await link.channel()
                await delete_topology(channel, consumer.topology(queue))
        [request] = spans.named("HTTP request")
        stored = spans.named("create ")[0] if create_span else request
        assert len(spans.named("create ")) == int(create_span), "the relay makes no create span"
        assert headers == {"traceparent": traceparent(stored)}
        context = ids_of(stored)
        assert context[0] == ids_of(request)[0], "in the request's trace"
        [delivered] = handled
        assert delivered == traceparent(stored), "the same context reached the consumer"
        [process] = spans.named("process ")
        assert process.kind is SpanKind.CONSUMER
        assert span_links(process) == [context]
        publishes = [s for s in spans.named("publish") if s.kind is SpanKind.CLIENT]
        assert len(publishes) == 1, "one batch span for the relay's one batch"
        [batch] = publishes
        assert batch.name == f"publish {queue}"
        assert span_links(batch) == [context], "the relay's batch span links to the row's context"
        assert batch.links[0].attributes == {"messaging.message.id": "e-1"}
        assert batch.attributes is not None
        assert batch.attributes["messaging.batch.message_count"] == 1
