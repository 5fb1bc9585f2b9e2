"""What a consumer's settings risk, said once at start: warnings, never errors.

`check_settings` runs in `reliable_mq.consumer.ReliableConsumer.start` before
any route opens: an unlimited prefetch, a dedup lease a handler can outlive,
and handlers that can outlive the broker's ``consumer_timeout``.
"""

from __future__ import annotations

from typing import Any

from ..settings import ConsumerSettings
from .frames import broker_cut

__all__ = ("RABBITMQ_CONSUMER_TIMEOUT", "check_settings")

RABBITMQ_CONSUMER_TIMEOUT = 1800.0
"""RabbitMQ's default ``consumer_timeout`` (seconds), since 3.8.15."""


def check_settings(
    settings: ConsumerSettings,
    *,
    uses_dedup: bool,
    consumer_timeout: float | None,
    log: Any,
) -> float:
    """Warn about settings that risk memory or double runs; return the dedup lease.

    ``consumer_timeout``: the broker's, if known (`ConsumerSettings.consumer_timeout`).
    """
    if settings.prefetch == 0:
        log.warning("unlimited_prefetch", hint="memory use is unbounded")
    lease = settings.effective_dedup_lease
    timeout = settings.handler_timeout
    if timeout is not None and lease <= timeout and uses_dedup:
        log.warning(
            "dedup_lease_shorter_than_handler_timeout",
            dedup_lease=lease,
            handler_timeout=timeout,
            hint="a slow handler's message may run twice at once",
        )
    _check_consumer_timeout(timeout, consumer_timeout, log)
    return lease


def _check_consumer_timeout(
    handler_timeout: float | None, consumer_timeout: float | None, log: Any
) -> None:
    """Warn when handlers may outlive the broker's ``consumer_timeout``."""
    if consumer_timeout is not None:
        cut = broker_cut(consumer_timeout)
        if handler_timeout is None or handler_timeout > cut:
            log.warning(
                "handler_timeout_above_consumer_timeout",
                handler_timeout=handler_timeout,
                consumer_timeout=consumer_timeout,
                cut_after=round(cut, 3),
                hint="handlers are cut (and retried) cut_after seconds after their "
                "delivery arrived, before the broker closes the channel",
            )
    elif handler_timeout is None or handler_timeout >= RABBITMQ_CONSUMER_TIMEOUT:
        log.warning(
            "handler_timeout_above_consumer_timeout",
            handler_timeout=handler_timeout,
            consumer_timeout=None,
            hint="RabbitMQ closes the channel of a delivery unacked for its "
            "consumer_timeout (30 minutes by default): set handler_timeout below it, "
            "and ConsumerSettings.consumer_timeout to the broker's value",
        )
