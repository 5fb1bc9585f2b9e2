"""``consume``: print or save the messages of a queue, settling each exactly once.

A face over [`ReliableConsumer`][reliable_mq.consumer.ReliableConsumer]: its one
handler consumes the queue as it is (``queue_only``: nothing declared, every
delivery as it came) and hands each delivery to the writer below, which settles
it (``AckPolicy.MANUAL``) once it is written.

Each message is written (and, with ``--output``, flushed and fsynced) *before*
it is settled, so ``--ack-mode ack`` never removes a message that did not reach
the output. Into a pipe (``| head -3``), "reached" means taken by the reader:
the lines go one at a time, and each is settled once the pipe is empty again
(the reader read it); a reader that is gone (EPIPE, or seen while waiting for
messages) ends the command at once with 141, and what it did not take stays in
the queue. ``requeue`` holds every message unacknowledged until the command
ends and then returns them all, so the broker never hands the same message
back during the run (a peek); ``reject`` drops them, or dead-letters them when
the queue has a dead-letter exchange (queues declared by ``topology`` do).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import fcntl
import json
import os
import select
import stat
import struct
import sys
import termios
from typing import IO, Any

from prometheus_client import CollectorRegistry

from ..consumer import ReliableConsumer
from ..delivery import Delivery, Settle
from ..errors import ConsumerError
from ..handlers import AckPolicy
from ..settings import ConsumerSettings
from ._common import (
    EXIT_BROKEN_PIPE,
    EXIT_FAILED,
    EXIT_OK,
    CLIError,
    CommandFailed,
    StopSignals,
    connection_settings,
    jsonable,
    positive_float,
    positive_int,
    prefetch_count,
    printable,
    say,
)

__all__ = ("add_consume_arguments", "run_consume")

_ACK_MODES = ("ack", "requeue", "reject")


def add_consume_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("queue", help="the queue to consume from (it must exist)")
    parser.add_argument(
        "--ack-mode",
        choices=_ACK_MODES,
        default="ack",
        help="ack: remove each message once written (default); requeue: peek, every "
        "message goes back to the queue when the command ends; reject: discard each "
        "message once written (dead-lettered if the queue has a dead-letter exchange)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per line: message_id, exchange, routing_key, redelivered, "
        "content_type, headers, body (base64 with body_encoding when not UTF-8)",
    )
    parser.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help="append to FILE instead of stdout (flushed and fsynced before messages are "
        "settled; never truncated, so a second run cannot lose the first one's messages)",
    )
    parser.add_argument(
        "-n", "--count", type=positive_int, metavar="N", help="stop after N messages"
    )
    parser.add_argument(
        "--idle-timeout",
        type=positive_float,
        metavar="S",
        help="stop when no message arrived for S seconds (default: wait for more until "
        "--count, Ctrl-C or SIGTERM)",
    )
    parser.add_argument(
        "--prefetch",
        type=prefetch_count,
        default=100,
        help="unacknowledged messages at most (basic.qos, default: %(default)s); with "
        "--ack-mode requeue the most messages one run shows, unless --count is larger",
    )


def _open_output(path: str | None) -> IO[bytes]:
    if path is None:
        return sys.stdout.buffer
    try:
        return open(path, "ab")
    except OSError as exc:
        raise CLIError(f"cannot write {path}: {exc.strerror}") from None


class _Taken:
    """One delivery handed over by the consumer's handler, which waits until it is settled."""

    __slots__ = ("delivery", "released")

    def __init__(self, delivery: Delivery) -> None:
        self.delivery = delivery
        self.released = asyncio.get_running_loop().create_future()
        """Set once the delivery is settled: its handler may return."""

    def release(self) -> None:
        if not self.released.done():
            self.released.set_result(None)


def delivery_record(delivery: Delivery) -> dict[str, Any]:
    """One message as a JSON object: ids, routing, properties, headers and body.

    The body is UTF-8 text when it decodes, else base64 with
    ``"body_encoding": "base64"``.
    """
    properties = delivery.properties
    record: dict[str, Any] = {
        "message_id": delivery.message_id or None,
        "exchange": delivery.exchange,
        "routing_key": delivery.routing_key,
        "redelivered": bool(delivery.redelivered),
        "content_type": delivery.content_type,
    }
    for name, value in (
        ("correlation_id", delivery.correlation_id),
        ("reply_to", delivery.reply_to),
        ("type", getattr(properties, "message_type", None)),
        ("app_id", getattr(properties, "app_id", None)),
    ):
        if value:
            record[name] = value
    timestamp = getattr(properties, "timestamp", None)
    if timestamp is not None:
        record["timestamp"] = jsonable(timestamp)
    record["headers"] = jsonable(delivery.headers or {})
    try:
        record["body"] = delivery.body.decode("utf-8")
    except UnicodeDecodeError:
        record["body"] = base64.b64encode(delivery.body).decode("ascii")
        record["body_encoding"] = "base64"
    return record


def _render(delivery: Delivery, as_json: bool) -> bytes:
    """One line per message; control characters never reach the output raw.

    Text: the body with control characters (newlines too) escaped. JSON: ASCII
    only, everything else as ``\\u`` escapes.
    """
    if as_json:
        return json.dumps(delivery_record(delivery), ensure_ascii=True).encode() + b"\n"
    return printable(delivery.body).encode() + b"\n"


def _durable_flush(output: IO[bytes]) -> None:
    """Flush, and fsync when the output is a regular file (a pipe or terminal cannot be)."""
    output.flush()
    fileno = output.fileno()
    if stat.S_ISREG(os.fstat(fileno).st_mode):
        os.fsync(fileno)


class _PipeReader:
    """The reader at the other end of the output, when the output is a pipe.

    A pipe takes up to 64 KiB before its reader reads anything: "written"
    must mean "read". `FIONREAD` on the write end counts the bytes still in
    the pipe, and ``POLLERR`` says that no reader is left.
    """

    WATCH = 0.1
    """Seconds between two looks for a reader gone while no message comes."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._poll = select.poll()
        self._poll.register(fd, select.POLLERR | select.POLLHUP)

    @classmethod
    def of(cls, output: IO[bytes]) -> _PipeReader | None:
        try:
            fd = output.fileno()
            return cls(fd) if stat.S_ISFIFO(os.fstat(fd).st_mode) else None
        except (OSError, ValueError):
            return None

    def gone(self) -> bool:
        return bool(self._poll.poll(0))

    def unread(self) -> int:
        return int(struct.unpack("i", fcntl.ioctl(self.fd, termios.FIONREAD, b"\0" * 4))[0])

    async def took_all(self, stop: asyncio.Event) -> bool:
        """Wait until the pipe is empty: True; False if told to stop first.

        Raises:
            BrokenPipeError: the reader is gone (what it did not read is lost to it).
        """
        pause = 0.0
        while self.unread():
            if self.gone():
                raise BrokenPipeError("the reader of the output is gone")
            if stop.is_set():
                return False
            await asyncio.sleep(pause)
            pause = min(pause * 2 or 0.0002, 0.02)
        return True

    async def wait_gone(self) -> None:
        while not self.gone():
            await asyncio.sleep(self.WATCH)


async def _write(
    output: IO[bytes],
    reader: _PipeReader | None,
    messages: list[Delivery],
    as_json: bool,
    stop: asyncio.Event,
) -> tuple[int, bool]:
    """Write ``messages``: how many reached the output (the first ones), and
    whether its reader is gone (a broken pipe).

    Raises:
        OSError: the output cannot be written (not a broken pipe).
    """
    if reader is None:  # a file (fsynced) or a terminal: what was written is there
        try:
            for message in messages:
                output.write(_render(message, as_json))
            _durable_flush(output)
        except BrokenPipeError:
            return 0, True
        return len(messages), False
    for index, message in enumerate(messages):
        try:
            output.write(_render(message, as_json))
            output.flush()
            if not await reader.took_all(stop):
                return index, False
        except BrokenPipeError:
            return index, True
    return len(messages), False


def _silence_stdout() -> None:
    """After a broken pipe, point stdout at /dev/null so the exit flush cannot fail."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


async def _next_batch(
    inbox: asyncio.Queue[_Taken],
    stop: asyncio.Event,
    idle_timeout: float | None,
    room: int,
    reader: _PipeReader | None,
) -> list[_Taken] | None:
    """Wait for at least one delivery (None: stop or idle), then take what is ready.

    Raises:
        BrokenPipeError: the reader of the output left while we waited.
    """
    if inbox.empty():
        getter = asyncio.ensure_future(inbox.get())
        stopper = asyncio.ensure_future(stop.wait())
        waiters: list[asyncio.Future[Any]] = [getter, stopper]
        if reader is not None:
            waiters.append(asyncio.ensure_future(reader.wait_gone()))
        try:
            await asyncio.wait(waiters, timeout=idle_timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters[1:]:
                waiter.cancel()
            if not getter.done():
                getter.cancel()
        if not getter.done() or getter.cancelled():
            if reader is not None and waiters[2].done() and not waiters[2].cancelled():
                raise BrokenPipeError("the reader of the output is gone")
            return None
        batch = [getter.result()]
    else:
        batch = [inbox.get_nowait()]
    while len(batch) < room and not inbox.empty():
        batch.append(inbox.get_nowait())
    return batch


class _Run:
    """One ``consume`` run: the consumer, its hand-over queue, and what it wrote."""

    def __init__(self, args: argparse.Namespace, window: int, stop: asyncio.Event) -> None:
        self.args = args
        self.inbox: asyncio.Queue[_Taken] = asyncio.Queue()
        self.taken: list[_Taken] = []
        """Handed over and not settled yet: held (requeue mode), or not written."""
        self.closing = False
        self.failure: str | None = None
        self.stop = stop
        """Set by a signal, or when the consumer's channel is lost."""
        self.consumer = ReliableConsumer(
            connection_settings(args),
            settings=ConsumerSettings(
                prefetch=window,
                concurrency=window,  # every delivery's handler waits for its settle
                handler_timeout=None,
            ),
            registry=CollectorRegistry(),
            dedup=None,
            on_channel_lost=self._channel_lost,
        )
        self.consumer.add_handler(
            args.queue, self._take, ack_policy=AckPolicy.MANUAL, queue_only=True
        )

    async def _take(self, delivery: Delivery) -> None:
        """The consumer's handler: hand the delivery over, wait until it is settled."""
        if self.closing:  # arrived while the command ends: back to the queue
            await delivery.nack(requeue=True)
            return
        taken = _Taken(delivery)
        self.taken.append(taken)
        self.inbox.put_nowait(taken)
        await taken.released

    def _channel_lost(self, queue: str) -> None:
        # Its deliveries are back in the queue already; a new channel would show
        # the ones written but not settled a second time: stop instead.
        self.failure = self.failure or "the channel to the broker closed"
        self.stop.set()

    async def settle(self, taken: _Taken, *, requeue: bool = False) -> None:
        """Settle one delivery as the mode says (``requeue``: back to the queue), once."""
        delivery = taken.delivery
        try:
            if requeue:
                await delivery.nack(requeue=True)
            elif self.args.ack_mode == "reject":
                await delivery.nack(requeue=False)
            else:
                await delivery.ack()
        finally:
            taken.release()
        if delivery.outcome is Settle.STALE:
            self.failure = self.failure or "the channel to the broker closed"

    async def finish(self) -> None:
        """Return every delivery not settled yet to the queue, then stop the consumer."""
        self.closing = True
        for taken in self.taken:
            if not taken.delivery.settled:
                await self.settle(taken, requeue=True)
            taken.release()
        self.taken.clear()
        await self.consumer.stop()


async def _consume(run: _Run, output: IO[bytes], limit: int | None) -> tuple[int, bool]:
    """Write and settle deliveries until done: (written, broken pipe)."""
    args, window, stop = run.args, run.consumer.settings.prefetch, run.stop
    written, broken_pipe = 0, False
    reader = _PipeReader.of(output)
    while (limit is None or written < limit) and not stop.is_set():
        room = limit - written if limit is not None else window
        try:
            batch = await _next_batch(run.inbox, stop, args.idle_timeout, room, reader)
        except BrokenPipeError:
            return written, True
        if batch is None:
            break
        live = [taken for taken in batch if not taken.delivery.settled]
        if len(live) < len(batch):  # settled stale meanwhile: its channel is gone
            run.failure = run.failure or "the channel to the broker closed"
            break
        try:
            count, broken_pipe = await _write(
                output, reader, [taken.delivery for taken in live], args.json, stop
            )
        except OSError as exc:
            run.failure = f"cannot write the output: {exc}"
            break
        for taken in live[:count]:
            if args.ack_mode != "requeue":  # requeue: held until the end, then returned
                await run.settle(taken)
        written += count
        if broken_pipe or run.failure is not None:
            break
    return written, broken_pipe


async def run_consume(args: argparse.Namespace) -> int:
    """Write messages of ``args.queue`` to stdout or a file and settle each once."""
    output = _open_output(args.output)
    requeue = args.ack_mode == "requeue"
    window = max(args.prefetch, args.count or 0) if requeue else args.prefetch
    window = min(window, 65535)
    limit: int | None = args.count if args.count else (window if requeue else None)
    written, broken_pipe = 0, False
    signals = StopSignals().__enter__()
    run = _Run(args, window, signals.event)
    try:
        try:
            await run.consumer.start()  # a failed start closes what it opened
        except ConsumerError as exc:
            raise CommandFailed(str(exc)) from None
        try:
            written, broken_pipe = await _consume(run, output, limit)
        finally:
            await run.finish()
    finally:
        signals.__exit__()
        if broken_pipe:
            _silence_stdout()
        if output is not sys.stdout.buffer:
            output.close()
    verb = {"ack": "acked", "requeue": "requeued (still in the queue)", "reject": "rejected"}
    say(
        f"reliable-mq: {written:,} message(s) from {args.queue!r} written and "
        f"{verb[args.ack_mode]}" + ("; interrupted" if signals.received else "")
    )
    if broken_pipe:
        say("reliable-mq: output closed; unwritten messages stay in the queue")
        return EXIT_BROKEN_PIPE
    if run.failure is not None:
        say(f"reliable-mq: error: {run.failure}; unsettled messages return to the queue")
        return EXIT_FAILED
    return signals.exit_code if signals.exit_code is not None else EXIT_OK
