"""OpenTelemetry spans for publish, process and settle, and the W3C trace context in headers.

The only package that imports ``opentelemetry`` (the ``otel`` extra: the API
alone). Without it, or without a real tracer provider, tracing is off and costs
one cached check per message: no span objects, no headers added.

On import nothing is installed: no provider, no propagator, no logging.
Attributes follow the OpenTelemetry messaging conventions for RabbitMQ
(``messaging.*``, ``server.*``, ``error.type``); ours are ``reliable_mq.*``.

* `reliable_mq._tracing.core`: the tracer (`Tracing`), the guard that keeps a
  raising provider from breaking a publish or a settle, destinations, headers;
* `reliable_mq._tracing.publish`: ``publish``, ``publish_many()``, outbox, Spark;
* `reliable_mq._tracing.consume`: ``process`` and the settle spans.
"""

from __future__ import annotations

from .consume import (
    CHANNEL_CLOSED,
    MAX_SETTLE_LINKS,
    SettleTrace,
    batch_process_ended,
    settle_frame,
    settle_trace,
    settled,
    start_batch_process,
    start_process,
    use_span,
)
from .core import (
    TRACEPARENT,
    TRACESTATE,
    Tracing,
    consume_destination,
    publish_destination,
)
from .publish import (
    batch_ended,
    batch_message,
    created,
    linked,
    partition_ended,
    publish_ended,
    republished,
    stamp_creation,
    start_batch,
    start_partition,
    start_publish,
)

__all__ = (
    "CHANNEL_CLOSED",
    "MAX_SETTLE_LINKS",
    "TRACEPARENT",
    "TRACESTATE",
    "SettleTrace",
    "Tracing",
    "batch_ended",
    "batch_message",
    "batch_process_ended",
    "consume_destination",
    "created",
    "linked",
    "partition_ended",
    "publish_destination",
    "publish_ended",
    "republished",
    "settle_frame",
    "settle_trace",
    "settled",
    "stamp_creation",
    "start_batch",
    "start_batch_process",
    "start_partition",
    "start_process",
    "start_publish",
    "use_span",
)
