"""The ``reliable-mq`` command line: publish with confirms, consume, inspect and repair.

Every subcommand is one ``add_*_arguments(parser)`` function and one
``async def run_*(args) -> int`` function, listed in :data:`COMMANDS`; adding a
subcommand means writing those two (in a module of this package) and one line
in the tuple.

Exit codes: 0 success; 1 the command could not do all of its job (messages
not confirmed or not moved, a missing queue, a message not found, a refused
declaration); 2 bad arguments, invalid settings or an unreachable broker (one
line on stderr, passwords redacted); 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import aiormq

from .. import __version__
from ..errors import BrokerUnavailable, InvalidSettings
from ..log import configure_logging
from ._common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    CLIError,
    Command,
    CommandFailed,
    add_common_arguments,
    redact,
)
from ._consume import add_consume_arguments, run_consume
from ._dlq import add_dlq_arguments, run_dlq
from ._publish import add_bench_arguments, add_publish_arguments, run_bench, run_publish
from ._run import add_run_arguments, run_run
from ._topology import add_topology_arguments, run_topology

__all__ = ("COMMANDS", "Command", "build_parser", "main")

COMMANDS: tuple[Command, ...] = (
    Command(
        "publish",
        "publish lines or JSON lines from stdin or a file, with confirms",
        add_publish_arguments,
        run_publish,
    ),
    Command(
        "consume",
        "print or save the messages of a queue (ack, requeue to peek, or reject)",
        add_consume_arguments,
        run_consume,
    ),
    Command(
        "topology",
        "declare (or delete) a queue with its retry queues and dead-letter queue",
        add_topology_arguments,
        run_topology,
    ),
    Command(
        "dlq",
        "list, show and move dead-lettered messages back to their queue",
        add_dlq_arguments,
        run_dlq,
        common=False,
    ),
    Command("bench", "measure confirmed publish throughput", add_bench_arguments, run_bench),
    Command(
        "run",
        "run a consumer as supervised worker processes, with probes and metrics",
        add_run_arguments,
        run_run,
        common=False,
    ),
)
"""Every subcommand, in ``--help`` order."""


def build_parser() -> argparse.ArgumentParser:
    """The ``reliable-mq`` parser with one sub-parser per :data:`COMMANDS` entry."""
    parser = argparse.ArgumentParser(
        prog="reliable-mq",
        description="Loss-proof RabbitMQ tools: every message confirmed by the broker.",
        epilog="exit codes: 0 ok; 1 not all done (messages not confirmed or moved, a missing "
        "queue or message); 2 bad arguments or broker unreachable; 130 interrupted",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        sub = subparsers.add_parser(
            command.name, help=command.help, description=command.help[:1].upper() + command.help[1:]
        )
        command.add_arguments(sub)
        if command.common:
            add_common_arguments(sub)
        sub.set_defaults(run=command.run)
    return parser


def _configure_logging(args: argparse.Namespace) -> None:
    configure_logging(json=args.log_json, level=args.log_level)
    if args.log_level != "DEBUG":
        # aiormq and aio-pika log each failed connect with a traceback; our own
        # one-line error (or connection_lost event) says it without the noise.
        logging.getLogger("aiormq").setLevel(logging.CRITICAL)
        logging.getLogger("aio_pika").setLevel(logging.CRITICAL)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (see the module docstring)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _configure_logging(args)
    url = getattr(args, "url", None)
    try:
        run: Callable[[argparse.Namespace], Coroutine[Any, Any, int]] = args.run
        return asyncio.run(run(args))
    except BrokerUnavailable as exc:
        print(f"reliable-mq: error: cannot reach the broker: {redact(str(exc), url)}",
              file=sys.stderr)  # fmt: skip
    except CommandFailed as exc:
        print(f"reliable-mq: error: {redact(str(exc), url)}", file=sys.stderr)
        return EXIT_FAILED
    except aiormq.exceptions.AMQPError as exc:
        print(f"reliable-mq: error: the broker refused: {redact(str(exc), url)}", file=sys.stderr)
        return EXIT_FAILED
    except (InvalidSettings, CLIError) as exc:
        print(f"reliable-mq: error: {redact(str(exc), url)}", file=sys.stderr)
    except KeyboardInterrupt:
        print("reliable-mq: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_USAGE
