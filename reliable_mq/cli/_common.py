"""Shared pieces of the ``reliable-mq`` subcommands: options, errors, output, connections."""

from __future__ import annotations

import argparse
import base64
import contextlib
import os
import re
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from datetime import datetime
from decimal import Decimal
from typing import IO, Any, NamedTuple

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage, AbstractQueue
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from ..connection import ConnectionSupervisor
from ..metrics import Metrics
from ..settings import ConnectionSettings, PublisherSettings, redact_credentials

__all__ = (
    "DEFAULT_URL",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "MAX_REPORTED_ERRORS",
    "CLIError",
    "Command",
    "CommandFailed",
    "Progress",
    "add_common_arguments",
    "add_publisher_arguments",
    "connection_settings",
    "header_arg",
    "jsonable",
    "message_record",
    "open_connection",
    "open_queue",
    "positive_float",
    "positive_int",
    "prefetch_count",
    "print_table",
    "progress_for",
    "publisher_settings",
    "redact",
)

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/"
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
MAX_REPORTED_ERRORS = 10


class Command(NamedTuple):
    """One subcommand: its name, a one-line help, and its two functions.

    ``common=False`` when ``add_arguments`` builds nested subcommands and adds
    the common options (:func:`add_common_arguments`) to each of them itself.
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
async def open_connection(args: argparse.Namespace) -> AsyncIterator[AbstractConnection]:
    """One connection for the command's own channels (fail-over and TLS from ``--url``).

    Raises:
        BrokerUnavailable: no broker address accepted a connection.
    """
    supervisor = ConnectionSupervisor(
        connection_settings(args), role="tool", metrics=Metrics.on(CollectorRegistry())
    )
    await supervisor.start()
    try:
        yield await supervisor.wait_connected()
    finally:
        await supervisor.close()


async def open_queue(
    connection: AbstractConnection, name: str, *, what: str = "queue"
) -> tuple[AbstractChannel, AbstractQueue, int]:
    """A new channel and a passive declaration of ``name``: (channel, queue, message count).

    Raises:
        CommandFailed: the queue does not exist.
    """
    channel = await connection.channel(publisher_confirms=False)
    try:
        queue = await channel.declare_queue(name, passive=True)
    except aio_pika.exceptions.ChannelNotFoundEntity:
        raise CommandFailed(f"{what} {name!r} does not exist") from None
    result = queue.declaration_result
    return channel, queue, int(result.message_count or 0)


# -- messages as JSON ---------------------------------------------------------------


def jsonable(value: Any) -> Any:
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


def message_record(message: AbstractIncomingMessage) -> dict[str, Any]:
    """One message as a JSON object: ids, routing, properties, headers and body.

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
    if message.timestamp is not None:
        record["timestamp"] = jsonable(message.timestamp)
    record["headers"] = jsonable(message.headers or {})
    try:
        record["body"] = message.body.decode("utf-8")
    except UnicodeDecodeError:
        record["body"] = base64.b64encode(message.body).decode("ascii")
        record["body_encoding"] = "base64"
    return record
