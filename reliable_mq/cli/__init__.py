"""The ``reliable-mq`` command line: publish with confirms, consume, inspect and repair.

Every subcommand is one ``add_*_arguments(parser)`` function and one
``async def run_*(args) -> int`` function, listed in `COMMANDS`; adding a
subcommand means writing those two (in a module of this package) and one line
in the tuple.

Exit codes (the tables in ``docs/guides/cli.md``): 0 success; 1 the command
could not do all of its job (messages not confirmed or not moved, a missing
queue, a message not found, a refused declaration); 2 bad arguments, invalid
settings or an unreachable broker (one line on stderr, passwords redacted);
130 SIGINT and 143 SIGTERM (after a partial summary); 141 the output was closed
early (a broken pipe, as with ``| head``). The two services, ``run`` and
``outbox relay``, take SIGTERM and SIGINT as the request to stop: after a
clean drain they exit 0, as systemd and Kubernetes expect.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from .._version import __version__
from ..connection import AMQP_ERRORS, classify
from ..errors import BrokerUnavailable, InvalidSettings
from ..log import get_logger
from ._common import (
    EXIT_BROKEN_PIPE,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    CLIError,
    Command,
    CommandFailed,
    add_common_arguments,
    configure_cli_logging,
    redact,
    say,
)
from ._consume import add_consume_arguments, run_consume
from ._dlq import add_dlq_arguments, run_dlq
from ._outbox import add_outbox_arguments, run_outbox
from ._publish import add_bench_arguments, add_publish_arguments, run_bench, run_publish
from ._run import add_run_arguments, run_run, structured
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
        "declare (or delete) a queue with its retry queues and dead-letter queue, or declare a stream",
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
        "outbox",
        "transactional outbox: create the table, run the relay, inspect and requeue dead rows",
        add_outbox_arguments,
        run_outbox,
        common=False,
    ),
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
    """The ``reliable-mq`` parser with one sub-parser per `COMMANDS` entry."""
    parser = argparse.ArgumentParser(
        prog="reliable-mq",
        description="Loss-proof RabbitMQ tools: every message confirmed by the broker.",
        epilog="exit codes: 0 ok; 1 not all done (messages not confirmed or moved, a missing "
        "queue or message); 2 bad arguments or broker unreachable; 130 SIGINT, 143 SIGTERM "
        "(after a partial summary); 141 output closed early (broken pipe). The services "
        "(run, outbox relay) exit 0 after a clean drain on SIGTERM or SIGINT",
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


def _quiet_stdout() -> None:
    """After a broken pipe, point stdout at /dev/null so the exit flush cannot fail."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when it is installed (the ``fast`` extra), else asyncio's.

    ``RELIABLE_MQ_NO_UVLOOP=1`` keeps asyncio's loop.
    """
    if os.environ.get("RELIABLE_MQ_NO_UVLOOP"):
        return None
    try:
        import uvloop  # noqa: PLC0415 - optional, and only the CLI picks a loop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (see the module docstring)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_cli_logging(
        json_lines=structured(getattr(args, "log_json", False), sys.stderr),
        level=getattr(args, "log_level", "ERROR"),
    )
    url = getattr(args, "url", None)
    try:
        run: Callable[[argparse.Namespace], Coroutine[Any, Any, int]] = args.run
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            loop = runner.get_loop()
            get_logger(__name__).debug("event_loop", loop=type(loop).__module__.split(".")[0])
            return runner.run(run(args))
    except BrokenPipeError:
        _quiet_stdout()  # the reader went away (`| head`): nothing to report
        return EXIT_BROKEN_PIPE
    except BrokerUnavailable as exc:
        say(f"reliable-mq: error: cannot reach the broker: {redact(str(exc), url)}")
    except CommandFailed as exc:
        say(f"reliable-mq: error: {redact(str(exc), url)}")
        return EXIT_FAILED
    except AMQP_ERRORS as exc:
        fault = classify(exc)
        what = "the broker refused" if fault is not None and fault.refusal else "broker error"
        detail = fault.describe() if fault is not None else str(exc)
        say(f"reliable-mq: error: {what}: {redact(detail, url)}")
        return EXIT_FAILED
    except (InvalidSettings, CLIError) as exc:
        say(f"reliable-mq: error: {redact(str(exc), url)}")
    except KeyboardInterrupt:
        say("reliable-mq: interrupted")
        return EXIT_INTERRUPTED
    return EXIT_USAGE
