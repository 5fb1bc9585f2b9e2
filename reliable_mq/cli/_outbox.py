"""``outbox init|relay|status|dead|requeue|cleanup``: the transactional outbox from the shell.

``init`` creates the table (or prints its SQL for a migration tool), ``relay``
runs an [OutboxRelay][reliable_mq.outbox.OutboxRelay] until SIGTERM/SIGINT,
``status`` counts rows, ``dead`` lists refused rows with their reasons,
``requeue`` makes them pending again, ``cleanup`` deletes old sent/dead rows.
The database is ``--dsn`` or ``$RELIABLE_MQ_OUTBOX_DSN`` (PostgreSQL DSN, or
an SQLite path); its password never appears in output or errors.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
from typing import Any

from ..outbox import OutboxRelay, RelaySettings, admin, redact_dsn, schema_sql
from ..outbox._dsn import dialect_of, error_text
from ..outbox.errors import OutboxError, OutboxUnavailable
from ..settings import PublisherSettings
from ._common import (
    EXIT_FAILED,
    EXIT_OK,
    CLIError,
    CommandFailed,
    add_common_arguments,
    connection_settings,
    positive_float,
    positive_int,
    print_table,
)

__all__ = ("add_outbox_arguments", "run_outbox")


def add_outbox_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="outbox_command", metavar="ACTION", required=True)

    def action(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = actions.add_parser(
            name, help=help_text, description=help_text[:1].upper() + help_text[1:]
        )
        sub.add_argument(
            "--dsn",
            default=os.environ.get("RELIABLE_MQ_OUTBOX_DSN"),
            help="the outbox database: a PostgreSQL DSN or an SQLite file "
            "(default: $RELIABLE_MQ_OUTBOX_DSN)",
        )
        sub.add_argument("--table", default="reliable_mq_outbox", help="(default: %(default)s)")
        add_common_arguments(sub)
        return sub

    init = action("init", "create the outbox table, its indexes and NOTIFY trigger")
    init.add_argument(
        "--print-sql",
        choices=("postgres", "sqlite"),
        help="print the SQL for this database kind instead (for a migration); needs no --dsn",
    )

    relay = action(
        "relay",
        "publish committed outbox rows with confirms until SIGTERM/SIGINT (then exit 0)",
    )
    relay.add_argument("--batch-size", type=positive_int, default=500)
    relay.add_argument(
        "--lanes",
        type=positive_int,
        default=2,
        metavar="N",
        help="PostgreSQL: batches in flight at once, one connection each (default: 2)",
    )
    relay.add_argument("--poll-interval", type=positive_float, default=1.0, metavar="SECONDS")
    relay.add_argument(
        "--listen",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wake on LISTEN/NOTIFY (PostgreSQL; default: on; polling goes on regardless)",
    )
    relay.add_argument("--keep-sent", type=float, default=0.0, metavar="SECONDS")
    relay.add_argument("--publish-timeout", type=positive_float, default=30.0, metavar="SECONDS")
    relay.add_argument(
        "--max-attempts",
        type=positive_int,
        metavar="N",
        help="failed dispatches of a row (nacked, or unconfirmed while the broker was reachable) "
        "before it goes dead; broker outages never count "
        "(default: $RELIABLE_MQ_OUTBOX_MAX_ATTEMPTS or 10)",
    )
    relay.add_argument("--window", type=positive_int, default=1000, help="unconfirmed at most")
    relay.add_argument("--name", help="this relay's name in logs")
    relay.add_argument("--once", action="store_true", help="dispatch what is pending, then exit")

    action("status", "count pending, sent and dead rows and the oldest pending row's age")

    dead = action("dead", "list dead rows (refused by the broker) with their reasons")
    dead.add_argument("--limit", type=positive_int, default=100)
    dead.add_argument("--json", action="store_true", help="one JSON object per row")

    requeue = action("requeue", "make dead rows pending again (after fixing the cause)")
    which = requeue.add_mutually_exclusive_group(required=True)
    which.add_argument("--all", action="store_true", help="every dead row")
    which.add_argument("--id", type=int, action="append", dest="ids", help="a row id (repeat)")

    cleanup = action("cleanup", "delete sent rows and old dead rows now, in batches")
    cleanup.add_argument("--keep-sent", type=float, default=0.0, metavar="SECONDS")
    cleanup.add_argument(
        "--keep-dead", type=float, default=7 * 86_400.0, metavar="SECONDS", help="(default: 7 days)"
    )


async def run_outbox(args: argparse.Namespace) -> int:
    """Dispatch to the action; outbox errors become one redacted line."""
    if args.outbox_command == "init" and args.print_sql:
        print(";\n\n".join(schema_sql(args.print_sql, args.table)) + ";")
        return EXIT_OK
    if not args.dsn:
        raise CLIError("no database: pass --dsn or set RELIABLE_MQ_OUTBOX_DSN")
    try:
        dialect_of(args.dsn)
        return await _ACTIONS[args.outbox_command](args)
    except OutboxUnavailable as exc:
        raise CLIError(error_text(exc)) from None
    except (OutboxError, ValueError) as exc:
        raise CommandFailed(error_text(exc)) from None


async def _init(args: argparse.Namespace) -> int:
    await admin.create_schema(args.dsn, table=args.table)
    print(f"outbox table {args.table} is ready in {redact_dsn(str(args.dsn))}")
    return EXIT_OK


async def _relay(args: argparse.Namespace) -> int:
    chosen: dict[str, Any] = {}
    if args.max_attempts is not None:
        chosen["max_attempts"] = args.max_attempts
    settings = RelaySettings(
        batch_size=args.batch_size,
        lanes=args.lanes,
        poll_interval=args.poll_interval,
        listen=args.listen,
        keep_sent=args.keep_sent,
        publish_timeout=args.publish_timeout,
        **chosen,
    )
    relay = OutboxRelay(
        args.dsn,
        connection_settings(args),
        settings=settings,
        publisher_settings=PublisherSettings(max_in_flight=args.window),
        table=args.table,
        name=args.name,
    )
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    if not args.once:
        # A service: SIGTERM/SIGINT is the request to stop, not a failure. The
        # relay finishes its batch and the command exits 0 (a clean stop for
        # systemd and Kubernetes), like `reliable-mq run`. Installed before the
        # relay starts, so a signal while it starts stops it the same way.
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, relay.stop)
                installed.append(sig)
    try:
        async with relay:
            if args.once:
                while await relay.run_once():
                    if relay.broker_unreachable:
                        # Rows come back as they were while the broker is away:
                        # --once would claim them again and again.
                        raise CLIError("the broker could not be reached; the rows stay pending")
            else:
                await relay.run()  # returns at once if stop() came during the start
            stats = relay.stats()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
    print_table(
        [
            ("dispatched", f"{stats.dispatched:,}"),
            ("dead", f"{stats.dead:,}"),
            ("retried", f"{stats.retried:,}"),
            ("batches", f"{stats.batches:,}"),
        ]
    )
    return EXIT_OK


async def _status(args: argparse.Namespace) -> int:
    status = await admin.outbox_status(args.dsn, table=args.table)
    print_table(
        [
            ("pending", f"{status.pending:,}"),
            ("oldest pending", f"{status.oldest_pending_age:.1f}s"),
            ("sent (kept)", f"{status.sent:,}"),
            ("dead", f"{status.dead:,}"),
        ]
    )
    return EXIT_OK


async def _dead(args: argparse.Namespace) -> int:
    rows = await admin.dead_rows(args.dsn, table=args.table, limit=args.limit)
    for row in rows:
        record: dict[str, Any] = {
            "id": row.id,
            "message_id": row.message_id,
            "exchange": row.exchange,
            "routing_key": row.routing_key,
            "ordering_key": row.ordering_key,
            "attempts": row.attempts,
            "reason": row.last_error,
        }
        if args.json:
            print(json.dumps(record, ensure_ascii=True))
        else:
            shown = {k: v for k, v in record.items() if v not in (None, "")}
            print(" ".join(f"{k}={json.dumps(v, ensure_ascii=True)}" for k, v in shown.items()))
    if not args.json:
        print(f"{len(rows)} dead row(s)")
    return EXIT_OK


async def _requeue(args: argparse.Namespace) -> int:
    count = await admin.requeue_dead(args.dsn, table=args.table, ids=None if args.all else args.ids)
    print(f"{count} row(s) pending again")
    if args.ids and count < len(set(args.ids)):
        print(f"{len(set(args.ids)) - count} id(s) were not dead rows")
        return EXIT_FAILED
    return EXIT_OK


async def _cleanup(args: argparse.Namespace) -> int:
    deleted = await admin.cleanup(
        args.dsn, table=args.table, keep_sent=args.keep_sent, keep_dead=args.keep_dead
    )
    print(f"{deleted} row(s) deleted")
    return EXIT_OK


_ACTIONS = {
    "init": _init,
    "relay": _relay,
    "status": _status,
    "dead": _dead,
    "requeue": _requeue,
    "cleanup": _cleanup,
}
