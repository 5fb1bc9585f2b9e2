"""Exactly-once into PostgreSQL: per-message inserts, run_once and run_once_batch, in one run.

N messages (256-byte bodies, an id each), one ``INSERT`` per message into an
events table, written three ways:

* at-least-once: one autocommit psycopg connection, one ``INSERT`` (and so
  one commit) per message; no de-duplication: the baseline;
* ``PostgresDedupStore.run_once`` per message: the insert and the done mark
  in one transaction per message;
* ``PostgresDedupStore.run_once_batch`` in batches of ``--batch`` (100 and
  500 by default): one transaction marks the batch's ids and inserts the new
  messages (``executemany``: one ``INSERT`` per message, pipelined), then
  commits;
* for reference, at-least-once in transactions of the largest batch size
  (the same ``executemany``, no marks): what the marks cost on top of a
  batched insert.

This measures the store's own cost: the messages are handed over directly,
without RabbitMQ, one call after another (no concurrency). Modes run one
after another, round after round (interleaved), each round with fresh ids;
the table shows medians: the rate, its ratio to at-least-once and to
``run_once`` from the same run, and this process's CPU per message. Every
round checks that the table holds each message exactly once.

    .venv/bin/python bench/inbox.py                          # 3,000 per mode, 3 rounds
    .venv/bin/python bench/inbox.py --messages 500 --rounds 1   # a quick check
    .venv/bin/python bench/inbox.py --batch 100 500 1000 --json inbox.json

``--dsn`` (default ``$RELIABLE_MQ_BENCH_DSN`` or the local server on 5432)
gets tables of its own, dropped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import _provenance
import psycopg

import reliable_mq
from reliable_mq.dedup.postgres import PostgresDedupStore

BODY = "x" * 256
AT_LEAST_ONCE = "at-least-once, autocommit INSERT per message"
RUN_ONCE = "run_once per message"

Conn = psycopg.AsyncConnection[Any]
Message = tuple[str, str]


@dataclass
class Sample:
    rate: float
    client_us: float


def insert_sql(table: str) -> str:
    return f"INSERT INTO {table} (message_id, body) VALUES (%s, %s)"


async def at_least_once(dsn: str, table: str, messages: list[Message]) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        query = insert_sql(table)
        for message in messages:
            await conn.execute(query, message)


async def batched_at_least_once(dsn: str, table: str, messages: list[Message], size: int) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        query = insert_sql(table)
        for start in range(0, len(messages), size):
            async with conn.transaction(), conn.cursor() as cursor:
                await cursor.executemany(query, messages[start : start + size])


async def per_message(store: PostgresDedupStore, table: str, messages: list[Message]) -> None:
    query = insert_sql(table)
    for message in messages:

        async def effect(conn: Conn, message: Message = message) -> None:
            await conn.execute(query, message)

        await store.run_once(message[0], effect)


async def batched(
    store: PostgresDedupStore, table: str, messages: list[Message], size: int
) -> None:
    query = insert_sql(table)
    bodies = dict(messages)

    async def effect(conn: Conn, ids: list[str]) -> None:
        async with conn.cursor() as cursor:
            await cursor.executemany(query, [(mid, bodies[mid]) for mid in ids])

    for start in range(0, len(messages), size):
        chunk = [mid for mid, _ in messages[start : start + size]]
        result = await store.run_once_batch(chunk, effect)
        assert len(result.ran) == len(chunk), "fresh ids must all be new"


async def measure(run: Callable[[], Awaitable[None]], count: int) -> Sample:
    cpu, started = time.process_time(), time.perf_counter()
    await run()
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    return Sample(count / seconds, cpu / count * 1e6)


async def count_rows(dsn: str, table: str, prefix: str) -> tuple[int, int]:
    """Rows with ids of this round, and distinct such ids."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cursor = await conn.execute(
            f"SELECT count(*), count(DISTINCT message_id) FROM {table} WHERE message_id LIKE %s",
            (prefix + "%",),
        )
        found = await cursor.fetchone()
    assert found is not None
    return found[0], found[1]


async def main(args: argparse.Namespace) -> None:
    origin = _provenance.origin(reliable_mq, args.label)
    print(_provenance.describe(origin), flush=True)
    suffix = uuid.uuid4().hex[:8]
    events, dedup = f"bench_inbox_events_{suffix}", f"bench_inbox_dedup_{suffix}"
    async with await psycopg.AsyncConnection.connect(args.dsn, autocommit=True) as conn:
        await conn.execute(f"CREATE TABLE {events} (message_id text NOT NULL, body text NOT NULL)")
        cursor = await conn.execute("SHOW synchronous_commit")
        sync_commit = (await cursor.fetchone() or ("?",))[0]
    store = PostgresDedupStore(args.dsn, table=dedup, pool_size=1)
    modes: dict[str, Callable[[list[Message]], Awaitable[None]]] = {
        AT_LEAST_ONCE: lambda ms: at_least_once(args.dsn, events, ms),
        RUN_ONCE: lambda ms: per_message(store, events, ms),
    }
    for size in args.batch:
        modes[f"run_once_batch, batches of {size}"] = lambda ms, size=size: batched(
            store, events, ms, size
        )
    largest = max(args.batch)
    modes[f"reference: at-least-once, batches of {largest}"] = lambda ms: batched_at_least_once(
        args.dsn, events, ms, largest
    )
    samples: dict[str, list[Sample]] = {name: [] for name in modes}
    load_before = os.getloadavg()
    try:
        await store.claim("warm-up", owner="bench", lease=1)  # connect, create the table
        for round_no in range(args.rounds):
            for index, (name, run) in enumerate(modes.items()):
                prefix = f"r{round_no}m{index}-"
                batch = [(f"{prefix}{n}-{uuid.uuid4().hex}", BODY) for n in range(args.messages)]
                sample = await measure(lambda run=run, batch=batch: run(batch), args.messages)
                rows, distinct = await count_rows(args.dsn, events, prefix)
                assert rows == distinct == args.messages, (name, rows, distinct)
                samples[name].append(sample)
                print(
                    f"round {round_no + 1}: {name:<44} {sample.rate:>8,.0f} msgs/s "
                    f"{sample.client_us:>7.1f} us client CPU/msg",
                    flush=True,
                )
    finally:
        await store.close()
        async with await psycopg.AsyncConnection.connect(args.dsn, autocommit=True) as conn:
            await conn.execute(f"DROP TABLE IF EXISTS {events}")
            await conn.execute(f"DROP TABLE IF EXISTS {dedup}")
    report(args, origin, samples, sync_commit, load_before)


def report(
    args: argparse.Namespace,
    origin: dict[str, Any],
    samples: dict[str, list[Sample]],
    sync_commit: str,
    load_before: tuple[float, float, float],
) -> None:
    rates = {name: statistics.median(s.rate for s in found) for name, found in samples.items()}
    base, once = rates[AT_LEAST_ONCE], rates[RUN_ONCE]
    load_after = os.getloadavg()
    print()
    print(
        f"inbox: {args.messages:,} messages per mode, one INSERT each, {args.rounds} interleaved "
        f"round(s), medians; direct calls, no broker; synchronous_commit={sync_commit}; "
        f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after "
        f"({os.cpu_count()} CPUs)\n{_provenance.describe(origin)}"
    )
    header = (
        f"{'mode':<44} {'msgs/s':>9} {'vs at-least-once':>17} {'vs run_once':>12} "
        f"{'client µs/msg':>14}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for name, found in samples.items():
        rate, client = rates[name], statistics.median(s.client_us for s in found)
        print(
            f"{name:<44} {rate:>9,.0f} {rate / base:>16.2f}x {rate / once:>11.2f}x {client:>14.1f}"
        )
        rows.append(
            {
                "mode": name,
                "rate": rate,
                "vs_at_least_once": rate / base,
                "vs_run_once": rate / once,
                "client_us": client,
                "rounds": [s.__dict__ for s in found],
            }
        )
    print()
    for size in args.batch:
        rate = rates[f"run_once_batch, batches of {size}"]
        for target, ratio, what in (
            (5.0, rate / once, "run_once"),
            (1.0, rate / base, "at-least-once"),
        ):
            verdict = "met" if ratio >= target else "NOT met"
            print(f"batches of {size} >= {target:.1f}x {what}: {ratio:.2f}x, {verdict}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {
                    "bench": "inbox",
                    "label": origin["label"],
                    "reliable_mq": origin,
                    "messages": args.messages,
                    "rounds": args.rounds,
                    "batches": args.batch,
                    "synchronous_commit": sync_commit,
                    "rows": rows,
                },
                out,
                indent=2,
            )


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dsn",
        default=os.environ.get(
            "RELIABLE_MQ_BENCH_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
    )
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument(
        "--batch", type=int, nargs="+", default=[100, 500], help="run_once_batch sizes"
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians")
    parser.add_argument("--label", help="a name for this run in the JSON (default: the commit)")
    parser.add_argument("--json", help="also write the medians to this file")
    asyncio.run(main(parser.parse_args()))


if __name__ == "__main__":
    cli()
