"""``publish`` and ``bench``: stream messages through a `ReliablePublisher`."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import secrets
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, NamedTuple

from prometheus_client import CollectorRegistry

from ..errors import InvalidMessage, PublishError, PublishUnroutable
from ..outcomes import PendingPublish, PublishResult
from ..publisher import ReliablePublisher
from ._common import (
    EXIT_FAILED,
    EXIT_OK,
    MAX_REPORTED_ERRORS,
    CLIError,
    Progress,
    StopSignals,
    add_publisher_arguments,
    connection_settings,
    header_arg,
    open_link,
    positive_int,
    print_table,
    printable,
    progress_for,
    publisher_settings,
    redact,
    say,
)

__all__ = ("add_bench_arguments", "add_publish_arguments", "run_bench", "run_publish")


@dataclass
class _Tally:
    """Outcomes of a publishing run."""

    read: int = 0
    confirmed: int = 0
    failed: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    reported: int = 0
    interrupted: bool = False
    unroutable: set[tuple[str, str]] = field(default_factory=set)

    def fail(self, where: str, exc: BaseException, url: str) -> None:
        self.failed += 1
        self.errors[type(exc).__name__] += 1
        if isinstance(exc, PublishUnroutable) and len(self.unroutable) < 5:
            self.unroutable.add((exc.exchange, exc.routing_key))
        if self.reported < MAX_REPORTED_ERRORS:
            self.reported += 1
            text = printable(redact(str(exc), url))
            say(f"reliable-mq: {where}: {type(exc).__name__}: {text}")

    def report_rest(self) -> None:
        """After the run: how many failures were not shown, and what would fix unroutables."""
        if self.failed > self.reported:
            say(
                f"reliable-mq: ... and {self.failed - self.reported:,} more failure(s) not "
                "shown (the summary counts them by error)"
            )
        for exchange, routing_key in sorted(self.unroutable):
            if exchange:
                hint = (
                    f"no queue is bound to exchange {printable(exchange)!r} for routing key "
                    f"{printable(routing_key)!r}: bind one first"
                )
            else:
                name = printable(routing_key)
                hint = (
                    f"no queue named {name!r} exists: declare it first, e.g. with "
                    f"`reliable-mq topology {name}` (the queue with its retry queues and DLQ)"
                )
            say(f"reliable-mq: hint: {hint}")


class _Item(NamedTuple):
    where: str
    body: Any
    message_id: str | None


async def _stream_publish(
    publisher: ReliablePublisher,
    items: AsyncIterator[_Item | Exception],
    *,
    exchange: str,
    routing_key: str,
    headers: dict[str, Any] | None,
    content_type: str | None,
    progress: Progress,
    url: str,
    keep_latencies: bool = False,
    stop: asyncio.Event | None = None,
) -> _Tally:
    """Enqueue every item (the window is the backpressure) and collect outcomes in order.

    When ``stop`` is set, no further item is read; messages already in flight
    are still awaited, so the summary counts every outcome.
    """
    tally = _Tally()
    pending: asyncio.Queue[tuple[str, PendingPublish] | None] = asyncio.Queue(
        maxsize=publisher.settings.max_in_flight * 2
    )

    async def collect() -> None:
        while True:
            entry = await pending.get()
            if entry is None:
                return
            where, outcome = entry
            try:
                result: PublishResult = await outcome
            except PublishError as exc:
                tally.fail(where, exc, url)
            else:
                tally.confirmed += 1
                if keep_latencies:
                    tally.latencies.append(result.confirm_latency)
            progress.update(tally.confirmed, tally.failed)

    async def feed() -> None:
        async for item in items:
            tally.read += 1
            if isinstance(item, Exception):
                tally.fail("input", item, url)
                continue
            try:
                outcome = await publisher.enqueue(
                    item.body,
                    exchange=exchange,
                    routing_key=routing_key,
                    message_id=item.message_id,
                    headers=headers,
                    content_type=content_type,
                )
            except (PublishError, InvalidMessage) as exc:
                tally.fail(item.where, exc, url)
                continue
            if collector.done():
                return
            await pending.put((item.where, outcome))

    collector = asyncio.create_task(collect())
    feeder = asyncio.create_task(feed())
    stopper = asyncio.create_task((stop or asyncio.Event()).wait())
    try:
        await asyncio.wait((feeder, stopper), return_when=asyncio.FIRST_COMPLETED)
        if not feeder.done():  # stopped: read no more, but wait for what is in flight
            tally.interrupted = True
            feeder.cancel()
            await asyncio.gather(feeder, return_exceptions=True)
        else:
            feeder.result()
        if not collector.done():
            await pending.put(None)
        await collector
    finally:
        for task in (stopper, feeder, collector):
            task.cancel()
    progress.finish(tally.confirmed, tally.failed)
    return tally


# -- publish ----------------------------------------------------------------------


def add_publish_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-e", "--exchange", default="", help='exchange (default: "", the default)')
    parser.add_argument(
        "-k",
        "--routing-key",
        required=True,
        help="routing key (on the default exchange: the queue name)",
    )
    parser.add_argument(
        "-f", "--file", default="-", help="read messages from this file (default: stdin)"
    )
    parser.add_argument(
        "--format",
        choices=("lines", "json"),
        default="lines",
        help="lines: each line is a UTF-8 text body; json: each line is a JSON value "
        "sent as application/json (default: %(default)s). Blank lines are skipped.",
    )
    parser.add_argument(
        "--id-field",
        metavar="NAME",
        help="with --format json: take each message_id from this field of the object, so "
        "running the same input twice yields the same ids (consumers can de-duplicate)",
    )
    parser.add_argument(
        "-H",
        "--header",
        type=header_arg,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an AMQP header for every message (repeatable)",
    )
    parser.add_argument("--content-type", help="override the content type of every message")
    add_publisher_arguments(parser, window=1000)


def _open_input(path: str) -> IO[bytes]:
    if path == "-":
        return sys.stdin.buffer
    try:
        return open(path, "rb")  # closed by the reader thread
    except OSError as exc:
        raise CLIError(f"cannot read {path}: {exc.strerror}") from None


def _count_lines(path: str) -> int | None:
    """Non-blank lines of a file (for the progress bar); None for stdin."""
    if path == "-":
        return None
    try:
        with open(path, "rb") as handle:
            return sum(1 for line in handle if line.strip())
    except OSError as exc:
        raise CLIError(f"cannot read {path}: {exc.strerror}") from None


def _raw_lines(fileno: int) -> Iterator[bytes]:
    """Lines read with ``os.read``: no buffered-reader lock, so an interrupted
    command can exit while this thread still waits on an idle pipe."""
    rest = b""
    while chunk := os.read(fileno, 65536):
        rest += chunk
        *lines, rest = rest.split(b"\n")
        for line in lines:
            yield line + b"\n"
    if rest:
        yield rest


async def _read_lines(stream: IO[bytes]) -> AsyncIterator[tuple[int, bytes]]:
    """Yield ``(line number, line)`` from a thread, so a slow pipe never blocks the loop."""
    loop = asyncio.get_running_loop()
    lines: queue.Queue[tuple[int, bytes] | BaseException | None] = queue.Queue(maxsize=10_000)
    ready = asyncio.Event()
    waiting = threading.Event()

    def reader() -> None:
        def put(item: tuple[int, bytes] | BaseException | None) -> None:
            lines.put(item)
            if waiting.is_set():
                loop.call_soon_threadsafe(ready.set)

        try:
            for number, line in enumerate(_raw_lines(stream.fileno()), 1):
                put((number, line))
        except BaseException as exc:  # handed to the loop, which raises it
            put(exc)
        else:
            put(None)
        finally:
            if stream is not sys.stdin.buffer:
                stream.close()

    thread = threading.Thread(target=reader, name="reliable-mq-cli-reader", daemon=True)
    thread.start()
    while True:
        try:
            item = lines.get_nowait()
        except queue.Empty:
            ready.clear()
            waiting.set()
            if lines.empty():
                await ready.wait()
            waiting.clear()
            continue
        if item is None:
            return
        if isinstance(item, BaseException):
            raise CLIError(f"cannot read input: {item}")
        yield item


async def _publish_items(args: argparse.Namespace) -> AsyncIterator[_Item | Exception]:
    async for number, raw in _read_lines(_open_input(args.file)):
        line = raw.rstrip(b"\r\n")
        if not line.strip():
            continue
        where = f"line {number}"
        if args.format == "lines":
            try:
                yield _Item(where, line.decode("utf-8"), None)
            except UnicodeDecodeError:
                yield _Item(where, line, None)
            continue
        try:
            value = json.loads(line)
        except ValueError as exc:
            yield InvalidMessage(f"{where}: invalid JSON: {exc}")
            continue
        message_id: str | None = None
        if args.id_field is not None:
            if not isinstance(value, dict) or value.get(args.id_field) in (None, ""):
                yield InvalidMessage(f"{where}: no {args.id_field!r} field for the message_id")
                continue
            message_id = str(value[args.id_field])
        yield _Item(where, value, message_id)


async def run_publish(args: argparse.Namespace) -> int:
    """Publish every line of the input with confirms; exit 1 if any is not confirmed."""
    if args.id_field is not None and args.format != "json":
        raise CLIError("--id-field needs --format json")
    total = _count_lines(args.file)
    started = time.monotonic()
    with StopSignals() as signals:
        async with ReliablePublisher(
            connection_settings(args),
            settings=publisher_settings(args),
            registry=CollectorRegistry(),
        ) as publisher:
            tally = await _stream_publish(
                publisher,
                _publish_items(args),
                exchange=args.exchange,
                routing_key=args.routing_key,
                headers=dict(args.header) or None,
                content_type=args.content_type,
                progress=progress_for(args, total=total, label="confirmed"),
                url=args.url,
                stop=signals.event,
            )
            stats = publisher.stats()
    elapsed = time.monotonic() - started
    tally.report_rest()
    rows = [
        ("read", f"{tally.read:,}"),
        ("confirmed", f"{tally.confirmed:,}"),
        ("failed", f"{tally.failed:,}"),
        ("republished", f"{stats.republished:,}"),
        ("elapsed", f"{elapsed:.2f} s"),
        ("rate", f"{tally.confirmed / max(elapsed, 1e-9):,.0f} msg/s"),
    ]
    rows += [(f"  {name}", f"{count:,}") for name, count in sorted(tally.errors.items())]
    if tally.interrupted:
        rows.append(("interrupted", "yes: the rest of the input was not read"))
    print_table(rows)
    if signals.exit_code is not None:
        return signals.exit_code
    return EXIT_FAILED if tally.failed else EXIT_OK


# -- bench ------------------------------------------------------------------------


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-n",
        "--messages",
        type=positive_int,
        default=20_000,
        help="messages to publish (default: %(default)s)",
    )
    parser.add_argument(
        "-s", "--size", type=int, default=256, help="body size in bytes (default: %(default)s)"
    )
    parser.add_argument(
        "--queue",
        help="publish to this durable queue and keep it (default: a fresh queue, deleted after)",
    )
    add_publisher_arguments(parser, window=1000)


def _percentile(sorted_values: Sequence[float], fraction: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(fraction * len(sorted_values)) - 1))
    return sorted_values[index]


async def run_bench(args: argparse.Namespace) -> int:
    """Publish ``--messages`` bodies of ``--size`` bytes and print a summary table."""
    if args.size < 0 or args.size > 128 * 1024 * 1024:
        raise CLIError("--size must be 0 to 134217728 bytes")
    queue_name = args.queue or f"reliable-mq-bench-{secrets.token_hex(4)}"
    body = (b"x" * args.size) if args.size else b""
    settings = publisher_settings(args)

    async def items() -> AsyncIterator[_Item | Exception]:
        for number in range(args.messages):
            yield _Item(f"message {number + 1}", body, None)

    async with ReliablePublisher(
        connection_settings(args), settings=settings, registry=CollectorRegistry()
    ) as publisher:
        async with open_link(args) as link:
            channel = await link.channel()
            await channel.declare_queue(queue_name, durable=True)
            try:
                started = time.monotonic()
                tally = await _stream_publish(
                    publisher,
                    items(),
                    exchange="",
                    routing_key=queue_name,
                    headers=None,
                    content_type=None,
                    progress=progress_for(args, total=args.messages, label="confirmed"),
                    url=args.url,
                    keep_latencies=True,
                )
                elapsed = time.monotonic() - started
                stats = publisher.stats()
            finally:
                if args.queue is None:
                    await channel.delete_queue(queue_name)
                await channel.close()
    tally.report_rest()
    latencies = sorted(tally.latencies)
    rate = tally.confirmed / max(elapsed, 1e-9)
    rows = [
        ("messages", f"{args.messages:,}"),
        ("body size", f"{args.size:,} B"),
        ("window", f"{args.window:,}"),
        ("persistent", "yes" if args.persistent else "no"),
        ("queue", queue_name + ("" if args.queue else " (deleted)")),
        ("confirmed", f"{tally.confirmed:,}"),
        ("failed", f"{tally.failed:,}"),
        ("republished", f"{stats.republished:,}"),
        ("max in flight", f"{stats.max_in_flight_seen:,}"),
        ("elapsed", f"{elapsed:.3f} s"),
        ("throughput", f"{rate:,.0f} msg/s"),
        ("bandwidth", f"{rate * args.size / 1e6:,.2f} MB/s"),
        ("confirm p50", f"{_percentile(latencies, 0.50) * 1000:.2f} ms"),
        ("confirm p95", f"{_percentile(latencies, 0.95) * 1000:.2f} ms"),
        ("confirm p99", f"{_percentile(latencies, 0.99) * 1000:.2f} ms"),
    ]
    if latencies:
        rows.append(("confirm mean", f"{statistics.fmean(latencies) * 1000:.2f} ms"))
    print_table(rows)
    return EXIT_FAILED if tally.failed else EXIT_OK
