"""Blocking (thread-based) facades over the async implementation.

[BlockingPublisher][reliable_mq.sync.BlockingPublisher] publishes with
confirms from plain threads (Flask, Django, scripts, Celery tasks); see the
"Publishing from sync code" guide.
"""

from ._batch_compat import BatchFailure, BatchResult, Message
from ._publisher import BlockingPublisher, PublisherState

__all__ = ("BatchFailure", "BatchResult", "BlockingPublisher", "Message", "PublisherState")
