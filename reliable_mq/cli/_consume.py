"""``consume``: print or save the messages of a queue, settling each exactly once.

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

from aio_pika.abc import AbstractIncomingMessage

from ._common import (
    EXIT_BROKEN_PIPE,
    EXIT_FAILED,
    EXIT_OK,
    CLIError,
    CommandFailed,
    StopSignals,
    message_record,
    open_connection,
    open_queue,
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


def _render(message: AbstractIncomingMessage, as_json: bool) -> bytes:
    """One line per message; control characters never reach the output raw.

    Text: the body with control characters (newlines too) escaped. JSON: ASCII
    only, everything else as ``\\u`` escapes.
    """
    if as_json:
        return json.dumps(message_record(message), ensure_ascii=True).encode() + b"\n"
    return printable(message.body).encode() + b"\n"


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
    messages: list[AbstractIncomingMessage],
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
    inbox: asyncio.Queue[AbstractIncomingMessage | None],
    stop: asyncio.Event,
    idle_timeout: float | None,
    room: int,
    reader: _PipeReader | None,
) -> list[AbstractIncomingMessage | None] | None:
    """Wait for at least one message (None: stop or idle), then take what is ready.

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
    while len(batch) < room and not inbox.empty() and batch[-1] is not None:
        batch.append(inbox.get_nowait())
    return batch


async def run_consume(args: argparse.Namespace) -> int:
    """Write messages of ``args.queue`` to stdout or a file and settle each once."""
    output = _open_output(args.output)
    requeue = args.ack_mode == "requeue"
    window = max(args.prefetch, args.count or 0) if requeue else args.prefetch
    window = min(window, 65535)
    limit: int | None = args.count if args.count else (window if requeue else None)
    written = 0
    held: list[AbstractIncomingMessage] = []
    failure: str | None = None
    broken_pipe = False
    signals = StopSignals().__enter__()
    stop = signals.event
    try:
        async with open_connection(args) as connection:
            channel, queue, _ = await open_queue(connection, args.queue)
            await channel.set_qos(prefetch_count=window)
            inbox: asyncio.Queue[AbstractIncomingMessage | None] = asyncio.Queue()

            def on_close(*_: Any) -> None:
                inbox.put_nowait(None)

            channel.close_callbacks.add(on_close)

            async def on_message(message: AbstractIncomingMessage) -> None:
                inbox.put_nowait(message)

            consumer_tag = await queue.consume(on_message, no_ack=False)
            pending: list[AbstractIncomingMessage] = []
            reader = _PipeReader.of(output)
            try:
                while (limit is None or written < limit) and not stop.is_set():
                    room = limit - written if limit is not None else window
                    try:
                        batch = await _next_batch(inbox, stop, args.idle_timeout, room, reader)
                    except BrokenPipeError:
                        broken_pipe = True
                        _silence_stdout()
                        break
                    if batch is None:
                        break
                    messages = [m for m in batch if m is not None]
                    pending = messages
                    if len(messages) < len(batch):
                        # The channel closed: its deliveries are back in the queue already.
                        failure = "the channel to the broker closed"
                        break
                    try:
                        taken, broken_pipe = await _write(output, reader, messages, args.json, stop)
                    except OSError as exc:
                        failure = f"cannot write the output: {exc}"
                        break
                    pending = messages[taken:]
                    for message in messages[:taken]:
                        if requeue:
                            held.append(message)
                        elif args.ack_mode == "reject":
                            await message.nack(requeue=False)
                        else:
                            await message.ack()
                    written += taken
                    if broken_pipe:
                        _silence_stdout()
                        break
                if channel.is_closed:
                    failure = failure or "the channel to the broker closed"
                else:
                    # No new deliveries; whatever arrived but was not written goes back.
                    await queue.cancel(consumer_tag)
                    await asyncio.sleep(0)
                    while not inbox.empty():
                        extra = inbox.get_nowait()
                        if extra is not None:
                            pending.append(extra)
                    for message in [*held, *pending]:
                        if not message.processed:
                            await message.nack(requeue=True)
                    await channel.close()
            except CommandFailed:
                raise
            except Exception as exc:
                if not channel.is_closed:
                    raise
                failure = f"the channel to the broker closed: {exc}"
    finally:
        signals.__exit__()
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
    if failure is not None:
        say(f"reliable-mq: error: {failure}; unsettled messages return to the queue")
        return EXIT_FAILED
    return signals.exit_code if signals.exit_code is not None else EXIT_OK
