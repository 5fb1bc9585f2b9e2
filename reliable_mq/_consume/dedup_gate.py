"""The consumer side of de-duplication: claim before the handler, complete or release after.

One `DedupGate` per consumed queue wraps that queue's
[`DedupStore`][reliable_mq.dedup.DedupStore]. A successful claim returns a
[`Claim`][reliable_mq._consume.dedup_gate.Claim] token; the consumer keeps it with the
delivery's settle state and hands it back to `complete` or `release`. The gate
never raises a store's error to the consumer (whatever the store raises); it
answers in a way that fails safe instead:

* `claim` returns ``None`` as the result (the consumer defers the delivery: no
  ack as done, no handler run);
* `complete` retries with backoff while the claim's lease lasts, then returns
  False (the consumer requeues instead of acking);
* `release` gives up after one try (the claim then ends with its lease, and a
  retried copy is deferred until then).

A store call interrupted by cancellation (a dead channel, a shutdown) is
finished in a background task, so a claim is not left behind and an effect
that happened is still recorded.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Coroutine
from typing import Any, NamedTuple

from ..dedup.base import ClaimResult, DedupStore
from ..dedup.memory import MemoryDedupStore
from ..log import get_logger
from ..metrics import QueueMetrics

__all__ = ("Claim", "DedupGate")

_CLAIMED = ClaimResult.CLAIMED


class Claim(NamedTuple):
    """A held claim on a message id: what `complete` and `release` need."""

    message_id: str
    owner: str


class DedupGate:
    """De-duplication for one queue: a store, a lease, unique owners, metrics."""

    __slots__ = (
        "_background",
        "_counter",
        "_outage_errors",
        "_warned_unkeyed",
        "lease",
        "log",
        "metrics",
        "nowait",
        "prefix",
        "queue",
        "store",
    )

    def __init__(
        self, store: DedupStore, *, lease: float, owner_prefix: str, metrics: QueueMetrics
    ) -> None:
        self.store = store
        # The memory store answers without a coroutine: the hot path skips two awaits.
        self.nowait = store if type(store) is MemoryDedupStore else None
        self.lease = lease
        self.queue = metrics.queue
        self.prefix = owner_prefix
        self.metrics = metrics
        self._counter = itertools.count(1)
        self._warned_unkeyed = False
        self._outage_errors = 0  # store failures since the last success; 0: healthy
        self._background: set[asyncio.Task[None]] = set()
        self.log = get_logger(__name__).bind(queue=self.queue, store=type(store).__name__)

    def unkeyed(self) -> None:
        """Count a delivery without a message id (processed without dedup); warn once."""
        self.metrics.dedup_event("no_message_id")
        if not self._warned_unkeyed:
            self._warned_unkeyed = True
            self.log.warning(
                "dedup_no_message_id",
                hint="messages without message_id are processed without de-duplication",
            )

    def busy(self) -> None:
        self.metrics.dedup_event("busy")

    def _owner(self) -> str:
        return f"{self.prefix}{next(self._counter)}"

    async def claim(self, message_id: str) -> tuple[ClaimResult | None, Claim | None]:
        """Claim ``message_id``: the store's answer (``None``: it cannot answer) and,
        on ``CLAIMED``, the token to `complete` or `release` later."""
        owner = self._owner()
        try:
            result = await self.store.claim(message_id, owner=owner, lease=self.lease)
        except asyncio.CancelledError:
            # The claim may have been stored: drop it, or copies wait for the lease.
            self._spawn(self._quiet_release(Claim(message_id, owner)))
            raise
        except Exception as exc:  # DedupStoreUnavailable, or a store's own bug: fail safe
            self._failed("claim", exc)
            return None, None
        return self._claimed(message_id, owner, result)

    def claim_nowait(self, message_id: str) -> tuple[ClaimResult | None, Claim | None]:
        """`claim` for a store with `nowait` (no coroutine)."""
        assert self.nowait is not None
        owner = self._owner()
        try:
            result = self.nowait.claim_nowait(message_id, owner=owner, lease=self.lease)
        except Exception as exc:
            self._failed("claim", exc)
            return None, None
        return self._claimed(message_id, owner, result)

    def _claimed(
        self, message_id: str, owner: str, result: ClaimResult
    ) -> tuple[ClaimResult, Claim | None]:
        if self._outage_errors:
            self._recovered()
        return result, Claim(message_id, owner) if result is _CLAIMED else None

    def complete_at_once(self, claim: Claim) -> bool:
        """`complete` in a store that answers at once (False: not such a store, or it
        failed; `complete` then retries as usual)."""
        if self.nowait is None:
            return False
        try:
            self.nowait.complete_nowait(claim.message_id, owner=claim.owner)
        except Exception:  # complete() counts, logs and retries it
            return False
        return True

    async def complete(self, claim: Claim) -> bool:
        """Mark the claimed id done; False if the store stayed down for a whole lease.

        The handler's effect has happened: never ack before this returns True.
        """
        if self.nowait is not None:
            try:
                self.nowait.complete_nowait(claim.message_id, owner=claim.owner)
            except Exception as exc:
                self.metrics.dedup_event("complete_failed")
                self._failed("complete", exc)
            else:
                return True
        return await self._complete_with_retries(claim)

    async def _complete_with_retries(self, claim: Claim) -> bool:
        delay = 0.05
        deadline = 0.0
        while True:
            try:
                await self.store.complete(claim.message_id, owner=claim.owner)
            except asyncio.CancelledError:
                self._spawn(self._quiet_complete(claim))
                raise
            except Exception as exc:
                self.metrics.dedup_event("complete_failed")
                self._failed("complete", exc)
                now = time.monotonic()
                if not deadline:
                    deadline = now + self.lease
                if now + delay >= deadline:
                    self.log.error(
                        "dedup_complete_gave_up",
                        message_id=claim.message_id,
                        error=repr(exc),
                        hint="the delivery is requeued; a copy may run again",
                    )
                    return False
                try:
                    await asyncio.sleep(delay)
                except asyncio.CancelledError:
                    self._spawn(self._quiet_complete(claim))
                    raise
                delay = min(delay * 2, 2.0)
                continue
            if self._outage_errors:
                self._recovered()
            return True

    async def release(self, claim: Claim) -> None:
        """Drop the claim (the handler failed or never ran), so a retried copy can run."""
        try:
            await self._quiet_release(claim)
        except asyncio.CancelledError:
            self._spawn(self._quiet_release(claim))
            raise

    def release_soon(self, claim: Claim) -> None:
        """Release in the background (the caller's task is being cancelled)."""
        self._spawn(self._quiet_release(claim))

    async def drain(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for background store calls."""
        if self._background:
            _, stuck = await asyncio.wait(set(self._background), timeout=timeout)
            for task in stuck:
                task.cancel()

    # -- internals ----------------------------------------------------------

    def _failed(self, operation: str, exc: BaseException) -> None:
        self.metrics.dedup_event("store_unavailable")
        if not self._outage_errors:
            self.log.warning(
                "dedup_store_unavailable",
                operation=operation,
                error=repr(exc),
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

    async def _quiet_release(self, claim: Claim) -> None:
        try:
            await self.store.release(claim.message_id, owner=claim.owner)
        except Exception as exc:
            self.metrics.dedup_event("release_failed")
            self._failed("release", exc)

    async def _quiet_complete(self, claim: Claim) -> None:
        try:
            await self.store.complete(claim.message_id, owner=claim.owner)
        except Exception as exc:
            self.metrics.dedup_event("complete_failed")
            self._failed("complete", exc)
            self.log.error("dedup_complete_lost", message_id=claim.message_id, error=repr(exc))
