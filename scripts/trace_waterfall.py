"""Render recorded OpenTelemetry spans as an SVG waterfall (docs/img/trace-waterfall.svg).

    python scripts/trace_waterfall.py spans.json -o waterfall.svg
    python scripts/trace_waterfall.py --record docs/img/trace-waterfall.svg

The first form renders a JSON file of finished spans (a list, or ``{"spans": [...]}``;
each span as [record][] writes it: name, kind, trace_id, span_id, parent_id, links,
start_ns, end_ns, status, attributes, events). The second runs the scenario of
``tests/docs/test_trace_waterfall.py`` against the real broker and a private
PostgreSQL (a request span, an outbox row, the relay, a consumer; and a plain
``publish()``), then renders what it recorded.

The picture: one row per span, bars on a shared time axis, children indented
under their parent; spans whose traces are joined by links share one panel, and
each link is a dashed arrow from the span it points to (or a note when that span
was not recorded). A span whose parent was not recorded is drawn as a root and
marked. Events are ticks on the bar (``republish``...); colours follow the kind.
Pure Python, no dependency beyond the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = "tests/docs/test_trace_waterfall.py"

KIND_COLOURS = {
    "PRODUCER": "#e8833a",
    "CONSUMER": "#3b7dd8",
    "CLIENT": "#8e5bc4",
    "SERVER": "#3a9d5d",
    "INTERNAL": "#8a939c",
}
KEY_ATTRIBUTES = (  # shown under a span's name, in this order, when present (up to 3)
    ("error.type", "error"),
    ("messaging.batch.message_count", "batch"),
    ("reliable_mq.publish.attempts", "attempts"),
    ("reliable_mq.settle", "settle"),
    ("reliable_mq.attempt", "attempt"),
    ("messaging.message.id", "id"),
    ("messaging.rabbitmq.message.delivery_tag", "tag"),
)

WIDTH = 1000
LABEL_WIDTH = 370
RIGHT_MARGIN = 70
ROW = 36
TRACE_ROW = 22
AXIS = 40
FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"


# -- recording ----------------------------------------------------------------------------


def record(span: Any) -> dict[str, Any]:
    """A finished SDK span (``ReadableSpan``) as the JSON record the renderer reads."""
    context = span.get_span_context()
    return {
        "name": span.name,
        "kind": span.kind.name,
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent_id": f"{span.parent.span_id:016x}" if span.parent is not None else None,
        "links": [
            {
                "trace_id": f"{link.context.trace_id:032x}",
                "span_id": f"{link.context.span_id:016x}",
                "attributes": _plain(link.attributes),
            }
            for link in span.links
        ],
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": _plain(span.attributes),
        "events": [
            {"name": event.name, "time_ns": event.timestamp, "attributes": _plain(event.attributes)}
            for event in span.events
        ],
    }


def _plain(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    return {
        key: list(value) if isinstance(value, tuple) else value
        for key, value in (attributes or {}).items()
    }


def dump(
    spans: Iterable[Any],
    path: str | os.PathLike[str],
    panels: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Write finished SDK spans to ``path`` as JSON (``{"spans": [...]}``); the records.

    ``panels`` maps a trace id (32 hex digits) to a panel title: the traces of one
    title are drawn together (a scenario); other traces are grouped by their links.
    """
    records = [record(span) for span in spans]
    for found in records:
        if panels and found["trace_id"] in panels:
            found["panel"] = panels[found["trace_id"]]
    Path(path).write_text(json.dumps({"spans": records}, indent=1) + "\n")
    return records


def load(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    data = json.loads(Path(path).read_text())
    spans: list[dict[str, Any]] = data["spans"] if isinstance(data, dict) else data
    return spans


# -- layout -------------------------------------------------------------------------------


@dataclass
class Row:
    span: dict[str, Any]
    depth: int
    orphan: bool
    """Its parent is named but was not recorded."""
    y: float = 0.0


@dataclass
class Panel:
    title: str
    traces: list[str]
    start: int
    end: int
    rows: list[Row | str] = field(default_factory=list)
    """Span rows, and trace ids where a trace's header row goes."""


def _panels(spans: Sequence[dict[str, Any]]) -> list[Panel]:
    """Traces with one ``panel`` title, or else joined by links (either way), share a
    panel; panels in time order."""
    by_trace: dict[str, list[dict[str, Any]]] = {}
    for span in sorted(spans, key=lambda s: (s["start_ns"], s["end_ns"])):
        by_trace.setdefault(span["trace_id"], []).append(span)
    group = {trace: trace for trace in by_trace}

    def find(trace: str) -> str:
        while group[trace] != trace:
            group[trace] = group[group[trace]]
            trace = group[trace]
        return trace

    title_of = {s["trace_id"]: s["panel"] for s in spans if s.get("panel")}
    first_of: dict[str, str] = {}
    for trace, title in title_of.items():  # one title: one panel
        group[find(trace)] = find(first_of.setdefault(title, trace))
    for span in spans:  # untitled traces: joined by their links
        for link in span.get("links") or []:
            target = link["trace_id"]
            if target in group and span["trace_id"] not in title_of and target not in title_of:
                group[find(target)] = find(span["trace_id"])
    members: dict[str, list[str]] = {}
    for trace in by_trace:  # in order of each trace's first span
        members.setdefault(find(trace), []).append(trace)
    panels = []
    for traces in members.values():
        found = [s for t in traces for s in by_trace[t]]
        title = title_of.get(traces[0], "")
        panel = Panel(
            title, traces, min(s["start_ns"] for s in found), max(s["end_ns"] for s in found)
        )
        for trace in traces:
            panel.rows.append(trace)
            panel.rows.extend(_tree(by_trace[trace]))
        panels.append(panel)
    return sorted(panels, key=lambda p: p.start)


def _tree(spans: list[dict[str, Any]]) -> list[Row]:
    """Depth-first, children by start time; a span with an unrecorded parent is a root."""
    ids = {s["span_id"] for s in spans}
    children: dict[str | None, list[dict[str, Any]]] = {}
    for span in spans:
        parent = span.get("parent_id")
        children.setdefault(parent if parent in ids else None, []).append(span)
    rows: list[Row] = []

    def walk(span: dict[str, Any], depth: int) -> None:
        parent = span.get("parent_id")
        rows.append(Row(span, depth, orphan=parent is not None and parent not in ids))
        for child in children.get(span["span_id"], []):
            walk(child, depth + 1)

    for root in children.get(None, []):
        walk(root, 0)
    return rows


def _step(span_ns: int) -> int:
    """A round tick interval giving 4 to 10 ticks over ``span_ns``."""
    target = max(span_ns, 1) / 8
    step = 1
    while step * 10 <= target:
        step *= 10
    for factor in (1, 2, 5, 10):
        if step * factor >= target:
            return step * factor
    return step * 10


def _duration(ns: int) -> str:
    ms = ns / 1e6
    if ms >= 100:
        return f"{ms:,.0f} ms"
    if ms >= 1:
        return f"{ms:.1f} ms"
    return f"{ns / 1e3:.0f} µs"


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


# -- drawing ------------------------------------------------------------------------------


class Svg:
    def __init__(self) -> None:
        self.parts: list[str] = []

    def add(self, element: str) -> None:
        self.parts.append(element)

    def text(self, x: float, y: float, content: str, size: float = 13, **style: Any) -> None:
        extra = "".join(f' {k.replace("_", "-")}="{v}"' for k, v in style.items())
        self.add(
            f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}"{extra}>{escape(content)}</text>'
        )


def render(spans: Sequence[dict[str, Any]], title: str = "") -> str:
    """The SVG document of ``spans`` (records as [record][] writes them)."""
    if not spans:
        raise ValueError("no spans to draw")
    panels = _panels(spans)
    svg = Svg()
    y = 20.0
    y = _header(svg, y, title or "A trace recorded by the test suite", spans)
    positions: dict[tuple[str, str], tuple[float, float, float]] = {}
    for panel in panels:
        y = _panel(svg, panel, y, positions)
    _links(svg, spans, positions)
    height = y + 16
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height:.0f}" '
        f'viewBox="0 0 {WIDTH} {height:.0f}" font-family="{FONT}">\n'
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
        'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
        'fill="#444"/></marker></defs>\n'
        f'<rect width="{WIDTH}" height="{height:.0f}" fill="#ffffff"/>\n'
        + "\n".join(svg.parts)
        + "\n</svg>\n"
    )


def _header(svg: Svg, y: float, title: str, spans: Sequence[dict[str, Any]]) -> float:
    svg.text(16, y + 8, title, 19, font_weight="bold", fill="#222")
    traces = len({s["trace_id"] for s in spans})
    svg.text(
        16,
        y + 30,
        f"{len(spans)} spans in {traces} traces; each panel has its own time scale",
        13,
        fill="#555",
    )
    y += 56
    x = 16.0
    for kind, colour in KIND_COLOURS.items():
        svg.add(f'<rect x="{x}" y="{y - 11}" width="15" height="13" rx="2" fill="{colour}"/>')
        svg.text(x + 20, y, kind.lower(), 13, fill="#333")
        x += 36 + 8 * len(kind)
    y += 22
    x = 16.0
    svg.add(
        f'<path d="M{x},{y - 4} L{x + 34},{y - 4}" stroke="#444" stroke-dasharray="5,3" '
        'fill="none" marker-end="url(#arrow)"/>'
    )
    svg.text(x + 40, y, "link, from the context it names", 13, fill="#333")
    x += 270
    svg.add(f'<line x1="{x}" y1="{y - 12}" x2="{x}" y2="{y + 2}" stroke="#111" stroke-width="2"/>')
    svg.text(x + 6, y, "event", 13, fill="#333")
    x += 70
    svg.add(
        f'<rect x="{x}" y="{y - 11}" width="15" height="13" rx="2" fill="#fff" '
        'stroke="#d62728" stroke-width="2"/>'
    )
    svg.text(x + 20, y, "error status", 13, fill="#333")
    x += 120
    svg.text(x, y, "↥ parent not recorded", 13, fill="#333")
    return y + 12


def _panel(
    svg: Svg, panel: Panel, y: float, positions: dict[tuple[str, str], tuple[float, float, float]]
) -> float:
    left, right = LABEL_WIDTH + 10, WIDTH - RIGHT_MARGIN
    scale = (right - left) / max(panel.end - panel.start, 1)

    def at(ns: int) -> float:
        return left + (ns - panel.start) * scale

    y += 12
    svg.add(f'<line x1="10" y1="{y}" x2="{WIDTH - 10}" y2="{y}" stroke="#bbb"/>')
    if panel.title:
        svg.text(16, y + 22, _clip(panel.title, 44), 14.5, font_weight="bold", fill="#222")
    y += AXIS
    step = _step(panel.end - panel.start)
    ticks = range(0, panel.end - panel.start + 1, step)
    for tick in ticks:
        x = at(panel.start + tick)
        svg.add(f'<line x1="{x:.1f}" y1="{y - 6}" x2="{x:.1f}" y2="{y}" stroke="#999"/>')
        label = _duration(tick).replace(".0 ", " ") if tick else "0"
        svg.text(x, y - 10, label, 12, fill="#666", text_anchor="middle")
    top = y
    rows: list[tuple[float, Row | str]] = []
    for row in panel.rows:
        rows.append((y, row))
        y += TRACE_ROW if isinstance(row, str) else ROW
    for tick in ticks:  # the grid, behind the bars
        x = at(panel.start + tick)
        svg.add(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{y}" stroke="#eee"/>')
    for row_y, row in rows:
        if isinstance(row, str):
            svg.add(
                f'<rect x="10" y="{row_y + 2}" width="{WIDTH - 20}" height="{TRACE_ROW - 4}" '
                'fill="#f3f4f6"/>'
            )
            svg.text(16, row_y + 16, f"trace {row[:8]}…", 12, fill="#555", font_weight="bold")
            continue
        _span_row(svg, row, row_y, at, positions)
    return y


def _span_row(
    svg: Svg,
    row: Row,
    y: float,
    at: Any,
    positions: dict[tuple[str, str], tuple[float, float, float]],
) -> None:
    span = row.span
    colour = KIND_COLOURS.get(span["kind"], KIND_COLOURS["INTERNAL"])
    indent = 16 + 16 * row.depth
    marker = "↥ " if row.orphan else ""
    svg.text(indent, y + 16, _clip(marker + span["name"], 40 - 2 * row.depth), 14.5, fill="#111")
    duration_ns = span["end_ns"] - span["start_ns"]
    details = [span["kind"].lower()]
    attributes = span.get("attributes") or {}
    for key, short in KEY_ATTRIBUTES:
        if key in attributes and len(details) < 4:
            value = str(attributes[key])
            details.append(f"{short}={_clip(value, 12 if short == 'id' else 20)}")
    if row.orphan:
        details = [details[0], "parent not recorded", *details[1:3]]
    svg.text(indent, y + 31, _clip(" · ".join(details), 54 - 2 * row.depth), 12, fill="#666")
    x0, x1 = at(span["start_ns"]), at(span["end_ns"])
    width = max(x1 - x0, 2.0)
    error = span.get("status") == "ERROR" or "error.type" in attributes
    stroke = ' stroke="#d62728" stroke-width="2.5"' if error else ""
    svg.add(
        f'<rect x="{x0:.1f}" y="{y + 10}" width="{width:.1f}" height="17" rx="3" '
        f'fill="{colour}"{stroke}><title>{escape(span["name"])}</title></rect>'
    )
    svg.text(x0 + width + 5, y + 23, _duration(duration_ns), 12, fill="#333")
    for event in span.get("events") or []:
        x = at(event["time_ns"])
        svg.add(
            f'<line x1="{x:.1f}" y1="{y + 5}" x2="{x:.1f}" y2="{y + 31}" stroke="#111" '
            'stroke-width="2"/>'
        )
        svg.text(x + 3, y + 7, event["name"], 10.5, fill="#111")
    positions[(span["trace_id"], span["span_id"])] = (x0, y + 18, x1)


def _links(
    svg: Svg,
    spans: Sequence[dict[str, Any]],
    positions: Mapping[tuple[str, str], tuple[float, float, float]],
) -> None:
    """A dashed arrow from each linked span to the span whose link points to it; a note
    beside the bar when the linked span was not recorded."""
    for span in spans:
        here = positions.get((span["trace_id"], span["span_id"]))
        if here is None:
            continue
        for number, link in enumerate(span.get("links") or []):
            there = positions.get((link["trace_id"], link["span_id"]))
            if there is None:
                svg.text(
                    here[0] - 6,
                    here[1] + 4 + 11 * number,
                    f"⇠ link to {link['span_id'][:6]}… (not recorded)",
                    11,
                    fill="#444",
                    text_anchor="end",
                )
                continue
            x0, y0 = there[0], there[1] + 8
            x1, y1 = here[0], here[1] - 8
            bend = max(abs(y1 - y0) * 0.5, 20)
            svg.add(
                f'<path d="M{x0:.1f},{y0:.1f} C{x0 - 30:.1f},{y0 + bend:.1f} '
                f'{x1 - 30:.1f},{y1 - bend:.1f} {x1:.1f},{y1:.1f}" stroke="#444" '
                'stroke-width="1.3" stroke-dasharray="5,3" fill="none" marker-end="url(#arrow)"/>'
            )


# -- command line --------------------------------------------------------------------------


def record_scenario(spans_path: Path) -> None:
    """Run the docs scenario (real broker, private PostgreSQL); it writes ``spans_path``."""
    env = {**os.environ, "WATERFALL_SPANS": str(spans_path)}
    env.setdefault("PYTHONPATH", str(ROOT))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", SCENARIO]
    subprocess.run(command, cwd=ROOT, env=env, check=True)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spans", nargs="?", help="a JSON file of recorded spans")
    parser.add_argument("-o", "--output", help="the SVG to write (default: stdout)")
    parser.add_argument(
        "--record", metavar="SVG", help="run the docs scenario, then render what it recorded"
    )
    parser.add_argument("--keep-spans", help="with --record: also keep the spans JSON here")
    parser.add_argument("--title", help="the picture's title")
    args = parser.parse_args(argv)
    if args.record:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(args.keep_spans or Path(tmp) / "spans.json").resolve()
            record_scenario(path)
            spans = load(path)
        output = args.record
    elif args.spans:
        spans, output = load(args.spans), args.output
    else:
        parser.error("give a spans JSON file, or --record SVG")
    title = args.title or (
        "Spans recorded in a test run (RabbitMQ, PostgreSQL)" if args.record else ""
    )
    svg = render(spans, title)
    if output:
        Path(output).write_text(svg)
        print(f"{output}: {len(spans)} spans", file=sys.stderr)
    else:
        sys.stdout.write(svg)


if __name__ == "__main__":
    main()
