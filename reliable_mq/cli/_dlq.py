"""``dlq list|show|move``: inspect dead-lettered messages and send them back.

Browsing never removes a message: each is fetched with ``basic.get`` and held
unacknowledged (so the broker cannot hand it out again during the scan), and
everything not moved is returned with ``basic.nack(requeue=true)`` at the end;
the broker puts requeued messages back in their original position. Only the
messages that were in the DLQ when the command started are scanned, so a
message that fails again at once cannot make ``move --all`` loop.

``move`` republishes each selected message to its original queue through a
[`ReliablePublisher`][reliable_mq.publisher.ReliablePublisher] (confirms, mandatory, same
``message_id``, attempt count and dead-letter headers removed) and acks it in
the DLQ only once the broker has confirmed the copy: a crash in between leaves
a duplicate (same ``message_id``), never a loss. The copy is the message: its
body and every property as the consumer's own copies keep them (see
`reliable_mq._consume.copies`), read from the frames as they came.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry

from .._consume import copy_properties
from ..connection import Channel, Got, Link
from ..errors import InvalidMessage, PublishError
from ..headers import (
    ATTEMPT_HEADER,
    BROKER_DEATH_HEADERS,
    DEAD_LETTER_HEADERS,
    DEATH_HEADER,
    DELIVERY_COUNT_HEADER,
    LAST_ERROR_HEADER,
    MOVED_FROM_HEADER,
)
from ..publisher import ReliablePublisher
from ..settings import PublisherSettings
from ._common import (
    EXIT_FAILED,
    EXIT_OK,
    add_common_arguments,
    connection_settings,
    jsonable,
    message_record,
    open_channel,
    open_link,
    positive_float,
    positive_int,
    print_table,
    printable,
    queue_count,
    redact,
    say,
)

__all__ = (
    "MOVED_FROM_HEADER",
    "DeadLetterInfo",
    "add_dlq_arguments",
    "moved_headers",
    "run_dlq",
)

_REASON, _ERROR_TYPE, _ERROR_MESSAGE, _ATTEMPTS, _QUEUE, _AT = DEAD_LETTER_HEADERS
_STRIP_ON_MOVE = frozenset(
    {
        *DEAD_LETTER_HEADERS,
        *BROKER_DEATH_HEADERS,
        ATTEMPT_HEADER,
        LAST_ERROR_HEADER,
        MOVED_FROM_HEADER,
        DELIVERY_COUNT_HEADER,
    }
)


class DeadLetterInfo(NamedTuple):
    """Why and from where a message was dead-lettered, read from its headers.

    Messages dead-lettered by the consumer carry ``x-reliable-mq-*`` headers;
    those dead-lettered by the broker (a plain reject, an expiry) carry
    ``x-death``, which is used when the former are missing.
    """

    reason: str
    error: str
    attempts: str
    queue: str | None
    at: str

    @classmethod
    def of(cls, headers: Mapping[str, Any]) -> DeadLetterInfo:
        def text(name: str) -> str:
            value = jsonable(headers.get(name))
            return "" if value is None else str(value)

        if headers.get(_REASON) is not None:
            error_type, error_message = text(_ERROR_TYPE), text(_ERROR_MESSAGE)
            error = f"{error_type}: {error_message}" if error_type else error_message
            return cls(text(_REASON), error, text(_ATTEMPTS), text(_QUEUE) or None, text(_AT))
        deaths = headers.get(DEATH_HEADER)
        if isinstance(deaths, list) and deaths and isinstance(deaths[0], Mapping):
            death = deaths[0]
            queue = jsonable(death.get("queue"))
            return cls(
                f"broker:{jsonable(death.get('reason'))}",
                "",
                str(jsonable(death.get("count", ""))),
                str(queue) if queue else None,
                str(jsonable(death.get("time", ""))),
            )
        return cls("unknown", "", "", None, "")


def _dlq_name(args: argparse.Namespace) -> str:
    name: str = args.dlq or f"{args.queue}.dlq"
    return name


def _missing_hint(args: argparse.Namespace) -> str:
    """What to try when the DLQ does not exist (``dlq list orders.dlq`` is a common slip)."""
    queue: str = args.queue
    if not args.dlq and queue.endswith(".dlq"):
        work = queue.removesuffix(".dlq")
        return (
            f"; QUEUE is the work queue, not its DLQ: try `reliable-mq dlq "
            f"{args.dlq_command} {work}` (or --dlq {queue})"
        )
    return f"; is {queue!r} the work queue? Its DLQ is QUEUE.dlq unless --dlq NAME"


async def _open_dlq(link: Link, args: argparse.Namespace) -> tuple[Channel, int]:
    return await open_channel(
        link, _dlq_name(args), what="dead-letter queue", hint=_missing_hint(args)
    )


def add_dlq_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="dlq_command", metavar="ACTION", required=True)

    def action(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = actions.add_parser(
            name, help=help_text, description=help_text[:1].upper() + help_text[1:]
        )
        sub.add_argument("queue", help="the work queue whose dead letters to look at")
        sub.add_argument("--dlq", metavar="NAME", help="the dead-letter queue (default: QUEUE.dlq)")
        return sub

    listing = action("list", "count and summarize dead-lettered messages, leaving them in place")
    listing.add_argument(
        "--limit",
        type=positive_int,
        default=100,
        help="summarize at most this many messages (default: %(default)s)",
    )
    listing.add_argument("--json", action="store_true", help="one JSON object per message")
    add_common_arguments(listing)

    show = action("show", "print dead-lettered messages in full (headers and body), in place")
    show.add_argument("--message-id", required=True, metavar="ID", help="the message to show")
    add_common_arguments(show)

    move = action(
        "move", "republish dead-lettered messages to their queue with confirms, then ack them"
    )
    which = move.add_mutually_exclusive_group(required=True)
    which.add_argument("--message-id", metavar="ID", help="move the messages with this id")
    which.add_argument("--all", action="store_true", help="move every message in the DLQ")
    move.add_argument(
        "--to",
        metavar="QUEUE",
        help="send them to this queue (default: the queue each was dead-lettered from, "
        "from its headers, else QUEUE)",
    )
    move.add_argument(
        "--timeout",
        type=positive_float,
        default=60.0,
        help="deadline of each republish in seconds (default: %(default)s)",
    )
    add_common_arguments(move)


async def run_dlq(args: argparse.Namespace) -> int:
    """Dispatch to ``list``, ``show`` or ``move``."""
    if args.dlq_command == "list":
        return await _list(args)
    if args.dlq_command == "show":
        return await _show(args)
    return await _move(args)


class _Browser:
    """Fetches a queue's messages with ``basic.get``, holding each unacknowledged.

    Each message keeps its properties exactly as they came (`Got.properties`):
    a copy must have what the original had.
    """

    def __init__(self, channel: Channel, queue: str, limit: int) -> None:
        self._channel = channel
        self._queue = queue
        self._limit = limit
        self.held: list[Got] = []
        self._settled: set[int] = set()

    async def messages(self) -> AsyncIterator[Got]:
        while len(self.held) < self._limit:
            message = await self._channel.get(self._queue)
            if message is None:
                return
            self.held.append(message)
            yield message

    async def ack(self, message: Got) -> None:
        """Remove ``message`` from the queue (its copy is confirmed)."""
        await self._channel.ack(message.delivery_tag)
        self._settled.add(message.delivery_tag)

    async def release(self) -> None:
        """Return every message not settled otherwise to the queue (one frame)."""
        unsettled = [m for m in self.held if m.delivery_tag not in self._settled]
        if unsettled and not self._channel.is_closed:
            # Held tags are ascending and the rest were acked singly, so
            # multiple=true on the highest unsettled tag covers exactly these.
            await self._channel.nack(unsettled[-1].delivery_tag, multiple=True, requeue=True)


async def _list(args: argparse.Namespace) -> int:
    name = _dlq_name(args)
    async with open_link(args) as link:
        channel, total = await _open_dlq(link, args)
        browser = _Browser(channel, name, min(total, args.limit))
        records: list[tuple[Got, DeadLetterInfo]] = []
        try:
            async for message in browser.messages():
                records.append((message, DeadLetterInfo.of(message.headers)))
        finally:
            await browser.release()
            await channel.close()
    if args.json:
        for message, info in records:
            record = message_record(message)
            record["dead_letter"] = info._asdict()
            print(json.dumps(record, ensure_ascii=True))
        return EXIT_OK
    shown = f", showing the first {len(records):,}" if len(records) < total else ""
    print(f"{printable(name)}: {total:,} message(s){shown}")
    if records:
        rows = [
            ("MESSAGE ID", "ATTEMPTS  REASON            DEAD-LETTERED AT                  ERROR")
        ]
        for message, info in records:
            error = printable(info.error)
            error = error if len(error) <= 60 else error[:57] + "..."
            attempts, reason, at = (printable(v) for v in (info.attempts, info.reason, info.at))
            rows.append(
                (
                    printable(message.message_id or "-"),
                    f"{attempts or '-':<8}  {reason:<16}  {at or '-':<32}  {error}",
                )
            )
        print_table(rows)
        reasons = Counter(printable(info.reason) for _, info in records)
        print("by reason: " + ", ".join(f"{r} {n:,}" for r, n in reasons.most_common()))
    return EXIT_OK


async def _show(args: argparse.Namespace) -> int:
    name = _dlq_name(args)
    found = 0
    async with open_link(args) as link:
        channel, total = await _open_dlq(link, args)
        browser = _Browser(channel, name, total)
        try:
            async for message in browser.messages():
                if message.message_id != args.message_id:
                    continue
                found += 1
                record = message_record(message)
                record["dead_letter"] = DeadLetterInfo.of(message.headers)._asdict()
                print(json.dumps(record, ensure_ascii=True, indent=2))
        finally:
            await browser.release()
            await channel.close()
    if not found:
        say(
            f"reliable-mq: error: no message with message_id {printable(args.message_id)!r} "
            f"in {printable(name)!r} ({total:,} message(s) scanned)"
        )
        return EXIT_FAILED
    return EXIT_OK


def moved_headers(headers: Mapping[str, Any], dlq: str) -> dict[str, Any]:
    """The headers of a moved copy: no attempt count, no dead-letter reasons."""
    kept = {key: value for key, value in headers.items() if key not in _STRIP_ON_MOVE}
    kept[MOVED_FROM_HEADER] = dlq
    return kept


def _target(args: argparse.Namespace, headers: Mapping[str, Any]) -> str:
    if args.to:
        target: str = args.to
        return target
    info = DeadLetterInfo.of(headers)
    return info.queue or str(args.queue)


async def _queue_exists(link: Link, name: str) -> bool:
    return await queue_count(link, name) is not None


async def _move(args: argparse.Namespace) -> int:
    name = _dlq_name(args)
    moved = failed = skipped = 0
    exists: dict[str, bool] = {}
    settings = PublisherSettings(publish_timeout=args.timeout)
    async with open_link(args) as link:
        channel, total = await _open_dlq(link, args)
        browser = _Browser(channel, name, total)
        async with ReliablePublisher(
            connection_settings(args), settings=settings, registry=CollectorRegistry()
        ) as publisher:
            finishing: list[asyncio.Task[None]] = []

            async def finish(message: Got, target: str, outcome: Any) -> None:
                nonlocal moved, failed
                try:
                    await outcome
                except PublishError as exc:
                    failed += 1
                    say(
                        f"reliable-mq: {printable(message.message_id)}: not moved to "
                        f"{printable(target)!r}: {type(exc).__name__}: "
                        f"{printable(redact(str(exc), args.url))}"
                    )
                    return  # stays held; released (requeued in the DLQ) at the end
                await browser.ack(message)  # only now: the copy is confirmed
                moved += 1
                print(f"moved {printable(message.message_id or '-')} to {printable(target)}")

            try:
                async for message in browser.messages():
                    if not args.all and message.message_id != args.message_id:
                        continue
                    headers = message.headers
                    target = _target(args, headers)
                    if target not in exists:
                        exists[target] = await _queue_exists(link, target)
                    if not exists[target]:
                        skipped += 1
                        say(
                            f"reliable-mq: {printable(message.message_id)}: queue "
                            f"{printable(target)!r} does not exist; left in the DLQ"
                        )
                        continue
                    copied = moved_headers(headers, name)
                    properties = copy_properties(message.properties, copied, user=publisher.user)
                    try:
                        outcome = await publisher._enqueue_copy(
                            message.body, routing_key=target, properties=properties, headers=copied
                        )
                    except (PublishError, InvalidMessage) as exc:  # left in the DLQ
                        failed += 1
                        say(
                            f"reliable-mq: {printable(message.message_id)}: not moved: "
                            f"{printable(exc)}"
                        )
                        continue
                    finishing.append(asyncio.create_task(finish(message, target, outcome)))
                await asyncio.gather(*finishing)
            finally:
                for task in finishing:
                    task.cancel()
                await asyncio.gather(*finishing, return_exceptions=True)
                await browser.release()
                await channel.close()
    selected = moved + failed + skipped
    print_table(
        [
            ("dead-letter queue", name),
            ("scanned", f"{len(browser.held):,}"),
            ("moved", f"{moved:,}"),
            ("not moved", f"{failed + skipped:,}"),
        ]
    )
    if not args.all and selected == 0:
        say(
            f"reliable-mq: error: no message with message_id {printable(args.message_id)!r} "
            f"in {printable(name)!r}"
        )
        return EXIT_FAILED
    return EXIT_FAILED if failed or skipped else EXIT_OK
