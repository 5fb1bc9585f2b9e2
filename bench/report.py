"""Render the "Figures" section of docs/performance.md from the benches' JSON files.

    python bench/report.py --publish before.json after.json \\
        --consume consume-before.json consume-after.json \\
        --profile profile-before.json profile-after.json \\
        --image img/performance.png > figures.md

Each of ``--publish`` (``bench/publish.py --json``), ``--consume``
(``bench/consume.py --json``) takes one run or two (before, then after);
``--profile`` (``bench/profile_publish.py --json``) takes any number. Every
figure printed comes from those files, except the profile column "issue 12",
which quotes the issue's profile of the path before the rewrite. Ratios are
against the baselines *of the same run* (aio-pika and pika without confirms;
aio-pika and pika with auto-ack), so they compare across runs where absolute
rates do not. The output is Markdown: paste it under "## Figures".
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from typing import Any

import _tracing_modes

AIO_UNCONFIRMED = "aio-pika, no confirms"
PIKA_UNCONFIRMED = "pika BlockingConnection, no confirms"
AIO_AUTO = "aio-pika auto-ack"
PIKA_AUTO = "pika BlockingConnection auto-ack"
PUBLISH_MANY = "reliable_mq publish_many()"
GATHERED = "reliable_mq publish() gathered"
CONSUMER_DEFAULTS = "reliable_mq defaults (dedup memory)"

ISSUE_12_PROFILE = {  # enqueue() + flush() of 20,000 before the rewrite, as the issue reports it
    "loop_iterations": 3.0,
    "call_soon": 11.7,
    "socket_writes": 1.0,
    "tasks": 1.0,
    "pamqp": 0.17,
}


def load(path: str) -> dict[str, Any]:
    with open(path) as handle:
        data: dict[str, Any] = json.load(handle)
    return data


def _label(run: dict[str, Any], fallback: str) -> str:
    return str(run.get("label") or (run.get("reliable_mq") or {}).get("label") or fallback)


def _origin(run: dict[str, Any]) -> str:
    found = run.get("reliable_mq") or {}
    return f"`{found.get('commit') or 'unknown commit'}`"


def _named(run: dict[str, Any], name: str) -> str:
    label = _label(run, name)
    return "" if label == name else f" ({label})"


def _rows(run: dict[str, Any], key: str) -> dict[str, dict[str, Any]]:
    return {row[key]: row for row in run["rows"]}


def _ratio(row: dict[str, Any] | None, base: dict[str, Any] | None) -> float | None:
    if row is None or base is None or not base.get("rate"):
        return None
    return float(row["rate"]) / float(base["rate"])


def _num(value: float | None, spec: str, suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def _pair(values: Sequence[float | None], spec: str, suffix: str = "") -> str:
    return " → ".join(_num(v, spec, suffix) for v in values)


def _table(header: Sequence[str], rows: list[list[str]], right_from: int = 1) -> list[str]:
    align = ["---" if i < right_from else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _runs_line(runs: list[dict[str, Any]], detail: str) -> str:
    last = runs[-1]
    names = ["before", "after"] if len(runs) == 2 else ["this run"]
    who = "; ".join(
        f"{name}{_named(run, name)}: reliable_mq {_origin(run)}"
        for name, run in zip(names, runs, strict=True)
    )
    return (
        f"{last['messages']:,} persistent {last.get('size', 256)}-byte messages per run, "
        f"{detail}, medians of {last['rounds']} interleaved round(s), loop "
        f"{last.get('loop', '?')}. {who}."
    )


def _column(
    runs: list[dict[str, Any]],
    name: str,
    key: str,
    value: Callable[[dict[str, Any] | None, dict[str, dict[str, Any]]], float | None],
) -> list[float | None]:
    found = []
    for run in runs:
        rows = _rows(run, key)
        found.append(value(rows.get(name), rows))
    return found


def publish_section(runs: list[dict[str, Any]]) -> list[str]:
    names: list[str] = []
    for run in reversed(runs):
        names += [row["variant"] for row in run["rows"] if row["variant"] not in names]
    two = len(runs) == 2
    arrow = " (before → after)" if two else ""
    header = [
        "publish",
        "confirms",
        f"msgs/s{arrow}",
        f"vs aio-pika unconfirmed{arrow}",
        f"vs pika unconfirmed{arrow}",
        f"client µs/msg{arrow}",
        f"broker µs/msg{arrow}",
    ]
    rows = []
    for name in names:
        confirms = next(
            (
                _rows(run, "variant")[name]["confirms"]
                for run in runs
                if name in _rows(run, "variant")
            ),
            False,
        )
        rows.append(
            [
                name,
                "yes" if confirms else "no",
                _pair(_column(runs, name, "variant", lambda r, _: r and r["rate"]), ",.0f"),
                _pair(
                    _column(runs, name, "variant", lambda r, a: _ratio(r, a.get(AIO_UNCONFIRMED))),
                    ".2f",
                    "x",
                ),
                _pair(
                    _column(runs, name, "variant", lambda r, a: _ratio(r, a.get(PIKA_UNCONFIRMED))),
                    ".2f",
                    "x",
                ),
                _pair(_column(runs, name, "variant", lambda r, _: r and r["client_us"]), ".1f"),
                _pair(_column(runs, name, "variant", lambda r, _: r and r["broker_us"]), ".1f"),
            ]
        )
    lines = ["### Publishing", "", _runs_line(runs, f"window {runs[-1]['window']:,}"), ""]
    lines += _table(header, rows, right_from=2)
    after = _rows(runs[-1], "variant")
    many, gathered = after.get(PUBLISH_MANY), after.get(GATHERED)
    aio = after.get(AIO_UNCONFIRMED)
    checks = [
        ("`publish_many()` ≥ 1.3x aio-pika unconfirmed", _ratio(many, aio), 1.3, "x", True),
        ("gathered `publish()` ≥ 1.0x aio-pika unconfirmed", _ratio(gathered, aio), 1.0, "x", True),
        (
            "client CPU per confirmed message (`publish_many()`) ≤ 40 µs",
            many and many["client_us"],
            40.0,
            " µs",
            False,
        ),
    ]
    lines += ["", "Issue 12's publishing targets, from the last run:", ""]
    lines += [_check(*check) for check in checks]
    return lines


def _check(text: str, value: float | None, goal: float, unit: str, higher: bool) -> str:
    if value is None:
        return f"- {text}: not measured"
    met = value >= goal if higher else value <= goal
    spec = ".2f" if unit == "x" else ".1f"
    return f"- {text}: {value:{spec}}{unit}, {'met' if met else 'not met'}"


def consume_section(runs: list[dict[str, Any]]) -> list[str]:
    names: list[str] = []
    for run in reversed(runs):
        names += [row["mode"] for row in run["rows"] if row["mode"] not in names]
    arrow = " (before → after)" if len(runs) == 2 else ""
    header = [
        "consume",
        f"msgs/s{arrow}",
        f"vs aio-pika auto-ack{arrow}",
        f"vs pika auto-ack{arrow}",
        f"client µs/msg{arrow}",
        f"broker µs/msg{arrow}",
    ]
    rows = [
        [
            name,
            _pair(_column(runs, name, "mode", lambda r, _: r and r["rate"]), ",.0f"),
            _pair(_column(runs, name, "mode", lambda r, a: _ratio(r, a.get(AIO_AUTO))), ".2f", "x"),
            _pair(
                _column(runs, name, "mode", lambda r, a: _ratio(r, a.get(PIKA_AUTO))), ".2f", "x"
            ),
            _pair(_column(runs, name, "mode", lambda r, _: r and r["client_us"]), ".1f"),
            _pair(_column(runs, name, "mode", lambda r, _: r and r["broker_us"]), ".1f"),
        ]
        for name in names
    ]
    lines = ["### Consuming", "", _runs_line(runs, f"prefetch {runs[-1]['prefetch']}"), ""]
    lines += _table(header, rows)
    after = _rows(runs[-1], "mode")
    ratio = _ratio(after.get(CONSUMER_DEFAULTS), after.get(AIO_AUTO))
    lines += ["", "Issue 12's consuming target, from the last run:", ""]
    lines.append(
        _check("the consumer with its defaults ≥ 1.2x aio-pika auto-ack", ratio, 1.2, "x", True)
    )
    return lines


def profile_section(profiles: list[dict[str, Any]]) -> list[str]:
    columns = [
        f"{_label(p, 'run')} `{p['api']}()`, {p['messages']:,} msgs ({_origin(p)})"
        for p in profiles
    ]
    header = ["per message", "issue 12 (before, 20,000 msgs)", *columns]

    def share(p: dict[str, Any], group: str) -> float | None:
        found = p.get("profile", {}).get("shares", {})
        return found.get(group) if found else None

    metrics: list[tuple[str, Any, Callable[[dict[str, Any]], float | None], str]] = [
        ("event-loop iterations", 3.0, lambda p: p["per_message"]["loop_iterations"], ".3f"),
        ("`call_soon` calls", 11.7, lambda p: p["per_message"]["call_soon"], ".3f"),
        ("socket writes", 1.0, lambda p: p["per_message"]["socket_writes"], ".4f"),
        (
            "messages per socket write",
            1.0,
            lambda p: p["messages"] / max(p["counts"]["socket_writes"], 1),
            ",.1f",
        ),
        ("asyncio Tasks created", 1.0, lambda p: p["per_message"]["tasks"], ".4f"),
        ("client CPU, µs", None, lambda p: p["per_message"]["cpu_us"], ".1f"),
        ("pamqp, share of busy time", 0.17, lambda p: share(p, "pamqp"), ".1%"),
        ("reliable_mq, share of busy time", None, lambda p: share(p, "reliable_mq"), ".1%"),
    ]
    rows = [
        [title, _num(issue, spec), *(_num(get(p), spec) for p in profiles)]
        for title, issue, get, spec in metrics
    ]
    lines = [
        "### Profile of the publish path",
        "",
        "From `bench/profile_publish.py`: counts without a profiler, shares under cProfile "
        "(busy time: profiled time minus the selector's wait).",
        "",
    ]
    lines += _table(header, rows)
    last = profiles[-1]
    if last.get("top"):
        lines += [
            "",
            f"Top functions by own time, {_label(last, 'last run')} `{last['api']}()`:",
            "",
        ]
        top_rows = [
            [f"`{row['function']}`", f"{row['calls']:,}", f"{row['us_per_message']:.2f}"]
            for row in last["top"]
        ]
        lines += _table(["function", "calls", "µs per message (cProfile)"], top_rows)
    return lines


def tracing_section(runs: list[dict[str, Any]]) -> list[str]:
    """The "Overhead" table of docs/tracing.md from ``--tracing`` runs (any bench's JSON)."""
    rows: list[list[str]] = []
    for run in runs:
        key = "mode" if run["bench"] == "consume" else "variant"
        found = _rows(run, key)
        for name in found:
            measured = [found.get(_tracing_modes.row_name(name, m)) for m in _tracing_modes.MODES]
            if any(row is None for row in measured):
                continue
            absent, api, sdk = (float(row["client_us"]) for row in measured if row is not None)
            spans = measured[2].get("spans_per_message") if measured[2] else None
            rows.append(
                [
                    f"{run['bench']}, {name}",
                    f"{absent:.1f} µs",
                    f"{api:.1f} µs",
                    f"{sdk:.1f} µs",
                    f"{(api / absent - 1) * 100:+.1f}%",
                    f"{sdk - api:+.1f} µs",
                    _num(spans, ".2f"),
                ]
            )
    header = [
        "bench, variant",
        "not importable",
        "API only",
        "SDK",
        "API only vs not importable",
        "SDK vs API only",
        "spans per message (SDK)",
    ]
    runs_text = "; ".join(
        f"{run['bench']}: {run['messages']:,} messages per run, medians of {run['rounds']} "
        f"interleaved round(s), reliable_mq {_origin(run)}"
        for run in runs
    )
    return [
        f"Client CPU per message, each set-up in a child process. {runs_text}.",
        "",
        *_table(header, rows),
    ]


def render(args: argparse.Namespace) -> str:
    parts: list[list[str]] = []
    if args.image:
        parts.append([f"![Publish rates and CPU per message, before and after]({args.image})"])
    if args.publish:
        parts.append(publish_section([load(path) for path in args.publish]))
    if args.consume:
        parts.append(consume_section([load(path) for path in args.consume]))
    if args.profile:
        parts.append(profile_section([load(path) for path in args.profile]))
    if args.tracing:
        parts.append(tracing_section([load(path) for path in args.tracing]))
    return "\n\n".join("\n".join(part) for part in parts) + "\n"


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--publish", nargs="+", metavar="JSON", help="before (optional), after")
    parser.add_argument("--consume", nargs="+", metavar="JSON", help="before (optional), after")
    parser.add_argument("--profile", nargs="+", metavar="JSON", help="profile runs, in order")
    parser.add_argument("--image", help="link this chart (bench/plot.py) at the top")
    parser.add_argument(
        "--tracing",
        nargs="+",
        metavar="JSON",
        help="runs with --tracing (publish, consume, sync_publish): the tracing overhead table",
    )
    args = parser.parse_args()
    for option in ("publish", "consume"):
        if getattr(args, option) and len(getattr(args, option)) > 2:
            parser.error(f"--{option} takes one run, or two: before and after")
    if not (args.publish or args.consume or args.profile or args.tracing):
        parser.error("nothing to render: give --publish, --consume, --profile and/or --tracing")
    print(render(args), end="")


if __name__ == "__main__":
    cli()
