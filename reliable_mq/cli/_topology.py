"""``topology``: declare or delete a work queue with its retry queues and DLQ, or a stream.

The queues and their arguments come from [`reliable_mq.topology.QueueTopology`][reliable_mq.topology.QueueTopology],
exactly as [`ReliableConsumer`][reliable_mq.consumer.ReliableConsumer] declares them, so a
queue set made here is the one a consumer with the same ``retry_delays``
expects. With ``--stream`` the name is a stream's instead
([`declare_stream`][reliable_mq.streams.declare_stream]), declared with its
retention: a stream has no retry queues or DLQ.
"""

from __future__ import annotations

import argparse

from ..connection import Link
from ..errors import ConsumerError
from ..settings import ConsumerSettings
from ..streams import StreamSpec, declare_stream
from ..topology import QueueCheck, QueueTopology, QueueType, prepare_topology
from ._common import EXIT_OK, CommandFailed, open_link, print_table, queue_count, say

__all__ = ("add_topology_arguments", "parse_delays", "run_topology")

_MAX_DELAY = 7 * 86_400


def parse_delays(text: str) -> tuple[float, ...]:
    """``"1,5,30"`` → ``(1.0, 5.0, 30.0)``; each must be > 0 and at most 7 days."""
    delays: list[float] = []
    for part in text.split(","):
        try:
            delay = float(part.strip().removesuffix("s"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number of seconds: {part!r}") from None
        if not 0 < delay <= _MAX_DELAY:
            raise argparse.ArgumentTypeError(f"each delay must be > 0 and at most 7 days: {part}")
        delays.append(delay)
    return tuple(delays)


def add_topology_arguments(parser: argparse.ArgumentParser) -> None:
    default_delays = ConsumerSettings.model_fields["retry_delays"].default
    shown = ",".join(f"{d:g}" for d in default_delays)
    parser.add_argument("queue", help="the work queue")
    parser.add_argument(
        "--quorum", action="store_true", help="declare quorum queues (default: classic)"
    )
    parser.add_argument(
        "--retry-delays",
        type=parse_delays,
        default=default_delays,
        metavar="S,S,...",
        help=f"seconds before attempt 2, 3, ...; one retry queue per delay (default: {shown}, "
        "as the consumer's default retry_delays)",
    )
    parser.add_argument("--dlq", metavar="NAME", help="the dead-letter queue (default: QUEUE.dlq)")
    parser.add_argument(
        "--delete",
        action="store_true",
        help="delete the queues instead (give the same --retry-delays and --dlq); "
        "refuses queues that hold messages unless --force",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="with --delete: delete queues with their messages; without: declare the missing "
        "queues of a set that exists with other --retry-delays or --dlq",
    )
    parser.add_argument(
        "--stream",
        action="store_true",
        help="declare QUEUE as a stream (x-queue-type: stream), read from offsets, with the "
        "retention below; no retry queues or DLQ",
    )
    parser.add_argument(
        "--max-length-bytes",
        type=int,
        metavar="N",
        help="with --stream: x-max-length-bytes, past which the oldest segments are removed",
    )
    parser.add_argument(
        "--max-age",
        metavar="AGE",
        help="with --stream: x-max-age, e.g. 7D or 12h (units Y M D h m s)",
    )
    parser.add_argument(
        "--max-segment-size-bytes",
        type=int,
        metavar="N",
        help="with --stream: x-stream-max-segment-size-bytes (retention removes whole segments)",
    )
    parser.add_argument(
        "--ignore-missing",
        action="store_true",
        help="with --delete: delete the queues that exist even if others of the set do not "
        "(default: refuse, as other --retry-delays would leave queues behind)",
    )


def _describe(topology: QueueTopology, name: str, check: QueueCheck | None) -> tuple[str, str]:
    """(role, what it does) of one queue of the set."""
    if name == topology.queue:
        if check is not None and check.adopted:
            return "work queue", "existed with other arguments: used as it is (see the note)"
        return "work queue", f"rejects dead-letter to {topology.dead_letter_queue}"
    if name == topology.dead_letter_queue:
        return "dead letters", "poison and malformed messages, with reason headers"
    delay = next(d for d in topology.retry_delays if topology.retry_queue(d) == name)
    return (
        f"retry {delay:g}s",
        f"TTL {max(1, round(delay * 1000))} ms, then back to {topology.queue}",
    )


async def _message_counts(connection: Link, names: tuple[str, ...]) -> dict[str, int]:
    """Message count of each queue that exists (absent ones are left out)."""
    counts: dict[str, int] = {}
    for name in names:
        count = await queue_count(connection, name)
        if count is not None:
            counts[name] = count
    return counts


async def run_topology(args: argparse.Namespace) -> int:
    """Declare (or with ``--delete`` remove) the queue set of ``args.queue``, or a stream."""
    if args.stream:
        return await _run_stream(args)
    retention = (args.max_length_bytes, args.max_age, args.max_segment_size_bytes)
    if retention != (None, None, None):
        raise CommandFailed(
            "--max-length-bytes, --max-age and --max-segment-size-bytes need --stream"
        )
    try:
        topology = QueueTopology(
            queue=args.queue,
            queue_type=QueueType.QUORUM if args.quorum else QueueType.CLASSIC,
            retry_delays=args.retry_delays,
            dead_letter_queue=args.dlq or "",
        )
    except ValueError as exc:
        raise CommandFailed(str(exc)) from None
    async with open_link(args) as connection:
        if args.delete:
            return await _delete(
                connection, topology, force=args.force, ignore_missing=args.ignore_missing
            )
        if not args.force:
            await _refuse_another_set(connection, topology)
        try:
            check = await prepare_topology(connection, topology)
        except ConsumerError as exc:
            raise CommandFailed(str(exc)) from None
        counts = await _message_counts(connection, topology.all_queues)
    if check.adopted:
        print(
            f"declared {len(topology.side_queues)} {topology.queue_type.value} queues, all "
            f"durable; {topology.queue} existed and is used as it is:"
        )
    else:
        print(
            f"declared {len(topology.all_queues)} {topology.queue_type.value} queues, all durable:"
        )
    rows = []
    for name in topology.all_queues:
        role, what = _describe(topology, name, check)
        rows.append((f"  {name}", f"{role:<13} {counts.get(name, 0):>9,} msgs  {what}"))
    print_table(rows)
    if check.adopted:
        say(f"reliable-mq: note: {check.warning(topology)}")
    return EXIT_OK


async def _refuse_another_set(connection: Link, topology: QueueTopology) -> None:
    """Refuse, before declaring anything, a set that exists with other delays or another DLQ.

    Retry queues of other delays have other names, so the broker would accept
    the new ones next to the old. AMQP cannot list queues; but when the work
    queue and some of its side queues exist while others asked for do not,
    the set was declared with other settings.

    Raises:
        CommandFailed: naming the queues that exist and those that do not.
    """
    counts = await _message_counts(connection, topology.all_queues)
    side = topology.side_queues
    missing = [name for name in side if name not in counts]
    if topology.queue not in counts or not missing or len(missing) == len(side):
        return
    found = [name for name in side if name in counts]
    raise CommandFailed(
        f"{topology.queue!r} exists with a queue set of other --retry-delays or --dlq: "
        f"{', '.join(found)} exist(s), {', '.join(missing)} do(es) not. Nothing declared. "
        "Give the set's own settings, delete it first (--delete with its settings), or "
        "--force to declare the missing queues next to the old ones"
    )


async def _delete(
    connection: Link, topology: QueueTopology, *, force: bool, ignore_missing: bool
) -> int:
    counts = await _message_counts(connection, topology.all_queues)
    if not counts:
        raise CommandFailed(f"no queue of the topology of {topology.queue!r} exists")
    missing = [name for name in topology.all_queues if name not in counts]
    if missing and not ignore_missing:
        raise CommandFailed(
            f"{', '.join(missing)} do(es) not exist: declared with other --retry-delays or "
            "--dlq? Nothing deleted; --ignore-missing deletes the queues that exist"
        )
    loaded = [f"{name} ({count:,})" for name, count in counts.items() if count]
    if loaded and not force:
        raise CommandFailed(
            "refusing to delete queues that hold messages: "
            + ", ".join(loaded)
            + "; --force deletes them with their messages"
        )
    channel = await connection.channel()
    rows = []
    for name in topology.all_queues:
        if name not in counts:
            rows.append((f"  {name}", "absent"))
            continue
        # Count again right before deleting (quorum queues refuse if_empty=True).
        count = (await _message_counts(connection, (name,))).get(name, 0)
        if count and not force:
            raise CommandFailed(
                f"{name!r} received {count:,} message(s) meanwhile; not deleted "
                "(--force deletes them)"
            )
        dropped = await channel.delete_queue(name)
        rows.append((f"  {name}", f"deleted, {dropped:,} msgs dropped"))
    await channel.close()
    print(f"deleted {len(counts)} of the {len(topology.all_queues)} queues of {topology.queue!r}:")
    print_table(rows)
    return EXIT_OK


async def _run_stream(args: argparse.Namespace) -> int:
    """Declare the stream ``args.queue`` with its retention."""
    if args.quorum or args.dlq or args.delete:
        raise CommandFailed(
            "--stream declares a stream: --quorum, --dlq and --delete do not apply (a stream "
            "has no retry queues or DLQ; delete one with `rabbitmqctl delete_queue`)"
        )
    try:
        spec = StreamSpec(
            args.queue,
            max_length_bytes=args.max_length_bytes,
            max_age=args.max_age,
            max_segment_size_bytes=args.max_segment_size_bytes,
        )
    except ValueError as exc:
        raise CommandFailed(str(exc)) from None
    async with open_link(args) as connection:
        try:
            await declare_stream(connection, spec)
        except ConsumerError as exc:
            raise CommandFailed(str(exc)) from None
    print(f"declared stream {spec.name} (durable):")
    print_table([(f"  {key}", str(value)) for key, value in spec.queue_arguments().items()])
    return EXIT_OK
