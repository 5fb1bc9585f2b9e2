"""Render the Grafana dashboard's panels from real traffic, without Grafana.

There is no Grafana on the machine the docs are built on, so this script
makes the picture in ``docs/img/dashboard.png`` itself: it runs a publisher
(through a TCP proxy that is cut once) and a consumer (some handlers raise
``Retry``, a few ``Reject``) against a real broker for about 40 seconds,
samples the metrics registry every 0.5 s, then evaluates the PromQL of six
panels of ``docs/grafana/reliable_mq.json`` over those samples and plots them.

Only the expression shapes those panels use are understood: ``rate`` and
``increase`` of counters, ``sum``/``max by (...)`` aggregations and
``histogram_quantile`` over bucket rates. Needs matplotlib
(``pip install -e '.[panels]'``):

    python docs/render_panels.py [--url amqp://guest:guest@127.0.0.1:5672/] [--seconds 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import re
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aio_pika
from prometheus_client import CollectorRegistry
from yarl import URL

from reliable_mq import (
    ConnectionSettings,
    Delivery,
    PublisherSettings,
    Reject,
    ReliableConsumer,
    ReliablePublisher,
    Retry,
    configure_logging,
)
from reliable_mq.testing import TCPProxy
from reliable_mq.topology import delete_topology

ROOT = Path(__file__).resolve().parent
DASHBOARD = ROOT / "grafana" / "reliable_mq.json"
OUTPUT = ROOT / "img" / "dashboard.png"
PANELS = (
    "Publish throughput",
    "Confirm latency",
    "In flight vs window",
    "Republished by reason",
    "Consumer outcomes",
    "DLQ rate",
)
STEP = 0.5  # seconds between samples
RATE_WINDOW = 2.0  # what $__rate_interval stands for here

Key = tuple[str, tuple[tuple[str, str], ...]]


def snapshot(registry: CollectorRegistry) -> dict[Key, float]:
    """Every sample of the registry, keyed by name and sorted labels."""
    values: dict[Key, float] = {}
    for family in registry.collect():
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = (
                sample.value
            )
    return values


# -- a very small PromQL ------------------------------------------------------

_SELECTOR = re.compile(r"(?P<name>[a-z_:]+)(?:\{(?P<matchers>[^}]*)\})?")
_MATCHER = re.compile(r'(?P<label>\w+)(?P<op>=~|=)"(?P<value>[^"]*)"')


@dataclass(frozen=True)
class Selector:
    name: str
    matchers: tuple[
        tuple[str, str], ...
    ]  # exact matches only; =~ (the $job variable) ignored

    @classmethod
    def parse(cls, text: str) -> Selector:
        match = _SELECTOR.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"not a selector: {text}")
        exact = tuple(
            (m["label"], m["value"])
            for m in _MATCHER.finditer(match["matchers"] or "")
            if m["op"] == "="
        )
        return cls(match["name"], exact)

    def series(
        self, sample: dict[Key, float]
    ) -> dict[tuple[tuple[str, str], ...], float]:
        wanted = dict(self.matchers)
        return {
            labels: value
            for (name, labels), value in sample.items()
            if name == self.name
            and all(dict(labels).get(k) == v for k, v in wanted.items())
        }


class Evaluator:
    """Evaluate the dashboard's expression shapes at one sample index."""

    def __init__(
        self, times: list[float], samples: list[dict[Key, float]]
    ) -> None:
        self.times = times
        self.samples = samples

    def _back(self, index: int, window: float) -> int:
        start = index
        while (
            start > 0
            and self.times[index] - self.times[start - 1] <= window + 1e-9
        ):
            start -= 1
        return start

    def _vector(
        self, expr: str, index: int
    ) -> dict[tuple[tuple[str, str], ...], float]:
        expr = expr.strip()
        fn = re.fullmatch(
            r"(rate|increase)\((.+)\[\$__rate_interval\]\)", expr
        )
        if fn:
            selector = Selector.parse(fn[2])
            start = self._back(index, RATE_WINDOW)
            now, then = (
                selector.series(self.samples[index]),
                selector.series(self.samples[start]),
            )
            span = self.times[index] - self.times[start]
            out = {}
            for labels, value in now.items():
                delta = value - then.get(labels, 0.0)
                if fn[1] == "rate":
                    out[labels] = delta / span if span > 0 else 0.0
                else:
                    out[labels] = delta
            return out
        return Selector.parse(expr).series(self.samples[index])

    def evaluate(
        self, expr: str, index: int
    ) -> dict[tuple[tuple[str, str], ...], float]:
        """The ``by`` labels of each series -> its value."""
        expr = expr.strip()
        hq = re.fullmatch(
            r"histogram_quantile\(([\d.]+),\s*sum by \(le\) \((.+)\)\)", expr
        )
        if hq:
            buckets: dict[float, float] = defaultdict(float)
            for labels, value in self._vector(hq[2], index).items():
                buckets[float(dict(labels)["le"])] += value
            return {(): histogram_quantile(float(hq[1]), buckets)}
        agg = re.fullmatch(r"(sum|max)(?: by \(([\w, ]+)\))? ?\((.+)\)", expr)
        if agg is None:
            raise ValueError(f"unsupported expression: {expr}")
        by = [
            name.strip() for name in (agg[2] or "").split(",") if name.strip()
        ]
        groups: dict[tuple[tuple[str, str], ...], list[float]] = defaultdict(
            list
        )
        for labels, value in self._vector(agg[3], index).items():
            label_map = dict(labels)
            groups[
                tuple((name, label_map.get(name, "")) for name in by)
            ].append(value)
        reduce = sum if agg[1] == "sum" else max
        return {
            group: float(reduce(values)) for group, values in groups.items()
        }


def histogram_quantile(q: float, buckets: dict[float, float]) -> float:
    """Prometheus's histogram_quantile: linear interpolation inside the bucket."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return math.nan
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (
                (rank - below) / max(count - below, 1e-12)
            )
        lower, below = bound, count
    return lower


# -- traffic --------------------------------------------------------------------


async def run_traffic(
    url: str, seconds: float, registry: CollectorRegistry
) -> tuple[list[float], list[dict[Key, float]], list[tuple[float, str]]]:
    broker = URL(url)
    queue = f"reliable_mq_panels_{uuid.uuid4().hex[:8]}"
    rng = random.Random(1)
    events: list[tuple[float, str]] = []
    times: list[float] = []
    samples: list[dict[Key, float]] = []
    consumer = ReliableConsumer(
        ConnectionSettings(url=url, connection_name="panels-consumer"),  # type: ignore[arg-type]
        registry=registry,
        prefetch=200,
        retry_delays=(1.0, 3.0),
        max_attempts=3,
    )

    @consumer.handler(queue)
    async def handle(body: dict[str, Any], delivery: Delivery) -> None:
        await asyncio.sleep(rng.random() * 0.004)
        if body["n"] % 500 == 0:
            raise Reject("poison")
        if delivery.attempt == 1 and rng.random() < 0.03:
            raise Retry("try later")

    started = time.monotonic()

    async def sampler() -> None:
        while True:
            times.append(time.monotonic() - started)
            samples.append(snapshot(registry))
            await asyncio.sleep(STEP)

    async with TCPProxy(
        broker.host or "127.0.0.1", broker.port or 5672
    ) as proxy:
        proxied = broker.with_host("127.0.0.1").with_port(proxy.port)
        publisher = ReliablePublisher(
            ConnectionSettings(
                url=str(proxied),  # type: ignore[arg-type]
                connection_name="panels-publisher",
                reconnect_initial_delay=0.5,
            ),
            settings=PublisherSettings(max_in_flight=500),
            registry=registry,
        )
        sampling = asyncio.create_task(sampler())
        async with consumer, publisher:
            n = 0
            cut_done = False
            while (elapsed := time.monotonic() - started) < seconds:
                phase = elapsed / seconds
                if (
                    0.3 <= phase < 0.6
                ):  # a burst: as fast as the window lets us
                    for _ in range(200):
                        await publisher.enqueue({"n": n}, routing_key=queue)
                        n += 1
                    if not cut_done and phase >= 0.45:
                        await proxy.cut()
                        events.append((elapsed, "connection cut"))
                        cut_done = True
                    continue
                for _ in range(50):  # steady: about 1,000 messages a second
                    await publisher.enqueue({"n": n}, routing_key=queue)
                    n += 1
                await asyncio.sleep(0.05)
            await publisher.flush()
            await asyncio.sleep(4)  # let retries come back and settle
        sampling.cancel()
    connection = await aio_pika.connect(url)
    async with connection:
        await delete_topology(
            await connection.channel(), consumer.topology(queue)
        )
    return times, samples, events


def legend_for(template: str, labels: dict[str, str]) -> str:
    """Grafana's ``{{label}}`` legend format, filled in."""
    if not template:
        return ",".join(labels.values())
    return re.sub(
        r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m[1], m[1]), template
    )


def plot(
    times: list[float],
    samples: list[dict[Key, float]],
    events: list[tuple[float, str]],
) -> None:
    import matplotlib  # noqa: PLC0415 - only this step needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    dashboard = json.loads(DASHBOARD.read_text())
    panels = {p["title"]: p for p in dashboard["panels"] if p.get("targets")}
    evaluator = Evaluator(times, samples)
    plt.style.use("dark_background")
    figure, axes = plt.subplots(3, 2, figsize=(13, 10), dpi=100)
    figure.patch.set_facecolor("#111217")
    for ax, title in zip(axes.flat, PANELS, strict=True):
        panel = panels[title]
        ax.set_facecolor("#181b1f")
        for target in panel["targets"]:
            expr = target["expr"]
            # A counter's series appears at its first increment; before that its rate is 0.
            missing = (
                0.0 if re.search(r"\b(rate|increase)\(", expr) else math.nan
            )
            series: dict[tuple[tuple[str, str], ...], list[float]] = {}
            for index in range(len(times)):
                for labels, value in evaluator.evaluate(expr, index).items():
                    series.setdefault(labels, [missing] * len(times))[
                        index
                    ] = value
            for labels, values in sorted(series.items()):
                legend = legend_for(
                    target.get("legendFormat", ""), dict(labels)
                )
                ax.plot(times, values, linewidth=1.4, label=legend)
        for at, label in events:
            ax.axvline(at, color="#f2495c", linestyle=":", linewidth=1)
            ax.text(
                at,
                ax.get_ylim()[1] * 0.95,
                f" {label}",
                color="#f2495c",
                fontsize=7,
                va="top",
            )
        unit = (
            panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        )
        unit = {"reqps": "per second", "s": "seconds"}.get(unit, "")
        ax.set_title(
            title + (f"  ({unit})" if unit else ""), fontsize=10, loc="left"
        )
        ax.grid(color="#2c3235", linewidth=0.6)
        ax.tick_params(labelsize=8)
        ax.set_xlabel("seconds", fontsize=8)
        ax.legend(fontsize=7, loc="upper right", framealpha=0.3)
    figure.suptitle(
        "reliable_mq dashboard panels, evaluated from real metrics (not a Grafana screenshot)",
        fontsize=11,
    )
    figure.tight_layout()
    OUTPUT.parent.mkdir(exist_ok=True)
    figure.savefig(OUTPUT, facecolor=figure.get_facecolor())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/")
    parser.add_argument("--seconds", type=float, default=40.0)
    args = parser.parse_args()
    configure_logging(level="WARNING")
    logging.getLogger("aiormq").setLevel(logging.CRITICAL)
    registry = CollectorRegistry()
    times, samples, events = asyncio.run(
        run_traffic(args.url, args.seconds, registry)
    )
    plot(times, samples, events)
    print(f"wrote {OUTPUT} from {len(samples)} samples")  # noqa: T201


if __name__ == "__main__":
    main()
