"""The picture in docs/tracing.md: spans recorded from a real run, drawn by scripts/trace_waterfall.py.

The scenario runs against the shared broker and a private PostgreSQL, with an SDK
``TracerProvider`` of its own (never the global one): a request span ``POST /orders``
writes an outbox row and commits, the ``OutboxRelay`` publishes it, a
``ReliableConsumer`` processes and acks it; and a plain ``publish()`` goes through
the same consumer. It records whatever spans the library makes today and writes
them to ``$WATERFALL_SPANS`` (a temporary file by default), which
``scripts/trace_waterfall.py --record`` renders into docs/img/trace-waterfall.svg.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import sys
import uuid
import xml.etree.ElementTree as ET
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import aio_pika
import psycopg
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client import CollectorRegistry

from reliable_mq import ReliablePublisher
from reliable_mq.consumer import ReliableConsumer
from reliable_mq.outbox import OutboxRelay, RelaySettings, add
from reliable_mq.outbox.admin import create_schema
from reliable_mq.topology import delete_topology
from tests.support.private_postgres import PrivatePostgres, running_private_postgres

ROOT = Path(__file__).resolve().parents[2]


def _renderer() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "trace_waterfall", ROOT / "scripts" / "trace_waterfall.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


waterfall = _renderer()


@pytest.fixture(scope="module")
def pg() -> Iterator[PrivatePostgres]:
    with running_private_postgres() as server:
        yield server


@pytest.fixture(name="table")
async def _table(pg: PrivatePostgres) -> AsyncIterator[str]:
    name = f"outbox_{uuid.uuid4().hex[:8]}"
    await create_schema(pg.dsn, table=name)
    yield name
    async with await psycopg.AsyncConnection.connect(pg.dsn, autocommit=True) as conn:
        await conn.execute(f"DROP TABLE {name}")


def _relay(dsn: str, publisher: ReliablePublisher, table: str) -> OutboxRelay:
    """The relay over ``publisher``, which carries the tracer provider."""
    return OutboxRelay(
        dsn,
        publisher,
        settings=RelaySettings(poll_interval=0.2),
        table=table,
        registry=CollectorRegistry(),
    )


PLAIN = "publish() → confirm → process → ack"
OUTBOX = "request → outbox row → relay → process"


async def record_scenario(
    broker_url: str, dsn: str, table: str
) -> tuple[list[ReadableSpan], dict[str, str]]:
    """Run the docs scenario: the finished spans, and each trace's scenario (panel title)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = provider.get_tracer("shop")
    queue = f"orders-{uuid.uuid4().hex[:4]}"
    consumer = ReliableConsumer(broker_url, registry=CollectorRegistry(), tracer_provider=provider)
    handled: list[bytes] = []

    @consumer.handler(queue)
    async def apply(body: bytes) -> None:
        with app.start_as_current_span("apply order"):  # the handler's own work: a child
            await asyncio.sleep(0.003)
        handled.append(body)

    publisher = ReliablePublisher(
        broker_url, registry=CollectorRegistry(), tracer_provider=provider
    )
    try:
        async with consumer, publisher:
            await publisher.publish(b'{"order": 1}', routing_key=queue, message_id="order-1")
            await _until(
                lambda: any(s.kind is SpanKind.CONSUMER for s in exporter.get_finished_spans())
            )
            plain = {f"{s.context.trace_id:032x}" for s in exporter.get_finished_spans()}
            with app.start_as_current_span("POST /orders", kind=SpanKind.SERVER):
                async with await psycopg.AsyncConnection.connect(dsn) as conn:
                    await add(
                        conn, {"order": 2}, routing_key=queue, message_id="order-2", table=table
                    )
                    await conn.commit()
            async with _relay(dsn, publisher, table) as relay:
                while not await relay.run_once():
                    await asyncio.sleep(0.05)
            await _until(lambda: len(handled) == 2)
    finally:
        async with await aio_pika.connect(broker_url) as link:
            await delete_topology(await link.channel(), consumer.topology(queue))
    provider.shutdown()
    spans = list(exporter.get_finished_spans())
    return spans, {
        f"{s.context.trace_id:032x}": PLAIN if f"{s.context.trace_id:032x}" in plain else OUTBOX
        for s in spans
    }


async def _until(condition: Any, timeout: float = 15) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


def ids(span: ReadableSpan) -> tuple[int, int]:
    context = span.get_span_context()
    assert context is not None
    return context.trace_id, context.span_id


def ids_of_link(link: Any) -> tuple[int, int]:
    return link.context.trace_id, link.context.span_id


@pytest.mark.rabbitmq
class TestRecordedWaterfall:
    async def test_the_docs_scenario_records_linked_traces_and_renders_them(
        self, broker_url: str, pg: PrivatePostgres, table: str, tmp_path: Path
    ) -> None:
        """publish → process, and request → outbox → relay → process: recorded, dumped,
        drawn with every span's name and an arrow for each link between recorded spans.

        Only what the library makes today is required (the relay's ``publish_many()``
        makes no span yet); spans added later are drawn as they come."""
        spans, panels = await record_scenario(broker_url, pg.dsn, table)
        recorded = {ids(span) for span in spans}
        process = {
            (s.attributes or {}).get("messaging.message.id"): s
            for s in spans
            if s.kind is SpanKind.CONSUMER
        }
        assert set(process) == {"order-1", "order-2"}, [s.name for s in spans]
        [plain] = [
            s for s in spans if s.kind is SpanKind.PRODUCER and panels[f"{ids(s)[0]:032x}"] == PLAIN
        ]
        assert [ids_of_link(link) for link in process["order-1"].links] == [ids(plain)]
        # The outbox hop: whatever links exist point into this recording (no dangling notes).
        assert all(ids_of_link(link) in recorded for link in process["order-2"].links)
        [request] = [s for s in spans if s.name == "POST /orders"]
        assert request.kind is SpanKind.SERVER
        handler_spans = [s for s in spans if s.name == "apply order"]
        assert sorted(s.parent.span_id for s in handler_spans if s.parent) == sorted(
            ids(p)[1] for p in process.values()
        )

        path = Path(os.environ.get("WATERFALL_SPANS") or tmp_path / "spans.json")
        records = waterfall.dump(spans, path, panels)
        svg = waterfall.render(waterfall.load(path))
        ET.fromstring(svg)  # well-formed
        for record in records:
            label = re.escape(_escaped(record["name"][:30]))
            assert re.search(f"<text [^>]*>(↥ )?{label}", svg), record["name"]
        drawn_links = svg.count('marker-end="url(#arrow)"') - 1  # minus the legend's
        linked = sum(1 for s in spans for link in s.links if ids_of_link(link) in recorded)
        assert drawn_links == linked >= 1
        assert "(not recorded)" not in svg
        assert f">{PLAIN}<" in svg and f">{OUTBOX}<" in svg


def _escaped(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _span(name: str, span_id: str, start: int, end: int, **fields: Any) -> dict[str, Any]:
    return {
        "name": name,
        "kind": fields.pop("kind", "INTERNAL"),
        "trace_id": fields.pop("trace_id", "a" * 32),
        "span_id": span_id,
        "parent_id": fields.pop("parent_id", None),
        "links": fields.pop("links", []),
        "start_ns": start,
        "end_ns": end,
        "status": fields.pop("status", "UNSET"),
        "attributes": fields.pop("attributes", {}),
        "events": fields.pop("events", []),
    }


@pytest.mark.unit
class TestRenderer:
    def test_children_are_indented_under_their_parent_and_orphans_are_marked(self) -> None:
        """A span whose parent was not recorded is drawn as a root, with the marker."""
        svg = waterfall.render(
            [
                _span("root", "1" * 16, 0, 10_000_000),
                _span("child", "2" * 16, 1_000_000, 5_000_000, parent_id="1" * 16),
                _span("orphan", "3" * 16, 2_000_000, 3_000_000, parent_id="9" * 16),
            ]
        )
        ET.fromstring(svg)
        assert ">↥ orphan<" in svg and "parent not recorded" in svg
        assert ">root<" in svg and ">child<" in svg
        x_of = {
            name: float(svg.split(f">{name}<")[0].rsplit('x="', 1)[1].split('"')[0])
            for name in ("root", "child")
        }
        assert x_of["child"] > x_of["root"]

    def test_links_become_arrows_or_notes_and_traces_joined_by_a_link_share_a_panel(
        self,
    ) -> None:
        """A recorded link target gets an arrow; a missing one a note; unlinked traces
        get panels of their own."""
        producer = _span("publish q", "1" * 16, 0, 4_000_000, kind="PRODUCER")
        consumer = _span(
            "process q",
            "2" * 16,
            3_000_000,
            6_000_000,
            kind="CONSUMER",
            trace_id="b" * 32,
            links=[{"trace_id": "a" * 32, "span_id": "1" * 16}],
        )
        stray = _span(
            "process r",
            "3" * 16,
            9_000_000_000,
            9_001_000_000,
            kind="CONSUMER",
            trace_id="c" * 32,
            links=[{"trace_id": "d" * 32, "span_id": "7" * 16}],
        )
        svg = waterfall.render([producer, consumer, stray])
        assert svg.count('marker-end="url(#arrow)"') == 2  # the legend's and one link
        assert "link to 777777… (not recorded)" in svg
        assert [p.traces for p in waterfall._panels([producer, consumer, stray])] == [
            ["a" * 32, "b" * 32],
            ["c" * 32],
        ]

    def test_events_are_ticks_and_errors_are_outlined(self) -> None:
        """A ``republish`` event is a tick with its name; an ERROR span a red outline."""
        span = _span(
            "publish q",
            "1" * 16,
            0,
            10_000_000,
            kind="PRODUCER",
            status="ERROR",
            attributes={"error.type": "PublishNacked", "reliable_mq.publish.attempts": 2},
            events=[{"name": "republish", "time_ns": 5_000_000, "attributes": {}}],
        )
        svg = waterfall.render([span])
        assert ">republish<" in svg
        assert 'stroke="#d62728"' in svg.split("</defs>", 1)[1].split("error status")[1]
        assert "attempts=2" in svg and "error=PublishNacked" in svg

    def test_nothing_to_draw_is_an_error(self) -> None:
        with pytest.raises(ValueError, match="no spans"):
            waterfall.render([])
