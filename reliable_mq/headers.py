"""The wire contract: every AMQP header reliable_mq reads or writes.

Operators read these on messages in a dead-letter queue; tools (the CLI, a
dashboard, another consumer) may rely on them. Names and meanings are public
API: they change only with a major version.

Headers the consumer writes on the copies it republishes:

| header | on | value |
|---|---|---|
| `x-reliable-mq-attempt` | retry and deferred copies | the attempt number the copy will run as (1-based, int) |
| `x-reliable-mq-last-error` | retry copies | `"ExceptionType: message"` of the failed attempt (at most 1,000 characters) |
| `x-reliable-mq-original-exchange` | every copy | the exchange the message was first published to (`""`: the default one) |
| `x-reliable-mq-original-routing-key` | every copy | the routing key it was first published with |
| `x-reliable-mq-original-expiration` | every copy of a message that had an `expiration` | that `expiration` (milliseconds, as a string); the copy itself has none |
| `x-reliable-mq-original-user-id` | every copy of a message whose `user_id` is not the user the copy is published as | that `user_id`; the copy itself has none (the broker would refuse it) |
| `x-reliable-mq-reason` | DLQ copies | why: one of [`DeadLetterReason`][reliable_mq.headers.DeadLetterReason] |
| `x-reliable-mq-error-type` | DLQ copies | the exception type (or the reason when nothing raised) |
| `x-reliable-mq-error-message` | DLQ copies | the exception text (at most 1,000 characters) |
| `x-reliable-mq-attempts` | DLQ copies | handler runs so far (int) |
| `x-reliable-mq-queue` | DLQ copies | the work queue it was consumed from |
| `x-reliable-mq-dead-lettered-at` | DLQ copies | ISO-8601 UTC time |
| `x-reliable-mq-dropped-headers` | trimmed copies | comma-separated names of the original's headers left out because the full copy could not be published |
| `x-reliable-mq-moved-from` | `reliable-mq dlq move` | the DLQ a message was moved back from |

Every copy (retry, deferred, DLQ, trimmed, and `reliable-mq dlq move`) also
keeps the body and every basic property of the original as it had them, but
`expiration` and a foreign `user_id` (the two headers above record them); a
message without a `message_id` gets one. RabbitMQ's own dead-lettering also
drops `expiration` (it records it in `x-death`).

Read, no longer written: `x-reliable-mq-no-content-type` (`True` on copies made
by earlier versions, which could not leave the content type out: such a copy
carries `application/octet-stream` and decodes as if it had none).

A message whose copy could not be published at all, on a work queue that
reliable_mq declared (it has a dead-letter exchange), is rejected onto that
exchange by the broker itself: it reaches the DLQ with the broker's `x-death`
header and without the `x-reliable-mq-reason` group.

Headers the Spark helper writes (`reliable_mq.spark`):
`x-spark-partition` (the partition index), `x-spark-task-attempt` (Spark's
attempt number of the task that sent it) and `x-spark-batch-id` (the
`foreachBatch` micro-batch id).

Headers the broker writes that reliable_mq reads: `x-delivery-count` (quorum
queues: earlier deliveries, added to the attempt number), `x-death` and the
`x-first-death-*`/`x-last-death-*` group (a message the broker dead-lettered:
`reliable-mq dlq list` shows its reason as `broker:<reason>`).
"""

from __future__ import annotations

import enum

__all__ = (
    "ATTEMPTS_HEADER",
    "ATTEMPT_HEADER",
    "DEAD_LETTERED_AT_HEADER",
    "BROKER_DEATH_HEADERS",
    "DEAD_LETTER_HEADERS",
    "DEATH_HEADER",
    "DELIVERY_COUNT_HEADER",
    "DROPPED_HEADERS_HEADER",
    "DeadLetterReason",
    "ERROR_MESSAGE_HEADER",
    "ERROR_TYPE_HEADER",
    "LAST_ERROR_HEADER",
    "MOVED_FROM_HEADER",
    "NO_CONTENT_TYPE_HEADER",
    "ORIGINAL_EXCHANGE_HEADER",
    "ORIGINAL_EXPIRATION_HEADER",
    "ORIGINAL_ROUTING_KEY_HEADER",
    "ORIGINAL_USER_ID_HEADER",
    "PREFIX",
    "QUEUE_HEADER",
    "REASON_HEADER",
    "SPARK_BATCH_ID_HEADER",
    "SPARK_PARTITION_HEADER",
    "SPARK_TASK_ATTEMPT_HEADER",
    "WIRE_CONTRACT",
)

PREFIX = "x-reliable-mq-"
"""The prefix of every header the consumer writes."""

ATTEMPT_HEADER = PREFIX + "attempt"
"""The attempt number (1-based int) a retried or deferred copy runs as."""

LAST_ERROR_HEADER = PREFIX + "last-error"
"""On a retry copy: ``"ExceptionType: message"`` of the attempt that failed."""

ORIGINAL_EXCHANGE_HEADER = PREFIX + "original-exchange"
"""The exchange the message was first published to (kept across every copy)."""

ORIGINAL_ROUTING_KEY_HEADER = PREFIX + "original-routing-key"
"""The routing key the message was first published with (kept across every copy)."""

NO_CONTENT_TYPE_HEADER = PREFIX + "no-content-type"
"""Read, no longer written: earlier versions set it on a copy whose original had
no content type (the copy carried ``application/octet-stream``), so that the copy
decodes exactly like the original. Copies now keep an absent content type absent."""

ORIGINAL_EXPIRATION_HEADER = PREFIX + "original-expiration"
"""On a copy of a message that had an ``expiration``: that value (milliseconds, a
string, as the property carries it). The copy has no ``expiration`` (it would
expire in a retry queue or the DLQ), as RabbitMQ's own dead-lettering does."""

ORIGINAL_USER_ID_HEADER = PREFIX + "original-user-id"
"""On a copy of a message whose ``user_id`` is not the user the copy is published
as: that ``user_id``. The copy has none (RabbitMQ refuses a ``user_id`` other than
the connection's user with 406 ``PRECONDITION_FAILED``)."""

REASON_HEADER = PREFIX + "reason"
"""On a DLQ copy: why it was dead-lettered (a [`DeadLetterReason`][reliable_mq.headers.DeadLetterReason] value)."""

ERROR_TYPE_HEADER = PREFIX + "error-type"
"""On a DLQ copy: the exception type name (the reason when nothing raised)."""

ERROR_MESSAGE_HEADER = PREFIX + "error-message"
"""On a DLQ copy: the exception text, at most 1,000 characters."""

ATTEMPTS_HEADER = PREFIX + "attempts"
"""On a DLQ copy: how many times a handler ran it (int)."""

QUEUE_HEADER = PREFIX + "queue"
"""On a DLQ copy: the work queue it was consumed from."""

DEAD_LETTERED_AT_HEADER = PREFIX + "dead-lettered-at"
"""On a DLQ copy: when, as an ISO-8601 UTC timestamp."""

DROPPED_HEADERS_HEADER = PREFIX + "dropped-headers"
"""On a trimmed copy: comma-separated names of the original headers left out
(the full copy was too large or refused); at most 1,000 characters."""

MOVED_FROM_HEADER = PREFIX + "moved-from"
"""Set by ``reliable-mq dlq move`` on a message sent back: the DLQ it came from."""

DEAD_LETTER_HEADERS = (
    REASON_HEADER,
    ERROR_TYPE_HEADER,
    ERROR_MESSAGE_HEADER,
    ATTEMPTS_HEADER,
    QUEUE_HEADER,
    DEAD_LETTERED_AT_HEADER,
)
"""Headers a dead-lettered message carries: why, what raised, how often, where, when."""

SPARK_PARTITION_HEADER = "x-spark-partition"
"""Set by the Spark helper: the index of the partition that sent the message."""

SPARK_TASK_ATTEMPT_HEADER = "x-spark-task-attempt"
"""Set by the Spark helper: Spark's attempt number of the task that sent it."""

SPARK_BATCH_ID_HEADER = "x-spark-batch-id"
"""Set by the Spark helper's ``foreachBatch`` sink: the micro-batch id."""

DELIVERY_COUNT_HEADER = "x-delivery-count"
"""Written by the broker on quorum queues: earlier deliveries of this message.
The consumer adds it to the attempt number and strips it from its copies."""

DEATH_HEADER = "x-death"
"""Written by the broker when it dead-letters a message: one table per (queue, reason)."""

BROKER_DEATH_HEADERS = (
    DEATH_HEADER,
    "x-first-death-exchange",
    "x-first-death-queue",
    "x-first-death-reason",
    "x-last-death-exchange",
    "x-last-death-queue",
    "x-last-death-reason",
)
"""Every header the broker writes when it dead-letters a message."""

WIRE_CONTRACT = frozenset(
    {
        ATTEMPT_HEADER,
        LAST_ERROR_HEADER,
        ORIGINAL_EXCHANGE_HEADER,
        ORIGINAL_ROUTING_KEY_HEADER,
        NO_CONTENT_TYPE_HEADER,
        ORIGINAL_EXPIRATION_HEADER,
        ORIGINAL_USER_ID_HEADER,
        *DEAD_LETTER_HEADERS,
        DROPPED_HEADERS_HEADER,
        MOVED_FROM_HEADER,
        SPARK_PARTITION_HEADER,
        SPARK_TASK_ATTEMPT_HEADER,
        SPARK_BATCH_ID_HEADER,
    }
)
"""Every header name reliable_mq writes (a trimmed copy keeps these, if small)."""


class DeadLetterReason(enum.StrEnum):
    """The values of [`REASON_HEADER`][reliable_mq.headers.REASON_HEADER] on a DLQ copy."""

    MAX_ATTEMPTS = "max_attempts"
    """The handler failed (or asked for a retry) ``max_attempts`` times."""
    REJECTED = "rejected"
    """The handler raised ``Reject`` or called ``delivery.reject()``."""
    INVALID_BODY = "invalid_body"
    """The body did not decode for the handler's annotation (bad JSON, wrong
    schema or content type, a validator that raised, nesting too deep)."""
    INVALID_PROPERTIES = "invalid_properties"
    """A string of the message that AMQP requires to be UTF-8 was not (a
    property such as ``message_id`` or ``content_type``, a header name, the
    routing key), or a timestamp was out of range: the broker does not check
    them. The handler did not run; the copy carries those strings
    backslash-escaped (``\\xff``), ``x-reliable-mq-error-message`` names them."""
    HANDLER_ERROR = "handler_error"
    """The handler raised under ``AckPolicy.DEAD_LETTER_ON_ERROR``."""
    HANDLER_TIMEOUT = "handler_timeout"
    """The handler ran past ``handler_timeout`` under ``AckPolicy.DEAD_LETTER_ON_ERROR``."""
    CONSUMER_TIMEOUT = "consumer_timeout"
    """The handler ran past the broker's ``consumer_timeout`` (the broker closed the
    channel) under ``AckPolicy.DEAD_LETTER_ON_ERROR``. Under the other policies
    such a run is a failed attempt, and the last one dead-letters with
    ``max_attempts`` and an error message naming ``consumer_timeout``."""
