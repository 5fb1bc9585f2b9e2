"""The consumer side of de-duplication: claim before the handler, complete or release after.

One `DedupGate` per consumed queue wraps that queue's
[`DedupStore`][reliable_mq.dedup.DedupStore]. It never raises the store's
[`DedupStoreUnavailable`][reliable_mq.dedup.DedupStoreUnavailable] to the consumer; it answers
in a way that fails safe instead:

* `DedupGate.claim()` returns ``None`` (the consumer defers the delivery:
  no ack as done, no handler run);
* `DedupGate.complete()` retries with backoff while the claim's lease
  lasts, then returns False (the consumer requeues instead of acking);
* `DedupGate.release()` gives up after one try (the claim then ends with
  its lease, and a retried copy is deferred until then).

A store call interrupted by cancellation (a dead channel, a shutdown) is
finished in a background task, so a claim is not left behind and an effect
that happened is still recorded.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Coroutine
from typing import Any

from .dedup.base import ClaimResult, DedupStore, DedupStoreUnavailable
from .dedup.memory import MemoryDedupStore
from .delivery import Delivery
from .log import get_logger
from .metrics import Metrics

__all__ = ("DedupGate",)

_CLAIMED = ClaimResult.CLAIMED
_EVENTS = ("no_message_id", "busy", "store_unavailable", "complete_failed", "release_failed")


class DedupGate:
    """De-duplication for one queue: a store, a lease, unique owners, metrics."""

    __slots__ = (
        "_background",
        "_counter",
        "_events",
        "_outage_errors",
        "_warned_unkeyed",
        "deferred",
        "duplicate",
        "lease",
        "log",
        "nowait",
        "prefix",
        "queue",
        "skipped",
        "store",
    )

    def __init__(
        self, store: DedupStore, *, lease: float, owner_prefix: str, metrics: Metrics, queue: str
    ) -> None:
        self.store = store
        # The memory store answers without a coroutine: the hot path skips two awaits.
        self.nowait = store if type(store) is MemoryDedupStore else None
        self.lease = lease
        self.queue = queue
        self.prefix = owner_prefix
        self._counter = itertools.count(1)
        self.duplicate = metrics.deliveries.labels(queue, "duplicate")
        self.deferred = metrics.deliveries.labels(queue, "deferred")
        self.skipped = metrics.duplicates_skipped.labels(queue)
        self._events = {event: metrics.dedup_events.labels(queue, event) for event in _EVENTS}
        self._warned_unkeyed = False
        self._outage_errors = 0  # store failures since the last success; 0: healthy
        self._background: set[asyncio.Task[None]] = set()
        self.log = get_logger(__name__).bind(queue=queue, store=type(store).__name__)

    def unkeyed(self) -> None:
        """Count a delivery without a message id (processed without dedup); warn once."""
        self._events["no_message_id"].inc()
        if not self._warned_unkeyed:
            self._warned_unkeyed = True
            self.log.warning(
                "dedup_no_message_id",
                hint="messages without message_id are processed without de-duplication",
            )

    def busy(self) -> None:
        self._events["busy"].inc()

    async def claim(self, delivery: Delivery) -> ClaimResult | None:
        """Claim the delivery's id; ``None`` when the store cannot answer.

        On ``CLAIMED`` the delivery holds the claim until `complete()` or
        `release()`.
        """
        message_id = delivery.message_id
        owner = f"{self.prefix}{next(self._counter)}"
        try:
            result = await self.store.claim(message_id, owner=owner, lease=self.lease)
        except DedupStoreUnavailable as exc:
            self._failed("claim", exc)
            return None
        except asyncio.CancelledError:
            # The claim may have been stored: drop it, or copies wait for the lease.
            self._spawn(self._quiet_release(message_id, owner))
            raise
        if self._outage_errors:
            self._recovered()
        if result is _CLAIMED:
            delivery._dedup_owner = owner
        return result

    def claim_nowait(self, delivery: Delivery) -> ClaimResult | None:
        """`claim()` for a store with `nowait` (no coroutine)."""
        assert self.nowait is not None
        owner = f"{self.prefix}{next(self._counter)}"
        try:
            result = self.nowait.claim_nowait(delivery.message_id, owner=owner, lease=self.lease)
        except DedupStoreUnavailable as exc:
            self._failed("claim", exc)
            return None
        if result is _CLAIMED:
            delivery._dedup_owner = owner
        return result

    def complete_nowait(self, delivery: Delivery) -> bool:
        """`complete()` for a store with `nowait`; False: use `complete()`."""
        assert self.nowait is not None
        owner = delivery._dedup_owner
        if owner is not None:
            try:
                self.nowait.complete_nowait(delivery.message_id, owner=owner)
            except DedupStoreUnavailable:
                return False
            delivery._dedup_owner = None
        return True

    async def complete(self, delivery: Delivery) -> bool:
        """Mark the delivery's id done; False if the store stayed down for a whole lease.

        The handler's effect has happened: never ack before this returns True.
        """
        owner = delivery._dedup_owner
        if owner is None:
            return True
        message_id = delivery.message_id
        store = self.store
        delay = 0.05
        deadline = 0.0
        while True:
            try:
                await store.complete(message_id, owner=owner)
            except DedupStoreUnavailable as exc:
                self._events["complete_failed"].inc()
                self._failed("complete", exc)
                now = time.monotonic()
                if not deadline:
                    deadline = now + self.lease
                if now + delay >= deadline:
                    self.log.error(
                        "dedup_complete_gave_up",
                        message_id=message_id,
                        error=str(exc),
                        hint="the delivery is requeued; a copy may run again",
                    )
                    return False
                try:
                    await asyncio.sleep(delay)
                except asyncio.CancelledError:
                    self._spawn(self._quiet_complete(message_id, owner))
                    raise
                delay = min(delay * 2, 2.0)
                continue
            except asyncio.CancelledError:
                self._spawn(self._quiet_complete(message_id, owner))
                raise
            if self._outage_errors:
                self._recovered()
            delivery._dedup_owner = None
            return True

    async def release(self, delivery: Delivery) -> None:
        """Drop the delivery's claim (its handler failed), so a retried copy can run."""
        owner = delivery._dedup_owner
        if owner is None:
            return
        delivery._dedup_owner = None
        try:
            await self._quiet_release(delivery.message_id, owner)
        except asyncio.CancelledError:
            self._spawn(self._quiet_release(delivery.message_id, owner))
            raise

    def release_soon(self, delivery: Delivery) -> None:
        """Release in the background (the delivery's own task is being cancelled)."""
        owner = delivery._dedup_owner
        if owner is not None:
            delivery._dedup_owner = None
            self._spawn(self._quiet_release(delivery.message_id, owner))

    async def drain(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for background store calls."""
        if self._background:
            _, stuck = await asyncio.wait(set(self._background), timeout=timeout)
            for task in stuck:
                task.cancel()

    # -- internals ----------------------------------------------------------

    def _failed(self, operation: str, exc: BaseException) -> None:
        self._events["store_unavailable"].inc()
        if not self._outage_errors:
            self.log.warning(
                "dedup_store_unavailable",
                operation=operation,
                error=str(exc),
                hint="deliveries are deferred, not acked, until the store answers",
            )
        self._outage_errors += 1

    def _recovered(self) -> None:
        self.log.warning("dedup_store_recovered", failed_calls=self._outage_errors)
        self._outage_errors = 0

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _quiet_release(self, message_id: str, owner: str) -> None:
        try:
            await self.store.release(message_id, owner=owner)
        except DedupStoreUnavailable as exc:
            self._events["release_failed"].inc()
            self._failed("release", exc)

    async def _quiet_complete(self, message_id: str, owner: str) -> None:
        try:
            await self.store.complete(message_id, owner=owner)
        except DedupStoreUnavailable as exc:
            self._events["complete_failed"].inc()
            self._failed("complete", exc)
            self.log.error("dedup_complete_lost", message_id=message_id, error=str(exc))
