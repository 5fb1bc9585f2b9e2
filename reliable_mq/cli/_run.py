"""``run``: run a consumer as supervised worker processes, for systemd or Kubernetes.

``reliable-mq run myapp.consumers:consumer --workers 4 --metrics-port 9464``
imports the target once to check it (exit 2 if it is not a ReliableConsumer
or a Router), then starts the workers. See ``docs/deploy.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TextIO

from ..errors import InvalidSettings, InvalidTarget
from ..runner import RunnerOptions, Supervisor, load_consumer
from ..runner._logs import configure_runner_logging
from ._common import CLIError, positive_float, positive_int

__all__ = ("add_run_arguments", "run_run", "structured")


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, not {value}")
    return value


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "target",
        help="MODULE:ATTRIBUTE naming a ReliableConsumer, or a Router (its consumer is then "
        "configured from RELIABLE_MQ_* variables), e.g. myapp.consumers:consumer",
    )
    parser.add_argument(
        "-w",
        "--workers",
        type=positive_int,
        default=1,
        help="worker processes (default: %(default)s); one that exits is restarted",
    )
    parser.add_argument(
        "--metrics-port",
        type=_port,
        metavar="PORT",
        help="serve /metrics (every worker's, summed), /livez and /readyz on PORT; "
        "without it nothing listens",
    )
    parser.add_argument(
        "--http-host",
        default="127.0.0.1",
        help="address for --metrics-port (default: %(default)s; 0.0.0.0 in a container)",
    )
    parser.add_argument(
        "--graceful-timeout",
        type=positive_float,
        default=60.0,
        metavar="S",
        help="on SIGTERM, seconds the workers get to drain before SIGKILL (default: "
        "%(default)s; keep it above the consumer's shutdown_grace)",
    )
    parser.add_argument(
        "--app-dir",
        default=".",
        help="folder added to the import path (default: the current folder)",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="default: %(default)s",
    )
    parser.add_argument(
        "--log-json",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="JSON lines, one object per event (default: JSON where nobody reads a terminal "
        "(systemd, Kubernetes, a pipe or a file), readable lines on a terminal; decided for "
        "stdout's logs and stderr's error lines each)",
    )


def _importable(app_dir: str) -> str:
    """Put ``app_dir`` first on the import path (workers get it in PYTHONPATH)."""
    path = os.path.abspath(app_dir)
    if path not in sys.path:
        sys.path.insert(0, path)
    return path


def structured(choice: bool | None, stream: TextIO) -> bool:
    """``--log-json``/``--no-log-json`` as given; unset, JSON unless ``stream`` is a terminal."""
    if choice is not None:
        return choice
    try:
        return not stream.isatty()
    except (AttributeError, ValueError):  # replaced or closed: nobody reads a terminal
        return True


async def run_run(args: argparse.Namespace) -> int:
    log_json = structured(args.log_json, sys.stdout)
    configure_runner_logging(json=log_json, level=args.log_level)
    app_dir = _importable(args.app_dir)
    try:
        load_consumer(args.target)  # fail here, once, rather than in every worker
    except (InvalidTarget, InvalidSettings) as exc:
        raise CLIError(str(exc)) from None
    options = RunnerOptions(
        target=args.target,
        workers=args.workers,
        metrics_port=args.metrics_port,
        http_host=args.http_host,
        graceful_timeout=args.graceful_timeout,
        log_json=log_json,
        log_level=args.log_level,
        app_dir=app_dir,
    )
    try:
        return await Supervisor(options).run()
    except OSError as exc:
        raise CLIError(f"cannot listen on {args.http_host}:{args.metrics_port}: {exc}") from None
