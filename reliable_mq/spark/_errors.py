"""The errors of ``reliable_mq.spark``, rooted in `ReliableMQError` like every other."""

from __future__ import annotations

from ..errors import InvalidMessage, ReliableMQError, StreamError

__all__ = (
    "DestinationNotFound",
    "DuplicateKeys",
    "MalformedBody",
    "NullKey",
    "PartitionNotConfirmed",
    "StreamStopping",
    "UnsupportedSchema",
)


class DestinationNotFound(ReliableMQError, LookupError):
    """The pre-check found no such exchange or queue (passive declare answered 404)."""


class PartitionNotConfirmed(ReliableMQError):
    """Messages of a partition stayed unconfirmed after every in-task round.

    Raised inside the task so that Spark retries it; the retry sends the same ids.
    """


class UnsupportedSchema(ReliableMQError, TypeError):
    """The DataFrame's schema cannot be published as asked; found on the driver.

    Raised before any task runs (nothing is published, no Spark retry is spent):
    a column type with no faithful encoding (intervals, variant, maps keyed by
    dates or binary...), duplicate column names, or a key or routing-key column
    of the wrong type.

    Attributes:
        problems: ``(column path, reason)`` pairs, one per problem found.
    """

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        lines = "; ".join(f"{path}: {reason}" for path, reason in problems)
        super().__init__(f"cannot publish this DataFrame: {lines}")


class NullKey(InvalidMessage):
    """A key column holds null, which would give distinct rows one message id.

    The driver looks for nulls in nullable key columns before any task runs;
    a task that still meets one (a source that changed under a retry) stops
    its partition with this error. Set ``allow_null_keys=True`` to publish such
    rows (see ``docs/spark.md``).
    """


class DuplicateKeys(ReliableMQError, ValueError):
    """``ids="key"``: several rows share one key, so they would share one message id.

    Found on the driver by one aggregation job before anything is published.

    Attributes:
        key: the first duplicated key, as canonical JSON.
        count: how many rows carry it.
    """

    def __init__(self, key: str, count: int) -> None:
        self.key = key
        self.count = count
        shown = key if len(key) <= 200 else key[:200] + "..."
        super().__init__(
            f"{count} rows share the key {shown}: with ids='key' they would get one "
            "message id and a de-duplicating consumer would keep one of them. Use "
            "ids='row' (ids from the whole row) or fix the key columns"
        )


class StreamStopping(ReliableMQError):
    """A micro-batch began after a graceful stop was asked for; nothing of it was published.

    The batch is not committed, so Spark replays it when the query restarts.
    """


class MalformedBody(StreamError, ValueError):
    """A stream record's body is not JSON of the read's ``bodySchema`` (``mode`` ``FAILFAST``).

    Raised in the task that read it, so the read fails; with ``mode``
    ``PERMISSIVE`` the body goes to the corrupt column instead.

    Attributes:
        stream: the stream.
        offset: the record's offset.
        reason: what is wrong (not UTF-8, not JSON, which field has which type).
    """

    def __init__(self, message: str, *, stream: str, offset: int, reason: str) -> None:
        super().__init__(message)
        self.stream = stream
        self.offset = offset
        self.reason = reason
