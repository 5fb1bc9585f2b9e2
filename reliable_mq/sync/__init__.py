"""Blocking (thread-based) facades over the async implementation.

[BlockingPublisher][reliable_mq.sync.BlockingPublisher] publishes with
confirms from plain threads (Flask, Django, scripts, Celery tasks); see the
"Publishing from sync code" guide. It is also importable from ``reliable_mq``.
"""

from ._publisher import BlockingPublisher

__all__ = ("BlockingPublisher",)
