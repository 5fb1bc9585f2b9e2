"""reliable_mq: loss-proof RabbitMQ publishing and consuming over aio-pika."""

from ._version import __version__
from .consumer import ConsumerStats, ReliableConsumer
from .delivery import Delivery
from .errors import (
    BrokerUnavailable,
    ClosedError,
    ConsumerError,
    ExchangeNotFound,
    FlushTimeout,
    InvalidBody,
    InvalidMessage,
    InvalidSettings,
    InvalidTarget,
    MessageTooLarge,
    PublishAborted,
    PublishBatchError,
    PublishError,
    PublishGaveUp,
    PublishOutcomeUnknown,
    PublishRefused,
    PublishTimeout,
    PublishUnavailable,
    PublishUnroutable,
    ReliableMQError,
    UnsupportedDependency,
    WouldDeadlock,
)
from .handlers import AckPolicy, BatchFailed, Reject, Retry, Router
from .log import configure_logging
from .message import Message, MessageOptions
from .metrics import Metrics
from .outcomes import BatchFailure, BatchResult
from .publisher import (
    PendingPublish,
    PublisherState,
    PublisherStats,
    PublishResult,
    ReliablePublisher,
)
from .settings import (
    ConnectionSettings,
    ConsumerSettings,
    FastPath,
    PublisherSettings,
    TLSSettings,
    redact_url,
)
from .sync import BlockingPublisher
from .topology import QueueTopology, QueueType, declare_topology

__all__ = (
    "AckPolicy",
    "BatchFailed",
    "BatchFailure",
    "BatchResult",
    "BlockingPublisher",
    "BrokerUnavailable",
    "ClosedError",
    "ConnectionSettings",
    "ConsumerError",
    "ConsumerSettings",
    "ConsumerStats",
    "Delivery",
    "ExchangeNotFound",
    "FastPath",
    "FlushTimeout",
    "InvalidBody",
    "InvalidMessage",
    "InvalidSettings",
    "InvalidTarget",
    "Message",
    "MessageOptions",
    "MessageTooLarge",
    "Metrics",
    "PendingPublish",
    "PublishAborted",
    "PublishBatchError",
    "PublishError",
    "PublishGaveUp",
    "PublishOutcomeUnknown",
    "PublishRefused",
    "PublishResult",
    "PublishTimeout",
    "PublishUnavailable",
    "PublishUnroutable",
    "PublisherSettings",
    "PublisherState",
    "PublisherStats",
    "QueueTopology",
    "QueueType",
    "Reject",
    "ReliableConsumer",
    "ReliableMQError",
    "ReliablePublisher",
    "Retry",
    "Router",
    "TLSSettings",
    "UnsupportedDependency",
    "WouldDeadlock",
    "__version__",
    "configure_logging",
    "declare_topology",
    "redact_url",
)
