"""Exactly-once effects with SQLiteDedupStore, no broker needed.

A "handler" credits an account for each payment message. The credit and the
message's *done* mark commit in one SQLite transaction, so every way a copy can
come back (a publisher republish, a redelivery after the consumer crashed
between commit and ack, two consumers racing after a lease expired) leaves the
balance credited once per message.

Run: python examples/dedup_sqlite_exactly_once.py
"""

from __future__ import annotations

import asyncio
import sqlite3
import tempfile
from pathlib import Path

from reliable_mq.dedup import AlreadyProcessed, ClaimResult, SQLiteDedupStore


async def handle(store: SQLiteDedupStore, message_id: str, amount: int, owner: str) -> str:
    """What a consumer does per delivery: claim, apply once, ack (here: return)."""
    claim = await store.claim(message_id, owner=owner, lease=30)
    if claim is ClaimResult.DONE:
        return "skipped (done)"
    if claim is ClaimResult.BUSY:
        return "deferred (busy)"

    def credit(conn: sqlite3.Connection) -> None:
        conn.execute("UPDATE account SET balance = balance + ? WHERE id = 1", (amount,))

    try:
        await store.run_once(message_id, credit)
    except AlreadyProcessed:
        return "skipped (another copy committed first)"
    except Exception:
        await store.release(message_id, owner=owner)  # let a retry run
        raise
    return "applied"


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bank.db"
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE account (id INTEGER PRIMARY KEY, balance INTEGER)")
            conn.execute("INSERT INTO account VALUES (1, 0)")

        store = SQLiteDedupStore(path, retention=3600)
        print("pay-1:", await handle(store, "pay-1", 10, owner="consumer-a"))
        print("pay-1 republished:", await handle(store, "pay-1", 10, owner="consumer-b"))

        # consumer-a commits pay-2 and crashes before acking: the broker
        # redelivers, and a fresh store (a restarted process) sees it done.
        print("pay-2:", await handle(store, "pay-2", 5, owner="consumer-a"))
        await store.close()
        restarted = SQLiteDedupStore(path, retention=3600)
        print("pay-2 redelivered:", await handle(restarted, "pay-2", 5, owner="consumer-a2"))

        # A handler with its own connection marks the id in its own transaction.
        await restarted.claim("pay-3", owner="consumer-c", lease=30)
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("UPDATE account SET balance = balance + 1 WHERE id = 1")
        restarted.mark_done_in(conn, "pay-3")
        conn.execute("COMMIT")
        conn.close()
        print("pay-3 redelivered:", await handle(restarted, "pay-3", 1, owner="consumer-d"))
        await restarted.close()

        with sqlite3.connect(path) as conn:
            (balance,) = conn.execute("SELECT balance FROM account").fetchone()
        print("balance:", balance, "(expected 16)")
        assert balance == 16


if __name__ == "__main__":
    asyncio.run(main())
