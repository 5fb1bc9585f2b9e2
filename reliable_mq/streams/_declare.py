"""Declare a stream with its retention, and tell a stream from a queue.

A stream (``x-queue-type: stream``, RabbitMQ 3.9+) keeps its messages after
they are read: readers start from an offset, and retention removes old data
by whole segments, once the stream is over ``x-max-length-bytes`` or its
segments are older than ``x-max-age``.
"""

from __future__ import annotations

import contextlib
import enum
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from .._amqp import (
    AMQP_ERRORS,
    Channel,
    ChannelOpener,
    FaultKind,
    UserChannel,
    classify,
    inequivalence,
    is_user_channel,
)
from .._amqp import user_channel as _user_channel
from ..connection import ConnectionSupervisor, Link
from ..errors import ConsumerError, NotAStream, StreamError, StreamNotSupported
from ..metrics import Metrics
from ..settings import ConnectionSettings

__all__ = (
    "StreamSpec",
    "check_stream",
    "declare_stream",
    "is_stream",
    "refuse_stream",
    "stream_connection",
)

_AGE = re.compile(r"^[1-9][0-9]*(Y|M|D|h|m|s)$")
_PREFETCH_REFUSAL = "prefetch count is not set"


@dataclass(frozen=True)
class StreamSpec:
    """A stream and its retention.

    Attributes:
        name: the stream's name.
        max_length_bytes: ``x-max-length-bytes``: past this size the oldest
            segments are removed (None: no limit).
        max_age: ``x-max-age``, e.g. ``"7D"``, ``"12h"``: segments older than
            this are removed (units ``Y M D h m s``; None: no limit).
        max_segment_size_bytes: ``x-stream-max-segment-size-bytes``, the size of
            a segment file (RabbitMQ's default is 500 MB). Retention removes
            whole segments, so a stream holds up to one segment more than its
            limits.
        arguments: other ``x-`` arguments (e.g. ``x-initial-cluster-size``).
    """

    name: str
    max_length_bytes: int | None = None
    max_age: str | None = None
    max_segment_size_bytes: int | None = None
    arguments: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("stream name must not be empty")
        for label, value in (
            ("max_length_bytes", self.max_length_bytes),
            ("max_segment_size_bytes", self.max_segment_size_bytes),
        ):
            if value is not None and value <= 0:
                raise ValueError(f"{label} must be > 0, not {value}")
        if self.max_age is not None and not _AGE.match(self.max_age):
            raise ValueError(
                f"max_age {self.max_age!r}: a positive number and one unit of Y M D h m s, "
                "e.g. '7D' or '12h'"
            )

    def queue_arguments(self) -> dict[str, Any]:
        """The declaration's arguments."""
        args: dict[str, Any] = {"x-queue-type": "stream"}
        if self.max_length_bytes is not None:
            args["x-max-length-bytes"] = self.max_length_bytes
        if self.max_age is not None:
            args["x-max-age"] = self.max_age
        if self.max_segment_size_bytes is not None:
            args["x-stream-max-segment-size-bytes"] = self.max_segment_size_bytes
        args.update(self.arguments or {})
        return args


async def declare_stream(
    target: UserChannel | Link | str | ConnectionSettings,
    stream: StreamSpec | str,
    *,
    max_length_bytes: int | None = None,
    max_age: str | None = None,
    max_segment_size_bytes: int | None = None,
) -> StreamSpec:
    """Declare (idempotently) a durable stream.

    Args:
        target: an open aio-pika channel, a connection of reliable_mq's own, or
            where to connect: an AMQP URL or
            [`ConnectionSettings`][reliable_mq.settings.ConnectionSettings].
        stream: the stream, or its name with the retention given below.
        max_length_bytes: see `StreamSpec` (only with a name).
        max_age: see `StreamSpec` (only with a name).
        max_segment_size_bytes: see `StreamSpec` (only with a name).

    Returns:
        The stream declared.

    Raises:
        ConsumerError: the name is taken by a queue or a stream with other
            arguments, or the broker refused the declaration.
        BrokerUnavailable: ``target`` is a URL and no broker accepted a connection.
    """
    if isinstance(stream, str):
        stream = StreamSpec(stream, max_length_bytes, max_age, max_segment_size_bytes)
    elif (max_length_bytes, max_age, max_segment_size_bytes) != (None, None, None):
        raise ValueError("give the retention in the StreamSpec, or a name with keywords")
    if is_user_channel(target):
        await _declare(await _user_channel(target), stream)
        return stream
    if isinstance(target, Link):
        await _declare_on(target, stream)
        return stream
    async with stream_connection(target, role="topology") as link:
        await _declare_on(link, stream)
    return stream


async def _declare_on(link: Link, stream: StreamSpec) -> None:
    channel = await link.channel()
    try:
        await _declare(channel, stream)
    finally:
        await channel.close()


async def _declare(channel: Channel, stream: StreamSpec) -> None:
    try:
        await channel.declare_queue(stream.name, durable=True, arguments=stream.queue_arguments())
    except AMQP_ERRORS as exc:
        fault = classify(exc)
        if fault is None or not fault.refusal:
            raise
        raise ConsumerError(f"cannot declare stream {stream.name!r}: {fault.describe()}") from None


async def is_stream(connection: ChannelOpener, name: str) -> bool | None:
    """Whether queue ``name`` is a stream; None when it does not exist.

    AMQP 0-9-1 cannot ask a queue's type (and a stream's passive declare
    counts messages as a queue's does), so after a passive declare (does it
    exist?) the queue is redeclared as a stream (`_PROBE_ARGUMENTS`), a no-op
    on an existing queue, until the broker accepts the declaration (a stream)
    or refuses it on ``x-queue-type`` or ``x-expires`` (a classic or quorum
    queue). RabbitMQ refuses a redeclare naming one argument that differs,
    with the queue's own value; each round takes that value.

    The redeclare cannot create anything, even when the queue is deleted
    between two steps: it carries ``x-expires: 0``, which a stream neither
    accepts at creation (nor does any queue type accept 0) nor compares on a
    redeclare (RabbitMQ 3.10 compares only the arguments of the queue's own
    type), while classic and quorum queues compare it. A declaration that
    reaches the broker's creating path is refused, and the queue is reported
    missing.

    Only when a refusal cannot be read, an empty queue gets a probe consumer
    without a prefetch, which RabbitMQ refuses only on a stream (it takes no
    message from a stream, and what it may take from an empty queue goes back
    when its channel closes); a queue with messages is then taken as no stream.
    """
    channel = await connection.channel()
    try:
        try:
            info = await channel.declare_queue(name, passive=True)
        except AMQP_ERRORS as exc:
            fault = classify(exc)
            if fault is not None and fault.kind is FaultKind.NOT_FOUND:
                return None
            raise
    finally:
        await channel.close()
    verdict = await _declared_as_stream(connection, name)
    if verdict is not _Verdict.UNKNOWN:
        return _VERDICTS[verdict]
    if info.messages:
        return False
    return await _refuses_no_prefetch(connection, name)


class _Verdict(enum.Enum):
    STREAM = enum.auto()
    QUEUE = enum.auto()
    MISSING = enum.auto()
    UNKNOWN = enum.auto()
    """A refusal that could not be read."""


_VERDICTS: dict[_Verdict, bool | None] = {
    _Verdict.STREAM: True,
    _Verdict.QUEUE: False,
    _Verdict.MISSING: None,
}
_NOT_A_STREAM_ARGUMENT = "x-expires"
_PROBE_ARGUMENTS: dict[str, Any] = {"x-queue-type": "stream", _NOT_A_STREAM_ARGUMENT: 0}
"""What the probe redeclares with: no declaration with these can create a queue
(probed on 3.10.8: "invalid arg 'x-expires' ... of queue type rabbit_stream_queue")."""
_ROUNDS = 16


async def _declared_as_stream(connection: ChannelOpener, name: str) -> _Verdict:
    """Redeclare ``name`` with `_PROBE_ARGUMENTS`, taking its own values, until accepted or
    refused on its type (see `is_stream`)."""
    arguments = dict(_PROBE_ARGUMENTS)
    flags = {"durable": True, "auto_delete": False}
    for _ in range(_ROUNDS):
        channel = await connection.channel()
        try:
            await channel.declare_queue(name, arguments=arguments, **flags)
            return _Verdict.STREAM
        except AMQP_ERRORS as exc:
            fault = classify(exc)
            if fault is None or fault.reply_code != 406:
                raise
        finally:
            await channel.close()
        found = inequivalence(fault)
        if found is None:
            # Only the creating path validates arguments: the queue is gone.
            gone = f"invalid arg '{_NOT_A_STREAM_ARGUMENT}'" in fault.reply_text
            return _Verdict.MISSING if gone else _Verdict.UNKNOWN
        if found.argument == "x-queue-type":
            return _Verdict.STREAM if found.value == "stream" else _Verdict.QUEUE
        if found.argument == _NOT_A_STREAM_ARGUMENT:
            return _Verdict.QUEUE
        if found.argument in flags:
            flags[found.argument] = bool(found.value)
        elif not found.present:
            arguments.pop(found.argument, None)
        else:
            arguments[found.argument] = found.value
    return _Verdict.UNKNOWN


async def _refuses_no_prefetch(connection: ChannelOpener, name: str) -> bool | None:
    channel = await connection.channel()
    try:
        await channel.consume_without_prefetch(name)
    except AMQP_ERRORS as exc:
        fault = classify(exc)
        if fault is not None and _PREFETCH_REFUSAL in fault.reply_text:
            return True
        if fault is not None and fault.kind is FaultKind.NOT_FOUND:
            return None
        raise
    finally:
        await channel.close()
    return False


async def check_stream(connection: ChannelOpener, name: str) -> None:
    """Raise `NotAStream` unless ``name`` is a stream (the message says why and what to do).

    Raises:
        NotAStream: a classic or quorum queue, or nothing of that name.
        StreamError: the broker refused the check (permissions, an exclusive
            consumer...): whether it is a stream is not known.
    """
    try:
        found = await is_stream(connection, name)
    except AMQP_ERRORS as exc:
        fault = classify(exc)
        if fault is None:
            raise
        raise StreamError(f"cannot check that {name!r} is a stream: {fault.describe()}") from None
    if found:
        return
    if found is None:
        raise NotAStream(
            f"stream {name!r} does not exist: declare it first (declare_stream(), or "
            f"`reliable-mq topology --stream {name}`)"
        )
    raise NotAStream(
        f"queue {name!r} is not a stream: a classic or quorum queue hands each message out "
        "once and forgets it when acked, so it cannot be read again from an offset, and a "
        "reader over it could not replay after a failure. Publish into a stream (declare "
        "one with declare_stream() or `reliable-mq topology --stream NAME`), or shovel or "
        "bind the queue's source into one, and read that"
    )


async def refuse_stream(connection: ChannelOpener, queue: str) -> None:
    """Raise `StreamNotSupported` if ``queue`` is a stream (a `ReliableConsumer` checks at start).

    A queue that cannot be checked (missing, exclusive to another connection,
    refused) is left to the consumer's own declaration, which reports it.
    """
    try:
        found = await is_stream(connection, queue)
    except AMQP_ERRORS as exc:
        if classify(exc) is None:
            raise
        return
    if found:
        raise StreamNotSupported(
            f"queue {queue!r} is a stream: a stream is read from an offset that the reader "
            "keeps, and a ReliableConsumer keeps none (nor do its retries, dead-lettering or "
            "requeues apply to a stream). Read it with reliable_mq.streams.StreamReader, or "
            "with the Spark source: spark.read.format('rabbitmq').option('stream', "
            f"{queue!r})"
        )


@contextlib.asynccontextmanager
async def stream_connection(
    target: str | ConnectionSettings, *, role: str = "stream"
) -> AsyncIterator[Link]:
    """One connection of reliable_mq's own to ``target``, closed on exit."""
    settings = ConnectionSettings.of(target)
    supervisor = ConnectionSupervisor(
        settings, role=role, metrics=Metrics.on(CollectorRegistry()), decode_frames=True
    )
    await supervisor.start()
    try:
        yield await supervisor.wait_connected()
    finally:
        await supervisor.close()
