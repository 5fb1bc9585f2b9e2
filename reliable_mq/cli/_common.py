"""Shared pieces of the ``reliable-mq`` subcommands: options, errors, output, connections."""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import logging
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from datetime import UTC, datetime
from decimal import Decimal
from typing import IO, Any, NamedTuple

import structlog
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from ..connection import AMQP_ERRORS, Channel, ConnectionSupervisor, FaultKind, Link, classify
from ..metrics import Metrics
from ..settings import ConnectionSettings, PublisherSettings, redact_credentials

__all__ = (
    "DEFAULT_URL",
    "EXIT_BROKEN_PIPE",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_TERMINATED",
    "EXIT_USAGE",
    "StopSignals",
    "MAX_REPORTED_ERRORS",
    "CLIError",
    "Command",
    "CommandFailed",
    "Progress",
    "add_common_arguments",
    "add_publisher_arguments",
    "configure_cli_logging",
    "connection_settings",
    "header_arg",
    "jsonable",
    "message_record",
    "open_channel",
    "open_link",
    "positive_float",
    "printable",
    "positive_int",
    "prefetch_count",
    "print_table",
    "progress_for",
    "publisher_settings",
    "queue_count",
    "redact",
    "say",
)

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/"
EXIT_OK = 0
"""Done: every message confirmed, consumed, declared or moved."""
EXIT_FAILED = 1
"""Not all done: a message not confirmed or not moved, a missing queue or message."""
EXIT_USAGE = 2
"""Bad arguments, invalid settings, unreadable input, or an unreachable broker."""
EXIT_INTERRUPTED = 130
"""Stopped by SIGINT (Ctrl-C), after a partial summary."""
EXIT_BROKEN_PIPE = 141
"""The output was closed early (``| head``): stopped quietly, unwritten messages stay queued."""
EXIT_TERMINATED = 143
"""Stopped by SIGTERM, after a partial summary."""
MAX_REPORTED_ERRORS = 10


class Command(NamedTuple):
    """One subcommand: its name, a one-line help, and its two functions.

    ``common=False`` when ``add_arguments`` builds nested subcommands and adds
    the common options (`add_common_arguments()`) to each of them itself.
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], Coroutine[Any, Any, int]]
    common: bool = True


class CLIError(Exception):
    """A usage or environment problem: printed as one line, exit code 2."""


class CommandFailed(Exception):
    """The command ran but could not do its job (a missing queue, a message not
    found, a refused declaration): printed as one line, exit code 1."""


# -- shared helpers -------------------------------------------------------------


_JSON_REPORTS = False


def configure_cli_logging(*, json_lines: bool, level: str) -> None:
    """One stderr handler for everything: reliable_mq's structlog events, the stdlib
    records of aio-pika and aiormq, and the command's own report lines (`say()`).

    With ``json_lines`` each is one JSON object per line; otherwise readable lines.
    Below DEBUG, aio-pika's and aiormq's own records are muted: each failed connect
    would print a traceback, and the command reports failures itself.
    """
    global _JSON_REPORTS  # noqa: PLW0603 (the CLI process's one output mode)
    _JSON_REPORTS = json_lines
    numeric = logging.getLevelName(level)
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json_lines
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    if level != "DEBUG":
        logging.getLogger("aiormq").setLevel(logging.CRITICAL)
        logging.getLogger("aio_pika").setLevel(logging.CRITICAL)


def say(text: str) -> None:
    """Write one report line to stderr (a JSON object under ``--log-json``).

    The text is made printable first: report lines quote broker replies and
    message ids, which may carry control characters.
    """
    line = printable(text)
    if _JSON_REPORTS:
        level = "error" if ": error:" in line else "info"
        record = {
            "event": "cli_report",
            "message": line,
            "level": level,
            "logger": "reliable_mq.cli",
            "timestamp": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
        }
        line = json.dumps(record, ensure_ascii=True)
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def printable(value: object) -> str:
    """``value`` as one line that is safe on a terminal: control characters escaped.

    The same escaping as the log lines (structlog renders values with ``repr()``):
    ``\\n``, ``\\x1b``, ``\\u202e``... without the quotes. Text without control
    characters is returned unchanged; bytes are decoded as UTF-8, invalid bytes
    shown as ``\\xNN``.
    """
    if isinstance(value, (bytes, bytearray, memoryview)):
        text = bytes(value).decode("utf-8", "backslashreplace")
    else:
        text = str(value)
    if text.isprintable():
        return text
    return repr(text)[1:-1]


class StopSignals:
    """SIGINT and SIGTERM set `event` once; a second signal interrupts at once.

    Use as a context manager around the part of a command that can stop early;
    `exit_code` is then 130 (SIGINT) or 143 (SIGTERM), else None.
    """

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.received: signal.Signals | None = None
        self._installed: list[signal.Signals] = []

    @property
    def exit_code(self) -> int | None:
        if self.received is None:
            return None
        return EXIT_TERMINATED if self.received is signal.SIGTERM else EXIT_INTERRUPTED

    def _on_signal(self, sig: signal.Signals) -> None:
        self.received = sig
        self.event.set()
        self._restore()  # a second Ctrl-C raises KeyboardInterrupt: stop without waiting

    def _restore(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in self._installed:
            loop.remove_signal_handler(sig)
        self._installed.clear()

    def __enter__(self) -> StopSignals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
                loop.add_signal_handler(sig, self._on_signal, sig)
                self._installed.append(sig)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._restore()


def redact(text: str, url: str | None = None) -> str:
    """Hide passwords: any ``scheme://user:pass@`` and the literal password of ``url``."""
    text = redact_credentials(text)
    if url:
        for part in url.split(","):
            match = re.match(r"amqps?://[^:/@\s]*:([^@\s]+)@", part.strip())
            if match and len(match.group(1)) >= 3:
                text = text.replace(match.group(1), "***")
    return text


def positive_int(text: str) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, not {text}")
    return value


def header_arg(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, not {text!r}")
    return name, value


def connection_settings(args: argparse.Namespace) -> ConnectionSettings:
    url: str = args.url
    return ConnectionSettings(url=SecretStr(url), connection_name=f"reliable-mq-cli.{args.command}")


def publisher_settings(args: argparse.Namespace) -> PublisherSettings:
    return PublisherSettings(
        max_in_flight=args.window,
        publish_timeout=args.timeout,
        persistent=args.persistent,
    )


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    default_url = os.environ.get("RELIABLE_MQ_URL", DEFAULT_URL)
    shown = redact(default_url, default_url).replace("%", "%%")
    parser.add_argument(
        "--url",
        default=default_url,
        help=f"AMQP URL; several, comma separated, fail over (default: $RELIABLE_MQ_URL, "
        f"now {shown})",
    )
    parser.add_argument(
        "--log-level",
        default="ERROR",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="log level of reliable_mq's own events (default: %(default)s; failures are "
        "reported by the command itself)",
    )
    parser.add_argument("--log-json", action="store_true", help="log JSON lines to stderr")
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show a progress bar on stderr (default: only when stderr is a terminal)",
    )


def add_publisher_arguments(parser: argparse.ArgumentParser, *, window: int) -> None:
    parser.add_argument(
        "--window",
        type=positive_int,
        default=window,
        help="unconfirmed messages in flight at most (default: %(default)s)",
    )
    parser.add_argument(
        "--persistent",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="delivery mode 2, written to disk by durable queues (default: on)",
    )
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=60.0,
        help="deadline of each message in seconds (default: %(default)s)",
    )


class Progress:
    """A one-line progress bar on a terminal, redrawn at most ten times a second."""

    WIDTH = 30

    def __init__(self, stream: IO[str], *, total: int | None, enabled: bool, label: str) -> None:
        self._stream = stream
        self._total = total
        self._enabled = enabled
        self._label = label
        self._started = time.monotonic()
        self._last_draw = 0.0
        self._drawn = False

    def update(self, done: int, failed: int = 0, *, force: bool = False) -> None:
        if not self._enabled:
            return
        now = time.monotonic()
        if not force and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        elapsed = max(now - self._started, 1e-9)
        rate = done / elapsed
        if self._total:
            filled = min(self.WIDTH, self.WIDTH * done // self._total)
            bar = "#" * filled + "." * (self.WIDTH - filled)
            head = f"[{bar}] {100 * done // self._total:3d}% {done:,}/{self._total:,}"
        else:
            head = f"{done:,}"
        tail = f" {self._label} {rate:,.0f} msg/s"
        if failed:
            tail += f" failed {failed:,}"
        self._stream.write("\r" + head + tail + "\x1b[K")
        self._stream.flush()
        self._drawn = True

    def finish(self, done: int, failed: int = 0) -> None:
        if not self._enabled:
            return
        self.update(done, failed, force=True)
        if self._drawn:
            self._stream.write("\n")
            self._stream.flush()


def progress_for(args: argparse.Namespace, *, total: int | None, label: str) -> Progress:
    enabled = args.progress if args.progress is not None else sys.stderr.isatty()
    if getattr(args, "log_json", False):
        enabled = False  # stderr is JSON lines then: no bar drawn between them
    return Progress(sys.stderr, total=total, enabled=enabled, label=label)


def print_table(rows: Sequence[tuple[str, str]]) -> None:
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def prefetch_count(text: str) -> int:
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be at most 65535, not {value}")
    return value


# -- connections and queues ------------------------------------------------------


@contextlib.asynccontextmanager
async def open_link(args: argparse.Namespace) -> AsyncIterator[Link]:
    """One connection for the command's own channels (fail-over and TLS from ``--url``).

    Its frames are decoded as the consumer decodes them: a message with a
    property or header name that is not UTF-8 is shown escaped, not a broker error.

    Raises:
        BrokerUnavailable: no broker address accepted a connection.
    """
    supervisor = ConnectionSupervisor(
        connection_settings(args),
        role="tool",
        metrics=Metrics.on(CollectorRegistry()),
        decode_frames=True,
    )
    await supervisor.start()
    try:
        yield await supervisor.wait_connected()
    finally:
        await supervisor.close()


async def open_channel(
    link: Link, name: str, *, what: str = "queue", hint: str = ""
) -> tuple[Channel, int]:
    """A new channel and a passive declaration of ``name``: (channel, message count).

    Raises:
        CommandFailed: the queue does not exist (``hint`` is appended to the message).
    """
    channel = await link.channel()
    try:
        info = await channel.declare_queue(name, passive=True)
    except AMQP_ERRORS as exc:
        fault = classify(exc)
        if fault is None or fault.kind is not FaultKind.NOT_FOUND:
            raise
        raise CommandFailed(f"{what} {name!r} does not exist{hint}") from None
    return channel, info.messages


async def queue_count(link: Link, name: str) -> int | None:
    """Messages ready in queue ``name`` (a passive declare), or None if it does not exist."""
    channel = await link.channel()
    try:
        info = await channel.declare_queue(name, passive=True)
    except AMQP_ERRORS as exc:
        fault = classify(exc)
        if fault is None or fault.kind is not FaultKind.NOT_FOUND:
            raise
        return None
    finally:
        await channel.close()
    return info.messages


# -- messages as JSON ---------------------------------------------------------------


def jsonable(value: Any) -> Any:  # noqa: PLR0911 (a converter: one return per AMQP value type)
    """AMQP field values (bytes, datetimes, decimals, nested tables) as JSON values."""
    if isinstance(value, Mapping):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return base64.b64encode(value).decode("ascii")
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Decimal):
        return str(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def message_record(message: Any) -> dict[str, Any]:
    """One message as a JSON object: ids, routing, properties, headers and body.

    ``message``: anything with a message's attributes (``message_id``,
    ``exchange``, ``routing_key``, ``redelivered``, ``content_type``, ``headers``,
    ``body``, optionally ``correlation_id``, ``reply_to``, ``type``, ``app_id``
    and ``timestamp``), as a fetched `reliable_mq._amqp.Got` has them.

    The body is UTF-8 text when it decodes, else base64 with
    ``"body_encoding": "base64"``.
    """
    record: dict[str, Any] = {
        "message_id": message.message_id,
        "exchange": message.exchange,
        "routing_key": message.routing_key,
        "redelivered": bool(message.redelivered),
        "content_type": message.content_type,
    }
    for name in ("correlation_id", "reply_to", "type", "app_id"):
        value = getattr(message, name, None)
        if value:
            record[name] = value
    timestamp = getattr(message, "timestamp", None)
    if timestamp is not None:
        record["timestamp"] = jsonable(timestamp)
    record["headers"] = jsonable(message.headers or {})
    try:
        record["body"] = message.body.decode("utf-8")
    except UnicodeDecodeError:
        record["body"] = base64.b64encode(message.body).decode("ascii")
        record["body_encoding"] = "base64"
    return record
