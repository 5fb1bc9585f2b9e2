"""The outbox's end-to-end fault scenarios: service A writes, the relay publishes, service B applies.

Service A commits an ``orders`` row and its event (``outbox.add``) in one
transaction; every seventh transaction rolls back after writing both. The
``orders`` table is the promise: every committed order must reach service B
(0 lost), and nothing else may (0 phantom: a rolled-back order never
publishes). Service B applies each event into ``effects`` together with its
inbox mark (``PostgresDedupStore.run_once``), so ``effects`` must hold each
id once (0 duplicate effects), and per ordering key in ``seq`` order.

Service B runs with ``concurrency=1`` and no consumer-side claim (the inbox
mark in the effect's own transaction is the de-duplication), which is what a
consumer that cares about per-key order looks like. When its database fails
under it (the inbox connection cut), it retries the effect in the handler
rather than through the retry queue, which would put the event behind later
events of its key; a retried effect whose first commit did land finds its id
done (``AlreadyProcessed``) and is acked as a duplicate.

Scenarios write ``KEYS`` ordering keys by default (each batch then holds at
most that many rows); ``write(..., keys=50, unkeyed_every=5)`` makes real
batch sizes, with every fifth event unkeyed (not part of the order check).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import psycopg
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from reliable_mq import ConnectionSettings, ReliableConsumer
from reliable_mq.dedup import DedupStoreUnavailable
from reliable_mq.dedup.postgres import PostgresDedupStore
from reliable_mq.delivery import Delivery
from reliable_mq.outbox import add
from reliable_mq.outbox.admin import create_schema
from reliable_mq.testing import LossOracle, OracleReport
from reliable_mq.topology import QueueTopology, declare_topology, delete_topology
from tests.support.amqp import drain_queue

ROOT = Path(__file__).resolve().parents[2]
KEYS = 4


@dataclass
class Verdict:
    """The oracle's report plus the per-key order check."""

    report: OracleReport
    committed: int
    rolled_back: int
    out_of_order: dict[str, list[int]] = field(default_factory=dict)
    phantoms: frozenset[str] = frozenset()

    @property
    def ok(self) -> bool:
        return self.report.ok and not self.out_of_order and not self.phantoms

    def describe(self) -> str:
        parts = [
            self.report.summary(),
            f"committed={self.committed} rolled_back={self.rolled_back}",
        ]
        for label, ids in (
            ("lost", self.report.lost),
            ("phantoms", self.phantoms),
            ("duplicate effects", self.report.duplicate_effects),
        ):
            if ids:
                parts.append(f"{label}: {sorted(ids)[:10]}")
        if self.out_of_order:
            parts.append(f"out of order: {dict(list(self.out_of_order.items())[:3])}")
        return "; ".join(parts)


class OutboxSystem:
    """Tables, queue and the three services of one scenario."""

    def __init__(self, dsn: str, amqp_url: str, name: str) -> None:
        suffix = uuid.uuid4().hex[:8]
        self.dsn = dsn
        self.amqp_url = amqp_url
        self.outbox = f"outbox_{suffix}"
        self.orders = f"orders_{suffix}"
        self.effects = f"effects_{suffix}"
        self.inbox = f"inbox_{suffix}"
        self.queue = f"outbox-{name}-{suffix}"
        self.topology = QueueTopology(queue=self.queue, retry_delays=(0.2,))
        self.rolled_back: set[str] = set()
        self.written = 0

    async def setup(self, amqp_url: str | None = None) -> None:
        await create_schema(self.dsn, table=self.outbox)
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
            await conn.execute(
                f"CREATE TABLE {self.orders} (message_id text PRIMARY KEY, key text, seq int)"
            )
            # No primary key: a duplicate effect must be visible, not refused.
            await conn.execute(
                f"CREATE TABLE {self.effects} (n bigserial, message_id text, key text, seq int)"
            )
        connection = await aio_pika.connect(amqp_url or self.amqp_url, timeout=10)
        async with connection:
            await declare_topology(await connection.channel(), self.topology)

    async def teardown(self, amqp_url: str | None = None) -> None:
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
            for table in (self.outbox, self.orders, self.effects, self.inbox):
                await conn.execute(f"DROP TABLE IF EXISTS {table}")
        try:
            connection = await aio_pika.connect(amqp_url or self.amqp_url, timeout=10)
            async with connection:
                await delete_topology(await connection.channel(), self.topology)
        except Exception:  # the broker may be the thing a test broke
            pass

    # -- service A ----------------------------------------------------------------------

    async def write(
        self,
        count: int,
        *,
        start: int = 0,
        rollback_every: int = 7,
        keys: int = KEYS,
        unkeyed_every: int = 0,
    ) -> None:
        """Service A in this process: ``count`` transactions, some rolled back.

        Events go round ``keys`` ordering keys; with ``unkeyed_every`` N, every
        Nth event has no key.
        """
        async with await psycopg.AsyncConnection.connect(self.dsn) as conn:
            for index in range(start, start + count):
                mid, key = f"o{index:06d}", f"k{index % keys}"
                if unkeyed_every and index % unkeyed_every == unkeyed_every - 1:
                    key = None
                try:
                    async with conn.transaction():
                        await conn.execute(
                            f"INSERT INTO {self.orders} VALUES (%s, %s, %s)", (mid, key, index)
                        )
                        await add(
                            conn,
                            {"id": mid, "key": key, "seq": index},
                            routing_key=self.queue,
                            message_id=mid,
                            ordering_key=key,
                            table=self.outbox,
                        )
                        if rollback_every and index % rollback_every == rollback_every - 1:
                            raise _Rollback
                except _Rollback:
                    self.rolled_back.add(mid)
                self.written += 1

    def writer_process(self, count: int, *, start: int = 0) -> subprocess.Popen[str]:
        """Service A as a process of its own (to be SIGKILLed); prints one line per commit."""
        return worker(
            "writer", {"dsn": self.dsn, "system": self.config(), "count": count, "start": start}
        )

    def config(self) -> dict[str, Any]:
        return {
            "outbox": self.outbox,
            "orders": self.orders,
            "effects": self.effects,
            "inbox": self.inbox,
            "queue": self.queue,
        }

    # -- service B ------------------------------------------------------------------------

    def consumer(
        self, amqp_url: str | None = None, *, name: str = "b", dsn: str | None = None
    ) -> tuple[ReliableConsumer, PostgresDedupStore]:
        """Service B in this process: effect + inbox mark in one transaction, one at a time.

        ``dsn``: where its inbox connects (default the scenario's database), e.g.
        through a proxy that cuts it.
        """
        return make_consumer(dsn or self.dsn, amqp_url or self.amqp_url, self.config(), name=name)

    # -- the verdict ------------------------------------------------------------------------

    async def committed(self) -> list[tuple[str, str, int]]:
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
            cursor = await conn.execute(f"SELECT message_id, key, seq FROM {self.orders}")
            return [tuple(row) for row in await cursor.fetchall()]  # type: ignore[misc]

    async def effects_rows(self) -> list[tuple[str, str, int]]:
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
            cursor = await conn.execute(
                f"SELECT message_id, key, seq FROM {self.effects} ORDER BY n"
            )
            return [tuple(row) for row in await cursor.fetchall()]  # type: ignore[misc]

    async def pending_outbox(self) -> int:
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
            cursor = await conn.execute(
                f"SELECT count(*) FROM {self.outbox} WHERE state = 'pending'"
            )
            row = await cursor.fetchone()
            return int(row[0]) if row else 0

    async def wait_applied(self, timeout: float = 60.0) -> bool:
        """Until every committed order has its effect (or ``timeout``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            wanted = {mid for mid, _, _ in await self.committed()}
            applied = {mid for mid, _, _ in await self.effects_rows()}
            if wanted and wanted <= applied:
                return True
            await asyncio.sleep(0.2)
        return False

    async def verdict(self, amqp_url: str | None = None) -> Verdict:
        """Drain the queues, then judge: lost, phantom, duplicate effects, order per key."""
        oracle = LossOracle()
        committed = await self.committed()
        for mid, _, _ in committed:
            oracle.attempted(mid)
            oracle.confirmed(mid)  # the commit is the promise
        effects = await self.effects_rows()
        for mid, _, _ in effects:
            oracle.delivered(mid)
            oracle.applied(mid)
        for name in self.topology.all_queues:
            drained = await drain_queue(amqp_url or self.amqp_url, name, idle_timeout=0.5)
            oracle.delivered_many(m.message_id or "" for m in drained)
        seqs: dict[str, list[int]] = defaultdict(list)
        for _, key, seq in effects:
            if key is not None:  # unkeyed events have no order to keep
                seqs[key].append(seq)
        out_of_order = {k: v for k, v in seqs.items() if v != sorted(v)}
        delivered = {mid for mid, _, _ in effects}
        return Verdict(
            report=oracle.report(),
            committed=len(committed),
            rolled_back=len(self.rolled_back),
            out_of_order=out_of_order,
            phantoms=frozenset(delivered & self.rolled_back),
        )


class _Rollback(Exception):
    pass


def make_consumer(
    dsn: str, amqp_url: str, system: dict[str, Any], *, name: str
) -> tuple[ReliableConsumer, PostgresDedupStore]:
    store = PostgresDedupStore(dsn, table=system["inbox"], pool_size=2)
    consumer = ReliableConsumer(
        ConnectionSettings(
            url=SecretStr(amqp_url),
            connection_name=f"outbox-test-{name}",
            reconnect_initial_delay=0.1,
            reconnect_max_delay=0.5,
            heartbeat=5,
        ),
        dedup=None,
        registry=CollectorRegistry(),
        prefetch=20,
        concurrency=1,
        retry_delays=(0.2,),
        max_attempts=1000,
    )
    effects = system["effects"]

    @consumer.handler(system["queue"])
    async def apply(body: dict[str, Any], delivery: Delivery) -> None:
        async def effect(conn: psycopg.AsyncConnection[Any]) -> None:
            await conn.execute(
                f"INSERT INTO {effects} (message_id, key, seq) VALUES (%s, %s, %s)",
                (body["id"], body["key"], body["seq"]),
            )

        for attempt in range(100):  # the database failed: retry here, keeping the order
            try:
                await store.run_once(delivery.message_id, effect)
                break
            except (DedupStoreUnavailable, psycopg.OperationalError):
                if attempt == 99:
                    raise
                await asyncio.sleep(0.1)
        hook = os.environ.get("OUTBOX_TEST_PAUSE_AFTER_EFFECT")
        if hook and delivery.message_id == hook:
            sys.stdout.write(f"applied {delivery.message_id}\n")
            sys.stdout.flush()
            await asyncio.sleep(3600)  # SIGKILLed here: effect committed, not acked

    return consumer, store


def worker(
    role: str, config: dict[str, Any], env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """Start ``tests/outbox/workers.py ROLE CONFIG`` with line-buffered stdout."""
    return subprocess.Popen(
        [sys.executable, "-m", "tests.outbox.workers", role, json.dumps(config)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )


async def read_line(proc: subprocess.Popen[str], prefix: str, timeout: float = 60.0) -> str:
    """The next stdout line of ``proc`` that starts with ``prefix``."""
    assert proc.stdout is not None
    stdout = proc.stdout

    def wait() -> str:
        for line in stdout:
            if line.startswith(prefix):
                return line.strip()
        return ""

    line = await asyncio.wait_for(asyncio.to_thread(wait), timeout)
    if not line:
        err = proc.stderr.read() if proc.stderr else ""
        raise AssertionError(f"worker ended without a {prefix!r} line: {err[-2000:]}")
    return line


def kill(proc: subprocess.Popen[str]) -> None:
    """SIGKILL and reap."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()
