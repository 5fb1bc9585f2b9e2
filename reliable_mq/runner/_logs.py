"""Logging for the runner's processes: one JSON object per line, lines never mixed."""

from __future__ import annotations

import logging

import structlog

from ..log import configure_logging

__all__ = ("configure_runner_logging",)


def configure_runner_logging(*, json: bool, level: str) -> None:
    """Configure like the CLI, writing each line with a single ``write()``.

    The supervisor and its workers share one stdout. structlog's default
    ``PrintLogger`` writes a line and its newline separately, so lines of two
    processes could splice; a single write of a short line to a pipe is atomic.
    """
    configure_logging(json=json, level=level)
    structlog.configure(logger_factory=structlog.WriteLoggerFactory())
    if level != "DEBUG":  # as the CLI: our own events say it without the tracebacks
        logging.getLogger("aiormq").setLevel(logging.CRITICAL)
        logging.getLogger("aio_pika").setLevel(logging.CRITICAL)
