"""Small AMQP helpers for tests: wait for a broker, drain a queue, send what pamqp cannot."""

from __future__ import annotations

import asyncio
import datetime
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple, TypeVar
from unittest import mock

import aio_pika
import pamqp.frame
from aio_pika.abc import AbstractIncomingMessage

from reliable_mq._sync import run_sync

__all__ = (
    "ESCAPED",
    "MARK",
    "NOT_UTF8",
    "PLACEHOLDER_TIME",
    "DrainedMessage",
    "drain_queue",
    "drain_queue_sync",
    "hostile_frames",
    "run_sync",
    "wait_for_amqp",
    "wait_for_amqp_sync",
)

_T = TypeVar("_T")

MARK = "<<BAD>>"
"""A placeholder to write in a string; `hostile_frames` swaps it for `NOT_UTF8`
(the same length: every length field of the frame stays right)."""
NOT_UTF8 = b"\xff\xfeb\xc3(d\x80"
ESCAPED = "\\xff\\xfeb\\xc3(d\\x80"
"""`NOT_UTF8` as reliable_mq shows it: backslash-escaped."""
PLACEHOLDER_TIME = datetime.datetime.fromtimestamp(1_234_567_890, datetime.UTC)
"""A timestamp `hostile_frames` swaps for the same time in microseconds (year 41,091)."""
_SWAPS = {
    MARK.encode(): NOT_UTF8,
    struct.pack(">Q", 1_234_567_890): struct.pack(">Q", 1_234_567_890 * 1_000_000),
}


@contextmanager
def hostile_frames() -> Iterator[None]:
    """aio-pika's frames with `MARK` and `PLACEHOLDER_TIME` swapped as they are marshalled:
    what another client (any language) can send, since the broker checks neither UTF-8
    nor dates. Every frame of the process is swapped meanwhile: publish only there."""
    marshal = pamqp.frame.marshal

    def swapped(frame: Any, channel: int) -> bytes:
        data = marshal(frame, channel)
        for old, new in _SWAPS.items():
            data = data.replace(old, new)
        return data

    with mock.patch.object(pamqp.frame, "marshal", swapped):
        yield


class DrainedMessage(NamedTuple):
    """What `drain_queue` keeps of each delivery."""

    message_id: str | None
    body: bytes
    headers: dict[str, Any]
    redelivered: bool


async def wait_for_amqp(url: str, timeout: float = 60.0) -> None:
    """Wait until a real AMQP handshake with `url` succeeds.

    Opens a connection and closes it again, retrying until `timeout` seconds
    have passed.

    Raises:
        TimeoutError: If no handshake succeeded in time (the last error is
            chained).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last_error: BaseException | None = None
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise TimeoutError(f"no AMQP handshake with {url} in {timeout:.0f}s") from last_error
        try:
            connection = await aio_pika.connect(url, timeout=min(5.0, remaining))
        except (TimeoutError, OSError, aio_pika.exceptions.AMQPError) as exc:
            last_error = exc
            await asyncio.sleep(min(0.2, max(deadline - loop.time(), 0)))
            continue
        await connection.close()
        return


async def drain_queue(
    url: str,
    queue: str,
    *,
    idle_timeout: float = 1.0,
    prefetch: int = 500,
    settled: bool = False,
) -> list[DrainedMessage]:
    """Consume everything from `queue`, acking each message, until it is idle.

    The queue must exist (it is declared passively). Draining stops once no
    message arrived for `idle_timeout` seconds. Use this, not message counts,
    to see what a queue holds.

    ``settled=True`` is for a queue whose content is final: every publisher to it
    is done and confirmed, and no other client consumes from it or holds a message
    of it unacked (such a message is invisible to us until it comes back). Then
    ``basic.get`` until the broker answers "empty" is exact, and takes
    milliseconds instead of the `idle_timeout`.

    Returns:
        One record per delivery, in delivery order.
    """
    if settled:
        return await _get_all(url, queue)
    received: list[DrainedMessage] = []
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel(publisher_confirms=False)
        await channel.set_qos(prefetch_count=prefetch)
        amqp_queue = await channel.get_queue(queue, ensure=True)
        activity = asyncio.Event()  # set on every delivery
        all_acked = asyncio.Event()  # set while every delivery so far is acked
        all_acked.set()
        acked = 0

        async def on_message(message: AbstractIncomingMessage) -> None:
            nonlocal acked
            all_acked.clear()
            activity.set()
            received.append(_drained(message))
            await message.ack()
            acked += 1
            if acked == len(received):
                all_acked.set()

        consumer_tag = await amqp_queue.consume(on_message)
        while True:
            activity.clear()
            try:
                await asyncio.wait_for(activity.wait(), idle_timeout)
            except TimeoutError:
                break
        await amqp_queue.cancel(consumer_tag)
        # Deliveries that raced the cancel run in their own tasks: let them
        # start and ack before the channel closes (closing would requeue them).
        await asyncio.sleep(0.05)
        await asyncio.wait_for(all_acked.wait(), 10)
        await channel.close()
    finally:
        await connection.close()
    return received


def _drained(message: AbstractIncomingMessage) -> DrainedMessage:
    return DrainedMessage(
        message.message_id, message.body, dict(message.headers), bool(message.redelivered)
    )


async def _get_all(url: str, queue: str) -> list[DrainedMessage]:
    """``basic.get`` (and ack) until the queue answers "empty"; see `drain_queue`."""
    received: list[DrainedMessage] = []
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel(publisher_confirms=False)
        amqp_queue = await channel.get_queue(queue, ensure=True)
        while (message := await amqp_queue.get(no_ack=False, fail=False)) is not None:
            received.append(_drained(message))
            await message.ack()
        await channel.close()
    return received


def drain_queue_sync(
    url: str, queue: str, *, idle_timeout: float = 1.0, settled: bool = False
) -> list[DrainedMessage]:
    """Blocking version of `drain_queue`."""
    return run_sync(lambda: drain_queue(url, queue, idle_timeout=idle_timeout, settled=settled))


def wait_for_amqp_sync(url: str, timeout: float = 60.0) -> None:
    """Blocking version of `wait_for_amqp`."""
    run_sync(lambda: wait_for_amqp(url, timeout))
