"""Draw ``bench/publish.py --json`` results as bar charts: one run, or before and after side by side.

    python bench/plot.py after.json --out docs/img/performance.png
    python bench/plot.py before.json after.json --out docs/img/performance.png
    python bench/plot.py before.json after.json --labels "74b721f,fast path" --out perf.png

Two panels: messages per second, and the client's CPU per message (µs; the
broker's, where it was measured, as a thin bar inside). Each variant gets one
bar per run, in the order given; each rate is annotated with its ratio to
aio-pika *unconfirmed* from the same run, the only comparison that survives the
drift between runs on a shared machine. Hatched bars publish without confirms
(not loss-proof). A run is labelled by ``--labels``, else by the ``label`` its
JSON records, else by its file name.

Needs matplotlib (the ``panels`` extra).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

AIO_UNCONFIRMED = "aio-pika, no confirms"
COLOURS = ("#9db4d6", "#2f5597", "#c55a11", "#548235")  # before, after, then any others


def load(path: str, label: str | None) -> dict[str, Any]:
    with open(path) as handle:
        data: dict[str, Any] = json.load(handle)
    data["_label"] = label or data.get("label") or Path(path).stem
    data["_rows"] = {row["variant"]: row for row in data["rows"]}
    return data


def variants(runs: list[dict[str, Any]]) -> list[str]:
    """Every variant, in the order of the last run, then those only earlier runs had."""
    names: list[str] = []
    for run in reversed(runs):
        for row in run["rows"]:
            if row["variant"] not in names:
                names.append(row["variant"])
    return names


def draw(runs: list[dict[str, Any]], target: str) -> None:
    names = variants(runs)
    count = len(runs)
    height = 0.8 / count
    figure, (rates_axis, cpu_axis) = plt.subplots(
        1, 2, figsize=(13, 0.5 * len(names) * max(count, 1.6) + 1.6), sharey=True
    )
    top_rate = top_cpu = 0.0
    for index, run in enumerate(runs):
        colour = COLOURS[index % len(COLOURS)]
        for position, name in enumerate(names):
            row = run["_rows"].get(name)
            y = position - 0.4 + height * (index + 0.5)
            if row is None:
                rates_axis.text(0, y, f" {run['_label']}: not in this run", va="center", fontsize=7)
                continue
            hatch = None if row["confirms"] else "//"
            rate = row["rate"]
            ratio = row.get("vs_aio_pika")
            if ratio is None and AIO_UNCONFIRMED in run["_rows"]:
                ratio = rate / run["_rows"][AIO_UNCONFIRMED]["rate"]
            rates_axis.barh(y, rate, height, color=colour, hatch=hatch, edgecolor="white")
            ratio_text = f"  {ratio:.2f}x" if ratio is not None else ""
            rates_axis.text(rate, y, f" {rate:,.0f}/s{ratio_text}", va="center", fontsize=7)
            top_rate = max(top_rate, rate)
            client = row.get("client_us")
            if client is not None:
                cpu_axis.barh(y, client, height, color=colour, hatch=hatch, edgecolor="white")
                broker = row.get("broker_us")
                if broker is not None:
                    cpu_axis.barh(y, broker, height / 4, color="#444444")
                extra = f" / broker {broker:.0f}" if broker is not None else ""
                cpu_axis.text(
                    max(client, broker or 0.0),
                    y,
                    f" {client:.0f} µs{extra}",
                    va="center",
                    fontsize=7,
                )
                top_cpu = max(top_cpu, client, broker or 0.0)
    rates_axis.set_yticks(range(len(names)), names, fontsize=8)
    rates_axis.invert_yaxis()
    rates_axis.set_xlim(0, top_rate * 1.45 or 1)
    cpu_axis.set_xlim(0, top_cpu * 1.5 or 1)
    rates_axis.set_xlabel("messages per second (higher is better); ratio: vs aio-pika unconfirmed")
    cpu_axis.set_xlabel("client CPU µs per message (lower is better); dark line: broker")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[i % len(COLOURS)]) for i in range(count)]
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="grey", hatch="//"))
    labels = [run["_label"] for run in runs] + ["no confirms (not loss-proof)"]
    figure.legend(handles, labels, loc="upper right", fontsize=8, ncol=count + 1)
    first = runs[-1]
    figure.suptitle(
        f"{first['messages']:,} persistent 256-byte messages, window {first['window']}, "
        f"medians of {first['rounds']} interleaved round(s) per run",
        fontsize=9,
        x=0.01,
        ha="left",
    )
    figure.tight_layout(rect=(0, 0, 1, 0.95))
    figure.savefig(target, dpi=110)


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="bench/publish.py --json files, oldest first")
    parser.add_argument("--out", "-o", required=True, help="the image to write (.png, .svg)")
    parser.add_argument("--labels", help="comma-separated names for the runs, in order")
    args = parser.parse_args()
    labels: list[str | None] = list(args.labels.split(",")) if args.labels else []
    if labels and len(labels) != len(args.results):
        parser.error(f"{len(labels)} labels for {len(args.results)} result files")
    labels += [None] * (len(args.results) - len(labels))
    draw([load(path, label) for path, label in zip(args.results, labels, strict=True)], args.out)


if __name__ == "__main__":
    cli()
