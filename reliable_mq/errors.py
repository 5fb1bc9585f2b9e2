"""The exceptions reliable_mq raises, rooted in one base class.

Callers catch a condition, not a transport detail: aio-pika and aiormq errors
are translated at the boundary and never reach user code raw.

```
ReliableMQError
├── InvalidSettings            (also ValueError)   bad configuration, named by field
├── InvalidMessage             (also ValueError)   a message that cannot be sent as given
│   └── InvalidBody            (also TypeError)    a body reliable_mq cannot encode
├── BrokerUnavailable          (also ConnectionError) no broker address accepted a connection
├── UnsupportedDependency      (also RuntimeError) fast_path="on" and aiormq/pamqp changed under us
├── ClosedError                                   the publisher/consumer was closed
├── FlushTimeout               (also TimeoutError) flush() ran out of time
├── PublishError                                  one message's outcome was not "confirmed"
│   ├── PublishUnroutable                         basic.return: no queue took it (not retried)
│   ├── PublishRefused                            the broker refused this message (not retried)
│   │   └── ExchangeNotFound                      404: the exchange does not exist
│   ├── MessageTooLarge                           over max_message_size (never sent)
│   ├── PublishGaveUp                             nacked / never confirmed max_attempts times
│   ├── PublishOutcomeUnknown                     the broker may have it: retry with the same id
│   │   ├── PublishTimeout     (also TimeoutError) the caller's deadline passed first
│   │   └── PublishAborted                        close() ran out of time before its confirm
│   └── PublishUnavailable (also BrokerUnavailable) no connection for unavailable_timeout
├── PublishBatchError                             publish_many(): some messages failed
├── ConsumerError                                 consumer-side failures (see consumer docs)
│   └── StreamNotSupported                        a ReliableConsumer was given a stream
├── StreamError                                   reading a stream (reliable_mq.streams)
│   ├── NotAStream             (also ValueError)  a classic or quorum queue: it cannot replay
│   └── StreamDataLoss                            retention removed offsets the reader needed
├── WouldDeadlock              (also RuntimeError) a blocking call from the thread that must serve it
└── InvalidTarget              (also ValueError)   `reliable-mq run`: the import path is not a consumer
```
"""

from __future__ import annotations

from typing import Any

__all__ = (
    "BrokerUnavailable",
    "ClosedError",
    "ConsumerError",
    "ExchangeNotFound",
    "FlushTimeout",
    "InvalidBody",
    "InvalidMessage",
    "InvalidSettings",
    "InvalidTarget",
    "MessageTooLarge",
    "NotAStream",
    "PublishAborted",
    "PublishBatchError",
    "PublishError",
    "PublishGaveUp",
    "PublishOutcomeUnknown",
    "PublishRefused",
    "PublishTimeout",
    "PublishUnavailable",
    "PublishUnroutable",
    "ReliableMQError",
    "StreamDataLoss",
    "StreamError",
    "StreamNotSupported",
    "UnsupportedDependency",
    "WouldDeadlock",
)


class ReliableMQError(Exception):
    """Base class of every error reliable_mq raises on purpose.

    Errors pickle with their attributes intact, so a Spark executor's error
    reaches the driver whole.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return (_restore_error, (type(self), self.args, dict(self.__dict__)))


def _restore_error(
    cls: type[ReliableMQError], args: tuple[Any, ...], state: dict[str, Any]
) -> ReliableMQError:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


class InvalidSettings(ReliableMQError, ValueError):
    """A setting failed validation; the message names each offending field.

    Input values are never echoed, so a bad URL's password cannot leak here.
    """

    def __init__(self, model: str, problems: list[tuple[str, str]]) -> None:
        self.model = model
        self.problems = problems
        lines = "; ".join(f"{field}: {msg}" for field, msg in problems)
        super().__init__(f"invalid {model}: {lines}")


class InvalidMessage(ReliableMQError, ValueError):
    """The message cannot be sent as given (routing key too long, bad header value...)."""


class InvalidBody(InvalidMessage, TypeError):
    """The body is not bytes, str, a pydantic model or JSON-serialisable data."""


class BrokerUnavailable(ReliableMQError, ConnectionError):
    """No broker address accepted a connection (addresses are shown redacted)."""


class UnsupportedDependency(ReliableMQError, RuntimeError):
    """A dependency no longer has what the fast path relies on, and ``fast_path="on"``.

    Raised when a connection opens (see ``fast_path`` in
    [`ConnectionSettings`][reliable_mq.settings.ConnectionSettings]).
    With ``fast_path="auto"`` (the default) the library logs one warning and uses its
    plain path instead.

    Attributes:
        dependency: the distribution (``aiormq``, ``pamqp``).
        installed: its installed version.
        supported: the range reliable_mq supports and CI tests.
        problem: which hook failed its check, and how.
    """

    def __init__(self, dependency: str, installed: str, supported: str, problem: str) -> None:
        self.dependency = dependency
        self.installed = installed
        self.supported = supported
        self.problem = problem
        super().__init__(
            f"{dependency} {installed} is installed; reliable_mq's fast path supports "
            f"{dependency}{supported}: {problem}"
        )


class ClosedError(ReliableMQError):
    """The publisher or consumer is closed (or closing) and takes no new work."""


class FlushTimeout(ReliableMQError, TimeoutError):
    """``flush()`` ran out of time with messages still unconfirmed (they stay in flight)."""


class ConsumerError(ReliableMQError):
    """Base for consumer-side errors."""


class StreamNotSupported(ConsumerError):
    """A `ReliableConsumer` was given a stream queue (``x-queue-type: stream``).

    A stream is read from an offset, and nothing in a consumer keeps one: read
    it with `reliable_mq.streams.StreamReader` (offsets you keep) or the Spark
    source (``spark.read.format("rabbitmq").option("stream", ...)``). The
    message names the queue.
    """


class StreamError(ReliableMQError):
    """Base for errors of reading a stream (`reliable_mq.streams`)."""


class NotAStream(StreamError, ValueError):
    """The queue is not a stream (classic or quorum, or missing).

    A classic or quorum queue hands each message out once and forgets it when it
    is acked: it cannot be read again from an offset, so a reader over it could
    not replay after a failure. Publish into a stream instead, or shovel or
    bind the queue's source into one.
    """


class StreamDataLoss(StreamError):
    """Retention removed offsets a reader still needed.

    Attributes:
        stream: the stream.
        requested: the first offset asked for.
        available: the first offset the stream still had (everything in
            ``[requested, available)`` is gone).
    """

    def __init__(self, message: str, *, stream: str, requested: int, available: int) -> None:
        super().__init__(message)
        self.stream = stream
        self.requested = requested
        self.available = available


class PublishError(ReliableMQError):
    """A message did not end confirmed.

    Attributes:
        message_id: the id the message carried on every attempt.
        attempts: how many times it was sent to the broker.
    """

    def __init__(self, message: str, *, message_id: str, attempts: int) -> None:
        self.message_id = message_id
        self.attempts = attempts
        super().__init__(f"{message} (message_id={message_id}, attempts={attempts})")


class PublishUnroutable(PublishError):
    """The broker returned a mandatory message: no queue is bound for its routing key.

    Not retried: republishing the same message would be returned again.
    """

    def __init__(
        self,
        *,
        message_id: str,
        attempts: int,
        exchange: str,
        routing_key: str,
        reply_code: int | None,
        reply_text: str | None,
    ) -> None:
        self.exchange = exchange
        self.routing_key = routing_key
        self.reply_code = reply_code
        self.reply_text = reply_text
        super().__init__(
            f"unroutable: {reply_code} {reply_text} "
            f"(exchange={exchange!r}, routing_key={routing_key!r})",
            message_id=message_id,
            attempts=attempts,
        )


class PublishRefused(PublishError):
    """The broker refused this message (a channel or connection close naming it).

    Not retried: sending it again would be refused again. Other messages in
    flight at the time are republished, never reported with this error.

    Attributes:
        reply_code: the AMQP reply code (403, 404, 406...), if the broker sent one.
        reply_text: the broker's reply text.
    """

    def __init__(
        self,
        message: str,
        *,
        message_id: str,
        attempts: int,
        reply_code: int | None = None,
        reply_text: str = "",
    ) -> None:
        self.reply_code = reply_code
        self.reply_text = reply_text
        super().__init__(message, message_id=message_id, attempts=attempts)


class ExchangeNotFound(PublishRefused):
    """The target exchange does not exist (404); no attempt of the message was routed.

    A missing exchange is remembered for one second: publishes to it within that
    second fail at once, even if it was declared meanwhile.
    """


class MessageTooLarge(PublishError):
    """The encoded body exceeds ``max_message_size``; it was never sent."""


class PublishGaveUp(PublishError):
    """The broker nacked the message, or never confirmed it, ``max_attempts`` times."""


class PublishOutcomeUnknown(PublishError):
    """The broker may or may not have taken the message.

    A retry by the caller must keep the same ``message_id``, so that a
    de-duplicating consumer applies it once.
    """


class PublishTimeout(PublishOutcomeUnknown, TimeoutError):
    """The caller's deadline passed before a confirm; the outcome is unknown."""


class PublishAborted(PublishOutcomeUnknown):
    """``close()`` gave up waiting for this message's confirm; its outcome is unknown."""


class PublishUnavailable(PublishError, BrokerUnavailable):
    """No connection could be had for ``unavailable_timeout`` seconds.

    Every message waiting for a connection fails together with this error, and
    new publishes fail at once until the connection is back. If ``attempts`` is
    above 0, an earlier attempt reached the broker and may have been taken:
    retry with the same ``message_id``.
    """


class PublishBatchError(ReliableMQError):
    """``publish_many()`` ended with failed messages; `result` has every outcome.

    Attributes:
        result: the batch's ``BatchResult`` (counts, and each failure with its
            index, message id and error).
    """

    def __init__(self, message: str, result: Any) -> None:
        self.result = result
        super().__init__(message)


class WouldDeadlock(ReliableMQError, RuntimeError):
    """A blocking call was made from the thread that would have to serve it.

    Raised by [BlockingPublisher][reliable_mq.sync.BlockingPublisher] when it is
    called from its own event-loop thread (for example inside a callback of a
    future it returned): waiting there would wait forever.
    """


class InvalidTarget(ReliableMQError, ValueError):
    """``reliable-mq run``: the import path does not name a consumer or router.

    The message names the path and what was found instead.
    """
