"""Structured logging through structlog, without configuring anything on import.

If the application configured structlog, reliable_mq's events go through that
pipeline. Otherwise they are rendered as ``key=value`` lines into the standard
``logging`` logger of the same name, so levels and handlers stay the
application's choice and an unconfigured app sees only warnings and errors.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

__all__ = ("configure_logging", "get_logger")

_STDLIB_PROCESSORS: list[Any] = [
    structlog.stdlib.filter_by_level,
    structlog.processors.format_exc_info,
    structlog.processors.KeyValueRenderer(key_order=["event"], drop_missing=True),
]


def get_logger(name: str) -> Any:
    """Return a bound structlog logger named ``name`` (see module docstring)."""
    if structlog.is_configured():
        return structlog.get_logger(name)
    return structlog.wrap_logger(
        logging.getLogger(name),
        processors=_STDLIB_PROCESSORS,
        wrapper_class=structlog.stdlib.BoundLogger,
        logger_name=name,
    )


def configure_logging(*, json: bool = False, level: int | str = logging.INFO) -> None:
    """Configure structlog and stdlib logging for an *application* or the CLI.

    Libraries must not call this; it is here so apps and examples get readable
    (or JSON) output in one line.
    """
    if isinstance(level, str):
        resolved = logging.getLevelName(level.upper())
        if not isinstance(resolved, int):
            raise ValueError(f"unknown log level {level!r}")
        level = resolved
    renderer: Any = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=level, format="%(message)s")
